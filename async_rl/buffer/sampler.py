"""Samplers: which drawn groups the pump may work on, and which READY groups form step s.

Owns: the stamp a record gets when drawn, the gate that bounds how far generation runs
ahead of the learner, the policy version a group must be generated with (deterministic
mode), staleness control (a READY group too old to train goes back to PENDING and is
regenerated, never dropped), zero-variance filtering, and the blocking
`next_batch(step)` the learner calls. Does not own: the ledger's storage (ledger), the
engine (pump), training (learner) or files: consumed-untrained groups and regenerations
are handed to the `on_filtered` / `on_regenerated` callbacks, which train wires to the
lineage and drops logs. None removes a group except through those callbacks.

Versions: the learner publishes version v after v steps; step t trains on version t-1.
A group's staleness at step t is (t - 1) - the oldest version among its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from async_rl.buffer.ledger import Group, Ledger, State
from async_rl.config import Config


class Stopped(Exception):
    """The run is stopping (signal or pump failure) while a sampler waits."""


@dataclass
class Hooks:
    on_filtered: Callable[[list[Group], int], None] = lambda groups, step: None
    on_regenerated: Callable[[Group, int], None] = lambda group, step: None


def zero_variance(g: Group) -> bool:
    rewards = [s.reward for s in g.samples]
    return max(rewards) == min(rewards)


class _Sampler:
    name = ""

    def __init__(self, cfg: Config, ledger: Ledger, hooks: Hooks | None = None, groups_per_step: int = 0):
        """`groups_per_step`: this process's share of a step (prompts_per_step / processes)."""
        self.ledger = ledger
        self.pps = groups_per_step or cfg.rollout.prompts_per_step
        self.lookahead = cfg.sampler.max_lookahead
        self.deterministic = cfg.run.determinism
        self.filter = cfg.rollout.filter_zero_variance
        self.cap = buffer_cap(cfg, self.pps)
        self.hooks = hooks or Hooks()

    # ---- what the pump asks (under the ledger lock) -------------------------------------

    def stamp(self, ordinal: int) -> int | None:
        return None

    def eligible(self, group: Group, version: int, latest: int) -> bool:
        """May the pump start `group` with weights `version` while `latest` is published?"""
        return True

    def may_draw(self, version: int, latest: int) -> bool:
        led = self.ledger
        return not led.exhausted and (not self.cap or len(led.groups) < self.cap)

    def on_ready(self, group: Group, version: int) -> None:
        """A group just became READY (pump thread, under the lock)."""

    def fits(self, group: Group, lo: int, hi: int, latest: int) -> bool:
        """May a finished sample whose tokens were made by versions [lo, hi] (a killed run's,
        from the rollout journal) join `group` now that `latest` is published?"""
        return True

    # ---- what the learner asks -----------------------------------------------------------

    def _try(self, step: int) -> list[Group] | None | bool:
        """The groups of `step`; None if no data is left; False if not yet (under the lock)."""
        raise NotImplementedError

    def _consume_filtered(self, groups: list[Group], step: int) -> list[Group]:
        """Splits off zero-variance groups and hands them to on_filtered; returns the rest."""
        if not self.filter:
            return groups
        out = [g for g in groups if zero_variance(g)]
        if out:
            self.hooks.on_filtered(out, step)
        return [g for g in groups if not zero_variance(g)]

    def next_batch(self, step: int, should_stop=lambda: False, poll_s: float = 0.05):
        """Blocks until step `step` can be formed; returns its groups (possibly empty when all
        were filtered), or None when every drawn group is trained and the data has ended."""
        with self.ledger.changed:
            while True:
                got = self._try(step)
                if got is not False:
                    return got
                if should_stop():
                    raise Stopped()
                self.ledger.changed.wait(poll_s)

    def finished(self, step: int) -> bool:
        """Every drawn group is consumed and the data has ended (no side effects)."""
        with self.ledger.lock:
            return self.ledger.exhausted and not self.ledger.groups


class InOrderSampler(_Sampler):
    """Step t trains exactly the groups with stamp t = base + ordinal // prompts_per_step + 1
    (base: the ledger's `base_step`, 0 unless it was re-partitioned onto another process count).

    Generation may run `max_lookahead` steps ahead: a group stamped t may be generated
    once version t-1-L is published. In deterministic mode it is generated with exactly
    that version (so which weights produced which token does not depend on timing).
    Zero-variance filtering makes a step smaller; it never pulls in another step's groups.
    """

    name = "in_order"

    def stamp(self, ordinal: int) -> int:
        return self.ledger.base_step + ordinal // self.pps + 1

    def required_version_for_stamp(self, step: int) -> int:
        return max(0, step - 1 - self.lookahead)

    def required_version(self, group: Group) -> int:
        """The weights a group is generated with in deterministic mode."""
        return self.required_version_for_stamp(group.target_step)

    def eligible(self, group: Group, version: int, latest: int) -> bool:
        return group.target_step <= version + 1 + self.lookahead

    def fits(self, group: Group, lo: int, hi: int, latest: int) -> bool:
        t = group.target_step  # the lookahead bound: every version in [t - 1 - L, t - 1]
        return t - 1 - self.lookahead <= lo and hi <= t - 1

    def may_draw(self, version: int, latest: int) -> bool:
        return (super().may_draw(version, latest)
                and self.stamp(self.ledger.next_ordinal) <= version + 1 + self.lookahead)

    def _try(self, step: int):
        led = self.ledger
        lo, hi = (step - 1 - led.base_step) * self.pps, (step - led.base_step) * self.pps
        if led.exhausted and led.next_ordinal <= lo:
            return None
        if led.next_ordinal < hi and not led.exhausted:
            return False
        groups = [led.groups.get(o) for o in range(lo, min(hi, led.next_ordinal))]
        if any(g is None for g in groups):
            missing = [o for o, g in zip(range(lo, hi), groups) if g is None]
            raise RuntimeError(f"in_order step {step}: ordinals {missing} are not in the ledger")
        if not all(g.state == State.READY for g in groups):
            return False
        return self._consume_filtered(groups, step)

    def finished(self, step: int) -> bool:
        with self.ledger.lock:  # no record was drawn for step + 1 and none will be
            return self.ledger.exhausted and self.ledger.next_ordinal <= (step - self.ledger.base_step) * self.pps


class _StalenessSampler(_Sampler):
    """Shared by fifo and windowed: READY groups older than max_staleness are regenerated."""

    def __init__(self, cfg: Config, ledger: Ledger, hooks: Hooks | None = None, groups_per_step: int = 0):
        super().__init__(cfg, ledger, hooks, groups_per_step)
        self.max_staleness = cfg.sampler.max_staleness

    def _order(self, fresh: list[Group]) -> list[Group]:
        raise NotImplementedError

    def eligible(self, group: Group, version: int, latest: int) -> bool:
        # trained at step latest + 1 at the earliest, on weights `latest`: work started on weights
        # more than max_staleness behind them could only arrive stale, so wait for newer ones
        return latest - version <= self.max_staleness

    def may_draw(self, version: int, latest: int) -> bool:
        return super().may_draw(version, latest) and self.eligible(None, version, latest)

    def fits(self, group: Group, lo: int, hi: int, latest: int) -> bool:
        return latest - lo <= self.max_staleness  # trained at step latest + 1 at the earliest

    def _try(self, step: int):
        led = self.ledger
        version = step - 1
        ready = [g for g in led.groups.values() if g.state == State.READY]
        fresh = []
        for g in ready:
            if version - g.min_version > self.max_staleness:
                self.hooks.on_regenerated(g, step)
                led.regenerate(g)  # back to PENDING: the pump generates it again with newer weights
            else:
                fresh.append(g)
        if self.filter:
            fresh = self._consume_filtered(fresh, step)
        if len(fresh) >= self.pps:
            return self._order(fresh)[:self.pps]
        if led.exhausted and len(fresh) == len(led.groups):
            return self._order(fresh) if fresh else None  # the last, short step
        return False


class FifoSampler(_StalenessSampler):
    """Oldest READY groups first; a record is drawn only if it can be trained in time."""

    name = "fifo"

    def may_draw(self, version: int, latest: int) -> bool:
        # the new group trains after every group already drawn, i.e. len // pps steps after
        # the next one, on weights that far past `latest`: draw only if that is within bound
        ahead = len(self.ledger.groups) // self.pps
        return super().may_draw(version, latest) and (latest - version) + ahead <= self.max_staleness

    def _order(self, fresh):
        return sorted(fresh, key=lambda g: g.ordinal)


class WindowedSampler(_StalenessSampler):
    """Freshest READY groups first within max_staleness; generation bounded only by the cap."""

    name = "windowed"

    def _order(self, fresh):
        return sorted(fresh, key=lambda g: (-g.min_version, g.ordinal))


SAMPLERS = {c.name: c for c in (InOrderSampler, FifoSampler, WindowedSampler)}


def buffer_cap(cfg: Config, pps: int) -> int:
    """Groups this process's ledger may hold (READY + GENERATING + PENDING); 0 = no cap
    (in_order's lookahead bounds it)."""
    s = cfg.sampler
    if s.max_buffered_groups:
        return max(s.max_buffered_groups * pps // cfg.rollout.prompts_per_step, pps)
    if s.name == "fifo":
        return (s.max_staleness + 1) * pps
    if s.name == "windowed":
        return (s.max_staleness + 2) * pps
    return 0


def make_sampler(cfg: Config, ledger: Ledger, hooks: Hooks | None = None, groups_per_step: int = 0) -> _Sampler:
    return SAMPLERS[cfg.sampler.name](cfg, ledger, hooks, groups_per_step)
