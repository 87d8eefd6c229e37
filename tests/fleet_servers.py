"""Test helpers for fleets: `async-rl serve` processes on loopback and the servers file."""
import contextlib
import os
import signal
import subprocess
import sys
import threading

import pytest
from helpers import FAST, kill9

# what shapes the model, the sampling and the engine: the servers run the trainer's own
SHARED = [*FAST, "data.num_records=32", "rollout.prompts_per_step=2", "data.num_epochs=1",
          "engine.max_concurrent_decodes=4", "engine.steps_per_call=2"]
TRAIN = ["checkpoint.every_steps=1", "checkpoint.keep=2", "engine.health_timeout_s=10", "engine.max_concurrent_decodes=8"]


STARTED: list = []  # every server a test started (killed at its end)


class Server:
    """One `async-rl serve` process on a free loopback port, generating at most a token per
    `delay` seconds (so a kill finds samples in flight); `url` once it says it listens."""

    def __init__(self, *overrides: str, delay: float = 0.02, fault: str = "", weights_delay: float = 0.0):
        STARTED.append(self)
        cmd = [sys.executable, "-m", "async_rl", "serve", "--config", "configs/tiny.yaml", "--port", "0",
               *SHARED, *overrides]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                                              ASYNC_RL_FAULT=fault,
                                              ASYNC_RL_DELAY=f"generate:{delay},weights:{weights_delay}"))
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


def stop_all() -> None:
    """SIGKILLs every server a test started that still runs."""
    while STARTED:
        s = STARTED.pop()
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGKILL)
            s.proc.wait(timeout=30)


@contextlib.contextmanager
def shared_server(*overrides: str, **kw):
    """A ready server for several tests in turn (a module fixture: each start costs seconds of
    CPU): not among those `stop_all` kills, SIGKILLed when the block ends. Each trainer that
    joins it loads its own session's weights (docs/fleet.md)."""
    s = Server(*overrides, **kw)
    STARTED.remove(s)
    try:
        yield s.ready()
    finally:
        s.kill()
