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
tokens generated so far), `restart` (run.resume=restart moving the history aside, after its
n-th item is moved), `export` (1: the new export written beside `--out`, not swapped in; 2:
swapped in, the previous one not yet removed). Does not own: anything else; with the variables unset every
call is a dictionary lookup.

`ASYNC_RL_DELAY` (comma-separated `point:seconds`, e.g. `generate:0.01,step:0.5`) sleeps
at `generate` (after each engine generate call, per decode step in it: seconds a token),
`step` (after each learner step) and `exit` (the CLI's command has returned, the process is
about to exit; it prints a line first).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

_SPEC = os.environ.get("ASYNC_RL_KILL_AT", "")
_POINTS = {tuple(p.split(":", 1)) for p in _SPEC.split(",") if ":" in p}


def point(name: str, step: int, detail=None) -> None:
    if _POINTS and (name, str(step)) in _POINTS:
        if detail is not None:
            print(f"fault: SIGKILL at {name}:{step} {detail()}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# ASYNC_RL_FAULT=enospc:<where>:<step>[,...]: an OSError(ENOSPC) raised inside the save of
# that step, where = ledger (the ledger writer) | commit (Orbax's commit of the step).
_ENOSPC = {tuple(p.split(":")[1:3]) for p in os.environ.get("ASYNC_RL_FAULT", "").split(",")
           if p.startswith("enospc:") and p.count(":") == 2}


# ASYNC_RL_FAULT=fail:<where>:<n>: a RuntimeError raised at the n-th call of that point in this
# process, where = reward (inside the reward function's call: the reward thread fails).
_FAIL = {tuple(p.split(":")[1:3]) for p in os.environ.get("ASYNC_RL_FAULT", "").split(",")
         if p.startswith("fail:") and p.count(":") == 2}
_calls: dict[str, int] = {}


def fail(where: str) -> None:
    if _FAIL:
        _calls[where] = n = _calls.get(where, 0) + 1
        if (where, str(n)) in _FAIL:
            raise RuntimeError(f"injected failure ({where} call {n})")


# ASYNC_RL_FAULT=wait:<what>:<seconds>: a shorter bound on a wait, where what = pump_stop (how
# long stopping the run waits for the pump thread to leave a compile or device call).
_WAITS = {p.split(":")[1]: float(p.split(":")[2]) for p in os.environ.get("ASYNC_RL_FAULT", "").split(",")
          if p.startswith("wait:") and p.count(":") == 2}


def wait_s(what: str, default: float) -> float:
    return _WAITS.get(what, default)


def enospc_points() -> bool:
    return bool(_ENOSPC)


def raise_enospc(where: str, step: int) -> None:
    if _ENOSPC and (where, str(step)) in _ENOSPC:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (injected: {where} of step {step})")


_DELAYS = {k: float(v) for k, v in (p.split(":", 1) for p in os.environ.get("ASYNC_RL_DELAY", "").split(",")
                                    if ":" in p)}


def delay(name: str, times: int = 1) -> None:
    if _DELAYS and name in _DELAYS:
        if name == "exit":
            print(f"fault: delay at exit ({_DELAYS[name]:g} s)", file=sys.stderr, flush=True)
        time.sleep(_DELAYS[name] * times)
