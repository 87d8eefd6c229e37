"""How the built-in engine draws a token: the sampling key of every (seed, prompt ordinal,
sample, position), and the draw itself at `engine.temperature` with top-k and top-p (the
top-p set found without sorting the vocabulary). The logprob returned is of the untruncated
softmax(logits / T): the behaviour logprob the learner corrects against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
        masked_V = jnp.where(nucleus_V(masked_V, top_p), masked_V, -jnp.inf)
    token = jax.random.categorical(key, masked_V).astype(jnp.int32)
    return token, logp_V[token]


def _order_keys(x_V):
    """int32 keys in the order of the float32 values (-0.0 read as 0.0)."""
    i = jax.lax.bitcast_convert_type(jnp.where(x_V == 0, 0.0, x_V), jnp.int32)  # not x + 0: XLA drops it
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def nucleus_V(x_V, top_p: float):
    """The top-p set of logits `x_V`: a token stays while the mass of the tokens above it is
    < top_p (the top token always; tied values together), found without sorting the vocabulary:
    32 halvings of a threshold over the values' order keys, each one masked sum of V."""
    key_V, p_V = _order_keys(x_V), jax.nn.softmax(x_V)
    above = lambda t: jnp.sum(jnp.where(key_V > t, p_V, 0.0)) < top_p  # noqa: E731 (monotone in t)

    def halve(_, lo_hi):
        lo, hi = lo_hi
        mid = lo + (jax.lax.bitcast_convert_type(hi - lo, jnp.uint32) >> 1).astype(jnp.int32)
        ok = above(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    # lo: below every value (all the mass is above it); hi: the key of +inf (none above it)
    bounds = (_order_keys(jnp.float32(-jnp.inf)) - 1, _order_keys(jnp.float32(jnp.inf)))
    _, t = jax.lax.fori_loop(0, 32, halve, bounds)
    return key_V >= t
