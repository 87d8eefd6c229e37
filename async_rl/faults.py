"""Fault injection for crash tests: SIGKILL this very process at a named point, or slow
a part down so a test can catch the pipeline in a chosen shape.

Owns: reading `ASYNC_RL_KILL_AT` (comma-separated `point:step`, e.g.
`ckpt_write:3,step:7`) and killing the process with SIGKILL when a matching point is
reached. Points: `ckpt_write` (inside a checkpoint write, after some files of the step
are written), `ckpt_saved` (save() returned, the async write may still be running),
`step` (a step's lineage lines are written, its weights not yet published). Does not
own: anything else; with the variables unset every call is a dictionary lookup.

`ASYNC_RL_DELAY` (comma-separated `point:seconds`, e.g. `generate:0.01,step:0.5`) sleeps
at `generate` (after each engine generate call) and `step` (after each learner step).
"""

from __future__ import annotations

import os
import signal
import time

_SPEC = os.environ.get("ASYNC_RL_KILL_AT", "")
_POINTS = {tuple(p.split(":", 1)) for p in _SPEC.split(",") if ":" in p}


def point(name: str, step: int) -> None:
    if _POINTS and (name, str(step)) in _POINTS:
        os.kill(os.getpid(), signal.SIGKILL)


_DELAYS = {k: float(v) for k, v in (p.split(":", 1) for p in os.environ.get("ASYNC_RL_DELAY", "").split(",")
                                    if ":" in p)}


def delay(name: str) -> None:
    if _DELAYS and name in _DELAYS:
        time.sleep(_DELAYS[name])
