"""Generation engine over KV slots: batched prefill / insert / generate / free.

Owns: compiled prefill (batched, at bucket widths), insert, generate (per decode window)
and free over a fixed number of KV-cache slots; the engine mesh (data x tensor) and the
weights' engine layout (compute dtype, split by logical axes); token sampling
(temperature, top-k, top-p) with per-token keys derived from (seed, ordinal, sample,
completion index); fp32 behaviour logprobs; swapping weights without recompiling. Its API
is the batched calls (`prefill_many`, `insert_many`, `generate_steps_async`, `free_many`);
JetStream's single-row Engine API (`prefill`, `insert`, `generate`, `free`) wraps them.
Does not own: when a sample is finished (the caller decides: EOS or N tokens; the slot
scheduler runs the continuous-batching loop through `rollout.BuiltinRollout`), rewards,
the ledger, policy-version bookkeeping beyond remembering the version of the loaded
weights, tokenisation.

Logprob convention: the logprob returned for a token is `log_softmax(logits / T)[token]`
in fp32 (plain `log_softmax(logits)` when T = 0). Top-k / top-p truncation changes
which tokens can be drawn but is deliberately NOT reflected in the logprob, because the
learner recomputes exactly this quantity from full-sequence logits.

Layout: see `async_rl.model.transformer` (prompt left-padded into [P-L, P), completion from column P).

Routing replay (`routes=True`, an MoE model): the experts every layer used at each position
(`moe.routes_dtype` on the host). A sampled token's routes are those of the forward whose
logits it was drawn from (position prompt_len - 1 + i for completion token i), kept per slot
in the state; a prefill's other positions come from `head_routes`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from async_rl.config import ConfigError, ModelConfig
from async_rl.model import attention, moe, sharding
from async_rl.model.sharding import is_var as _is_var
from async_rl.model.transformer import KVCache, Recent, init_cache, init_recent, layout, write_recent
from async_rl.rollout.sampling import sample_token, token_key


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefixArrays:
    """Prefilled sequences (B rows) on device, each inserted into a slot on its own. The cache
    holds engine columns [col0, col0 + W) only: a prompt bucket and a completion bucket, not P + N."""
    cache: KVCache  # k/v [n_layers, B, Hkv, W, hd]
    logits_BxV: jax.Array  # fp32 next-token logits per row, taken at its last valid column
    starts_B: jax.Array  # int32: first valid column per row (P - prompt length)
    next_cols_B: jax.Array  # int32: column each row's next sampled token goes to
    col0: jax.Array  # int32 scalar: engine column of the cache's column 0
    experts_BxWxLxK: jax.Array | None = None  # `moe.routes_dtype`: experts used at each column (routes only)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeArrays:
    """Every slot's device state: what the compiled insert, generate and free take and donate."""
    cache: KVCache  # k/v [n_layers, S, Hkv, T, hd]
    logits_SxV: jax.Array  # fp32 next-token logits per slot
    cols_S: jax.Array  # int32: column of the token the next `generate` samples
    starts_S: jax.Array  # int32: first valid column
    ordinals_S: jax.Array  # int32: stream ordinal of the slot's prompt (sampling key)
    samples_S: jax.Array  # int32: sample index within the prompt's group (sampling key)
    active_S: jax.Array  # bool: inactive slots compute garbage and do not advance
    experts_SxLxK: jax.Array | None = None  # int32: experts of the forward behind logits_SxV (routes only)


@dataclasses.dataclass(frozen=True)
class SlotMirror:
    """The host's copy of every slot's column and activity, kept by the engine's own calls so
    that choosing a decode window costs no device sync."""
    cols_S: np.ndarray  # int64: column of the token the next `generate` samples
    active_S: np.ndarray  # bool

    def copy(self) -> SlotMirror:
        return SlotMirror(self.cols_S.copy(), self.active_S.copy())


@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The slots between engine calls: device arrays and their host mirror, always together.
    Deliberately not a pytree: a tree map or `jax.block_until_ready` treats it as one leaf, so
    no transformation can hand the engine arrays whose mirror was dropped (the decode window
    would silently widen to P + N)."""
    arrays: DecodeArrays
    host: SlotMirror

    def block_until_ready(self) -> DecodeState:
        jax.block_until_ready(self.arrays)
        return self


@dataclasses.dataclass(frozen=True)
class Prefix:
    """Prefilled rows (`prefill_many`) and, on the host, the column each row's next token goes to."""
    arrays: PrefixArrays
    next_cols_B: np.ndarray  # int32
    starts_B: np.ndarray | None = None  # int32: each row's first valid column
    key: int = 0  # names the prefill among the engine's (a paged engine keeps its rows' pages under it)
    col0: int = 0  # engine column of the prefill's column 0

    def block_until_ready(self) -> Prefix:
        jax.block_until_ready(self.arrays)
        return self


AXES = ("data", "tensor")


def engine_mesh(devices, tensor: int = 1) -> Mesh:
    """Mesh ("data", "tensor") over the engine's devices: slots split over data, weights
    and KV heads over tensor (a tensor group: the closest devices, `sharding.build_mesh`)."""
    devs = list(np.asarray(devices, dtype=object).reshape(-1))
    if tensor < 1 or len(devs) % tensor:
        raise ConfigError(f"engine.tensor={tensor}: must divide the engine's {len(devs)} devices")
    return sharding.build_mesh(devs, (len(devs) // tensor, tensor), AXES)


def check_tensor(model_cfg: ModelConfig, tensor: int) -> None:
    """Attention heads and KV heads split whole over the tensor axis."""
    for name, n in (("model.n_heads", model_cfg.n_heads), ("model.n_kv_heads", model_cfg.n_kv_heads)):
        if n % tensor:
            raise ConfigError(f"engine.tensor={tensor}: must divide {name}={n} (heads split whole over it)")


def ladder(limit: int, minimum: int = 16) -> tuple[int, ...]:
    """Bucket sizes up to `limit`: the powers of two in [minimum, limit), then `limit`."""
    out, b = [], 1
    while b < limit:
        if b >= minimum:
            out.append(b)
        b *= 2
    return tuple(out) + (limit,)


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    return next(b for b in sizes if b >= n)


def _checked(state, cls):
    if not isinstance(state, cls):
        raise TypeError(f"expected the engine's {cls.__name__}, got {type(state).__name__}")
    return state


def _devices_of(params) -> set:
    """The devices the committed arrays of a parameter tree lie on."""
    return {d for x in jax.tree.leaves(params) if isinstance(x, jax.Array) and x.committed
            for d in x.sharding.device_set}


def _is_norm_scale(axes) -> bool:
    return axes is not None and tuple(a for a in axes if a != "layers") == ("embed",)


class Engine:
    def __init__(self, model_cfg: ModelConfig, graphdef, *, vocab_size: int, slots: int, max_prompt_len: int,
                 max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int, devices=None,
                 steps_per_call: int = 1, tensor: int = 1, windows: bool = True, unroll: bool | int = 1,
                 all_devices=None, recent: bool | None = None, routes: bool = False):
        """`windows`: decode reads only a bucket of the cache's columns (`decode_window`);
        False reads all P + N (the choice then never depends on other slots' lengths).
        `unroll`: layers per decode scan iteration (True: all; `plan` counts costs so).
        `all_devices`: several processes: every process's engine devices (a list per
        process, this one's equal to `devices`), so weights are published in one program.
        `recent`: a multi-step call keeps its new columns in a block beside the cache and
        writes them once at its end (`model.Recent`); None: on TPU only (elsewhere the
        cache is written in place each step, which costs less there). `routes`: record the
        experts an MoE model uses (routing replay: `generate_routed_async`, `head_routes`)."""
        if routes and not model_cfg.moe:
            raise ValueError("Engine(routes=True): a dense model has no expert routes")
        self.routes = routes
        self.unroll = unroll
        self.model_cfg, self.graphdef, self.vocab_size = model_cfg, graphdef, vocab_size
        self.max_concurrent_decodes = slots
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.width = max_prompt_len + max_new_tokens
        self.seed = seed
        self.steps_per_call = steps_per_call
        self.windows = ladder(self.width, minimum=max_prompt_len + 1) if windows else (self.width,)
        self.prompt_buckets = ladder(max_prompt_len)
        self.done_buckets = (0,) + ladder(max_new_tokens - 1) if max_new_tokens > 1 else (0,)
        self.dtype = jnp.dtype(model_cfg.dtype)
        self._sample = functools.partial(sample_token, temperature=temperature, top_k=top_k, top_p=top_p)
        check_tensor(model_cfg, tensor)
        self.mesh = engine_mesh(devices if devices is not None else jax.devices(), tensor)
        self.tensor = tensor
        self.params: Any = None
        self.version: int | None = None
        platform = self.mesh.devices.flat[0].platform
        self.recent = platform == "tpu" if recent is None else recent
        self.attn = attention.resolve(model_cfg.attention, platform, model_cfg.dtype, self.mesh, ("data",), "tensor")
        self._global_mesh = self._every_process_mesh(all_devices)

        rep = NamedSharding(self.mesh, PS())
        # Slots are independent rows: they split over the data axis when they divide evenly.
        data = "data" if slots % self.mesh.shape["data"] == 0 and self.mesh.shape["data"] > 1 and self._split_slots \
            else None
        heads = "tensor" if tensor > 1 else None
        per_slot = NamedSharding(self.mesh, PS(data))
        cache_sh = self._cache_sharding(data, heads)
        prefix_cache = NamedSharding(self.mesh, PS(None, None, heads, None, None))
        self._replicated = rep
        self._state_sharding = DecodeArrays(
            cache={"k": cache_sh, "v": cache_sh}, logits_SxV=per_slot, cols_S=per_slot,
            starts_S=per_slot, ordinals_S=per_slot, samples_S=per_slot, active_S=per_slot,
            experts_SxLxK=per_slot if routes else None)
        self._prefix_sharding = PrefixArrays(cache={"k": prefix_cache, "v": prefix_cache}, logits_BxV=rep, starts_B=rep,
                                       next_cols_B=rep, col0=rep, experts_BxWxLxK=rep if routes else None)
        st, pre = self._state_sharding, self._prefix_sharding
        self._publishers: dict = {}
        # Params keep the shardings `load_params` gave them (None: taken from the arguments).
        self._init = jax.jit(self._init_impl, out_shardings=st)
        self._prefill = jax.jit(self._prefill_impl, in_shardings=(None, rep, rep, rep, rep, rep), out_shardings=pre)
        self._insert = jax.jit(self._insert_impl, in_shardings=(pre, st, rep, rep, rep, rep, rep), out_shardings=st,
                               donate_argnums=1)
        # state, [K, S] tokens and logprobs, [K, S, L, k] routes
        self._out_sh = (st, NamedSharding(self.mesh, PS(None, data)), NamedSharding(self.mesh, PS(None, data))
                        if routes else None)
        self._decoders: dict[tuple[int, bool, bool], Any] = {}  # (window, multi-step, last forward) -> decode
        self._prefills = 0  # prefills made (names each)
        self._free = jax.jit(self._free_impl, in_shardings=(st, rep), out_shardings=st, donate_argnums=0)

    def _decoder(self, window: int, multi: bool, last_forward: bool = True):
        """The compiled decode of one token or of `steps_per_call` (`multi`) for one window (a
        bounded set: `self.windows`), with or without the forward pass after its last token
        (`generate_steps_async`)."""
        key = (window, multi, last_forward)
        if key not in self._decoders:
            body = self._generate_steps_impl if multi else self._generate_one_impl
            st, many, routes = self._out_sh
            extra = (self._replicated,) * self._decode_extra
            self._decoders[key] = jax.jit(functools.partial(body, window=window, last_forward=last_forward),
                                          in_shardings=(None, st, *extra), out_shardings=(st, many, many, routes),
                                          donate_argnums=1)
        return self._decoders[key]

    _split_slots = True  # slots split over the data axis (a paged pool is one, every slot's)
    _decode_extra = 0  # arguments a decode takes after the state (a paged engine's page table)

    def _cache_sharding(self, data, heads) -> NamedSharding:
        return NamedSharding(self.mesh, PS(None, data, heads, None, None))  # [L, S, Hkv, T, hd]

    def _init_cache(self) -> KVCache:
        return init_cache(self.model_cfg, self.max_concurrent_decodes, self.width)

    # ---- weights -------------------------------------------------------------------
    def param_dtype(self, v) -> Any:
        """The engine's dtype of a parameter: the compute dtype, except norm scales, which the
        model reads in fp32 (so the engine computes exactly what the learner computes)."""
        x = v.get_value() if _is_var(v) else v
        if not jnp.issubdtype(x.dtype, jnp.floating) or _is_norm_scale(getattr(v, "axes", None)):
            return x.dtype
        return self.dtype

    def param_shardings(self, params):
        """NamedShardings on the engine mesh from the parameters' logical axes (`sharding.RULES`)."""
        return sharding.param_shardings(params, self.mesh)

    def _cast(self, params, copy: bool):
        def one(v):
            x, dt = v.get_value(), self.param_dtype(v)
            return v.replace(x.astype(dt) if x.dtype != dt else jnp.copy(x) if copy else x)
        return jax.tree.map(one, params, is_leaf=_is_var)

    def load_params(self, params):
        """Params in the engine's compute dtype and sharding, in fresh buffers (a donating
        learner may pass its own). Cast once here, not per token. On the engine's own devices
        one program casts and reshards from any layout (no gathered replica, no second copy);
        from other devices they are cast where they are, then transferred."""
        srcs = _devices_of(params)
        if self._spans_every_process(srcs):
            return self._load_global(params)
        if not srcs or srcs == set(self.mesh.devices.flat):
            return self._publisher(params, self.mesh)(params)
        if any(x.dtype != self.param_dtype(v) for v, x in
               zip(jax.tree.leaves(params, is_leaf=_is_var), jax.tree.leaves(params))):
            params = jax.jit(functools.partial(self._cast, copy=False))(params)
        return jax.device_put(params, self.param_shardings(params))

    def _publisher(self, params, mesh: Mesh):
        """The compiled cast into fresh buffers laid out by logical axes on `mesh`, one per
        mesh and parameter tree (shardings are built only when it compiles)."""
        key = (mesh, jax.tree.structure(params))
        if key not in self._publishers:
            self._publishers[key] = jax.jit(functools.partial(self._cast, copy=True),
                                            out_shardings=sharding.param_shardings(params, mesh))
        return self._publishers[key]

    def _every_process_mesh(self, all_devices) -> Mesh | None:
        """("process", "data", "tensor") over every process's engine devices, each process's
        block laid out as its own engine mesh (None with one process)."""
        if not all_devices or len(all_devices) < 2:
            return None
        mine = set(all_devices[jax.process_index()])
        if len({len(g) for g in all_devices}) != 1 or mine != set(self.mesh.devices.flat):
            raise ValueError("all_devices: one equal-length list per process, this process's equal to the engine's")
        mesh = sharding.stacked_mesh(all_devices, self.mesh.devices.shape, ("process",) + AXES)
        if list(mesh.devices[jax.process_index()].flat) != list(self.mesh.devices.flat):
            raise ValueError("all_devices: this process's list is not in the order its engine's devices were given")
        return mesh

    def gathers(self, params) -> bool:
        """True when `load_params` takes these global (several-process) weights itself: they
        lie on exactly the engine devices of every process (engine and learner share them)."""
        return self._spans_every_process(_devices_of(params))

    def _spans_every_process(self, devices: set) -> bool:
        return self._global_mesh is not None and devices == set(self._global_mesh.devices.flat)

    def _load_global(self, params):
        """One program on every process casts the weights and reshards them from the learner's
        layout to each process's engine layout (split over tensor, whole over processes and
        data): no full replica in the learner's dtype, no second copy. Each process then
        wraps its own shards as its engine's arrays."""
        out = self._publisher(params, self._global_mesh)(params)

        def local(x, sh):
            return jax.make_array_from_single_device_arrays(x.shape, sh, [s.data for s in x.addressable_shards])
        return jax.tree.map(local, out, self.param_shardings(params))

    def _placed(self, params) -> bool:
        """Already in the engine's dtypes and shardings (e.g. from `load_params`)."""
        sh = jax.tree.leaves(self.param_shardings(params))
        for v, x, s in zip(jax.tree.leaves(params, is_leaf=_is_var), jax.tree.leaves(params), sh):
            if not isinstance(x, jax.Array) or x.dtype != self.param_dtype(v) or not x.sharding.is_equivalent_to(
                    s, x.ndim):
                return False
        return True

    def adopt(self, params):
        """`params` as the engine reads them: as they are where they already have its dtypes
        and shardings (a frozen LoRA base on shared devices: no second copy, and nothing may
        donate it), else `load_params`'s fresh copy."""
        return params if self._placed(params) else self.load_params(params)

    def update_params(self, params, version: int) -> None:
        """Swaps in new weights; same shapes, dtypes and placement, so nothing recompiles."""
        if self.params is not None:
            old = jax.tree.structure(self.params)
            if jax.tree.structure(params) != old:
                raise ValueError("update_params: parameter tree differs from the loaded one")
            for a, b in zip(jax.tree.leaves(self.params), jax.tree.leaves(params)):
                if a.shape != b.shape:
                    raise ValueError(f"update_params: shape {b.shape} != loaded {a.shape}")
        self.params = params if self._placed(params) else self.load_params(params)
        self.version = version

    # ---- API: the batched calls --------------------------------------------------------
    def init_decode_state(self) -> DecodeState:
        s = self.max_concurrent_decodes
        return DecodeState(self._init(), SlotMirror(np.zeros(s, np.int64), np.zeros(s, bool)))

    def prefill_many(self, params, seqs) -> Prefix:
        """Prefills several (prompt, completion prefix or None) sequences in one call, at
        the width of a prompt bucket plus a completion bucket (powers of two, `ladder`);
        rows are padded to a power of two. A completion prefix of k < N tokens lets a saved
        half-finished sample continue without regenerating; a sequence prefilled alone gets
        the buckets of its own lengths, so its result depends on it alone."""
        rows = [self._check_seq(p, c) for p, c in seqs]
        if not rows:
            raise ValueError("prefill_many: no sequences")
        p = self.max_prompt_len
        pb = bucket(max(r[0].size for r in rows), self.prompt_buckets)
        nb = bucket(max(r[1].size for r in rows), self.done_buckets)
        b = 1 << (len(rows) - 1).bit_length()  # rows: the next power of two
        c0, w = p - pb, pb + nb
        tokens, positions, valid = (np.zeros((b, w), np.int32), np.zeros((b, w), np.int32),
                                    np.zeros((b, w), bool))
        next_cols, starts = np.full(b, p, np.int32), np.full(b, p - 1, np.int32)
        for i, (prompt, done) in enumerate(rows + [(np.zeros(1, np.int32), np.zeros(0, np.int32))] * (b - len(rows))):
            start, pos, ok = layout(prompt.size, p, self.width, n_filled=prompt.size + done.size)
            tokens[i, start - c0:pb] = prompt
            tokens[i, pb:pb + done.size] = done
            positions[i], valid[i] = pos[c0:c0 + w], ok[c0:c0 + w]
            next_cols[i], starts[i] = p + done.size, start
        self._prefills += 1
        arrays = self._prefill(params, tokens, positions, valid, next_cols, np.int32(c0))
        if arrays.experts_BxWxLxK is not None:  # on its way while the decode runs (`head_routes`)
            arrays.experts_BxWxLxK.copy_to_host_async()
        return Prefix(arrays, next_cols, starts, self._prefills, c0)

    def head_routes(self, prefix: Prefix, row: int) -> np.ndarray:
        """A prefilled row's routes at positions 0 .. n-2 ([n - 1, L, k], `moe.routes_dtype`;
        n: its prompt and completion-prefix tokens). Position n-1's go with the first token
        sampled from it (`generate_routed_async`). Waits for the prefill."""
        e = _checked(prefix, Prefix).arrays.experts_BxWxLxK
        if e is None:
            raise ValueError("head_routes: this engine records no routes (Engine(routes=True))")
        lo, hi = int(prefix.starts_B[row]) - prefix.col0, int(prefix.next_cols_B[row]) - 1 - prefix.col0
        return np.asarray(e)[row, lo:hi].copy()  # its own rows, not a view of the prefill's

    def _check_seq(self, prompt_tokens, completion):
        prompt = np.asarray(prompt_tokens, np.int32).reshape(-1)
        done = np.zeros(0, np.int32) if completion is None else np.asarray(completion, np.int32).reshape(-1)
        if not 1 <= prompt.size <= self.max_prompt_len:
            raise ValueError(f"prompt length {prompt.size} not in [1, max_prompt_len={self.max_prompt_len}]")
        if done.size >= self.max_new_tokens:
            raise ValueError(f"completion prefix of {done.size} tokens leaves nothing to generate "
                             f"(max_new_tokens={self.max_new_tokens})")
        return prompt, done

    def insert_many(self, prefix: Prefix, decode_state: DecodeState, todo) -> DecodeState:
        """Several (slot, row, ordinal, sample) of one prefix in one call (distinct slots):
        a copy per row, so the result is the same as inserting them one at a time. A slot's
        columns outside the prefix are never read before the slot writes them."""
        todo = [tuple(int(v) for v in t) for t in todo]
        if not todo:
            return decode_state
        n = len(todo)
        # padded to the slot count (distinct slots: n never exceeds it): one program per prefix
        # shape, not one per count as well (the loop runs n times whatever the padding)
        arr = np.zeros((4, self.max_concurrent_decodes), np.int32)
        arr[:, :n] = np.asarray(todo, np.int32).T
        prefix, decode_state = _checked(prefix, Prefix), _checked(decode_state, DecodeState)
        host = decode_state.host.copy()
        st = self._insert(prefix.arrays, decode_state.arrays, *arr, np.int32(n))
        for slot, row, _, _ in todo:
            host.cols_S[slot], host.active_S[slot] = prefix.next_cols_B[row], True
        return DecodeState(st, host)

    def generate_steps_async(self, params, decode_state: DecodeState, steps: int | None = None
                             ) -> tuple[DecodeState, jax.Array, jax.Array]:
        """`generate_routed_async` without the routes."""
        state, tokens_KxS, logprobs_KxS, _ = self.generate_routed_async(params, decode_state, steps)
        return state, tokens_KxS, logprobs_KxS

    def generate_routed_async(self, params, decode_state: DecodeState, steps: int | None = None
                              ) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array | None]:
        """K = `steps` tokens for every slot in one dispatch, without waiting: (state, tokens_KxS,
        logprobs_KxS, routes) as device arrays still being computed, their copy to the host already
        started. `steps`: `steps_per_call` (the default) or 1, the two compiled decodes. The
        caller records the previous chunk meanwhile and fetches these later (`np.asarray`), so
        the host's per-token work overlaps the device's next K steps. Tokens a slot produces
        after its stop token (or its N-th token) are garbage the caller drops; a finished slot
        idles for the rest of the call. `routes` (None unless the engine records them): [K, S, L, k] in
        `moe.routes_dtype`, token j's experts at every layer (those of the forward that gave
        the logits it was drawn from)."""
        steps = self._check_steps(steps)
        fn = self._decoder(self.decode_window(decode_state, steps), steps > 1, self.last_forward(decode_state, steps))
        return self._dispatched(decode_state, steps, fn(params, decode_state.arrays))

    def _check_steps(self, steps: int | None) -> int:
        steps = steps or self.steps_per_call
        if steps not in (1, self.steps_per_call):
            raise ValueError(f"generate_steps_async: steps={steps}, not 1 or steps_per_call={self.steps_per_call}")
        return steps

    def _dispatched(self, decode_state: DecodeState, steps: int, out) -> tuple:
        """A decode call's (state, tokens, logprobs, routes), the host mirror advanced and the copies started."""
        state, tokens_KxS, logprobs_KxS, routes = out
        host = decode_state.host.copy()
        host.cols_S[host.active_S] += steps
        for x in (tokens_KxS, logprobs_KxS, routes):
            if x is not None:
                x.copy_to_host_async()
        return DecodeState(state, host), tokens_KxS, logprobs_KxS, routes

    def free_many(self, decode_state: DecodeState, slots) -> DecodeState:
        """Marks slots inactive (they stop advancing and leave the decode window), in one call."""
        mask_S = np.zeros(self.max_concurrent_decodes, bool)
        mask_S[list(slots)] = True
        if not mask_S.any():
            return decode_state
        host = _checked(decode_state, DecodeState).host.copy()
        st = self._free(decode_state.arrays, mask_S)
        host.active_S[mask_S] = False
        return DecodeState(st, host)

    def active_slots(self, decode_state: DecodeState) -> np.ndarray:
        """The slots the host mirror holds active (bool [S], a copy)."""
        return _checked(decode_state, DecodeState).host.active_S.copy()

    def decode_window(self, decode_state: DecodeState, steps: int = 1) -> int:
        """Cache columns the next `steps` decode steps read: the smallest of `self.windows`
        holding every active slot's columns (the engine mirrors each slot's column on the
        host, so the choice costs no device sync). Inactive slots compute garbage anyway."""
        host = _checked(decode_state, DecodeState).host
        if len(self.windows) == 1:
            return self.width
        cols, active = host.cols_S, host.active_S
        need = int(cols[active].max()) + steps if active.any() else 1
        return bucket(min(need, self.width), self.windows)

    def last_forward(self, decode_state: DecodeState, steps: int) -> bool:
        """Whether the forward pass after the last of `steps` tokens has a use: it computes
        the logits of each slot's next column, which no slot samples once every active one
        holds its last column (P + N - 1) by then."""
        host = _checked(decode_state, DecodeState).host
        cols, active = host.cols_S, host.active_S
        return bool((cols[active] + steps < self.width).any())

    # ---- JetStream's single-row Engine API: each a batched call of one ----------------------
    def prefill(self, params, prompt_tokens: np.ndarray, completion: np.ndarray | None = None) -> Prefix:
        return self.prefill_many(params, [(prompt_tokens, completion)])

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *, ordinal: int,
               sample: int, row: int = 0) -> DecodeState:
        return self.insert_many(prefix, decode_state, [(slot, row, ordinal, sample)])

    def generate_steps(self, params, decode_state: DecodeState, steps: int | None = None):
        """`generate_steps_async`, fetched: (state, tokens_KxS, logprobs_KxS) on the host."""
        state, tokens_KxS, logprobs_KxS = self.generate_steps_async(params, decode_state, steps)
        return state, np.asarray(tokens_KxS), np.asarray(logprobs_KxS)

    def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, np.ndarray, np.ndarray]:
        """One token for every slot: (state, tokens_S int32, logprobs_S fp32) on the host."""
        state, tokens_1xS, logprobs_1xS = self.generate_steps(params, decode_state, 1)
        return state, tokens_1xS[0], logprobs_1xS[0]

    def free(self, decode_state: DecodeState, slot: int) -> DecodeState:
        return self.free_many(decode_state, [slot])

    def kv_tokens(self) -> int:
        """Tokens the KV cache has room for."""
        return self.max_concurrent_decodes * self.width

    def tokens_per_sample(self, group: int) -> float:
        """Tokens of that room one sample of the configured lengths takes (a slot: all its columns)."""
        return float(self.width)

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables per entry point: prefill and insert one per bucket shape,
        generate one per decode window used, with and without its last forward pass (all
        bounded, however many requests run)."""
        fns = {"prefill": self._prefill, "insert": self._insert, "free": self._free}
        out = {k: f._cache_size() for k, f in fns.items()}
        out["generate"] = sum(f._cache_size() for f in self._decoders.values())
        return {k: out[k] for k in ("prefill", "insert", "generate", "free")}

    # ---- jitted bodies ---------------------------------------------------------------
    def _init_impl(self) -> DecodeArrays:
        s = self.max_concurrent_decodes
        zeros = jnp.zeros((s,), jnp.int32)
        return DecodeArrays(cache=self._init_cache(),
                           logits_SxV=jnp.zeros((s, self.vocab_size), jnp.float32), cols_S=zeros,
                           starts_S=zeros, ordinals_S=zeros, samples_S=zeros,
                           active_S=jnp.zeros((s,), bool), experts_SxLxK=self._no_routes(s))

    def _no_routes(self, s: int):
        """Zeroed per-slot routes [s, L, k] when recording them, else None."""
        c = self.model_cfg
        return jnp.zeros((s, c.n_layers, c.n_experts_per_token), jnp.int32) if self.routes else None

    def _prefill_impl(self, params, tokens_BxW, positions_BxW, valid_BxW, next_cols_B, col0) -> PrefixArrays:
        model = nnx.merge(self.graphdef, params)
        out = model.prefill_at(tokens_BxW, positions_BxW, valid_BxW, next_cols_B - 1 - col0, attn=self.attn,
                               col_offset=col0, experts=self.routes)
        starts_B = col0 + jnp.argmax(valid_BxW, axis=1).astype(jnp.int32)
        # in the host's dtype, like a decode's routes: the host copy of every column is a quarter of int32's
        experts = out[2].astype(moe.routes_dtype(self.model_cfg.n_experts)) if self.routes else None
        return PrefixArrays(cache=out[1], logits_BxV=out[0], starts_B=starts_B, next_cols_B=next_cols_B, col0=col0,
                            experts_BxWxLxK=experts)

    def _insert_impl(self, prefix: PrefixArrays, st: DecodeArrays, slots_B, rows_B, ordinals_B, samples_B,
                     n) -> DecodeArrays:
        def one(i, st):
            slot, row = slots_B[i], rows_B[i]

            def put(c, p):  # c [L, S, Hkv, T, hd] <- p [L, B, Hkv, W, hd]
                r = jax.lax.dynamic_index_in_dim(p, row, axis=1).astype(c.dtype)
                return jax.lax.dynamic_update_slice(c, r, (0, slot, 0, prefix.col0, 0))
            st = dataclasses.replace(st, cache=jax.tree.map(put, st.cache, prefix.cache))
            return seat(prefix, st, slot, row, ordinals_B[i], samples_B[i])
        return jax.lax.fori_loop(0, n, one, st)  # in place in the donated state, one row at a time

    def _generate_impl(self, params, st: DecodeArrays, window: int, last_forward: bool = True,
                       recent: Recent | None = None, table=None):
        """Samples every slot's token, then (`last_forward`) runs it through the model for the
        next column's logits and writes its k/v (into `recent` in a multi-step call); without,
        the slot's logits and cache stay. Returns (state, recent, tokens_S, logprobs_S, the
        tokens' routes [S, L, k] or None): those of the forward that gave the logits sampled."""
        n_S = st.cols_S - self.max_prompt_len
        keys_S = jax.vmap(functools.partial(token_key, self.seed))(st.ordinals_S, st.samples_S, n_S)
        tokens_S, logprobs_S = jax.vmap(self._sample)(st.logits_SxV, keys_S)
        new = dataclasses.replace(st, cols_S=st.cols_S + st.active_S.astype(jnp.int32))
        routes_SxLxK = st.experts_SxLxK
        if not last_forward:
            return new, recent, tokens_S, logprobs_S, routes_SxLxK
        # An inactive (or finished and not yet freed) slot must not write out of bounds.
        cols_S = jnp.minimum(st.cols_S, self.width - 1)
        model = nnx.merge(self.graphdef, params)
        if table is not None:  # a paged pool: rows not active write and read only the null page
            pos_S = jnp.where(st.active_S, cols_S - st.starts_S, 0)
            out = model.decode_paged(tokens_S, pos_S, cols_S, st.cache, table, impl=self.paged_impl,
                                     experts=self.routes)
        else:
            out = model.decode(tokens_S, cols_S - st.starts_S, cols_S, st.starts_S, st.cache, window=window,
                               unroll=self.unroll, recent=recent, experts=self.routes)
        new = dataclasses.replace(new, logits_SxV=out[0], experts_SxLxK=out[2] if self.routes else None)
        if recent is not None:  # the cache stays; the new k/v are in `recent`
            return new, out[1], tokens_S, logprobs_S, routes_SxLxK
        return dataclasses.replace(new, cache=out[1]), None, tokens_S, logprobs_S, routes_SxLxK

    def _generate_one_impl(self, params, st: DecodeArrays, table=None, *, window: int, last_forward: bool = True):
        st, _, tokens_S, logprobs_S, routes_SxLxK = self._generate_impl(params, st, window, last_forward, table=table)
        return st, tokens_S[None], logprobs_S[None], self._host_routes(routes_SxLxK, None)

    def _host_routes(self, routes_SxLxK, earlier_KxSxLxK):
        """A call's routes [K, S, L, k] in the host's dtype (a quarter of int32's bytes to copy)."""
        if routes_SxLxK is None:
            return None
        out = routes_SxLxK[None] if earlier_KxSxLxK is None else jnp.concatenate([earlier_KxSxLxK,
                                                                                  routes_SxLxK[None]])
        return out.astype(moe.routes_dtype(self.model_cfg.n_experts))

    def _generate_steps_impl(self, params, st: DecodeArrays, table=None, *, window: int, last_forward: bool = True):
        """K steps; with `self.recent` over a read-only cache, each step's new k/v going to a
        K-column `Recent` block written into the cache once at the end (`model.Recent`)."""
        recent = None
        if self.recent and table is None:
            k_sh = self._state_sharding.cache["k"]  # [L, S, Hkv, K, hd] splits as the cache does
            recent = init_recent(st.cache, self.steps_per_call, st.cols_S)
            recent = dataclasses.replace(recent, k=jax.lax.with_sharding_constraint(recent.k, k_sh),
                                         v=jax.lax.with_sharding_constraint(recent.v, k_sh))

        def step(carry, _):
            st, recent = carry
            st, recent, tok, lp, routes = self._generate_impl(params, st, window, recent=recent, table=table)
            return (st, recent), (tok, lp, routes)
        (st, recent), (tokens_KxS, logprobs_KxS, routes_KxSxLxK) = jax.lax.scan(
            step, (st, recent), None, length=self.steps_per_call - 1, unroll=True)
        st, recent, tok_S, lp_S, routes_SxLxK = self._generate_impl(params, st, window, last_forward, recent, table)
        if recent is not None:
            st = dataclasses.replace(st, cache=write_recent(st.cache, recent))
        return (st, jnp.concatenate([tokens_KxS, tok_S[None]]), jnp.concatenate([logprobs_KxS, lp_S[None]]),
                self._host_routes(routes_SxLxK, routes_KxSxLxK))

    def _free_impl(self, st: DecodeArrays, free_S) -> DecodeArrays:
        return dataclasses.replace(st, active_S=st.active_S & ~free_S)


def seat(prefix: PrefixArrays, st: DecodeArrays, slot, row, ordinal, sample) -> DecodeArrays:
    """`st` with prefix row `row`'s next-token logits (and the routes behind them), columns and
    sampling key in `slot`, active (its k/v is the caller's to place)."""
    if prefix.experts_BxWxLxK is not None:
        last = prefix.next_cols_B[row] - 1 - prefix.col0  # the column whose logits these are
        e_LxK = jax.lax.dynamic_index_in_dim(prefix.experts_BxWxLxK[row], last, axis=0, keepdims=False)
        st = dataclasses.replace(st, experts_SxLxK=st.experts_SxLxK.at[slot].set(e_LxK))
    return dataclasses.replace(st, logits_SxV=st.logits_SxV.at[slot].set(prefix.logits_BxV[row]),
                               cols_S=st.cols_S.at[slot].set(prefix.next_cols_B[row]),
                               starts_S=st.starts_S.at[slot].set(prefix.starts_B[row]),
                               ordinals_S=st.ordinals_S.at[slot].set(ordinal),
                               samples_S=st.samples_S.at[slot].set(sample), active_S=st.active_S.at[slot].set(True))
