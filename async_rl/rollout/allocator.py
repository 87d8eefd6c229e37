"""The allocator: which samples go into which free slots, on the ledger side of the pump.

Owns: the order samples start in (continuations of half-finished samples first, then groups
in stream order, then new draws from the Grain iterator as the sampler's gates allow), the
version gates a start must pass (deterministic runs: exact versions, and nothing at or past
a checkpoint cut), the `Start` of each pick (a continuation resumes after its recorded
tokens with the budget left), and giving samples back (`release`: a slot whose backend lost
it; the sample keeps its recorded tokens and starts again elsewhere, first in line).
A slot is a lease: the sample is `in_engine` from its pick until its last tokens are
recorded or its lease is released. Every call runs under the ledger lock.
Does not own: the slots or the chunk loop (scheduler), the backend (rollout), weights
(pump), rewards or env steps (pump), which groups train (sampler).
"""

from __future__ import annotations

from async_rl.buffer.ledger import Group, Ledger
from async_rl.rollout.interface import Start
from async_rl.rollout.scheduler import Fill


class Allocator:
    def __init__(self, *, ledger: Ledger, sampler, iterator, journal, max_new_tokens: int, episodes,
                 deterministic: bool, version: int):
        self.ledger, self.sampler, self.iterator, self.journal = ledger, sampler, iterator, journal
        self.N, self.episodes, self.deterministic = max_new_tokens, episodes, deterministic
        self.version = version  # weights the backend runs now (the pump swaps them)
        self.latest = version  # newest published
        self.cut_below: int | None = None  # deterministic cut: start only work needing older weights
        self._shared: set[int] = set()  # ordinals whose prompt the rollout may share with later starts
        self.released = 0  # leases given back by a backend that lost them

    # ---- gates ----------------------------------------------------------------------------

    def gate_version(self) -> int:
        # deterministic: generation waits for exact versions anyway; otherwise the gates count
        # from the weights the backend runs, so no group is generated staler than its bound
        return self.latest if self.deterministic else self.version

    def required_for_next_draw(self) -> int:
        return self.sampler.required_version_for_stamp(self.sampler.stamp(self.ledger.next_ordinal))

    def next_required_version(self) -> int | None:
        """Deterministic mode: the weights the next unstarted sample in stream order needs."""
        for g in self.ledger.groups.values():
            if any(not s.in_engine and not s.done for s in g.samples):
                return self.sampler.required_version(g)
        if self.sampler.may_draw(self.latest, self.latest):
            return self.required_for_next_draw()
        return None

    def _startable(self, g: Group) -> bool:
        if not self.sampler.eligible(g, self.gate_version(), self.latest):
            return False
        if not self.deterministic:
            return True
        req = self.sampler.required_version(g)
        return req == self.version and (self.cut_below is None or req < self.cut_below)

    def _may_draw(self) -> bool:
        if not self.sampler.may_draw(self.gate_version(), self.latest):
            return False
        return not self.deterministic or self.cut_below is None or self.required_for_next_draw() < self.cut_below

    # ---- picks ----------------------------------------------------------------------------

    def pick(self, free: list[int]) -> list[tuple[int, Group, int]]:
        """(slot, group, sample) assignments for free slots; marks them in_engine."""
        if not free:
            return []
        picks: list[tuple[int, Group, int]] = []
        journal = self.journal
        waits = journal.waits if journal is not None else {}

        def take(g: Group) -> None:
            for si, s in enumerate(g.samples):
                if len(picks) == len(free):
                    return
                if not s.in_engine and not s.done and not s.awaiting and \
                        not (waits and journal.waiting(g.ordinal, si)):
                    s.in_engine = True
                    picks.append((free[len(picks)], g, si))

        # continuations of half-finished samples first, then in stream order
        groups = sorted(self.ledger.groups.values(), key=lambda g: (not any(s.tokens and not s.done
                                                                            for s in g.samples), g.ordinal))
        for g in groups:
            if len(picks) == len(free):
                break
            if self._startable(g):
                take(g)
        while len(picks) < len(free) and self._may_draw():
            g = self._draw()
            if g is None:
                break
            if self._startable(g):
                take(g)
            else:
                break
        return picks

    def _draw(self) -> Group | None:
        try:
            rec = next(self.iterator)
        except StopIteration:
            self.ledger.mark_exhausted()
            return None
        g = self.ledger.add(rec, self.sampler.stamp(self.ledger.next_ordinal))
        if self.journal is not None:  # a killed run may have generated this group already
            self.journal.claim(g, self.latest)
        return g

    def starts(self, picks) -> Fill:
        """The picked samples' starts: continuations from prompt + recorded tokens with the
        remaining budget (none is generated twice); and the groups whose prompt no later
        start shares, every sample started or done."""
        starts, occupants = [], []
        for slot, g, si in picks:
            toks = tuple(g.samples[si].tokens)
            budget = self.N - len(toks) if self.episodes is None else self.episodes.budget(g.samples[si])
            starts.append(Start(slot, g.ordinal, si, g.prompt_tokens, toks, budget))
            occupants.append((g, si))
            if not toks:
                self._shared.add(g.ordinal)
        done = [o for o, g in ((o, self.ledger.groups.get(o)) for o in self._shared)
                if g is None or all(s.started or s.done for s in g.samples)]
        self._shared.difference_update(done)
        return Fill(starts, occupants, done)

    def release(self, occupants) -> None:
        """Leases a backend lost (a server died, stopped answering or answered garbage): each
        sample keeps the tokens recorded so far and is picked again first, as a continuation."""
        for g, si in occupants:
            s = g.samples[si]
            if self.ledger.groups.get(g.ordinal) is g and not s.done:
                s.in_engine = False
                self.released += 1
        self.ledger.changed.notify_all()
