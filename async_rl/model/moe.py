"""Mixture-of-experts feed-forward (Qwen3-MoE): a router picks each token's top-k experts, each
a SwiGLU MLP, and the token's output is their routing-weighted sum.

Owns: the block's MoE parameters (`router` [D, E], `experts_gate`/`experts_up` [E, D, F],
`experts_down` [E, F, D], stacked over layers like every block parameter), routing (softmax in
fp32, top-k, renormalised when `model.norm_topk_prob`), the dropless expert compute, and the
router's statistics (load-balancing loss, expert load, entropy), and routing replay (given
experts in place of the top-k, weighted by the router's own probabilities). Does not own: the block around
it (`transformer`), checkpoint names (`hf`), the loss weighting (`learner`).

Dropless: every (token, expert) pair is computed, none dropped for capacity. The pairs are
sorted by expert and each expert's run of rows is one group of a grouped matmul (`grouped`),
so the work is k rows per token whatever the routing. On a TPU the learner's grouped matmuls
are megablox's Pallas kernels (`gmm`, and `tgmm` for the weights' gradient: XLA's own
`ragged_dot` gradient for the weights computes every expert on every row there); elsewhere,
and in the engine (forward only, which XLA's TPU `ragged_dot` computes as grouped),
`jax.lax.ragged_dot`. (XLA:CPU and XLA:GPU compute `ragged_dot` as a dense product masked per
group, E times the work: right for tests, not for a large model on a GPU.)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from async_rl.config import ModelConfig


def routes_dtype(n_experts: int) -> np.dtype:
    """The host dtype of recorded expert ids (routing replay): one byte up to 256 experts."""
    return np.dtype(np.uint8 if n_experts <= 256 else np.uint16)


def grouped(x_MxK, w_GxKxN, sizes_G, impl: str = "xla", interpret: bool = False):
    """Rows [sum(sizes[:g]), sum(sizes[:g+1])) of x times w[g], for every group g. `impl`: xla
    (`jax.lax.ragged_dot`) | megablox (the Pallas TPU kernels; `interpret` runs them anywhere).
    megablox tiles K and N by 128 (its backward swaps them): other widths take XLA's."""
    m, k, n = x_MxK.shape[0], x_MxK.shape[1], w_GxKxN.shape[2]
    if impl == "xla" or (not interpret and (k % 128 or n % 128)):
        return jax.lax.ragged_dot(x_MxK, w_GxKxN, sizes_G)
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
    tm = min(128, -(-m // 8) * 8)
    # gmm leaves rows past the groups' sum unwritten (forward and backward): zeros in both ways
    held = (jnp.arange(m) < sizes_G.sum())[:, None]
    x = jnp.pad(jnp.where(held, x_MxK, 0), ((0, -m % tm), (0, 0)))
    tiling = (tm, min(128, k), min(128, n))
    out = megablox.gmm(x, w_GxKxN.astype(x.dtype), sizes_G, x.dtype, tiling, None, None, False, interpret)[:m]
    return jnp.where(held, out, 0)


def _param(rngs: nnx.Rngs, stack: int, shape: tuple, axes: tuple, std: float, dtype) -> nnx.Param:
    if stack:
        shape, axes = (stack,) + shape, ("layers",) + axes
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), axes=axes)


def in_shard_map(spec) -> bool:
    """Whether `MoE.experts` computes inside a shard_map on `spec`'s mesh (an `attention.Spec`),
    gathering the experts' fsdp shards itself: on a TPU, or with an expert axis."""
    mesh = spec.mesh if spec is not None else None
    return mesh is not None and mesh.size > 1 and (spec.platform == "tpu" or mesh.shape.get("expert", 1) > 1)


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

    def route(self, x_NxD, forced_NxK=None):
        """(router probabilities [N, E] fp32, top-k weights [N, k] fp32, experts used [N, k]).
        `forced_NxK` (routing replay): rows whose first id is >= 0 use those experts, weighted
        by the router's probabilities there (so the router still learns); -1 rows their top-k."""
        logits = jnp.dot(x_NxD.astype(self.dtype), self.router[...].astype(self.dtype))
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        w_NxK, e_NxK = jax.lax.top_k(probs, self.k)
        if forced_NxK is not None:
            e_NxK = jnp.where(forced_NxK[:, :1] >= 0, forced_NxK.astype(e_NxK.dtype), e_NxK)
            w_NxK = jnp.take_along_axis(probs, e_NxK, axis=-1)
        if self.norm_topk:
            w_NxK = w_NxK / w_NxK.sum(-1, keepdims=True)
        return probs, w_NxK, e_NxK

    def experts(self, x_NxD, w_NxK, e_NxK, spec=None):
        """sum_j w[n, j] * expert_{e[n, j]}(x[n]) for every token n, dropless. `spec`: the
        `attention.Spec` of the mesh. On a TPU or with an expert axis, inside a shard_map
        (`in_shard_map`: megablox, a Pallas kernel, is not partitioned by XLA; the expert axis's
        gathers are explicit): each device computes its own rows, or with an expert axis its own
        experts for the rows of its expert group (`_experts`); the experts' F axis split over the
        head axis, their D axis gathered over fsdp in there, so that their gradient leaves as a
        reduce-scatter (`sharding.layer_gatherer` leaves them to it)."""
        ws = tuple(p[...].astype(self.dtype) for p in (self.experts_gate, self.experts_up, self.experts_down))
        fn = functools.partial(_experts, impl="megablox" if spec is not None and spec.platform == "tpu" else "xla")
        if not in_shard_map(spec):
            return fn(x_NxD, w_NxK, e_NxK, *ws)
        mesh = spec.mesh
        ep = "expert" if mesh.shape.get("expert", 1) > 1 else None
        nb = math.prod(mesh.shape[a] for a in spec.batch_axes)
        rows = P(spec.batch_axes if spec.batch_axes and x_NxD.shape[0] % nb == 0 else None, None)
        t = spec.head_axis if spec.head_axis and ws[0].shape[-1] % mesh.shape[spec.head_axis] == 0 else None
        # the experts' D axis stays split over fsdp into the shard_map and is gathered there, so
        # the gradient leaves it as a reduce-scatter (across its boundary: an all-reduce)
        fs = "fsdp" if mesh.shape.get("fsdp", 1) > 1 and ws[0].shape[1] % mesh.shape["fsdp"] == 0 else None
        gather = ep is not None and ep in (rows[0] or ())
        f = jax.shard_map(functools.partial(fn, tensor_axis=t, expert_axis=ep, gather=gather, fsdp_axis=fs),
                          mesh=mesh, in_specs=(rows, rows, rows, P(ep, fs, t), P(ep, fs, t), P(ep, t, fs)),
                          out_specs=rows, check_vma=False)
        return f(x_NxD, w_NxK, e_NxK, *ws)

    def routed(self, x, valid=None, spec=None, forced=None):
        """(the MoE output for `x` [..., D], the router's `stats` over the `valid` tokens (a bool
        mask of x's leading shape; None without), the experts used [..., k]). `forced` [..., k]:
        experts to use (`route`); `spec`: see `experts`."""
        x_NxD = x.reshape(-1, x.shape[-1])
        probs, w_NxK, e_NxK = self.route(x_NxD, None if forced is None else forced.reshape(-1, self.k))
        y = self.experts(x_NxD, w_NxK, e_NxK, spec).reshape(x.shape)
        router = None if valid is None else stats(probs, e_NxK, valid.reshape(-1))
        return y, router, e_NxK.reshape(x.shape[:-1] + (self.k,))

    def __call__(self, x, shard=lambda y, features=False: y, valid=None, spec=None):
        """The MoE output for `x` [..., D]; with `valid` also the router's statistics (`routed`)."""
        y, router, _ = self.routed(x, valid, spec)
        return y if valid is None else (y, router)


def _experts(x_NxD, w_NxK, e_NxK, gate_ExDxF, up_ExDxF, down_ExFxD, *, impl: str,
             tensor_axis: str | None = None, expert_axis: str | None = None, gather: bool = False,
             fsdp_axis: str | None = None):
    """`MoE.experts` on arrays: the (token, j) pairs sorted by expert, three grouped matmuls,
    the weighted outputs added back per token. Inside a shard_map: summed over `tensor_axis`;
    with `expert_axis` the weights are this device's run of experts, so its pairs for other
    experts are sorted past every group and their outputs zeroed, and the rows of the expert
    group (`gather`: gathered here, else every device's already) are summed back over it."""
    if fsdp_axis:
        gate_ExDxF, up_ExDxF = (jax.lax.all_gather(w, fsdp_axis, axis=1, tiled=True) for w in (gate_ExDxF, up_ExDxF))
        down_ExFxD = jax.lax.all_gather(down_ExFxD, fsdp_axis, axis=2, tiled=True)
    el = gate_ExDxF.shape[0]  # the experts held here
    if expert_axis and gather:
        x_NxD, w_NxK, e_NxK = (jax.lax.all_gather(a, expert_axis, tiled=True) for a in (x_NxD, w_NxK, e_NxK))
    local = e_NxK - (jax.lax.axis_index(expert_axis) * el if expert_axis else 0)
    mine = (local >= 0) & (local < el)
    n, k = e_NxK.shape
    dt = gate_ExDxF.dtype
    flat_e = jnp.where(mine, local, el).reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # pair order grouped by expert; pair p is (token p // k, choice p % k)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    ends = jnp.searchsorted(flat_e[order], jnp.arange(1, el + 1), side="left")
    sizes = jnp.diff(ends, prepend=0).astype(jnp.int32)
    xs = _dispatch(x_NxD.astype(dt), order, inverse, k)
    g, u = grouped(xs, gate_ExDxF, sizes, impl), grouped(xs, up_ExDxF, sizes, impl)
    y_NxKxD = _rows(grouped(jax.nn.silu(g) * u, down_ExFxD, sizes, impl), inverse, order).reshape(n, k, -1)
    y_NxKxD = jnp.where(mine[..., None], y_NxKxD, 0)  # rows past the groups: zeros (XLA) or unwritten (megablox)
    out = (y_NxKxD * w_NxK[..., None].astype(dt)).sum(1)
    if tensor_axis:
        out = jax.lax.psum(out, tensor_axis)
    if expert_axis:
        out = (jax.lax.psum_scatter(out, expert_axis, scatter_dimension=0, tiled=True) if gather
               else jax.lax.psum(out, expert_axis))
    return out


# The pairs move by gathers both ways, gradients included: a gather's own gradient is a
# scatter-add, but these gathers are permutations (and k-fold copies), whose gradients are
# gathers by the inverse permutation.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x_NxD, order, inverse, k: int):
    """Each token's row once per choice, in pair order: x[order // k]."""
    return x_NxD[order // k]


def _dispatch_fwd(x_NxD, order, inverse, k):
    return x_NxD[order // k], (order, inverse, x_NxD.shape[0])


def _dispatch_bwd(k, res, g_PxD):
    order, inverse, n = res
    return g_PxD[inverse].reshape(n, k, -1).sum(1), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _rows(y, index, back):
    """y[index], `back` its inverse permutation (the gradient's gather)."""
    return y[index]


def _rows_fwd(y, index, back):
    return y[index], back


def _rows_bwd(back, g):
    return g[back], None, None


_rows.defvjp(_rows_fwd, _rows_bwd)


def stats(probs_NxE, e_NxK, valid_N) -> dict:
    """The router's statistics over valid tokens: `aux`, the load-balancing loss of Switch /
    Qwen3-MoE, E * sum_e (tokens routed to e / tokens) * (mean probability of e), k when the
    load is even; `load`, the busiest expert's routed tokens over the mean; `entropy`, the
    routing distribution's mean entropy (nats)."""
    e = probs_NxE.shape[-1]
    fm = valid_N.astype(jnp.float32)
    n = jnp.maximum(fm.sum(), 1.0)
    count_E = jnp.zeros(e, jnp.float32).at[e_NxK].add(jnp.broadcast_to(fm[:, None], e_NxK.shape))
    p_E = (probs_NxE * fm[:, None]).sum(0) / n
    ent_N = -(probs_NxE * jnp.log(jnp.maximum(probs_NxE, 1e-30))).sum(-1)
    return {"aux": e * jnp.sum(count_E / n * p_E), "load": count_E.max() / jnp.maximum(count_E.mean(), 1e-9),
            "entropy": (ent_N * fm).sum() / n}
