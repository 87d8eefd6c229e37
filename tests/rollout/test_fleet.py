"""A run on a fleet of `async-rl serve` processes (`engine.backend=remote`, docs/fleet.md):
servers SIGKILLed, restarted and replaced while the learner trains, the trainer SIGKILLed and
resumed; every prompt is trained exactly once, and the learner goes on while a server is down."""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import FAST, kill9, lineage, run_cli, spawn, wait_for_step

from async_rl.state.audit import audit

pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

# what shapes the model, the sampling and the engine: the servers run the trainer's own
SHARED = [*FAST, "data.num_records=32", "rollout.prompts_per_step=2", "data.num_epochs=1",
          "engine.max_concurrent_decodes=4", "engine.steps_per_call=2"]
TRAIN = ["checkpoint.every_steps=1", "checkpoint.keep=2", "engine.health_timeout_s=10", "engine.max_concurrent_decodes=8"]


STARTED: list = []  # every server a test started (killed at its end)


class Server:
    """One `async-rl serve` process on a free loopback port, generating at most a token per
    `delay` seconds (so a kill finds samples in flight); `url` once it says it listens."""

    def __init__(self, *overrides: str, delay: float = 0.02):
        STARTED.append(self)
        cmd = [sys.executable, "-m", "async_rl", "serve", "--config", "configs/tiny.yaml", "--port", "0",
               *SHARED, *overrides]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                                              ASYNC_RL_DELAY=f"generate:{delay}"))
        self.lines: list[str] = []
        self.url = ""
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("serving on "):
                self.url = line.split()[-1].strip()
                self._listening.set()
        self._listening.set()

    def ready(self) -> "Server":
        if not self._listening.wait(240) or not self.url:
            self.proc.kill()
            pytest.fail("the server did not start:\n" + "".join(self.lines[-40:]))
        return self

    def kill(self) -> bool:
        return kill9(self.proc)


def write_servers(path, servers) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{s.url}\n" for s in servers))
    tmp.replace(path)  # the trainer re-reads it: never a half-written file


@pytest.mark.slow
def test_servers_and_trainer_killed_at_random_moments_every_prompt_once(tmp_path, xla_cache):
    rng = random.Random(0)
    run_dir, servers_file = tmp_path / "run", tmp_path / "servers.txt"
    # a and b serve from the start; a2 is a restarted a (a new port), c a new server that replaces b
    a, b, a2, c = (Server() for _ in range(4))
    a, b, a2, c = (s.ready() for s in (a, b, a2, c))
    write_servers(servers_file, [a, b])
    overrides = [*SHARED, *TRAIN, "engine.backend=remote", f"engine.servers_file={servers_file}"]
    server_kills = trainer_kills = 0
    p, killed_at, said = None, [], ""

    def at_step(n: int) -> None:
        assert wait_for_step(run_dir, n, p, timeout=240), p.stderr.read()[-3000:]
        time.sleep(rng.uniform(0, 0.3))  # a random moment after that step

    try:
        p = spawn(run_dir, *overrides, cache=xla_cache)
        at_step(2)
        server_kills += a.kill()  # 1: the learner goes on with b alone
        killed_at.append(time.time())
        at_step(4)
        write_servers(servers_file, [a2, b])  # a, restarted
        at_step(6)
        trainer_kills += kill9(p)  # the servers keep running; the new trainer's requests are its own
        said += p.stderr.read()
        p = spawn(run_dir, *overrides, cache=xla_cache)
        at_step(8)
        server_kills += b.kill()  # 2: replaced by c, added to the file
        killed_at.append(time.time())
        write_servers(servers_file, [a2, c])
        at_step(10)
        server_kills += a2.kill()  # 3: c alone until the end
        killed_at.append(time.time())
        write_servers(servers_file, [c])
        at_step(12)
        trainer_kills += kill9(p)
        said += p.stderr.read()
        r = run_cli(run_dir, *overrides, cache=xla_cache, timeout=400)
        assert r.returncode == 0, r.stderr[-4000:]
        said += r.stderr
    finally:
        if p is not None and p.poll() is None:
            kill9(p)
        for s in STARTED:
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGKILL)
                s.proc.wait(timeout=30)
    print(f"fleet: {server_kills} server and {trainer_kills} trainer SIGKILLs delivered")
    print("".join(line for line in said.splitlines(True) if line.startswith(("fleet:", "step", "resum"))))
    assert server_kills == 3 and trainer_kills == 2
    rep = audit(run_dir)
    assert rep["ok"], rep
    rows = lineage(run_dir)
    assert sorted(r["prompt_id"] for r in rows) == list(range(32))
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("rollout/samples_moved", 0) for m in metrics) > 0, "no kill found a sample in flight"
    for t in killed_at:  # the learner went on: a step within health_timeout_s (10) and a step's time of each kill
        after = min(m["time"] for m in metrics if m["time"] > t)
        assert after - t <= 10 + 10, f"no step for {after - t:.1f} s after a server was killed"
