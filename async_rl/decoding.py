"""Decoding over an Engine: the continuous-batching driver and the reference decoder.

Owns: `generate_all` (fill free slots, decode chunks of `steps_per_call` tokens, retire
finished samples, refill, through the same `rollout.Rollout` interface the pump drives;
used by evaluation and the benchmarks), `chunk_ends`
(where each slot's sample ends in a chunk; the pump uses it too) and `naive_generate`, a
cache-free decoder that recomputes the whole row per token with the engine's sampling and
keys (the engine's tests compare against it). Does not own: the compiled programs, KV
slots or sampling (engine), the ledger or rewards (pump).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from async_rl.config import ModelConfig
from async_rl.engine import sample_token, token_key
from async_rl.model import layout
from async_rl.rollout import BuiltinRollout, Rollout, Start


@dataclasses.dataclass
class Completion:
    tokens: np.ndarray  # int32 [n], includes the EOS token if one was drawn
    logprobs: np.ndarray  # float32 [n], see the module docstring for what they are


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


def generate_all(backend, params, prompts: list[np.ndarray], *, samples: int = 1,
                 eos_id: int | tuple[int, ...] | None, ordinals: list[int] | None = None,
                 max_tokens: list[list[int]] | None = None, max_new_tokens: int | None = None
                 ) -> list[list[Completion]]:
    """Continuous batching over the rollout interface the pump drives: fill free slots, step,
    retire finished samples, refill.

    `backend` is a `rollout.Rollout` (it holds its weights; `params` is unused) or an `Engine`
    with `params`, driven through `BuiltinRollout` with one prefill per prompt, shared by its
    samples (so a result never depends on which prompts were batched with it).

    Returns completions indexed [prompt][sample]. A sample ends at `eos_id` (one id or a tuple
    of stop ids; kept as its last token) or after `max_new_tokens` tokens (by default the
    engine's; or `max_tokens[i][s]` for sample s of prompt i, when given); `eos_id=None`
    never stops early.

    After each chunk only the ends are found on the host (vectorised) before the freed slots
    are refilled and the next chunk dispatched, and the tokens are appended to their samples
    while the backend computes it."""
    ro = backend if isinstance(backend, Rollout) else BuiltinRollout(backend, params, 0, prefill_rows=1)
    stops = frozenset(() if eos_id is None else (eos_id,) if isinstance(eos_id, int) else eos_id)
    ordinals = list(range(len(prompts))) if ordinals is None else list(ordinals)
    n_max = max_new_tokens or backend.max_new_tokens
    waiting = [(i, s) for i in range(len(prompts)) for s in range(samples)]
    waiting.reverse()
    out: list[list[Completion | None]] = [[None] * samples for _ in prompts]
    running: list[_Row | None] = [None] * ro.capacity
    fetched = None  # the last chunk on the host, its ends found, its tokens not yet appended
    while waiting or any(running) or fetched is not None:
        starts, started = [], []
        for slot, row in enumerate(running):
            if row is None and waiting:
                i, s = waiting.pop()
                limit = n_max if max_tokens is None else max(1, min(int(max_tokens[i][s]), n_max))
                running[slot] = _Row(i, s, limit)
                starts.append(Start(slot, ordinals[i], s, np.asarray(prompts[i], np.int32), (), limit))
                if s == samples - 1:
                    started.append(ordinals[i])
        if starts:
            ro.start(starts)
            ro.forget(started)  # every sample of these prompts is in a slot: their prefill may go
        pending = None
        if any(running):
            pending = (ro.step([r is not None for r in running]), list(running))
        if fetched is not None:  # while the backend computes the chunk just dispatched
            _append(*fetched, out)
        fetched = None
        if pending is not None:
            handle, rows = pending
            chunk = ro.collect(handle)
            room_S = np.asarray([0 if r is None else r.limit - r.n for r in rows])
            take_S, ended_S = chunk_ends(chunk.tokens_KxS, room_S, stops)
            for slot, r in enumerate(rows):
                if r is not None:
                    r.n += int(take_S[slot])
                    if ended_S[slot]:
                        running[slot] = None  # refilled above, or stopped by the next step
            fetched = (chunk.tokens_KxS, chunk.logprobs_KxS, rows, take_S, ended_S)
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
