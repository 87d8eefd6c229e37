"""GRPO advantages and the clipped policy-gradient loss with off-policy corrections.

Owns: pure jnp functions from per-token logprobs, rewards and masks to a scalar loss and
its statistics. Does not own: the model forward pass, sharding or the optimizer
(learner), or where behaviour logprobs come from (engine).

Three policies appear: the behaviour policy mu that generated the tokens (its fp32
logprobs come from the engine), the proximal policy pi_prox (the learner's weights at
the start of the step; with one update per step it equals the current weights under
stop-gradient) and the policy pi_theta being optimised.

Token means take an optional `denom`: a micro-batch divides its sums by the token count
of the whole update, so the micro-batches' losses, gradients and mean statistics add up
to the unsplit ones (`MAX_STATS` combine by max instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grpo_advantages(rewards_GxS: jax.Array, eps: float) -> jax.Array:
    """Group-normalised advantages: (r - mean_group) / (std_group + eps)."""
    mean = rewards_GxS.mean(axis=-1, keepdims=True)
    std = rewards_GxS.std(axis=-1, keepdims=True)
    return (rewards_GxS - mean) / (std + eps)


def advantages(rewards_GxS: jax.Array, kind: str, eps: float) -> jax.Array:
    """Per-sample advantages from one group's rewards r_1..r_G.

    grpo  (r_i - mean) / (std + eps)                     (GRPO, DeepSeekMath)
    mean  r_i - mean                                     (Dr. GRPO: no std scaling)
    rloo  r_i - 1/(G-1) sum_{j != i} r_j = G/(G-1) (r_i - mean)   (RLOO, Ahmadian et al.)
    """
    if kind == "grpo":
        return grpo_advantages(rewards_GxS, eps)
    centred = rewards_GxS - rewards_GxS.mean(axis=-1, keepdims=True)
    if kind == "mean":
        return centred
    g = rewards_GxS.shape[-1]
    return centred * (g / (g - 1))


def overlong_penalty(lengths_B: jax.Array, max_len: int, buffer: int, coef: float) -> jax.Array:
    """DAPO's soft overlong punishment, added to the reward: 0 up to L_max - L_buf tokens, then
    a linear ramp coef * (L_max - L_buf - |y|) / L_buf down to -coef at |y| = L_max (completions
    never exceed L_max = rollout.max_new_tokens here)."""
    over = lengths_B.astype(jnp.float32) - (max_len - buffer)
    return -coef * jnp.clip(over, 0.0, float(buffer)) / buffer


def token_logprobs(logits_BxNxV: jax.Array, tokens_BxN: jax.Array, temperature: float) -> jax.Array:
    """fp32 log pi(token) under temperature-scaled logits (the engine's exact quantity)."""
    t = temperature if temperature > 0 else 1.0
    logp = jax.nn.log_softmax(logits_BxNxV.astype(jnp.float32) / t, axis=-1)
    return jnp.take_along_axis(logp, tokens_BxN[..., None], axis=-1)[..., 0]


MAX_STATS = ("is_weight_max", "logp_diff_max", "ratio_max", "expert_load_max")


def completion_logprobs(logits_fn, x_BxNxD, tokens_BxN, temperature: float, chunk: int = 0,
                        unroll: bool | int = 1):
    """(logp_BxN, entropy_BxN) of the completion tokens, projecting to the vocabulary `chunk`
    columns at a time: the [B, chunk, V] logits are rematerialised in the backward pass
    instead of keeping [B, N, V] alive (it dominates memory for 100k+ vocabularies)."""
    t = temperature if temperature > 0 else 1.0

    def one(x_c, tok_c):
        logp_all = jax.nn.log_softmax(logits_fn(x_c).astype(jnp.float32) / t, axis=-1)
        logp = jnp.take_along_axis(logp_all, tok_c[..., None], axis=-1)[..., 0]
        ent = -(jnp.exp(logp_all) * logp_all).sum(-1)
        return logp, ent

    n = x_BxNxD.shape[1]
    if not chunk or chunk >= n:
        return one(x_BxNxD, tokens_BxN)
    pad = (-n) % chunk
    x = jnp.pad(x_BxNxD, ((0, 0), (0, pad), (0, 0)))
    tok = jnp.pad(tokens_BxN, ((0, 0), (0, pad)))
    b, k = x.shape[0], (n + pad) // chunk
    xs = x.reshape(b, k, chunk, -1).swapaxes(0, 1)
    ts = tok.reshape(b, k, chunk).swapaxes(0, 1)
    _, (logp, ent) = jax.lax.scan(lambda c, a: (c, jax.checkpoint(one)(*a)), None, (xs, ts), unroll=unroll)
    unchunk = lambda y: y.swapaxes(0, 1).reshape(b, k * chunk)[:, :n]
    return unchunk(logp), unchunk(ent)


def token_count(mask_BxN):
    """The denominator of a token mean over `mask` (at least 1)."""
    return jnp.maximum(mask_BxN.astype(jnp.float32).sum(), 1.0)


def _masked_mean(x, mask, denom=None):
    return (x * mask).sum() / (token_count(mask) if denom is None else denom)


def policy_loss(logp_BxN, behav_BxN, adv_B, mask_BxN, *, clip_eps: float, correction: str,
                is_cap: float, prox_BxN=None, denom=None, clip_high: float | None = None,
                ratio_level: str = "token", row_w_B=None):
    """Clipped surrogate with an importance correction for off-policy tokens.

    correction:
      none      ratio pi_theta/mu, PPO-clip; mu plays the old policy.
      tis       ratio pi_theta/pi_prox, PPO-clip, times w = min(pi_prox/mu, is_cap) per token.
      seq_tis   as tis, w = min(prod_t pi_prox/mu, is_cap) per sequence.
      decoupled ratio pi_theta/pi_prox, PPO-clip, times w = pi_prox/mu; tokens with w > is_cap
                are masked out (decoupled PPO with a behaviour-weight cap).
    The clip range is [1 - clip_eps, 1 + clip_high] (`clip_high` None: clip_eps; DAPO's
    clip-higher sets it above clip_eps).
    ratio_level:
      token     one ratio per token (PPO/GRPO).
      sequence  GSPO: s_i = exp(mean_t log(pi_theta/pi_old)) over sequence i's tokens, clipped per
                sequence; each token carries sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t)), whose value
                is s_i and whose gradient is s_i grad log pi_theta(y_t) (GSPO-token). With
                per-row weights 1/|y_i| (`row_w_B`, seq_mean) this is GSPO's gradient exactly.
                Per-token corrections (tis, decoupled) are not defined on it (config refuses).
    `prox_BxN`: the proximal logprobs (default: the current ones under stop-gradient).
    Aggregation: `row_w_B` None: token mean over `denom` tokens (default: this mask's);
    else sum_i row_w_i sum_t (weighted surrogate)_it (seq_mean, token_sum_norm).
    Returns (loss, stats) with importance-weight mean/max and the clipped fractions.
    """
    mask = mask_BxN.astype(jnp.float32)
    if prox_BxN is None:
        prox_BxN = jax.lax.stop_gradient(logp_BxN)
    adv = adv_B[:, None] if adv_B.ndim == 1 else adv_B  # per sample, or per token (learner.distill)
    if correction == "none":
        log_ratio, log_w = logp_BxN - behav_BxN, jnp.zeros_like(logp_BxN)
    else:
        log_ratio = logp_BxN - prox_BxN
        log_w = jax.lax.stop_gradient(prox_BxN - behav_BxN)
        if correction == "seq_tis":
            log_w = jnp.broadcast_to((log_w * mask).sum(axis=1, keepdims=True), log_w.shape)
    if ratio_level == "sequence":
        seq = (log_ratio * mask).sum(axis=1, keepdims=True) / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
        log_ratio = jax.lax.stop_gradient(seq) + logp_BxN - jax.lax.stop_gradient(logp_BxN)
    ratio = jnp.exp(log_ratio)
    raw_w = jnp.exp(jnp.minimum(log_w, 30.0))  # exp overflow guard; far above any cap
    if correction in ("tis", "seq_tis"):
        w, w_clipped = jnp.minimum(raw_w, is_cap), raw_w > is_cap
    elif correction == "decoupled":
        w_clipped = raw_w > is_cap
        w = jnp.where(w_clipped, 0.0, raw_w)
    else:
        w, w_clipped = raw_w, jnp.zeros_like(raw_w, bool)
    high = clip_eps if clip_high is None else clip_high
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + high) * adv
    surrogate = jnp.minimum(unclipped, clipped)
    if row_w_B is None:
        loss = -_masked_mean(w * surrogate, mask, denom)
    else:
        loss = -(w * surrogate * mask * row_w_B[:, None]).sum()
    # the importance weight that multiplies the gradient of log pi_theta, per token
    is_weight = jax.lax.stop_gradient(ratio if correction == "none" else raw_w)
    sg_ratio = jax.lax.stop_gradient(ratio)
    active = clipped < unclipped  # the min picked the clipped term: no gradient through the ratio
    stats = {
        "clip_frac": _masked_mean(active.astype(jnp.float32), mask, denom),
        "clip_frac_low": _masked_mean((active & (sg_ratio < 1.0)).astype(jnp.float32), mask, denom),
        "clip_frac_high": _masked_mean((active & (sg_ratio > 1.0)).astype(jnp.float32), mask, denom),
        "ratio_mean": _masked_mean(sg_ratio, mask, denom),
        "ratio_max": jnp.max(jnp.where(mask > 0, sg_ratio, 0.0)),
        "is_weight_mean": _masked_mean(is_weight, mask, denom),
        "is_weight_max": jnp.max(jnp.where(mask > 0, is_weight, 0.0)),
        "is_clip_frac": _masked_mean(w_clipped.astype(jnp.float32), mask, denom),
    }
    return loss, stats


def approx_kl(logp_BxN, behav_BxN, mask_BxN, denom=None):
    """Token-mean k3 estimate of KL(mu || pi_theta) on tokens drawn from mu: r - 1 - log r, r = pi_theta/mu."""
    log_r = jax.lax.stop_gradient(logp_BxN - behav_BxN)
    return _masked_mean(jnp.exp(log_r) - 1.0 - log_r, mask_BxN.astype(jnp.float32), denom)


def row_weights(mask_BxN, agg: str, max_len: int) -> jax.Array:
    """Per-row loss weights of the update's rows (its valid rows count n):
    seq_mean 1/(n |y_i|) (mean over sequences of token means); token_sum_norm 1/(n L_max)
    (Dr. GRPO: token sums over a constant length, L_max = rollout.max_new_tokens)."""
    lens = mask_BxN.astype(jnp.float32).sum(axis=1)
    n = jnp.maximum((lens > 0).sum().astype(jnp.float32), 1.0)
    if agg == "seq_mean":
        return jnp.where(lens > 0, 1.0 / (n * jnp.maximum(lens, 1.0)), 0.0)
    return jnp.full(lens.shape, 1.0 / (n * max_len), jnp.float32)


def kl_k3(logp_BxN, ref_BxN, mask_BxN, denom=None):
    """Unbiased, non-negative KL(pi_theta || pi_ref) estimator exp(d) - d - 1, d = ref - logp."""
    d = ref_BxN - logp_BxN
    return _masked_mean(jnp.exp(d) - d - 1.0, mask_BxN.astype(jnp.float32), denom)
