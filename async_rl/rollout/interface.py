"""The rollout interface the slot scheduler drives, and its adapter for the built-in engine.

Owns: what a generation backend must offer the slot scheduler, and so the pump, evaluation
and the benchmarks (start samples in slots, generate a chunk of tokens for every live slot
with behaviour logprobs and the weights version that made them, stop slots, swap weights
between chunks, report capacity), and `BuiltinRollout`, which maps it onto the engine's
batched calls (batched prefills shared by a prompt's samples, asynchronous chunks). Does
not own: the chunk loop (scheduler), which samples go where (pump), the ledger, rewards.

Call order, all from one thread: `start` and `stop` for slots, `step` dispatches a chunk,
`collect` waits for it; `swap` only between a `collect` and the next `step`, and a chunk
says which weights made each of its tokens (per-token versions are exact). A backend that
offers views of one engine (vLLM: evaluation beside training) serialises them itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class Start:
    slot: int  # engine slot the sample goes into, in [0, capacity)
    ordinal: int  # the group's place in the stream: with `sample`, names the sample's sampling seed
    sample: int  # index of the sample in its group
    prompt: np.ndarray  # prompt token ids, int32 [P]
    tokens: tuple[int, ...]  # tokens already generated (a saved half-finished sample continues after them)
    budget: int  # tokens still allowed: max_new_tokens - len(tokens), >= 1


@dataclass
class Chunk:
    tokens_KxS: np.ndarray  # int32 [steps_per_call, capacity]; rows past a slot's end are garbage
    logprobs_KxS: np.ndarray  # fp32, the sampled tokens' logprobs after temperature (behaviour policy)
    version: int  # weights version in use when the chunk was collected
    # version of each token when a backend buffers tokens across a swap; None: all `version`
    versions_KxS: np.ndarray | None = None
    # tokens that arrived for each slot (a backend whose slots run apart, on servers); None: K each
    count_S: np.ndarray | None = None
    # slots whose backend lost them (its server died, went silent or answered garbage): their
    # samples go back to the allocator with what was recorded before; this chunk has none of theirs
    lost: tuple[int, ...] = ()
    # routing replay (a backend that records routes): the experts every MoE layer chose for the
    # position that predicted each token, uint [K, S, n_layers, k]; None: not recorded
    routes_KxS: np.ndarray | None = None
    # slots started since the last chunk -> the experts of the positions their start prefilled
    # (prompt and saved tokens) except the last, whose go with the first token: [n, n_layers, k]
    heads: dict[int, np.ndarray] | None = None


@runtime_checkable
class Rollout(Protocol):
    capacity: int  # samples generated at once (slots)
    steps_per_call: int  # tokens per slot per chunk
    version: int  # weights version in use

    def swap(self, params: Any, version: int) -> None:
        """Use published weights from the next `step` on (called only between chunks)."""

    def start(self, starts: Sequence[Start]) -> None:
        """Puts samples into free slots; a continuation produces only new tokens. The sampling
        seed of token n of a sample is a function of (run seed, ordinal, sample, n)."""

    def step(self, live: Sequence[bool]) -> Any:
        """Dispatches one chunk for the live slots without waiting; returns a handle for
        `collect`. Slots not live are stopped first."""

    def collect(self, pending: Any) -> Chunk:
        """Waits for a dispatched chunk; its tokens are on the host."""

    def stop(self, slots: Sequence[int]) -> None:
        """Stops (aborts) samples: what they produced was collected already; the slots are free."""

    def forget(self, ordinals: Sequence[int]) -> None:
        """A hint: no later `start` shares these groups' prompts (cached prefills may go)."""


class BuiltinRollout:
    """`Rollout` over the built-in engine (or anything with its methods: `init_decode_state`,
    `prefill_many`, `insert_many`, `generate_steps_async`, `active_slots`, `free_many`,
    `update_params`). Params passed in are the engine's current ones (not re-placed)."""

    bit_identical = True  # a sample's tokens depend only on its key and weights (run.determinism)
    # the scheduler dispatches the next chunk before it fetches this one: each chunk is K tokens
    # per live slot, so a sample whose budget ends in the chunk in flight is known to end there
    ahead = 1

    def __init__(self, engine, params, version: int, *, deterministic: bool = False, prefill_rows: int = 32):
        self.engine, self.params, self.version = engine, params, version
        self.capacity = engine.max_concurrent_decodes
        self.steps_per_call = getattr(engine, "steps_per_call", 1)
        self.deterministic = deterministic
        self.prefill_rows = prefill_rows  # sequences per batched prefill call
        self.prefills = 0  # sequences prefilled
        self.decode_state = engine.init_decode_state()
        self._prefixes: dict[int, tuple] = {}  # ordinal -> (version, prefill, row) shared by its samples
        self.routes = bool(getattr(engine, "routes", False))  # the engine records MoE routes (routing replay)
        self._heads: dict[int, tuple] = {}  # slot -> (prefill, row) started since the last `step` (routes only)

    def swap(self, params, version: int) -> None:
        self.engine.update_params(params, version)
        self.params, self.version = params, version

    def start(self, starts: Sequence[Start]) -> None:
        """Prefills what the starts need, then inserts them, one insert call per prefill.
        Continuations prefill their tokens too (none is generated twice); the samples of a
        group share its prompt's prefill while the weights are unchanged."""
        params = self.params
        inserts: dict[int, tuple[object, list]] = {}  # id(prefix) -> (prefix, [(slot, row, ordinal, sample)])
        conts = self._admitted([s for s in starts if s.tokens])
        once = []  # continuations' prefills: no later start shares them
        for batch in self.batches(conts):
            prefix = self._prefill(params, [(s.prompt, np.asarray(s.tokens, np.int32)) for s in batch])
            inserts[id(prefix)] = (prefix, [(s.slot, row, s.ordinal, s.sample) for row, s in enumerate(batch)])
            once.append(prefix)
        fresh = [s for s in starts if not s.tokens]
        stale = {s.ordinal: s.prompt for s in fresh if self._prefixes.get(s.ordinal, (None,))[0] != self.version}
        for batch in self.batches(list(stale.items())):
            prefix = self._prefill(params, [(prompt, None) for _, prompt in batch])
            for row, (ordinal, _) in enumerate(batch):
                old = self._prefixes.get(ordinal)
                self._prefixes[ordinal] = (self.version, prefix, row)
                self._drop(old and old[1])
        for s in fresh:
            _, prefix, row = self._prefixes[s.ordinal]
            inserts.setdefault(id(prefix), (prefix, []))[1].append((s.slot, row, s.ordinal, s.sample))
        for prefix, todo in inserts.values():
            self.decode_state = self.engine.insert_many(prefix, self.decode_state, todo)
            if self.routes:
                self._heads.update({slot: (prefix, row) for slot, row, _, _ in todo})
        for prefix in once:
            self._drop(prefix)

    def _admitted(self, conts: list[Start]) -> list[Start]:
        """The continuations a paged engine has room for; the rest are refused before their
        prefill (their slots come back lost, and they start again later)."""
        admit = getattr(self.engine, "admit", None)
        if admit is None or not conts:
            return conts
        ok = admit([s.prompt.size + len(s.tokens) for s in conts])
        refused = [s.slot for s, a in zip(conts, ok) if not a]
        if refused:
            self.decode_state = self.engine.refuse(self.decode_state, refused)
        return [s for s, a in zip(conts, ok) if a]

    def room(self, slots: list[int]) -> int:
        """How many of these free slots are worth new samples now (a paged engine short of pages
        would refuse the rest); every one for the slot engine."""
        room = getattr(self.engine, "room", None)
        return len(slots) if room is None else room(self.decode_state, slots)

    @property
    def evictions(self) -> int:
        """Samples a paged engine evicted or refused for want of pages (0 for others)."""
        return getattr(self.engine, "evictions", 0) + getattr(self.engine, "refusals", 0)

    def forget(self, ordinals: Sequence[int]) -> None:
        for o in ordinals:
            old = self._prefixes.pop(o, None)
            self._drop(old and old[1])

    def _drop(self, prefix) -> None:
        """A prefill no start uses again (None: none): a paged engine frees the pages its rows
        hold once no other group's row of it is kept."""
        release = getattr(self.engine, "release_prefix", None)
        if prefix is not None and release is not None and not any(p is prefix for _, p, _ in self._prefixes.values()):
            release(prefix)

    def batches(self, items: list) -> list[list]:
        """Deterministic runs prefill one sequence per call, so a result depends on that
        sequence alone (never on what else was picked with it); others batch."""
        n = 1 if self.deterministic else self.prefill_rows
        return [items[i:i + n] for i in range(0, len(items), n)]

    def _prefill(self, params, seqs):
        self.prefills += len(seqs)
        return self.engine.prefill_many(params, seqs)

    def step(self, live: Sequence[bool]):
        self._free_idle(live)
        if self.routes:
            self.decode_state, toks, lps, routes = self.engine.generate_routed_async(self.params, self.decode_state)
        else:
            (self.decode_state, toks, lps), routes = self.engine.generate_steps_async(self.params, self.decode_state), None
        take = getattr(self.engine, "take_evicted", None)
        heads, self._heads = self._heads, {}
        return toks, lps, self.version, tuple(take()) if take else (), routes, heads

    def collect(self, pending) -> Chunk:
        """Slots a paged engine evicted (or did not admit) come back as lost: their samples
        continue later from what was recorded."""
        toks, lps, version, lost, routes, heads = pending
        chunk = Chunk(np.asarray(toks), np.asarray(lps), version, lost=lost)
        if routes is not None:
            chunk.routes_KxS = np.asarray(routes)
            chunk.heads = {slot: self.engine.head_routes(prefix, row) for slot, (prefix, row) in heads.items()}
        return chunk

    def stop(self, slots: Sequence[int]) -> None:
        """Frees slots the engine holds active: the decode window follows the active slots'
        columns, and a finished slot would still count."""
        active = self.engine.active_slots(self.decode_state)
        idle = [slot for slot in slots if active[slot]]
        if idle:
            self.decode_state = self.engine.free_many(self.decode_state, idle)

    def _free_idle(self, live: Sequence[bool]) -> None:
        active = self.engine.active_slots(self.decode_state)
        idle = [slot for slot in np.flatnonzero(active) if not live[slot]]
        if idle:
            self.decode_state = self.engine.free_many(self.decode_state, idle)
