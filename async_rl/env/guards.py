"""What an env step may hand the run, and what the run keeps of a step that failed.

Owns: the limits of an env step's state (`StateLimits`, from `rollout.env_state_max_depth` and
`rollout.env_state_max_bytes`: the state is kept in the ledger, every checkpoint and the journal,
and read back at every resume), measuring a state's depth without recursion, and writing a
failed step's traceback to its file in run.dir (`traceback_keeper`; the name is
`runfiles.env_error`'s). Does not own: checking the rest of a step's result
(`interface.StepResult.check`) or running steps (`interface.EnvRunner`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from async_rl.store import runfiles, storage


@dataclass(frozen=True)
class StateLimits:
    """How big an env step's state may be: it is kept in the ledger, every checkpoint and the
    journal, and read back at every resume (`rollout.env_state_max_depth`, `..._max_bytes`)."""
    max_depth: int = 32  # nesting levels of dicts and lists
    max_bytes: int = 1_000_000  # its JSON text, UTF-8 bytes


def state_limits(rollout_cfg) -> StateLimits:
    return StateLimits(rollout_cfg.env_state_max_depth, rollout_cfg.env_state_max_bytes)


def state_depth(state: Any, limit: int) -> int:
    """Nesting levels of dicts, lists and tuples in `state`, counted breadth-first (no recursion:
    a state nested a thousand levels deep must be measured, not crash the measuring), stopping
    at `limit` + 1 (a state that holds itself is as deep as that)."""
    depth, level = 0, [state]
    while level and depth <= limit:
        depth += 1
        nxt = []
        for v in level:
            children = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ()
            nxt.extend(c for c in children if isinstance(c, (dict, list, tuple)))
        level = nxt
    return depth


def traceback_keeper(run_dir):
    """`EnvRunner`'s keep_traceback for a run: writes a failed step's traceback to its file in
    `run_dir` (`runfiles.env_error`) and returns that path. A symlink where the file or its
    folder would be is refused by storage, as for every run.dir write (nothing goes through it)."""
    def keep(key, text: str):  # key: the StepKey of the step that raised
        p = runfiles.env_error(run_dir, str(key))
        storage.mkdirs(p.parent)
        storage.write_atomic(p, f"env step {key}\n{text}")
        return p
    return keep
