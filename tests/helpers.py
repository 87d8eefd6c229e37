"""Shared test helpers: small configs and reading run outputs."""
from __future__ import annotations

import contextlib
import json
import os
import os as _os
import signal
import subprocess
import sys
import time
from pathlib import Path

from async_rl import config as C

# one persistent XLA cache per test session (conftest): in-process runs and subprocesses
# reuse compiled programs instead of compiling the same shapes again
FAST = ["log.progress=false", "log.tensorboard=false", "log.plot=false",
        f"run.compilation_cache={_os.environ.get('ASYNC_RL_TEST_XLA_CACHE', '')}",
        "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_kv_heads=2",
        "engine.max_concurrent_decodes=16", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6",
        "data.max_digits=4", "checkpoint.every_steps=0", "eval.every_steps=0"]


# the architecture fields have no default: configs that do not start from a preset name them
MODEL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64"]


def cfg(run_dir: Path, *overrides: str) -> C.Config:
    return C.load("configs/tiny.yaml", [f"run.dir={run_dir}", *FAST, *overrides])


def run_jsonl(run_dir, name: str, missing_ok: bool = True) -> list[dict]:
    """The lines of a run's JSONL log; a run on object storage (`gs://...`) is read through its store."""
    if "://" in str(run_dir):  # segment objects there, not one file
        from async_rl.state.lineage import read_jsonl
        from async_rl.store import storage
        return read_jsonl(storage.run_path(str(run_dir)) / name)
    p = Path(run_dir) / name
    if missing_ok and not p.exists():
        return []
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()]


def run_text(run_dir, name: str) -> str:
    """A file of a run directory, local or on object storage."""
    if "://" in str(run_dir):
        from async_rl.store import storage
        return storage.read_text(storage.run_path(str(run_dir)) / name)
    return (Path(run_dir) / name).read_text()


def lineage(run_dir: Path) -> list[dict]:
    return run_jsonl(run_dir, "lineage.jsonl")


def steps_of(run_dir: Path) -> dict[int, list[int]]:
    """step -> prompt_ids trained in it, in ordinal order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for r in lineage(run_dir):
        out.setdefault(r["step"], []).append((r["ordinal"], r["prompt_id"]))
    return {s: [p for _, p in sorted(v)] for s, v in sorted(out.items())}


CLI = [sys.executable, "-m", "async_rl", "train", "--config", "configs/tiny.yaml"]


def cli_args(run_dir: Path, *overrides: str, cache: Path | None = None) -> list[str]:
    extra = [f"run.compilation_cache={cache}"] if cache else []
    return [*CLI, f"run.dir={run_dir}", *FAST, *extra, *overrides]


def run_cli(run_dir: Path, *overrides: str, cache: Path | None = None, kill_at: str = "", delay: str = "",
            fault: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, ASYNC_RL_KILL_AT=kill_at, ASYNC_RL_DELAY=delay, ASYNC_RL_FAULT=fault,
               PYTHONUNBUFFERED="1")
    if "enospc:" in fault:  # the commit that fails lives here, in tests/
        here = str(Path(__file__).parent)
        env.update(ASYNC_RL_FAULT_COMMIT="faulty_commit:FaultyCommit",
                   PYTHONPATH=os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p))
    return subprocess.run(cli_args(run_dir, *overrides, cache=cache), capture_output=True, text=True,
                          timeout=timeout, env=env)


def spawn(run_dir: Path, *overrides: str, cache: Path | None = None, kill_at: str = "",
          delay: str = "") -> subprocess.Popen:
    env = dict(os.environ, ASYNC_RL_KILL_AT=kill_at, ASYNC_RL_DELAY=delay, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cli_args(run_dir, *overrides, cache=cache), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> bool:
    """Polls lineage.jsonl until a line of `step` (or later) appears, or the process ends."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rows = lineage(run_dir)
        if rows and rows[-1]["step"] >= step:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached in {timeout}s")


def kill9(proc: subprocess.Popen) -> bool:
    """SIGKILLs `proc` if it still runs; True if the kill is what ended it."""
    alive = proc.poll() is None
    if alive:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return alive and proc.returncode == -signal.SIGKILL


def checkpoint_steps(run_dir: Path) -> list[int]:
    from async_rl.state.layout import committed_steps
    return committed_steps(Path(run_dir) / "checkpoints")


def read_ledger(run_dir: Path, step: int):
    """The ledger saved in checkpoint `step`, read straight from its files."""
    from async_rl.buffer.ledger import Ledger
    from async_rl.state.items import LedgerHandler
    return Ledger.from_snapshot(LedgerHandler().restore(Path(run_dir) / "checkpoints" / str(step) / "ledger"))


def rollouts(run_dir: Path) -> list[dict]:
    return run_jsonl(run_dir, "rollouts.jsonl", missing_ok=False)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_multi(run_dir: Path, *overrides: str, nproc: int = 2, devices_per_process: int = 2, kill_at: str = "",
              timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """A multi-host job on this machine: `nproc` training processes joined through
    jax.distributed on loopback, each with its own forced CPU devices."""
    port = free_port()
    procs = []
    for i in range(nproc):
        env = dict(os.environ, ASYNC_RL_DISTRIBUTED="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   ASYNC_RL_NUM_PROCESSES=str(nproc), ASYNC_RL_PROCESS_ID=str(i), PYTHONUNBUFFERED="1",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
                   ASYNC_RL_KILL_AT=kill_at if i == 0 else "")
        procs.append(subprocess.Popen(cli_args(run_dir, *overrides), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, env=env))
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            err = p.communicate(timeout=max(1, deadline - time.monotonic()))[1]
        except subprocess.TimeoutExpired:
            p.kill()
            err = p.communicate()[1]
        out.append(subprocess.CompletedProcess(p.args, p.returncode, "", err))
        if kill_at:  # the others wait on a collective the killed one never joins: end them too
            for q in procs:
                if q.poll() is None:
                    q.kill()
    return out


def wait_until(cond, timeout: float, what: str = "condition", poll: float = 0.02) -> None:
    """Polls `cond()` until it is true; TimeoutError after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"{what} not reached in {timeout}s")
        time.sleep(poll)


def tree_digest(root: Path, only: tuple = (), skip: tuple = ()) -> dict[str, str]:
    """{relative path: sha256} of every file under `root` (or only the named top-level entries)."""
    import hashlib
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = p.relative_to(root)
        if not p.is_file() or (only and rel.parts[0] not in only) or rel.parts[0] in skip:
            continue
        out[str(rel)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def handles_sigterm(pid: int) -> bool:
    """Has process `pid` installed a SIGTERM handler yet (Linux: SigCgt in /proc)?"""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    except OSError:
        return False
    return False


def spawn_job(run_dir: Path, *overrides: str, nproc: int = 1, devices_per_process: int | None = None,
              kill_at: str = "", delay: str = "", fault: dict[int, str] | None = None) -> list[subprocess.Popen]:
    """`nproc` training processes on `run_dir` (joined through jax.distributed on loopback when
    more than one), each with `devices_per_process` forced CPU devices (default: this session's);
    `kill_at` applies to process 0, `fault` ({process: ASYNC_RL_FAULT}) to the processes it names.
    stderr goes to a temporary file (`read_stderr`)."""
    import tempfile
    port = free_port()
    procs = []
    for i in range(nproc):
        env = dict(os.environ, PYTHONUNBUFFERED="1", ASYNC_RL_KILL_AT=kill_at if i == 0 else "",
                   ASYNC_RL_DELAY=delay, ASYNC_RL_FAULT=(fault or {}).get(i, ""))
        if devices_per_process:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
        if nproc > 1:
            env.update(ASYNC_RL_DISTRIBUTED="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       ASYNC_RL_NUM_PROCESSES=str(nproc), ASYNC_RL_PROCESS_ID=str(i))
        err = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen(cli_args(run_dir, *overrides), stdout=subprocess.DEVNULL, stderr=err, text=True, env=env)
        p.err_file = err
        procs.append(p)
    return procs


@contextlib.contextmanager
def running_job(run_dir: Path, *overrides: str, **kw):
    """`spawn_job` whose processes still running when the block ends are SIGKILLed."""
    procs = spawn_job(run_dir, *overrides, **kw)
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)


def read_stderr(proc: subprocess.Popen) -> str:
    proc.err_file.seek(0)
    return proc.err_file.read()


def finish_job(procs: list[subprocess.Popen], timeout: float = 300, kill_rest: bool = False) -> list[int]:
    """Waits for every process (bounded); with `kill_rest`, once the first ends the others are
    SIGKILLed (they wait on a collective the dead one never joins). Returns the exit codes."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=60)
        if kill_rest:
            for q in procs:
                if q.poll() is None:
                    q.kill()
    for p in procs:
        p.wait(timeout=60)
    return [p.returncode for p in procs]


# Engine KV-cache layouts (`Engine` kwargs): one buffer per layer written in place (CPU
# default from 128 slots), stacked and written after each step's layer loop, stacked and
# written once per call (`recent`, the TPU default)
CACHE_LAYOUTS = {"stacked": dict(recent=False), "recent": dict(recent=True)}
