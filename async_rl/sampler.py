"""Samplers: which drawn groups the pump may work on, and which READY groups form step s.

Owns: the stamp a record gets when drawn, the gate that bounds how far generation runs
ahead of the learner, the policy version a group must be generated with (deterministic
mode), and the blocking `next_batch(step)` the learner calls. Does not own: the ledger's
storage (ledger), the engine (pump), or training (learner). Every sampler reads and
writes the ledger under its lock; none removes a group (the learner commits it).

Versions: the learner publishes version v after v steps; step t trains on version t-1.
"""

from __future__ import annotations

import time

from .config import Config
from .ledger import Group, Ledger, State


class Stopped(Exception):
    """The run is stopping (signal or pump failure) while a sampler waits."""


class InOrderSampler:
    """Step t trains exactly the groups with stamp t = ordinal // prompts_per_step + 1.

    Generation may run `max_lookahead` steps ahead: a group stamped t may be generated
    once version t-1-L is published. In deterministic mode it is generated with exactly
    that version (so which weights produced which token does not depend on timing).
    """

    name = "in_order"

    def __init__(self, cfg: Config, ledger: Ledger):
        self.ledger = ledger
        self.pps = cfg.rollout.prompts_per_step
        self.lookahead = cfg.sampler.max_lookahead
        self.deterministic = cfg.run.determinism
        self.max_buffered = cfg.sampler.max_buffered_groups

    def stamp(self, ordinal: int) -> int:
        return ordinal // self.pps + 1

    def required_version_for_stamp(self, step: int) -> int:
        return max(0, step - 1 - self.lookahead)

    def required_version(self, group: Group) -> int:
        """The weights a group is generated with in deterministic mode."""
        return self.required_version_for_stamp(group.target_step)

    def eligible(self, group: Group, version: int) -> bool:
        return group.target_step <= version + 1 + self.lookahead

    def may_draw(self, version: int) -> bool:
        led = self.ledger
        if led.exhausted:
            return False
        if self.max_buffered and len(led.groups) >= self.max_buffered:
            return False
        return self.stamp(led.next_ordinal) <= version + 1 + self.lookahead

    def on_ready(self, group: Group, version: int) -> None:
        """A group just became READY (pump, under the lock). in_order keeps every group."""

    def _batch_if_ready(self, step: int) -> list[Group] | None | bool:
        """The groups of `step` if all are READY; None if the data has no step `step`; False if not yet."""
        led = self.ledger
        lo, hi = (step - 1) * self.pps, step * self.pps
        if led.exhausted and led.next_ordinal <= lo:
            return None
        if led.next_ordinal < hi and not led.exhausted:
            return False
        groups = [led.groups.get(o) for o in range(lo, min(hi, led.next_ordinal))]
        if any(g is None for g in groups):
            missing = [o for o, g in zip(range(lo, hi), groups) if g is None]
            raise RuntimeError(f"in_order step {step}: ordinals {missing} are not in the ledger")
        if all(g.state == State.READY for g in groups):
            return groups
        return False

    def next_batch(self, step: int, should_stop=lambda: False, poll_s: float = 0.05):
        """Blocks until step `step`'s groups are READY; returns them in ordinal order, or None at end of data."""
        with self.ledger.changed:
            while True:
                got = self._batch_if_ready(step)
                if got is not False:
                    return got
                if should_stop():
                    raise Stopped()
                self.ledger.changed.wait(poll_s)

    def finished(self, step: int) -> bool:
        """No group is left to train after `step` steps."""
        with self.ledger.lock:
            return self._batch_if_ready(step + 1) is None


def make_sampler(cfg: Config, ledger: Ledger):
    if cfg.sampler.name == "in_order":
        return InOrderSampler(cfg, ledger)
    raise NotImplementedError(f"sampler.name={cfg.sampler.name!r}")


def wait_until(cond, pred, timeout: float) -> bool:
    """Waits on a Condition (held by the caller) until pred() or timeout; returns pred()."""
    end = time.monotonic() + timeout
    while not pred():
        left = end - time.monotonic()
        if left <= 0:
            return False
        cond.wait(left)
    return True
