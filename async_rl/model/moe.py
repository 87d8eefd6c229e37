"""Mixture-of-experts feed-forward (Qwen3-MoE): a router picks each token's top-k experts, each
a SwiGLU MLP, and the token's output is their routing-weighted sum.

Owns: the block's MoE parameters (`router` [D, E], `experts_gate`/`experts_up` [E, D, F],
`experts_down` [E, F, D], stacked over layers like every block parameter), routing (softmax in
fp32, top-k, renormalised when `model.norm_topk_prob`), the dropless expert compute, and the
router's statistics (load-balancing loss, expert load, entropy). Does not own: the block around
it (`transformer`), checkpoint names (`hf`), the loss weighting (`learner`).

Dropless: every (token, expert) pair is computed, none dropped for capacity. The pairs are
sorted by expert and each expert's run of rows is one group of `jax.lax.ragged_dot`, so the
work is k rows per token whatever the routing, and no [tokens, experts] dense product is formed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from async_rl.config import ModelConfig


def _param(rngs: nnx.Rngs, stack: int, shape: tuple, axes: tuple, std: float, dtype) -> nnx.Param:
    if stack:
        shape, axes = (stack,) + shape, ("layers",) + axes
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), axes=axes)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int = 0):
        d, f, e = cfg.d_model, cfg.d_ff_expert, cfg.n_experts
        pdt, self.dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        self.n_experts, self.k, self.norm_topk = e, cfg.n_experts_per_token, cfg.norm_topk_prob
        self.router = _param(rngs, stack, (d, e), ("embed", None), 1 / math.sqrt(d), pdt)
        self.experts_gate = _param(rngs, stack, (e, d, f), ("experts", "embed", "mlp"), 1 / math.sqrt(d), pdt)
        self.experts_up = _param(rngs, stack, (e, d, f), ("experts", "embed", "mlp"), 1 / math.sqrt(d), pdt)
        down_std = 1 / math.sqrt(f) / math.sqrt(2 * cfg.n_layers)
        self.experts_down = _param(rngs, stack, (e, f, d), ("experts", "mlp", "embed"), down_std, pdt)

    def route(self, x_NxD):
        """(router probabilities [N, E] fp32, top-k weights [N, k] fp32, top-k experts [N, k])."""
        logits = jnp.dot(x_NxD.astype(self.dtype), self.router[...].astype(self.dtype))
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        w_NxK, e_NxK = jax.lax.top_k(probs, self.k)
        if self.norm_topk:
            w_NxK = w_NxK / w_NxK.sum(-1, keepdims=True)
        return probs, w_NxK, e_NxK

    def experts(self, x_NxD, w_NxK, e_NxK):
        """sum_j w[n, j] * expert_{e[n, j]}(x[n]) for every token n, dropless."""
        n, k = e_NxK.shape
        dt = self.dtype
        flat_e = e_NxK.reshape(-1)
        order = jnp.argsort(flat_e, stable=True)  # the (token, j) pairs grouped by expert
        tok = order // k
        sizes = jnp.bincount(flat_e, length=self.n_experts).astype(jnp.int32)
        xs = x_NxD[tok].astype(dt)
        g = jax.lax.ragged_dot(xs, self.experts_gate[...].astype(dt), sizes)
        u = jax.lax.ragged_dot(xs, self.experts_up[...].astype(dt), sizes)
        y = jax.lax.ragged_dot(jax.nn.silu(g) * u, self.experts_down[...].astype(dt), sizes)
        y = y * w_NxK.reshape(-1)[order][:, None].astype(dt)
        return jnp.zeros((n, x_NxD.shape[-1]), dt).at[tok].add(y)

    def __call__(self, x, shard=lambda y, features=False: y, valid=None):
        """The MoE output for `x` [..., D]; with `valid` (a bool mask of x's leading shape) also
        the router's statistics over the valid tokens (`stats`)."""
        x_NxD = x.reshape(-1, x.shape[-1])
        probs, w_NxK, e_NxK = self.route(x_NxD)
        y = self.experts(x_NxD, w_NxK, e_NxK).reshape(x.shape)
        if valid is None:
            return y
        return y, stats(probs, e_NxK, valid.reshape(-1))


def stats(probs_NxE, e_NxK, valid_N) -> dict:
    """The router's statistics over valid tokens: `aux`, the load-balancing loss of Switch /
    Qwen3-MoE, E * sum_e (tokens routed to e / tokens) * (mean probability of e), k when the
    load is even; `load`, the busiest expert's routed tokens over the mean; `entropy`, the
    routing distribution's mean entropy (nats)."""
    e = probs_NxE.shape[-1]
    fm = valid_N.astype(jnp.float32)
    n = jnp.maximum(fm.sum(), 1.0)
    count_E = (jax.nn.one_hot(e_NxK, e, dtype=jnp.float32).sum(1) * fm[:, None]).sum(0)
    p_E = (probs_NxE * fm[:, None]).sum(0) / n
    ent_N = -(probs_NxE * jnp.log(jnp.maximum(probs_NxE, 1e-30))).sum(-1)
    return {"aux": e * jnp.sum(count_E / n * p_E), "load": count_E.max() / jnp.maximum(count_E.mean(), 1e-9),
            "entropy": (ent_N * fm).sum() / n}
