"""The slot scheduler's ordering rules, over a host-only rollout: slots refilled before the
chunk that ended them is recorded, no chunk spent on an ended sample, a slot freed only once
its sample's last tokens are recorded, fills only between a collect and the next step, and
on stop the fetched chunk recorded first."""

import numpy as np

from async_rl.rollout.decoding import Requests
from async_rl.rollout.interface import Chunk
from async_rl.rollout.scheduler import Scheduler

STOP = 0


def stop_at(ordinal: int) -> int:
    """The sample of `ordinal` draws the stop token as its n-th token (1-based)."""
    return 2 + ordinal % 11


class HostRollout:
    """A `Rollout` on the host: token n of a sample is STOP at n == stop_at(ordinal), else
    100 + ordinal; every call is appended to `log`. It checks what the scheduler asks of it:
    a live slot holds a sample that has not ended, and every unended sample is live."""

    version = 0

    def __init__(self, capacity: int, steps_per_call: int, log: list):
        self.capacity, self.steps_per_call, self.log = capacity, steps_per_call, log
        self.rows: dict[int, list[int]] = {}  # slot -> [ordinal, tokens made, budget]

    def swap(self, params, version: int) -> None:
        self.version = version

    def start(self, starts) -> None:
        self.log.append(("start", [s.slot for s in starts]))
        for s in starts:
            assert s.slot not in self.rows or self._ended(s.slot), "a start into a slot still generating"
            self.rows[s.slot] = [s.ordinal, len(s.tokens), s.budget]

    def _ended(self, slot: int) -> bool:
        o, n, budget = self.rows[slot]
        return n >= budget or n >= stop_at(o)

    def step(self, live):
        self.log.append(("step", [i for i, x in enumerate(live) if x]))
        for slot in list(self.rows):
            assert bool(live[slot]) != self._ended(slot), f"slot {slot}: live={live[slot]} ended={self._ended(slot)}"
            if not live[slot]:
                del self.rows[slot]
        toks = np.full((self.steps_per_call, self.capacity), -1, np.int32)
        for slot, row in self.rows.items():
            self._draw(toks, slot, row, self.steps_per_call)
        return Chunk(toks, -np.abs(toks).astype(np.float32), self.version)

    @staticmethod
    def _draw(toks, slot: int, row: list, n: int) -> None:
        """The row's next `n` tokens into column `slot` of `toks`."""
        for k in range(n):
            row[1] += 1
            toks[k, slot] = STOP if row[1] == stop_at(row[0]) else 100 + row[0]

    def collect(self, pending) -> Chunk:
        self.log.append(("collect",))
        return pending

    def stop(self, slots) -> None:
        pass

    def forget(self, ordinals) -> None:
        self.log.append(("forget", list(ordinals)))


class Checked(Requests):
    """`Requests` that logs its calls and checks, at each fill, that a free slot (None) held
    only samples whose last tokens were recorded."""

    def __init__(self, *a, log: list, **kw):
        super().__init__(*a, **kw)
        self.log, self.sched, self.refilled_first = log, None, 0
        self.held: dict[int, list] = {}  # slot -> every row it was given

    def fill(self, free, busy):
        self.log.append(("fill", list(free)))
        for slot in free:
            if self.sched.slots[slot] is None:
                assert all(self.out[r.prompt][r.sample] is not None for r in self.held.get(slot, ())), slot
        fill = super().fill(free, busy)
        for st, row in zip(fill.starts, fill.occupants):
            self.held.setdefault(st.slot, []).append(row)
        return fill

    def release(self, occupants):
        self.log.append(("release",))
        for rows in self.held.values():  # a lost sample goes on elsewhere: its old slot no longer holds it
            rows[:] = [r for r in rows if all(r is not o for o in occupants)]
        super().release(occupants)

    def record(self, pieces, version):
        self.log.append(("record",))
        self.refilled_first += sum(p.ended and self.sched.slots[p.slot] is not p.occupant for p in pieces)
        super().record(pieces, version)

    def run(self, rollout, stops, stop=None):
        self.sched = Scheduler(rollout, self, stops)
        self.sched.run(stop or (lambda: not self.waiting and self.sched.idle))
        return self.out


def expected(ordinal: int, cap: int) -> list[int]:
    n = min(cap, stop_at(ordinal))
    return [STOP if i + 1 == stop_at(ordinal) else 100 + ordinal for i in range(n)]


def test_ended_slots_are_refilled_before_their_chunk_is_recorded_and_freed_only_after():
    log: list = []
    caps = np.random.RandomState(0).randint(1, 12, (9, 2)).tolist()
    req = Checked([np.ones(2, np.int32)] * 9, samples=2, limits=caps, ordinals=list(range(10, 19)), log=log)
    out = req.run(HostRollout(3, 4, log), (STOP,))
    for i in range(9):
        for s in range(2):
            assert out[i][s].tokens.tolist() == expected(10 + i, caps[i][s])
            np.testing.assert_array_equal(out[i][s].logprobs, -np.abs(out[i][s].tokens))
    assert req.refilled_first > 0, "no slot was refilled before the chunk that ended it was recorded"
    names = [e[0] for e in log]
    # every turn fills before it dispatches; between a dispatch and its collect there is no fill
    # (the one place a source may swap weights) but the previous chunk's record
    for i, name in enumerate(names):
        if name == "step":
            assert names[i - 1] in ("fill", "start", "forget")
            assert names[i + 1] == "collect" or names[i + 1:i + 3] == ["record", "collect"], names[i:i + 3]
    assert names[-1] == "record"
    # a prompt's prefill is forgotten once its last sample is in a slot
    forgotten = [o for e in log if e[0] == "forget" for o in e[1]]
    assert forgotten == list(range(10, 19))


def test_on_stop_the_fetched_chunk_is_recorded_first():
    log: list = []
    ordinals = [10, 21, 32]  # each stops at its 12th token: none ends within two chunks of 4
    req = Checked([np.ones(2, np.int32)] * 3, samples=1, limits=[[100]] * 3, ordinals=ordinals, log=log)
    req.run(HostRollout(3, 4, log), (STOP,), stop=lambda: req.sched.stats.calls >= 2)
    assert [e[0] for e in log].count("collect") == 2 and log[-1] == ("record",)
    assert [r.tokens for r in req.sched.slots] == [[100 + o] * 8 for o in ordinals]


class LossyRollout(HostRollout):
    """Slots that run apart, as on servers: each chunk brings 0..K tokens per slot, and now and
    then a slot is lost (its server gone) with the tokens of that chunk; the sample must go on
    from what was recorded, in another slot."""

    def __init__(self, capacity: int, steps_per_call: int, log: list, seed: int = 0):
        super().__init__(capacity, steps_per_call, log)
        self.rs, self.lost_n = np.random.RandomState(seed), 0

    def step(self, live):
        for slot in list(self.rows):
            if not live[slot]:
                del self.rows[slot]
        toks = np.full((self.steps_per_call, self.capacity), -1, np.int32)
        count = np.zeros(self.capacity, np.int64)
        lost = []
        for slot, row in list(self.rows.items()):
            if self.rs.rand() < 0.15:
                lost.append(slot)
                del self.rows[slot]
                continue
            count[slot] = self.rs.randint(0, self.steps_per_call + 1)
            self._draw(toks, slot, row, count[slot])
        self.lost_n += len(lost)
        return Chunk(toks, -np.abs(toks).astype(np.float32), self.version, count_S=count, lost=tuple(lost))


def test_lost_slots_continue_elsewhere_from_their_recorded_tokens_and_short_chunks_take_what_came():
    log: list = []
    caps = np.random.RandomState(1).randint(1, 14, (12, 2)).tolist()
    req = Checked([np.ones(2, np.int32)] * 12, samples=2, limits=caps, ordinals=list(range(10, 22)), log=log)
    rollout = LossyRollout(3, 4, log)
    out = req.run(rollout, (STOP,))
    assert rollout.lost_n > 5, "the schedule lost too few slots to test anything"
    for i in range(12):
        for s in range(2):
            assert out[i][s].tokens.tolist() == expected(10 + i, caps[i][s]), (i, s)


class AheadRollout(HostRollout):
    """`HostRollout` that takes the next chunk before the previous one is fetched (`ahead`):
    a live slot may hold a sample that ended in the chunk in flight (its tokens are garbage,
    -7), never one whose end was fetched or whose budget ended before."""

    ahead = 1

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.garbage_rows = 0  # slot-chunks run for a sample already ended
        self.uncollected: list[set] = []  # per chunk dispatched and not collected: slots it gave tokens
        self.early_starts = 0  # starts into a slot whose sample's last chunk was not collected yet

    def start(self, starts) -> None:
        self.early_starts += sum(any(s.slot in c for c in self.uncollected) for s in starts)
        super().start(starts)

    def step(self, live):
        self.log.append(("step", [i for i, x in enumerate(live) if x]))
        for slot in list(self.rows):
            if not live[slot]:
                del self.rows[slot]
        toks = np.full((self.steps_per_call, self.capacity), -1, np.int32)
        for slot, row in self.rows.items():
            assert row[1] < row[2], f"slot {slot}: run again after its budget ended"
            if self._ended(slot):
                self.garbage_rows += 1
                toks[:, slot] = -7
                continue
            self._draw(toks, slot, row, self.steps_per_call)
        self.uncollected.append({slot for slot, x in enumerate(live) if x and (toks[:, slot] != -7).any()})
        return Chunk(toks, -np.abs(toks).astype(np.float32), self.version)

    def collect(self, pending) -> Chunk:
        self.uncollected.pop(0)
        return super().collect(pending)


def test_with_a_chunk_dispatched_ahead_every_sample_gets_its_tokens_and_garbage_is_dropped():
    log: list = []
    caps = np.random.RandomState(1).randint(1, 12, (12, 2)).tolist()
    req = Checked([np.ones(2, np.int32)] * 12, samples=2, limits=caps, ordinals=list(range(30, 42)), log=log)
    rollout = AheadRollout(3, 4, log)
    out = req.run(rollout, (STOP,))
    for i in range(12):
        for s in range(2):
            assert out[i][s].tokens.tolist() == expected(30 + i, caps[i][s])
    assert rollout.garbage_rows > 0, "no sample ended by its stop token inside a chunk in flight"
    assert req.sched.stats.dropped == rollout.garbage_rows
    assert rollout.early_starts > 0, "no slot whose sample's budget ended in flight was refilled before its fetch"
    names = [e[0] for e in log]
    steps = [i for i, name in enumerate(names) if name == "step"]
    # the next chunk is dispatched before the previous one is collected
    assert any(names[i + 1:].index("collect") > names[i + 1:].index("step") for i in steps[:-1] if "step" in names[i + 1:])
    assert names.count("step") == names.count("collect")
