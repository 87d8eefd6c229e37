"""Fault injection for crash tests: SIGKILL this very process at a named point, or slow
a part down so a test can catch the pipeline in a chosen shape.

Owns: reading `ASYNC_RL_KILL_AT` (comma-separated `point:step`, e.g.
`ckpt_write:3,step:7`) and killing the process with SIGKILL when a matching point is
reached. Points: `ckpt_write` (inside a checkpoint write, after some files of the step
are written), `ckpt_saved` (save() returned, the async write may still be running),
`step` (a step's weights are published and its lineage lines written), `set_aside`
(while damaged steps are moved aside on resume; the step is the damaged one), `generate`
(the pump thread, after its n-th engine call of this process's session, before recording
its tokens: a kill at a moment in the generation stream; it first prints a line with the
tokens generated so far), `env_submit` (the pump thread, at its n-th env step request of this
session: the step is requested, its result not yet recorded), `restart` (run.resume=restart moving the history aside, after its
n-th item is moved), `export` (1: the new export written beside `--out`, not swapped in; 2:
swapped in, the previous one not yet removed). Does not own: anything else; with the variables unset every
call is a dictionary lookup.

`ASYNC_RL_DELAY` (comma-separated `point:seconds`, e.g. `generate:0.01,step:0.5`) sleeps
at `generate` (after each engine generate call, per decode step in it: seconds a token),
`step` (after each learner step), `weights` (`async-rl serve` loading a weights version) and
`exit` (the CLI's command has returned, the process is about to exit; it prints a line first).

`ASYNC_RL_FAULT_COMMIT` (`module:Class`) names the temporary-path class Orbax commits a local
step with while `ASYNC_RL_FAULT` has enospc points (the tests' stand-in for a full disk at the
commit, `tests/faulty_commit.py`). Every variable is read when a point is reached, not at import:
a changed environment takes effect at the next call.
"""

from __future__ import annotations

import errno
import functools
import importlib
import os
import signal
import sys
import time

from .errors import UsageError


@functools.lru_cache(maxsize=8)
def _parse(kill_at: str, fault: str, delay: str) -> tuple:
    """(kill points, enospc points, fail points, waits, delays) of the variables' values."""
    points = {tuple(p.split(":", 1)) for p in kill_at.split(",") if ":" in p}
    parts = [p for p in fault.split(",") if p.count(":") == 2]
    # enospc:<where>:<step>: an OSError(ENOSPC) raised inside the save of that step, where =
    # ledger (the ledger writer) | commit (Orbax's commit of the step)
    enospc = {tuple(p.split(":")[1:3]) for p in parts if p.startswith("enospc:")}
    # fail:<where>:<n>: a RuntimeError raised at the n-th call of that point in this process,
    # where = reward (inside the reward function's call: the reward thread fails)
    fail = {tuple(p.split(":")[1:3]) for p in parts if p.startswith("fail:")}
    # wait:<what>:<seconds>: a shorter bound on a wait, where what = pump_stop (how long
    # stopping the run waits for the pump thread to leave a compile or device call)
    waits = {p.split(":")[1]: float(p.split(":")[2]) for p in parts if p.startswith("wait:")}
    # garble:<kind>:<n>: `async-rl serve` sends its n-th completion event garbled, kind = token
    # (an id past the vocabulary), version (a weights version it was never given), cut (the
    # stream ends inside the event)
    garble = {int(p.split(":")[2]): p.split(":")[1] for p in parts if p.startswith("garble:")}
    delays = {k: float(v) for k, v in (p.split(":", 1) for p in delay.split(",") if ":" in p)}
    return points, enospc, fail, waits, delays, garble


def _spec() -> tuple:
    env = os.environ
    return _parse(env.get("ASYNC_RL_KILL_AT", ""), env.get("ASYNC_RL_FAULT", ""), env.get("ASYNC_RL_DELAY", ""))


def point(name: str, step: int, detail=None) -> None:
    points = _spec()[0]
    if points and (name, str(step)) in points:
        if detail is not None:
            print(f"fault: SIGKILL at {name}:{step} {detail()}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


_calls: dict[str, int] = {}


def fail(where: str) -> None:
    failing = _spec()[2]
    if failing:
        _calls[where] = n = _calls.get(where, 0) + 1
        if (where, str(n)) in failing:
            raise RuntimeError(f"injected failure ({where} call {n})")


def garbled(n: int) -> str | None:
    """How the n-th completion event of this server is garbled (`garble:<kind>:<n>`), or None."""
    garble = _spec()[5]
    return garble.get(n) if garble else None


def wait_s(what: str, default: float) -> float:
    return _spec()[3].get(what, default)


def enospc_points() -> bool:
    return bool(_spec()[1])


def raise_enospc(where: str, step: int) -> None:
    enospc = _spec()[1]
    if enospc and (where, str(step)) in enospc:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (injected: {where} of step {step})")


def commit_class() -> type | None:
    """The temporary-path class `ASYNC_RL_FAULT_COMMIT` names for a local step's commit while
    enospc points are set, or None (Orbax's own)."""
    enospc = _spec()[1]
    if not enospc:
        return None
    name = os.environ.get("ASYNC_RL_FAULT_COMMIT", "")
    if not name:
        if any(where == "commit" for where, _ in enospc):
            raise UsageError("ASYNC_RL_FAULT=enospc:commit:<step> needs ASYNC_RL_FAULT_COMMIT=<module>:<class>, "
                             "the commit that raises it")
        return None
    module, _, cls = name.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"ASYNC_RL_FAULT_COMMIT={name!r}: cannot be loaded ({e})") from None


def delay(name: str, times: int = 1) -> None:
    delays = _spec()[4]
    if delays and name in delays:
        if name == "exit":
            print(f"fault: delay at exit ({delays[name]:g} s)", file=sys.stderr, flush=True)
        time.sleep(delays[name] * times)
