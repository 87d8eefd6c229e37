"""The slot scheduler: the one overlapped continuous-batching loop over a `rollout.Rollout`.

Owns: the slot table (what each slot holds until its sample's last tokens are recorded, and
how many tokens that sample may still have), the loop (fill free slots from a `Source`,
dispatch chunk k+1, record chunk k while the backend computes it, find where samples end,
free and refill slots, stop) and `chunk_ends`. Does not own: what starts in which slot or
what a recorded token means (the source: `pump.Pump` with its ledger, `decoding.Requests`
with its completions), the backend's slots, prefills or weights (the rollout).

Ordering rules (docs/design.md, "The pump"): `Source.fill` runs between a `collect` and the
next `step`, the one place where a source may swap weights (a rollout with `ahead` = 1 has
the next chunk dispatched before the previous is collected; a sample that ended in the chunk
in flight runs one more chunk, dropped); a slot whose sample ended in
the fetched chunk is offered to `fill` before that chunk is recorded, so no chunk is spent
on it; a slot is freed only when its sample's last tokens are recorded, under the source's
lock together with `Source.record`; on stop the fetched chunk is recorded first, then any in flight.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import numpy as np

from async_rl.rollout.interface import Chunk, Rollout, Start


def chunk_ends(tokens_KxS: np.ndarray, room_S: np.ndarray, stops: np.ndarray,
               count_S: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Where each slot's sample ends within one chunk of K tokens: (take_S, ended_S).

    `room_S` is how many more tokens each sample may have (its cap minus what it holds);
    it ends at a token of `stops` (kept) or when the room is used up. `count_S`: the tokens
    that arrived per slot (None: K each). take_S counts the tokens that belong to it (all that
    arrived when it runs on); what follows an end is garbage."""
    k = tokens_KxS.shape[0]
    rows_K1 = np.arange(1, k + 1)[:, None]
    end_KxS = rows_K1 >= np.asarray(room_S)[None, :]
    if stops.size:
        end_KxS |= np.isin(tokens_KxS, stops)
    if count_S is not None:
        end_KxS &= rows_K1 <= np.asarray(count_S)[None, :]
    ended_S = end_KxS.any(axis=0)
    return np.where(ended_S, end_KxS.argmax(axis=0) + 1, k if count_S is None else count_S), ended_S


@dataclass(frozen=True)
class Fill:
    """What a source starts in free slots at one turn of the loop."""
    starts: Sequence[Start] = ()  # samples for free slots, at most one per slot
    occupants: Sequence[Any] = ()  # the source's handle of each start, held by its slot until the sample ends
    forget: Sequence[int] = ()  # ordinals passed to `Rollout.forget` once these starts are in


class Piece(NamedTuple):  # a tuple: one is built per live slot per chunk
    """One slot's share of a recorded chunk."""
    slot: int  # the slot the tokens came from
    occupant: Any  # the source's handle of the sample (from `Fill.occupants`)
    tokens: list[int]  # the sample's new tokens, up to and including its end
    logprobs: list[float]  # behaviour logprob of each token
    versions: list[int]  # weights version that made each token
    ended: bool  # these are the sample's last tokens (a stop token, kept, or its budget used up)
    routes: Any = None  # routing replay: uint [n, n_layers, k], the experts behind each token (`Chunk.routes_KxS`)
    head: Any = None  # routing replay, a slot's first chunk: its start's prefilled positions' (`Chunk.heads`)


class Source(Protocol):
    """What the scheduler asks of its user; every call comes from the scheduler's thread."""

    def fill(self, free: list[int], busy: bool) -> Fill:
        """Under the lock, between a `collect` and the next `step`: samples for some of the
        `free` slots. `busy`: some slot still holds a sample (or its unrecorded end)."""

    def record(self, pieces: list[Piece], version: int) -> None:
        """Under the lock: a chunk's tokens for every sample that was live in it (`version`:
        the weights in use when it was collected). The scheduler frees ended slots after it."""

    def collected(self, calls: int) -> None:
        """A chunk is on the host, its ends found, not yet recorded (`calls`: chunks so far)."""

    def release(self, occupants: list) -> None:
        """Under the lock: the backend lost these samples' slots (`Chunk.lost`); what was
        recorded of them stays theirs, and the slots are free."""


@dataclass
class SlotStats:
    busy_s: float = 0.0  # seconds inside rollout calls (start, forget, step, collect)
    calls: int = 0  # chunks collected
    dropped: int = 0  # slot-chunks run for a sample whose end was still in flight (`ahead`), dropped


@dataclass
class _Fetched:
    chunk: Chunk
    live: list  # occupant per slot at dispatch (None: not live)
    take_S: np.ndarray  # tokens of the chunk that belong to each live sample
    ended_S: np.ndarray  # the sample ended in this chunk


class Scheduler:
    """Runs a `Source` over a `Rollout`'s slots. `lock` (a context manager, e.g. the source's
    condition) is held around `fill` and around `record` with the freeing of ended slots, so
    another thread that takes it sees a sample's end and its free slot together."""

    def __init__(self, rollout: Rollout, source: Source, stops, *, lock=None, stats: SlotStats | None = None):
        self.rollout, self.source = rollout, source
        self.stops = np.fromiter(stops, np.int64)  # token ids that end a sample (kept as its last)
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.stats = stats if stats is not None else SlotStats()
        self.slots: list[Any] = [None] * rollout.capacity  # occupant per slot, None: free
        self._room_S = np.zeros(rollout.capacity, np.int64)  # tokens each slot's sample may still have
        self._ended: dict[int, Any] = {}  # slot -> its occupant that ended in the fetched, unrecorded chunk
        # per slot: samples it was given, and the latest of them seen to end, be lost or abandoned
        # (a chunk in flight may still run it: its part is dropped)
        self._fills_S = np.zeros(rollout.capacity, np.int64)
        self._over_S = np.zeros(rollout.capacity, np.int64)
        self._tail: dict[int, tuple[int, int]] = {}  # slot -> (fills, room) of a sample refilled over while its last chunk flies
        self._flight: deque[tuple] = deque()  # (pending, live, mask, fills) dispatched, not fetched, oldest first

    @property
    def idle(self) -> bool:
        """No slot holds a sample (so no chunk is fetched and unrecorded either)."""
        return all(occ is None for occ in self.slots)

    def run(self, stop: Callable[[], bool]) -> None:
        """Turns of fill -> start -> dispatch chunk k+1 -> record chunk k -> fetch chunk k+1
        until `stop()` (asked at the top of each turn). After a fetch only the ends are found
        (vectorised) before the next turn refills the freed slots and dispatches; recording
        runs while the backend computes. A rollout with `ahead` = 1 is given chunk k+2 before
        chunk k+1 is fetched, so it computes while the host fetches, fills and starts: a slot
        whose sample ends in the chunk in flight runs one chunk of garbage (dropped), unless its
        budget says it ends there (then the slot is refilled before that chunk is fetched). On
        stop every chunk in flight is fetched and recorded, oldest first. An exception leaves
        the fetched chunk unrecorded."""
        ahead = int(getattr(self.rollout, "ahead", 0))
        flight = self._flight
        fetched: _Fetched | None = None
        while not stop():
            with self.lock:
                fill = self.source.fill(self._offered(), not self.idle)
                ending_S = self._ending_S()
                for start, occ in zip(fill.starts, fill.occupants, strict=True):
                    slot = start.slot
                    if ending_S[slot]:  # its sample's last tokens are in flight: their room is kept for them
                        self._tail[slot] = (int(self._fills_S[slot]), int(self._room_S[slot]))
                    self.slots[slot], self._room_S[slot] = occ, start.budget
                    self._fills_S[slot] += 1
            if not fill.starts and self.idle and not flight:
                continue
            t0 = time.perf_counter()
            if fill.starts:
                self.rollout.start(fill.starts)
            if fill.forget:
                self.rollout.forget(fill.forget)
            live = self._live()
            mask = [occ is not None for occ in live]
            if any(mask):
                flight.append((self.rollout.step(mask), live, mask, self._fills_S.copy()))
            self.stats.busy_s += time.perf_counter() - t0
            if fetched is not None:
                self._record(fetched)  # meanwhile the backend computes what is in flight
                fetched = None
            if len(flight) > (ahead if any(mask) else 0):
                fetched = self._fetch_oldest(flight)
        if fetched is not None:
            self._record(fetched)
        while flight:
            self._record(self._fetch_oldest(flight))

    def _live(self) -> list:
        """The occupant per slot the next chunk runs (None: not live): not one whose end was
        seen, nor, with a chunk in flight, one whose budget ends in it."""
        over_S = (self._over_S == self._fills_S) | self._ending_S()
        return [None if over else occ for occ, over in zip(self.slots, over_S.tolist())]

    def _ending_S(self) -> np.ndarray:
        """Slots whose sample ends in the chunk in flight for want of room (a chunk gives every
        live slot K tokens): not run again, and offered to `fill` before that chunk is fetched."""
        if not self._flight:
            return np.zeros(len(self.slots), bool)
        _, _, mask, fills_S = self._flight[-1]
        return (np.asarray(mask) & (fills_S == self._fills_S) & (self._over_S != self._fills_S)
                & (self._room_S <= self.rollout.steps_per_call))

    def _fetch_oldest(self, flight) -> _Fetched:
        t0 = time.perf_counter()
        out = self._fetch(*flight.popleft())
        self.stats.calls += 1
        self.source.collected(self.stats.calls)
        self.stats.busy_s += time.perf_counter() - t0
        return out

    def abandon(self, slots: Sequence[int]) -> None:
        """Gives up samples before their end (their source abandoned them: an aborted request):
        called from `Source.fill` under the lock, or between `run`s. The rollout stops them
        and their slots are free from the next turn on; a fetched chunk still hands their
        last tokens to `Source.record`, which knows them for abandoned."""
        self.rollout.stop(list(slots))
        for slot in slots:
            self.slots[slot] = None
            self._over_S[slot] = self._fills_S[slot]

    def _offered(self) -> list[int]:
        """The free slots offered to the source: those the rollout has room for while samples
        run (when none does, every free slot: what is in the way is dropped to make room)."""
        free = self._free()
        room = getattr(self.rollout, "room", None)
        return free if room is None or self.idle else free[:room(free)]

    def _free(self) -> list[int]:
        # a slot whose sample ended in the fetched chunk is refilled before that chunk is recorded,
        # one whose sample's budget ends in the chunk in flight before that chunk is fetched
        ending_S = self._ending_S()
        return [slot for slot, occ in enumerate(self.slots)
                if occ is None or self._ended.get(slot) is occ or ending_S[slot]]

    def _fetch(self, pending, live: list, mask: list[bool], fills_S: np.ndarray) -> _Fetched:
        """Waits for a chunk and finds where each live sample ends in it (nothing recorded). A
        sample whose end (or loss) an earlier chunk showed has no part in it."""
        chunk = self.rollout.collect(pending)
        mask_S = np.asarray(mask) & (self._over_S != fills_S)
        self.stats.dropped += int(np.count_nonzero(mask)) - int(np.count_nonzero(mask_S))
        live = [occ if m else None for occ, m in zip(live, mask_S.tolist())]
        if chunk.lost:  # every earlier chunk is recorded: the lost samples go back whole
            self._release(chunk.lost, live, mask_S, fills_S)
        room_S = self._room_S.copy()
        for slot, (fills, room) in list(self._tail.items()):  # a sample refilled over before its last chunk
            if fills_S[slot] == fills:
                room_S[slot] = room
                del self._tail[slot]
        take_S, ended_S = chunk_ends(chunk.tokens_KxS, np.where(mask_S, room_S, 0), self.stops, chunk.count_S)
        self._room_S -= np.where(mask_S & (fills_S == self._fills_S), take_S, 0)
        self._ended = {slot: live[slot] for slot in np.flatnonzero(ended_S & mask_S).tolist()}
        self._over_S = np.where(ended_S & mask_S, fills_S, self._over_S)
        return _Fetched(chunk, live, take_S, ended_S)

    def _release(self, lost, live: list, mask_S: np.ndarray, fills_S: np.ndarray) -> None:
        gone = [slot for slot in lost if live[slot] is not None]
        mask_S[gone] = False
        self._over_S[gone] = fills_S[gone]
        with self.lock:
            self.source.release([live[slot] for slot in gone])
            for slot in gone:
                if self.slots[slot] is live[slot]:
                    self.slots[slot] = None
                live[slot] = None

    def _record(self, f: _Fetched) -> None:
        """Hands a fetched chunk to the source: the lists are built outside the lock, which is
        held only for `Source.record` and freeing the slots whose samples ended."""
        c = f.chunk
        toks_SxK, lps_SxK = c.tokens_KxS.T.tolist(), c.logprobs_KxS.T.tolist()  # one conversion, not one per slot
        v = c.version
        vers_SxK = [None] * len(f.live) if c.versions_KxS is None else c.versions_KxS.T.tolist()
        pieces = [Piece(slot, occ, t[:n], lp[:n], [v] * n if vs is None else vs[:n], e)
                  for slot, (occ, t, lp, vs, n, e) in enumerate(zip(f.live, toks_SxK, lps_SxK, vers_SxK,
                                                                    f.take_S.tolist(), f.ended_S.tolist()))
                  if occ is not None]
        if c.routes_KxS is not None:
            heads = c.heads or {}
            pieces = [p._replace(routes=c.routes_KxS[:len(p.tokens), p.slot].copy(), head=heads.get(p.slot)) for p in pieces]
        with self.lock:
            self.source.record(pieces, c.version)
            for p in pieces:
                if p.ended and self.slots[p.slot] is p.occupant:  # else refilled already, before this record
                    self.slots[p.slot] = None
            self._ended = {}
