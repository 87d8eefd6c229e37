"""The generation server's engine loop: requests from HTTP into the built-in engine's slots.

Owns: `Request` (one completion request: its prompt, the tokens it continues, sampling key,
budget, and how its chunks reach its stream), and `ServerLoop`, the thread that runs the
slot scheduler over `BuiltinRollout` with itself as the scheduler's source: queued requests
go into free slots (with `run.determinism` one prefill per sequence, so a sample's tokens
never depend on what else is generating; otherwise batched prefills, as a run's), each recorded chunk goes to its request's stream,
published weights are swapped in between chunks, paused means no chunk is dispatched,
aborted requests give up their slots. A failure of the thread ends every stream and is
reported once (`on_failure`). Does not own: HTTP, validation or the event format (`server`),
the weights file (`weights`), the engine.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from async_rl import faults, signals
from async_rl.rollout.interface import BuiltinRollout, Start
from async_rl.rollout.scheduler import Fill, Piece, Scheduler

STOP_WAIT_S = 60.0  # how long closing waits for the loop thread (inside a compile or a device call)


@dataclass(eq=False)
class Request:
    """One sample to generate. `emit` is called from any thread with each chunk, as
    (tokens, logprobs, versions, finish_reason or None), then with None once the stream ends;
    or with a one-line str where the loop failed (the stream ends without a finish)."""
    id: str
    run: str
    prompt: np.ndarray  # the prompt proper, int32
    done: tuple[int, ...]  # tokens the sample already has (a continuation); the engine prefills them
    ordinal: int
    sample: int
    budget: int  # tokens still allowed, >= 1
    emit: Callable[[object], None]
    slot: int | None = None
    ended: bool = False
    sent: list = field(default_factory=list)  # tokens streamed since its start (an evicted sample continues after them)
    key: bytes = field(init=False)  # the prompt's identity: samples of one ordinal share its prefill

    def __post_init__(self):
        self.key = np.asarray(self.prompt, np.int32).tobytes()


class ServerLoop:
    """The scheduler's source and the thread that runs it; public methods are called from the
    HTTP side (any thread), the `Source` methods from the loop thread."""

    def __init__(self, engine, stops, *, log, on_failure: Callable[[str], None] = lambda line: None,
                 deterministic: bool = True, prefill_rows: int = 32):
        """`deterministic` (the served run's `run.determinism`): one prefill per sequence, so a
        sample's tokens never depend on what else is prefilled with it; otherwise batched."""
        self.stops = frozenset(int(t) for t in stops)
        self.log, self.on_failure = log, on_failure
        self.cond = threading.Condition()
        self.rollout = BuiltinRollout(engine, None, 0, deterministic=deterministic, prefill_rows=prefill_rows)
        self.scheduler = Scheduler(self.rollout, self, self.stops, lock=self.cond)
        self.version: int | None = None  # weights held (None until a trainer publishes some)
        self.paused = False
        self.error: str | None = None
        self._quiet = False  # the thread is outside the scheduler's loop (paused or closing)
        self._closing = False
        self._queue: collections.deque[Request] = collections.deque()
        self._live: set[Request] = set()  # requests in slots, not ended
        self._dropping: list[Request] = []  # aborted requests whose slots are to be released
        self._cached: dict[int, bytes] = {}  # ordinal -> prompt the rollout keeps a prefill of
        self._pending: tuple | None = None  # (params, version, future) to swap in
        self._thread = threading.Thread(target=self._run, name="server-loop", daemon=True)

    # ---- the HTTP side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, r: Request) -> None:
        with self.cond:
            if self._closing or self.error is not None:
                raise RuntimeError("the server is stopping")
            self._queue.append(r)
            self.cond.notify_all()

    def swap(self, params, version: int) -> concurrent.futures.Future:
        """Weights (placed by `Engine.load_params`) to use from the next chunk on; the future is
        done once every chunk from then on uses them."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cond:
            if self.error is not None or self._closing:
                fut.set_exception(RuntimeError(self.error or "the server is stopping"))
                return fut
            if self._pending is not None:
                self._pending[2].cancel()
            self._pending = (params, version, fut)
            self.cond.notify_all()
        return fut

    def abort(self, match: Callable[[Request], bool]) -> int:
        """Ends every queued or running request `match` picks with finish_reason "abort";
        their slots are released before the next chunk. Returns how many there were."""
        with self.cond:
            queued = [r for r in self._queue if match(r)]
            for r in queued:
                self._queue.remove(r)
            live = [r for r in self._live if match(r)]
            self._live.difference_update(live)
            self._dropping += live
            for r in queued + live:
                r.ended = True
                r.emit(([], [], [], "abort"))
                r.emit(None)
            self.cond.notify_all()
        return len(queued) + len(live)

    def pause(self, timeout_s: float = 60.0) -> bool:
        """Stops dispatching chunks; returns once the chunk in flight is recorded (True), or
        False after `timeout_s` or where the loop failed."""
        end = time.monotonic() + timeout_s
        with self.cond:
            self.paused = True
            self.cond.notify_all()
            while not self._quiet and self.error is None and time.monotonic() < end:
                self.cond.wait(0.05)
            return self._quiet and self.error is None

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def shutdown(self) -> None:
        """Refuses new requests, ends every stream (abort) and tells the thread to stop."""
        with self.cond:
            self._closing = True
        self.abort(lambda r: True)

    def close(self) -> None:
        """`shutdown`, then waits for the thread."""
        self.shutdown()
        self._thread.join(timeout=STOP_WAIT_S)
        if self._thread.is_alive():
            self.log(f"warning: the generation loop did not stop within {STOP_WAIT_S:g} s (inside a compile or a "
                     "device call); the process exits without waiting for it")
            signals.left_running(self._thread.name)

    # ---- the loop thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    self._between()
                    if self._closing:
                        return
                    self._quiet = self.paused
                    if self.paused:
                        self.cond.notify_all()
                        self.cond.wait(0.1)
                        continue
                self.scheduler.run(lambda: self.paused or self._closing)
        except BaseException as e:  # reaches the process: one line, every stream ended, exit 1
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        line = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        self.log(f"error: the generation loop failed: {line}")
        with self.cond:
            self.error = line
            if self._pending is not None:
                self._pending[2].set_exception(RuntimeError(line))
                self._pending = None
            for r in [*self._queue, *self._live]:
                r.ended = True
                r.emit(line)
            self._queue.clear()
            self._live.clear()
            self.cond.notify_all()
        self.on_failure(line)

    def _between(self) -> None:
        """Between chunks (under the lock): swap in published weights, release aborted slots."""
        if self._pending is not None:
            params, version, fut = self._pending
            self._pending = None
            self.rollout.swap(params, version)
            self.version = version
            fut.set_result(version)
        if self._dropping:
            slots = [r.slot for r in self._dropping if r.slot is not None and self.scheduler.slots[r.slot] is r]
            self._dropping = []
            if slots:
                self.scheduler.abandon(slots)

    # ---- the scheduler's source (loop thread; fill and record under the lock) ---------------

    def fill(self, free: list[int], busy: bool) -> Fill:
        self._between()
        starts, reqs = self._pick(free)
        if not starts and not busy:
            self.cond.wait(0.05)
            return Fill()
        return Fill(starts, reqs, self._forget())

    def _pick(self, free: list[int]) -> tuple[list[Start], list[Request]]:
        """Queued requests for free slots, first come first served. A fresh sample shares the
        prefill the rollout keeps for its ordinal; one whose ordinal is kept for another prompt
        waits until that prefill is forgotten."""
        starts, reqs, later = [], [], []
        while self._queue and len(starts) < len(free):
            r = self._queue.popleft()
            if not r.done:
                if self._cached.get(r.ordinal, r.key) != r.key:
                    later.append(r)
                    continue
                self._cached[r.ordinal] = r.key
            r.slot = free[len(starts)]
            starts.append(Start(r.slot, r.ordinal, r.sample, r.prompt, r.done, r.budget))
            reqs.append(r)
            self._live.add(r)
        self._queue.extendleft(reversed(later))
        return starts, reqs

    def _forget(self) -> list[int]:
        """Ordinals whose kept prefill no queued request shares."""
        wanted = {(r.ordinal, r.key) for r in self._queue if not r.done}
        gone = [o for o, k in self._cached.items() if (o, k) not in wanted]
        for o in gone:
            del self._cached[o]
        return gone

    def record(self, pieces: list[Piece], version: int) -> None:
        for p in pieces:
            r = p.occupant
            if r.ended:  # aborted meanwhile: its stream has ended
                continue
            finish = None
            if p.ended:
                finish = "stop" if p.tokens[-1] in self.stops else "length"
                r.ended = True
                self._live.discard(r)
            r.emit((p.tokens, p.logprobs, p.versions, finish))
            r.sent += p.tokens
            if finish:
                r.emit(None)

    def release(self, occupants: list) -> None:
        """Samples a paged engine evicted: each continues first in line from what it has sent."""
        for r in reversed(occupants):
            self._live.discard(r)
            if not r.ended:
                r.done, r.budget, r.sent = r.done + tuple(r.sent), r.budget - len(r.sent), []
                self._queue.appendleft(r)

    def collected(self, calls: int) -> None:
        faults.delay("generate", self.rollout.steps_per_call)
