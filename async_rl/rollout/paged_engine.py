"""The built-in engine over a paged KV pool (`engine.kv_layout=paged`, docs/design.md, "Paged KV").

Owns: the device pool (k/v [n_layers, Hkv, pages, page_size, hd]) and the host's `PagePool`
of who holds which pages; placing a prefill's rows in pages once (a holder per row, named by
the prefill's key) and mapping each inserted sample onto them (`fork`: a group's samples share
their prompt's full pages, only the partial last page is copied); growing each live slot's
pages before every decode call; and eviction. When the pool is short, a new sample is not
admitted and a live one that cannot grow frees the youngest live sample's pages (itself when
it is the youngest): both are reported by `take_evicted`, and the rollout gives them back to
the scheduler as lost slots, whose samples continue later from their recorded tokens (the
ledger keeps them; nothing is generated twice). Decode reads a page table as wide as a bucket
of the most pages a live slot holds (`decode_window`, in pages).
Does not own: the sampling, the weights, the prefill (the `Engine` it extends), which sample
goes where (the scheduler and its source).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from async_rl.config import ConfigError
from async_rl.rollout.engine import DecodeArrays, DecodeState, Engine, Prefix, PrefixArrays, _checked, bucket, ladder, seat
from async_rl.rollout.kv_pages import NULL_PAGE, PagePool


class PagedEngine(Engine):
    def __init__(self, model_cfg, graphdef, *, page_size: int = 16, pool_tokens: int = 0, impl: str = "auto",
                 **kw):
        """A pool per layer, each [Hkv, pages, page_size, hd] for keys and for values.
        `pool_tokens`: tokens of k/v the pool holds (0: every slot at full length, so nothing
        is ever evicted); `impl`: the decode attention kernel (`paged_attention.IMPLS`; auto:
        JAX's Pallas kernel for the platform on a TPU or GPU, which reads only held pages, else xla)."""
        self.page_size = page_size
        super().__init__(model_cfg, graphdef, recent=False, **kw)
        platform = self.mesh.devices.flat[0].platform
        self.paged_impl = impl if impl != "auto" else {"tpu": "pallas", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(
            platform, "xla")
        self.max_pages = -(-self.width // page_size)  # pages one sequence holds at most
        n = (self.max_concurrent_decodes * (self.max_pages + 1) if not pool_tokens else -(-pool_tokens // page_size))
        if n < self.max_pages + 1:
            raise ConfigError(f"engine.kv_pool_tokens={pool_tokens}: holds fewer than one sequence "
                              f"({self.width} tokens) and its copied page")
        self.pool = PagePool(n + 1, page_size)  # + the null page
        self.windows = ladder(self.max_pages, minimum=1) if len(self.windows) > 1 else (self.max_pages,)
        self._age = np.zeros(self.max_concurrent_decodes, np.int64)  # insertion order of each slot's sample
        self._start_S = np.zeros(self.max_concurrent_decodes, np.int64)  # each slot's first valid column
        self._inserted = 0
        self._evicted: list[int] = []
        self.evictions = 0  # live samples whose pages went to older ones, all calls
        self.refusals = 0  # samples not admitted for want of pages, all calls
        self._insert_paged = jax.jit(self._insert_paged_impl, donate_argnums=1,
                                     out_shardings=self._state_sharding)

    _decode_extra = 1
    _split_slots = False  # one pool, every slot's: a data axis repeats the work (pages split over it: not yet)

    def _cache_sharding(self, data, heads) -> list[NamedSharding]:
        return [NamedSharding(self.mesh, PS(heads, None, None, None))] * self.model_cfg.n_layers  # [Hkv, N, P, hd] each

    def _init_cache(self):
        c = self.model_cfg
        shape = (c.n_kv_heads, self.pool.n_pages, self.page_size, c.resolved_head_dim)
        return {n: [jnp.zeros(shape, self.dtype) for _ in range(c.n_layers)] for n in ("k", "v")}

    # ---- host side ------------------------------------------------------------------------

    def take_evicted(self) -> list[int]:
        """Slots whose samples lost their pages since the last call (they are inactive)."""
        out, self._evicted = self._evicted, []
        return out

    def release_prefix(self, prefix: Prefix) -> None:
        """The pages a prefill's rows hold for later inserts go (samples mapped onto them keep theirs)."""
        for h in [h for h in self.pool.holders() if isinstance(h, tuple) and h[1] == prefix.key]:
            self.pool.release(h)

    def admit(self, sizes: list[int]) -> list[bool]:
        """Whether samples of these many tokens (prompt + completion so far) would be admitted
        now, each counted as needing its row's pages of its own: a rollout asks before it
        prefills a continuation that could not go in."""
        p, pool = self.page_size, self.pool
        spare, out = self._spare(), []
        for n in sizes:
            need = pool.pages_for(n) + pool.pages_for(n + self.steps_per_call) - n // p
            out.append(need <= spare)
            spare -= need if out[-1] else 0
        return out

    def room(self, decode_state: DecodeState, slots: list[int]) -> int:
        """How many of these free slots to offer new samples now: the pages free, or held only by
        prefill rows or by these slots' ended samples, less a call's growth for every live sample
        (what they take before anything new does), over the least a new sample takes (its copied
        page and its first call's). Offering more only has samples refused and offered again."""
        k, active = self.steps_per_call, decode_state.host.active_S
        live = int(active.sum()) - sum(bool(active[s]) for s in slots)
        growth = live * self.pool.pages_for(k)
        return max(0, min(len(slots), (self._spare(slots) - growth) // (self.pool.pages_for(k) + 1)))

    def _spare(self, slots=()) -> int:
        """Pages a new sample could have now: free, or held only by prefill rows (`_reclaim`
        drops those first) or by `slots` (samples that ended, their pages not yet released)."""
        pool, ended = self.pool, set(slots)
        return pool.free + sum(int((pool.refs[pool.pages(h)] == 1).sum()) for h in pool.holders()
                               if isinstance(h, tuple) or h in ended)

    def refuse(self, decode_state: DecodeState, slots) -> DecodeState:
        """Slots whose samples were not admitted: free, and reported by `take_evicted`."""
        slots = [int(s) for s in slots]
        decode_state = self.free_many(decode_state, slots)
        self._refused(slots)
        return decode_state

    def _refused(self, slots: list[int]) -> None:
        self._evicted += slots
        self.refusals += len(slots)

    def insert_many(self, prefix: Prefix, decode_state: DecodeState, todo) -> DecodeState:
        """`Engine.insert_many` into pages: a row is written once, into pages of its own, and each
        sample maps them (`PagePool.fork`). A sample the pool has no room for (its first chunk
        included) is not admitted: its slot stays inactive and is reported by `take_evicted`."""
        todo = [tuple(int(v) for v in t) for t in todo]
        prefix, decode_state = _checked(prefix, Prefix), _checked(decode_state, DecodeState)
        for t in todo:  # a slot refilled before it was freed
            self.pool.release(t[0])
        decode_state = self.free_many(decode_state, [t[0] for t in todo if decode_state.host.active_S[t[0]]])
        host, pool, p = decode_state.host.copy(), self.pool, self.page_size
        writes: dict[int, list[int]] = {}
        copies, seated = [], []
        for slot, row, ordinal, sample in todo:
            n = int(prefix.next_cols_B[row] - prefix.starts_B[row])
            h = ("row", prefix.key, row)
            fresh = h not in pool
            need = pool.pages_for(n + self.steps_per_call) - n // p + (pool.pages_for(n) if fresh else 0)
            if not self._reclaim(need, keep={("row", prefix.key, r) for r in writes} | {h}):
                self._refused([slot])
                continue
            if fresh:
                pool.grow(h, n)
                writes[row] = pool.pages(h)
            copy = pool.fork(h, slot, n)
            if copy:
                copies.append(copy)
            seated.append((slot, row, ordinal, sample))
            self._inserted += 1
            self._age[slot], self._start_S[slot] = self._inserted, prefix.starts_B[row]
            host.cols_S[slot], host.active_S[slot] = prefix.next_cols_B[row], True
        if not seated:
            return DecodeState(decode_state.arrays, host)
        b, w = prefix.next_cols_B.size, self._row_pages(prefix)
        rows_W = np.full((b, w), NULL_PAGE, np.int32)
        for row, pages in writes.items():
            rows_W[row, :len(pages)] = pages
        s = self.max_concurrent_decodes
        copies_C = np.zeros((s, 2), np.int32)
        if copies:
            copies_C[:len(copies)] = copies
        seats = np.zeros((4, s), np.int32)
        seats[:, :len(seated)] = np.asarray(seated, np.int32).T
        st = self._insert_paged(prefix.arrays, decode_state.arrays, rows_W, copies_C, *seats, np.int32(len(seated)))
        return DecodeState(st, host)

    def _row_pages(self, prefix: Prefix) -> int:
        return -(-prefix.arrays.cache["k"].shape[3] // self.page_size)

    def generate_routed_async(self, params, decode_state: DecodeState, steps: int | None = None):
        """`Engine.generate_routed_async` (and so `generate_steps_async`) after every live slot has
        pages for the call's tokens (evicting where the pool is short), with its page table."""
        steps = self._check_steps(steps)
        decode_state = self._make_room(_checked(decode_state, DecodeState), steps)
        width = self.decode_window(decode_state, steps)
        table = self.pool.table([s if a else None for s, a in enumerate(decode_state.host.active_S)], width)
        fn = self._decoder(width, steps > 1, self.last_forward(decode_state, steps))
        return self._dispatched(decode_state, steps, fn(params, decode_state.arrays, table))

    def _make_room(self, decode_state: DecodeState, steps: int) -> DecodeState:
        """Each live slot holds pages for `steps` more tokens; oldest first, and where the pool is
        short the youngest live sample is evicted (vLLM's recompute preemption)."""
        host = decode_state.host.copy()
        for slot in sorted(np.flatnonzero(host.active_S), key=lambda s: self._age[s]):
            if not host.active_S[slot]:
                continue
            need = min(int(host.cols_S[slot]) + steps, self.width) - int(self._start_S[slot])
            while self.pool.grow(slot, need) is None:
                if self._reclaim(self.pool.pages_for(need) - len(self.pool.pages(slot))):
                    continue
                victim = max(np.flatnonzero(host.active_S), key=lambda s: self._age[s])
                self._evict(victim, host)
                if victim == slot:
                    break
        gone = [s for s in self._evicted if decode_state.host.active_S[s]]
        arrays = self._free(decode_state.arrays, np.isin(np.arange(self.max_concurrent_decodes), gone)) \
            if gone else decode_state.arrays
        return DecodeState(arrays, host)

    def _reclaim(self, pages: int, keep=frozenset()) -> bool:
        """Whether `pages` are free, after dropping the pages prefill rows hold for later inserts
        (oldest first, none in `keep`) where they are not: a row is written again when a
        sample needs it, so this loses no work a sample has."""
        rows = sorted((h for h in self.pool.holders() if isinstance(h, tuple) and h not in keep), key=lambda h: h[1])
        while self.pool.free < pages and rows:
            self.pool.release(rows.pop(0))
        return self.pool.free >= pages

    def _evict(self, slot: int, host) -> None:
        self.pool.release(slot)
        host.active_S[slot] = False
        self._evicted.append(slot)
        self.evictions += 1

    def free_many(self, decode_state: DecodeState, slots) -> DecodeState:
        for s in slots:
            self.pool.release(int(s))
        return super().free_many(decode_state, slots)

    def decode_window(self, decode_state: DecodeState, steps: int = 1) -> int:
        """Page-table width the next call reads: a bucket of the most pages a live slot holds."""
        host = _checked(decode_state, DecodeState).host
        if len(self.windows) == 1:
            return self.max_pages
        most = max((len(self.pool.pages(int(s))) for s in np.flatnonzero(host.active_S)), default=1)
        return bucket(max(most, 1), self.windows)

    def kv_tokens(self) -> int:
        return self.pool.n_pages * self.page_size

    def tokens_per_sample(self, group: int) -> float:
        """A sample of the configured lengths: its completion's pages and its prompt's partial page
        of its own, its prompt's whole pages shared by its `group`."""
        whole = self.max_prompt_len // self.page_size
        return self.page_size * (self.max_pages - whole + whole / group)

    # ---- jitted body ----------------------------------------------------------------------

    def _insert_paged_impl(self, prefix: PrefixArrays, st: DecodeArrays, rows_BxW, copies_Cx2, slots_S, rows_S,
                           ordinals_S, samples_S, n) -> DecodeArrays:
        """Writes prefix rows into their pages (a row of null pages writes nowhere read), copies
        forked partial pages, then seats the samples."""
        p = self.page_size
        cols_W = prefix.col0 + jnp.arange(prefix.cache["k"].shape[3])
        pos_BxW = cols_W[None] - prefix.starts_B[:, None]
        held = (pos_BxW >= 0) & (pos_BxW < rows_BxW.shape[1] * p)
        safe = jnp.clip(pos_BxW, 0, rows_BxW.shape[1] * p - 1)
        page_BxW = jnp.where(held, jnp.take_along_axis(rows_BxW, safe // p, axis=1), NULL_PAGE)

        def place(pool, new):  # a layer's pool [G, N, P, D] <- new [B, G, W, D] (the indexed axes stay: [G, B, W, D])
            pool = pool.at[:, page_BxW, safe % p].set(new.swapaxes(0, 1).astype(pool.dtype))
            return pool.at[:, copies_Cx2[:, 1]].set(pool[:, copies_Cx2[:, 0]])
        st = dataclasses.replace(st, cache={n: [place(pool, prefix.cache[n][i]) for i, pool in enumerate(st.cache[n])]
                                            for n in ("k", "v")})
        return jax.lax.fori_loop(0, n, lambda i, st: seat(prefix, st, slots_S[i], rows_S[i], ordinals_S[i],
                                                          samples_S[i]), st)

