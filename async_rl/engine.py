"""Generation engine with JetStream's Engine API (prefill / insert / generate over KV slots).

Owns: compiled prefill, insert, generate and free over a fixed number of KV-cache slots;
token sampling (temperature, top-k, top-p) with per-token keys derived from
(seed, ordinal, sample, completion index); fp32 behaviour logprobs; swapping weights
without recompiling; a small continuous-batching driver (`generate_all`) and a cache-free
reference decoder (`naive_generate`). Does not own: when a sample is finished (the
caller decides: EOS or N tokens), rewards, the ledger, policy-version bookkeeping beyond
remembering the version of the loaded weights, tokenisation.

Logprob convention: the logprob returned for a token is `log_softmax(logits / T)[token]`
in fp32 (plain `log_softmax(logits)` when T = 0). Top-k / top-p truncation changes
which tokens can be drawn but is deliberately NOT reflected in the logprob, because the
learner recomputes exactly this quantity from full-sequence logits.

Layout: see `async_rl.model` (prompt left-padded into [P-L, P), completion from column P).
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

from async_rl.config import ModelConfig
from async_rl.model import KVCache, init_cache, layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """One prefilled sequence, ready to be inserted into a slot."""
    cache: KVCache  # k/v [n_layers, 1, T, Hkv, hd]
    logits_V: jax.Array  # fp32 next-token logits, taken at the last valid column
    start: jax.Array  # int32 scalar: first valid column (P - prompt length)
    next_col: jax.Array  # int32 scalar: column the next sampled token goes to


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    cache: KVCache  # k/v [n_layers, S, T, Hkv, hd]
    logits_SxV: jax.Array  # fp32 next-token logits per slot
    cols_S: jax.Array  # int32: column of the token the next `generate` samples
    starts_S: jax.Array  # int32: first valid column
    ordinals_S: jax.Array  # int32: stream ordinal of the slot's prompt (sampling key)
    samples_S: jax.Array  # int32: sample index within the prompt's group (sampling key)
    active_S: jax.Array  # bool: inactive slots compute garbage and do not advance


@dataclasses.dataclass
class Completion:
    tokens: np.ndarray  # int32 [n], includes the EOS token if one was drawn
    logprobs: np.ndarray  # float32 [n], see the module docstring for what they are


def token_key(seed: int, ordinal, sample, n) -> jax.Array:
    """Key for completion token n of (ordinal, sample): independent of slot, batch and order."""
    key = jax.random.PRNGKey(seed)
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, ordinal), sample), n)


def sample_token(logits_V, key, *, temperature: float, top_k: int, top_p: float):
    """(token int32, logprob fp32) for one row; logprob ignores top-k/top-p truncation."""
    logits_V = logits_V.astype(jnp.float32)
    if temperature == 0:
        token = jnp.argmax(logits_V).astype(jnp.int32)
        return token, jax.nn.log_softmax(logits_V)[token]
    scaled_V = logits_V / temperature
    logp_V = jax.nn.log_softmax(scaled_V)
    masked_V = scaled_V
    if top_k > 0 and top_k < scaled_V.shape[-1]:
        kth = jax.lax.top_k(scaled_V, top_k)[0][-1]
        masked_V = jnp.where(scaled_V >= kth, masked_V, -jnp.inf)
    if top_p < 1.0:
        sorted_V = jnp.sort(masked_V)[::-1]
        probs_V = jax.nn.softmax(sorted_V)
        # Keep a token while the mass strictly before it is < top_p; the first always stays.
        keep_V = (jnp.cumsum(probs_V) - probs_V) < top_p
        cutoff = jnp.min(jnp.where(keep_V, sorted_V, jnp.inf))
        masked_V = jnp.where(masked_V >= cutoff, masked_V, -jnp.inf)
    token = jax.random.categorical(key, masked_V).astype(jnp.int32)
    return token, logp_V[token]


class Engine:
    def __init__(self, model_cfg: ModelConfig, graphdef, *, vocab_size: int, slots: int, max_prompt_len: int,
                 max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int, devices=None,
                 steps_per_call: int = 1):
        self.model_cfg, self.graphdef, self.vocab_size = model_cfg, graphdef, vocab_size
        self.max_concurrent_decodes = slots
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.width = max_prompt_len + max_new_tokens
        self.seed = seed
        self.steps_per_call = steps_per_call
        self._sample = functools.partial(sample_token, temperature=temperature, top_k=top_k, top_p=top_p)
        self.mesh = Mesh(np.asarray(devices if devices is not None else jax.devices()), ("data",))
        self.params: Any = None
        self.version: int | None = None

        rep = NamedSharding(self.mesh, PS())
        # Slots are independent rows, so they split over the devices (data parallel
        # decode) when they divide evenly; weights are replicated.
        split = slots % self.mesh.size == 0
        per_slot = NamedSharding(self.mesh, PS("data") if split else PS())
        per_slot_cache = NamedSharding(self.mesh, PS(None, "data") if split else PS())
        self._replicated = rep
        self._state_sharding = DecodeState(
            cache={"k": per_slot_cache, "v": per_slot_cache}, logits_SxV=per_slot, cols_S=per_slot,
            starts_S=per_slot, ordinals_S=per_slot, samples_S=per_slot, active_S=per_slot)
        st = self._state_sharding
        self._init = jax.jit(self._init_impl, out_shardings=st)
        self._prefill = jax.jit(self._prefill_impl, in_shardings=rep, out_shardings=rep)
        self._insert = jax.jit(self._insert_impl, in_shardings=(rep, st, rep, rep, rep), out_shardings=st,
                               donate_argnums=1)
        def compiled(body, token_spec, token_sharding):
            if split:
                # Per-device bodies over local slots: without this the partitioner all-gathers
                # the logits for top-k and the new k/v rows for the cache scatter.
                specs = jax.tree.map(lambda s: s.spec, st)
                body = jax.shard_map(body, mesh=self.mesh, in_specs=(PS(), specs),
                                     out_specs=(specs, token_spec, token_spec))
            return jax.jit(body, in_shardings=(rep, st), out_shardings=(st, token_sharding, token_sharding),
                           donate_argnums=1)

        self._generate = compiled(self._generate_impl, PS("data"), per_slot)
        per_step_slot = NamedSharding(self.mesh, PS(None, "data") if split else PS())
        self._generate_steps = compiled(self._generate_steps_impl, PS(None, "data"), per_step_slot)
        self._free = jax.jit(self._free_impl, in_shardings=(st, rep), out_shardings=st, donate_argnums=0)

    # ---- weights -------------------------------------------------------------------
    def load_params(self, params):
        """Params replicated on the engine's devices. Arrays already laid out that way are
        returned as they are (no copy), so a donating learner must publish a copy."""
        return jax.device_put(params, self._replicated)

    def update_params(self, params, version: int) -> None:
        """Swaps in new weights; same shapes, dtypes and placement, so nothing recompiles."""
        if self.params is not None:
            old = jax.tree.structure(self.params)
            if jax.tree.structure(params) != old:
                raise ValueError("update_params: parameter tree differs from the loaded one")
            for a, b in zip(jax.tree.leaves(self.params), jax.tree.leaves(params)):
                if a.shape != b.shape:
                    raise ValueError(f"update_params: shape {b.shape} != loaded {a.shape}")
            params = jax.tree.map(lambda a, b: b if b.dtype == a.dtype else b.astype(a.dtype),
                                  self.params, params)
        self.params = self.load_params(params)
        self.version = version

    # ---- API -----------------------------------------------------------------------
    def init_decode_state(self) -> DecodeState:
        return self._init()

    def prefill(self, params, prompt_tokens: np.ndarray, completion: np.ndarray | None = None) -> Prefix:
        """Prefills one sequence of width T: the prompt and an optional completion prefix
        of k < N tokens (a saved half-finished sample continues without regenerating)."""
        prompt = np.asarray(prompt_tokens, np.int32).reshape(-1)
        done = np.zeros(0, np.int32) if completion is None else np.asarray(completion, np.int32).reshape(-1)
        p, t = self.max_prompt_len, self.width
        if not 1 <= prompt.size <= p:
            raise ValueError(f"prompt length {prompt.size} not in [1, max_prompt_len={p}]")
        if done.size >= self.max_new_tokens:
            raise ValueError(f"completion prefix of {done.size} tokens leaves nothing to generate "
                             f"(max_new_tokens={self.max_new_tokens})")
        start, positions, valid = layout(prompt.size, p, t, n_filled=prompt.size + done.size)
        tokens = np.zeros(t, np.int32)
        tokens[start:p] = prompt
        tokens[p:p + done.size] = done
        return self._prefill(params, tokens[None], positions[None], valid[None], np.int32(p + done.size))

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *, ordinal: int,
               sample: int) -> DecodeState:
        return self._insert(prefix, decode_state, np.int32(slot), np.int32(ordinal), np.int32(sample))

    def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, np.ndarray, np.ndarray]:
        """One token for every slot: (state, tokens_S int32, logprobs_S fp32) on the host."""
        state, tokens_S, logprobs_S = self._generate(params, decode_state)
        tokens_S, logprobs_S = jax.device_get((tokens_S, logprobs_S))
        return state, np.asarray(tokens_S), np.asarray(logprobs_S)

    def generate_steps(self, params, decode_state: DecodeState) -> tuple[DecodeState, np.ndarray, np.ndarray]:
        """`steps_per_call` tokens for every slot in one call: (state, tokens_KxS, logprobs_KxS).

        One dispatch and one host sync per K tokens. Tokens a slot produces after its stop
        token (or its N-th token) are garbage the caller drops; the slot is refilled after
        the call, so a finished slot idles for the rest of it."""
        if self.steps_per_call == 1:
            state, tokens_S, logprobs_S = self.generate(params, decode_state)
            return state, tokens_S[None], logprobs_S[None]
        state, tokens_KxS, logprobs_KxS = self._generate_steps(params, decode_state)
        tokens_KxS, logprobs_KxS = jax.device_get((tokens_KxS, logprobs_KxS))
        return state, np.asarray(tokens_KxS), np.asarray(logprobs_KxS)

    def generate_steps_async(self, params, decode_state: DecodeState) -> tuple[DecodeState, jax.Array, jax.Array]:
        """`generate_steps` without waiting: (state, tokens_KxS, logprobs_KxS) as device arrays
        still being computed (dispatch is asynchronous), their copy to the host already
        started. The caller records the previous chunk meanwhile and fetches these later
        (`np.asarray`), so the host's per-token work overlaps the device's next K steps."""
        if self.steps_per_call == 1:
            state, tokens_S, logprobs_S = self._generate(params, decode_state)
            tokens_KxS, logprobs_KxS = tokens_S[None], logprobs_S[None]
        else:
            state, tokens_KxS, logprobs_KxS = self._generate_steps(params, decode_state)
        for x in (tokens_KxS, logprobs_KxS):
            x.copy_to_host_async()
        return state, tokens_KxS, logprobs_KxS

    def free(self, decode_state: DecodeState, slot: int) -> DecodeState:
        return self._free(decode_state, np.int32(slot))

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables per entry point; each stays 1 however many requests run."""
        fns = {"prefill": self._prefill, "insert": self._insert, "generate": self._generate,
               "free": self._free}
        return {k: f._cache_size() for k, f in fns.items()}

    # ---- jitted bodies ---------------------------------------------------------------
    def _init_impl(self) -> DecodeState:
        s = self.max_concurrent_decodes
        zeros = jnp.zeros((s,), jnp.int32)
        return DecodeState(cache=init_cache(self.model_cfg, s, self.width),
                           logits_SxV=jnp.zeros((s, self.vocab_size), jnp.float32), cols_S=zeros,
                           starts_S=zeros, ordinals_S=zeros, samples_S=zeros,
                           active_S=jnp.zeros((s,), bool))

    def _prefill_impl(self, params, tokens_1xT, positions_1xT, valid_1xT, next_col) -> Prefix:
        model = nnx.merge(self.graphdef, params)
        logits_1xV, cache = model.prefill_at(tokens_1xT, positions_1xT, valid_1xT, (next_col - 1)[None])
        start = jnp.argmax(valid_1xT[0]).astype(jnp.int32)
        return Prefix(cache=cache, logits_V=logits_1xV[0], start=start, next_col=next_col)

    def _insert_impl(self, prefix: Prefix, st: DecodeState, slot, ordinal, sample) -> DecodeState:
        cache = jax.tree.map(lambda c, p: c.at[:, slot].set(p[:, 0].astype(c.dtype)), st.cache, prefix.cache)
        return DecodeState(cache=cache, logits_SxV=st.logits_SxV.at[slot].set(prefix.logits_V),
                           cols_S=st.cols_S.at[slot].set(prefix.next_col),
                           starts_S=st.starts_S.at[slot].set(prefix.start),
                           ordinals_S=st.ordinals_S.at[slot].set(ordinal),
                           samples_S=st.samples_S.at[slot].set(sample),
                           active_S=st.active_S.at[slot].set(True))

    def _generate_impl(self, params, st: DecodeState):
        model = nnx.merge(self.graphdef, params)
        n_S = st.cols_S - self.max_prompt_len
        keys_S = jax.vmap(functools.partial(token_key, self.seed))(st.ordinals_S, st.samples_S, n_S)
        tokens_S, logprobs_S = jax.vmap(self._sample)(st.logits_SxV, keys_S)
        # An inactive (or finished and not yet freed) slot must not write out of bounds.
        cols_S = jnp.minimum(st.cols_S, self.width - 1)
        logits_SxV, cache = model.decode(tokens_S, cols_S - st.starts_S, cols_S, st.starts_S, st.cache)
        new = dataclasses.replace(st, cache=cache, logits_SxV=logits_SxV,
                                  cols_S=st.cols_S + st.active_S.astype(jnp.int32))
        return new, tokens_S, logprobs_S

    def _generate_steps_impl(self, params, st: DecodeState):
        def step(carry, _):
            carry, tok, lp = self._generate_impl(params, carry)
            return carry, (tok, lp)
        st, (tokens_KxS, logprobs_KxS) = jax.lax.scan(step, st, None, length=self.steps_per_call, unroll=True)
        return st, tokens_KxS, logprobs_KxS

    def _free_impl(self, st: DecodeState, slot) -> DecodeState:
        return dataclasses.replace(st, active_S=st.active_S.at[slot].set(False))


def chunk_ends(tokens_KxS: np.ndarray, room_S: np.ndarray, stops) -> tuple[np.ndarray, np.ndarray]:
    """Where each slot's sample ends within one chunk of K tokens: (take_S, ended_S).

    `room_S` is how many more tokens each sample may have (its cap minus what it holds);
    it ends at a stop token (kept) or when the room is used up. take_S counts the tokens
    that belong to it (K when it runs on); what follows an end is garbage."""
    k = tokens_KxS.shape[0]
    end_KxS = np.arange(1, k + 1)[:, None] >= np.asarray(room_S)[None, :]
    if stops:
        end_KxS |= np.isin(tokens_KxS, np.fromiter(stops, np.int64))
    ended_S = end_KxS.any(axis=0)
    return np.where(ended_S, end_KxS.argmax(axis=0) + 1, k), ended_S


def generate_all(engine: Engine, params, prompts: list[np.ndarray], *, samples: int = 1,
                 eos_id: int | tuple[int, ...] | None, ordinals: list[int] | None = None,
                 max_tokens: list[list[int]] | None = None) -> list[list[Completion]]:
    """Continuous batching: fill free slots, step, retire finished samples, refill.

    Returns completions indexed [prompt][sample]. A sample ends at `eos_id` (one id or a tuple
    of stop ids; kept as its last token) or after `engine.max_new_tokens` tokens (or
    `max_tokens[i][s]` for sample s of prompt i, when given); `eos_id=None` never stops early.

    `engine.steps_per_call` tokens per call; after each call only the ends are found on the
    host (vectorised) before the freed slots are refilled and the next call dispatched, and
    the tokens are appended to their samples while the device computes it."""
    stops = frozenset(() if eos_id is None else (eos_id,) if isinstance(eos_id, int) else eos_id)
    ordinals = list(range(len(prompts))) if ordinals is None else list(ordinals)
    n_max = engine.max_new_tokens
    waiting = [(i, s) for i in range(len(prompts)) for s in range(samples)]
    waiting.reverse()
    out: list[list[Completion | None]] = [[None] * samples for _ in prompts]
    running: list[_Row | None] = [None] * engine.max_concurrent_decodes
    state = engine.init_decode_state()
    prefix_of: tuple[int, Prefix] | None = None  # samples of one prompt share its prefill
    fetched = None  # the last chunk on the host, its ends found, its tokens not yet appended
    while waiting or any(running) or fetched is not None:
        for slot, row in enumerate(running):
            if row is None and waiting:
                i, s = waiting.pop()
                if prefix_of is None or prefix_of[0] != i:
                    prefix_of = (i, engine.prefill(params, prompts[i]))
                state = engine.insert(prefix_of[1], state, slot, ordinal=ordinals[i], sample=s)
                limit = n_max if max_tokens is None else max(1, min(int(max_tokens[i][s]), n_max))
                running[slot] = _Row(i, s, limit)
        chunk = None
        if any(running):
            state, tokens_KxS, logprobs_KxS = engine.generate_steps_async(params, state)
            chunk = (tokens_KxS, logprobs_KxS, list(running))
        if fetched is not None:  # while the device computes the chunk just dispatched
            _append(*fetched, out)
        fetched = None
        if chunk is not None:
            tokens_KxS, logprobs_KxS, rows = chunk
            tokens_KxS, logprobs_KxS = np.asarray(tokens_KxS), np.asarray(logprobs_KxS)
            room_S = np.asarray([0 if r is None else r.limit - r.n for r in rows])
            take_S, ended_S = chunk_ends(tokens_KxS, room_S, stops)
            for slot, r in enumerate(rows):
                if r is not None:
                    r.n += int(take_S[slot])
                    if ended_S[slot]:
                        running[slot] = None
                        if not waiting:  # an idle slot stops advancing (nothing will refill it)
                            state = engine.free(state, slot)
            fetched = (tokens_KxS, logprobs_KxS, rows, take_S, ended_S)
    return out  # type: ignore[return-value]


@dataclasses.dataclass
class _Row:
    prompt: int
    sample: int
    limit: int  # tokens after which the sample ends
    n: int = 0  # tokens it holds, counting those found but not appended yet
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)


def _append(tokens_KxS, logprobs_KxS, rows, take_S, ended_S, out) -> None:
    for slot, r in enumerate(rows):
        if r is None:
            continue
        r.tokens += tokens_KxS[:take_S[slot], slot].tolist()
        r.logprobs += logprobs_KxS[:take_S[slot], slot].tolist()
        if ended_S[slot]:
            out[r.prompt][r.sample] = Completion(np.asarray(r.tokens, np.int32), np.asarray(r.logprobs, np.float32))


@functools.lru_cache(maxsize=16)
def _naive_step(graphdef, seed: int, temperature: float, top_k: int, top_p: float):
    sample = functools.partial(sample_token, temperature=temperature, top_k=top_k, top_p=top_p)

    @jax.jit
    def step(params, tokens_1xT, positions_1xT, valid_1xT, col, ordinal, sample_idx, n):
        logits_1xTxV = nnx.merge(graphdef, params)(tokens_1xT, positions_1xT, valid_1xT)
        return sample(logits_1xTxV[0, col], token_key(seed, ordinal, sample_idx, n))
    return step


def naive_generate(model_cfg: ModelConfig, graphdef, params, prompt: np.ndarray, *, max_new_tokens: int,
                   eos_id: int | None, temperature: float, top_k: int, top_p: float, seed: int,
                   ordinal: int, sample: int, max_prompt_len: int | None = None) -> Completion:
    """Reference decoder: recomputes the whole row with `Transformer.__call__` every token
    (no cache), with the engine's sampling function and keys. Slow by design."""
    del model_cfg  # the graphdef carries the architecture; kept for a uniform signature
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    p = max_prompt_len or prompt.size
    t = p + max_new_tokens
    step = _naive_step(graphdef, seed, float(temperature), int(top_k), float(top_p))
    tokens = np.zeros(t, np.int32)
    tokens[p - prompt.size:p] = prompt
    toks, lps = [], []
    for n in range(max_new_tokens):
        _, positions, valid = layout(prompt.size, p, t, n_filled=prompt.size + n)
        tok, lp = step(params, tokens[None], positions[None], valid[None], np.int32(p + n - 1),
                       np.int32(ordinal), np.int32(sample), np.int32(n))
        toks.append(int(tok))
        lps.append(float(lp))
        tokens[p + n] = toks[-1]
        if toks[-1] == eos_id:
            break
    return Completion(np.asarray(toks, np.int32), np.asarray(lps, np.float32))
