"""A cache-free reference decoder for the engine's tests: recomputes the whole row with
`Transformer.__call__` every token, with the engine's sampling function and keys."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from async_rl.model.transformer import layout
from async_rl.rollout.decoding import Completion
from async_rl.rollout.sampling import sample_token, token_key


@functools.lru_cache(maxsize=16)
def _naive_step(graphdef, seed: int, temperature: float, top_k: int, top_p: float):
    sample = functools.partial(sample_token, temperature=temperature, top_k=top_k, top_p=top_p)

    @jax.jit
    def step(params, tokens_1xT, positions_1xT, valid_1xT, col, ordinal, sample_idx, n):
        logits_1xTxV = nnx.merge(graphdef, params)(tokens_1xT, positions_1xT, valid_1xT)
        return sample(logits_1xTxV[0, col], token_key(seed, ordinal, sample_idx, n))
    return step


def naive_generate(graphdef, params, prompt: np.ndarray, *, max_new_tokens: int, eos_id: int | None,
                   temperature: float, top_k: int, top_p: float, seed: int, ordinal: int, sample: int,
                   max_prompt_len: int | None = None) -> Completion:
    """One sample of `prompt` (left-padded to `max_prompt_len`), up to `eos_id` (kept) or
    `max_new_tokens`. Slow by design: no KV cache."""
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
