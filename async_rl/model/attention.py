"""Causal self-attention over a padded row, and the choice of kernel per platform.

Owns: the attention kernels the model's full-sequence passes (learner forward, engine
prefill) call, their numerics contract and `resolve`, which turns `model.attention`
into one concrete kernel for a platform and mesh. Does not own: projections, RoPE or the
KV cache (`model`); the decode step's one-query attention is the plain masked path here.

Contract (every kernel): query column i sees key column j iff j <= i and valid[j] (and,
with a sliding `window` W > 0, i - j < W: Gemma 3's local layers, HF's convention); scores
are q.k / sqrt(hd) accumulated in fp32 and softmaxed in fp32. A query that sees no key
(a pad column) gets some finite output, never NaN; those outputs are never read, because
pad columns are masked as keys and their logits are not used.

Kernels:
  xla        the whole [T, T] score matrix per head (what short rows and decode use)
  blockwise  FlashAttention-2 in plain XLA: query blocks x key blocks with an online
             softmax and a custom VJP that recomputes scores from the saved log-sum-exp;
             never more than BLOCK x BLOCK scores per head live; skips blocks above the
             diagonal. Rows no wider than BLOCK are one block: the xla path itself.
  cudnn      jax.nn.dot_product_attention(implementation="cudnn") (GPU, bf16/fp16). cuDNN
             masks padding only at a row's end, so each row is rotated to start at its
             first valid column, attended with per-row lengths, and rotated back.
  splash     Pallas splash attention (TPU), inside shard_map over the batch and head axes;
             pad columns are segment 0 and valid columns segment 1.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from async_rl.config import ConfigError

# Finite, so that a query with no visible key gets a uniform softmax instead of NaN.
MASK_VALUE = -1e30
BLOCK = 512  # blockwise: query and key block, columns
CHOICES = ("auto", "xla", "blockwise", "cudnn", "splash")


@dataclass(frozen=True)
class Spec:
    """A resolved kernel and the mesh layout the model's activations keep: rows split over
    `batch_axes`, heads and MLP features over `head_axis` (what splash's shard_map splits)."""
    impl: str  # xla | blockwise | cudnn | splash
    mesh: object = None
    batch_axes: tuple = ()
    head_axis: str | None = None
    strict: bool = True  # cudnn: False lets an unsupported shape fall back to blockwise
    platform: str = ""  # the devices' platform (cpu | gpu | tpu), for kernels chosen by platform (MoE's)

    def shard(self, x, features: bool = False):
        """`x` [B, ..., F] constrained to rows over the batch axes (and F over the head axis).

        Without it the partitioner may keep an FSDP weight sharded on its input dim and
        gather the activations' rows instead (every device then computes the whole batch)."""
        if self.mesh is None or self.mesh.size == 1:
            return x
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        nb = int(np.prod([self.mesh.shape[a] for a in self.batch_axes])) if self.batch_axes else 1
        rows = self.batch_axes if self.batch_axes and x.shape[0] % nb == 0 else None
        nt = self.mesh.shape[self.head_axis] if self.head_axis else 1
        last = self.head_axis if features and nt > 1 and x.shape[-1] % nt == 0 else None
        spec = P(rows, *([None] * (x.ndim - 2)), last)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def resolve(choice: str, platform: str, dtype, mesh=None, batch_axes: tuple = (), head_axis=None) -> Spec:
    """`model.attention` for a platform ("cpu", "gpu"/"cuda"/"rocm", "tpu")."""
    if choice not in CHOICES:
        raise ConfigError(f"model.attention={choice!r}: must be one of {', '.join(CHOICES)}")
    gpu = platform in ("gpu", "cuda", "rocm")
    strict = True
    if choice == "auto":
        if platform == "tpu":
            choice = "splash"
        elif gpu and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
            choice, strict = "cudnn", False
        else:
            choice = "blockwise"
    if choice == "splash" and platform != "tpu":
        raise ConfigError(f"model.attention=splash: needs a TPU (this mesh is on {platform})")
    if choice == "cudnn" and not gpu:
        raise ConfigError(f"model.attention=cudnn: needs an NVIDIA GPU (this mesh is on {platform})")
    return Spec(choice, mesh, tuple(batch_axes), head_axis, strict, "gpu" if gpu else platform)


def masked(q_BxQxHxD, k_BxKxGxD, v_BxKxGxD, mask_BxQxK):
    """Grouped-query attention under an explicit mask; the whole score matrix at once."""
    b, nq, h, d = q_BxQxHxD.shape
    g = k_BxKxGxD.shape[2]
    q = q_BxQxHxD.reshape(b, nq, g, h // g, d)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, k_BxKxGxD, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d)
    scores = jnp.where(mask_BxQxK[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxKxGxD.dtype)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs, v_BxKxGxD)
    return out.reshape(b, nq, h * d)


def one_query(q_Bx1xHxD, k_BxGxKxD, v_BxGxKxD, mask_BxK, k_self_BxGxD, v_self_BxGxD, extra=()):
    """Decode attention: one query per row against a head-major cache block under a mask,
    plus the row's own new key and value (always visible). `extra`: more (keys, values,
    mask) blocks of the same head-major form (a multi-step call's recent columns), each
    read where it lies: no block is concatenated to another."""
    b, _, h, d = q_Bx1xHxD.shape
    g = k_BxGxKxD.shape[1]
    q = q_Bx1xHxD.reshape(b, g, h // g, d)
    blocks = [(k_BxGxKxD, v_BxGxKxD, mask_BxK), *extra]
    scores = [jnp.where(m[:, None, None], jnp.einsum("bgrd,bgkd->bgrk", q, k, preferred_element_type=jnp.float32)
                        / math.sqrt(d), MASK_VALUE) for k, _, m in blocks]
    own = jnp.einsum("bgrd,bgd->bgr", q, k_self_BxGxD, preferred_element_type=jnp.float32) / math.sqrt(d)
    top = own
    for s in scores:
        top = jnp.maximum(top, s.max(-1))
    ps, p_own = [jnp.exp(s - top[..., None]) for s in scores], jnp.exp(own - top)
    total = p_own
    for p in ps:
        total = total + p.sum(-1)
    out = (p_own / total)[..., None] * v_self_BxGxD[:, :, None].astype(jnp.float32)
    for p, (_, v, _) in zip(ps, blocks):
        out = out + jnp.einsum("bgrk,bgkd->bgrd", (p / total[..., None]).astype(v.dtype), v,
                               preferred_element_type=jnp.float32)
    return out.astype(v_BxGxKxD.dtype).reshape(b, 1, h * d)


def causal_mask(valid_BxT, window: int = 0):
    t = valid_BxT.shape[1]
    i, j = np.arange(t)[:, None], np.arange(t)[None]
    visible = (j <= i) & ((i - j < window) if window else True)
    return jnp.asarray(visible)[None] & valid_BxT[:, None, :]


def self_attention(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT, spec: Spec, window: int = 0):
    """Causal attention of a row's columns to its valid columns: [B, T, H * hd]. `window`
    (static, 0 = none): each query sees only keys less than `window` columns back."""
    impl = spec.impl
    if impl == "blockwise" and q_BxTxHxD.shape[1] <= BLOCK:
        impl = "xla"
    if impl == "xla":
        return masked(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, causal_mask(valid_BxT, window))
    if impl == "blockwise":
        return _blockwise(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT, window)
    if impl == "cudnn":
        try:
            return _cudnn(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT, window)
        except (ValueError, NotImplementedError, RuntimeError):
            if spec.strict:
                raise
            return _blockwise(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT, window)
    if impl == "splash":
        return _splash(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT, spec, window)
    raise ValueError(f"unknown attention kernel {impl!r}")


# ---- blockwise (plain XLA FlashAttention-2) ---------------------------------------------

def _blockwise(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT, window: int = 0):
    b, t, h, d = q_BxTxHxD.shape
    g = k_BxTxGxD.shape[2]
    pad = (-t) % BLOCK
    if pad:
        widen = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT = map(widen, (q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT))
    tp = t + pad
    q = q_BxTxHxD.reshape(b, tp, g, h // g, d).transpose(0, 2, 3, 1, 4)  # [B, G, R, T, D]
    k = k_BxTxGxD.transpose(0, 2, 1, 3)  # [B, G, T, D]
    v = v_BxTxGxD.transpose(0, 2, 1, 3)
    out = _flash(q, k, v, valid_BxT, window)  # [B, G, R, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tp, h * d)[:, :t]


def _blocks(x, axis):
    """[..., T, ...] -> [n, ..., BLOCK, ...]: block index first, for scans."""
    n = x.shape[axis] // BLOCK
    x = x.reshape(x.shape[:axis] + (n, BLOCK) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _scores(q_i, k_j, valid_j, i, j, scale, window: int = 0):
    """Masked fp32 scores of query block i against key block j: [B, G, R, bq, bk]."""
    s = jnp.einsum("bgrqd,bgkd->bgrqk", q_i, k_j, preferred_element_type=jnp.float32) * scale
    qpos = i * BLOCK + jnp.arange(BLOCK)
    kpos = j * BLOCK + jnp.arange(BLOCK)
    ok = kpos[None, :] <= qpos[:, None]
    if window:
        ok = ok & (qpos[:, None] - kpos[None, :] < window)
    ok = ok[None, None, None] & valid_j[:, None, None, None, :]
    return jnp.where(ok, s, MASK_VALUE)


def _first_key_block(i, window: int):
    """The first key block query block i can see: 0, or with a window the block holding
    column i * BLOCK - window + 1 (blocks further left are all masked)."""
    return 0 if not window else jnp.maximum(0, (i * BLOCK - window + 1) // BLOCK)


def _last_query_block(j, n: int, window: int):
    """One past the last query block that can see key block j (n without a window)."""
    return n if not window else jnp.minimum(n, ((j + 1) * BLOCK + window - 2) // BLOCK + 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, valid, window):
    return _flash_fwd(q, k, v, valid, window)[0]


def _flash_fwd(q, k, v, valid, window):
    scale = 1.0 / math.sqrt(q.shape[-1])
    qb, kb, vb, validb = _blocks(q, 3), _blocks(k, 2), _blocks(v, 2), _blocks(valid, 1)

    def one_query_block(args):
        i, q_i = args

        def step(j, carry):
            m, l, acc = carry
            s = _scores(q_i, kb[j], validb[j], i, j, scale, window)
            m_new = jnp.maximum(m, s.max(-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            pv = jnp.einsum("bgrqk,bgkd->bgrqd", p.astype(v.dtype), vb[j], preferred_element_type=jnp.float32)
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

        shape = q_i.shape[:-1]
        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(q_i.shape, jnp.float32))
        # blocks above the diagonal (and left of the window) are all masked
        m, l, acc = jax.lax.fori_loop(_first_key_block(i, window), i + 1, step, init)
        return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

    out_b, lse_b = jax.lax.map(one_query_block, (jnp.arange(qb.shape[0]), qb))
    out = jnp.moveaxis(out_b, 0, 3).reshape(q.shape)
    lse = jnp.moveaxis(lse_b, 0, 3).reshape(q.shape[:-1])
    return out, (q, k, v, valid, out, lse)


def _flash_bwd(window, res, d_out):
    q, k, v, valid, out, lse = res
    scale = 1.0 / math.sqrt(q.shape[-1])
    delta = (d_out.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)  # [B, G, R, T]
    qb, kb, vb, validb = _blocks(q, 3), _blocks(k, 2), _blocks(v, 2), _blocks(valid, 1)
    dob, lseb, deltab = _blocks(d_out, 3), _blocks(lse, 3), _blocks(delta, 3)
    n = qb.shape[0]

    def one_key_block(dq, args):
        j, k_j, v_j, valid_j = args

        def step(i, carry):
            dk, dv, dq = carry
            s = _scores(qb[i], k_j, valid_j, i, j, scale, window)
            p = jnp.exp(s - lseb[i][..., None])
            dv = dv + jnp.einsum("bgrqk,bgrqd->bgkd", p.astype(v.dtype), dob[i], preferred_element_type=jnp.float32)
            dp = jnp.einsum("bgrqd,bgkd->bgrqk", dob[i], v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - deltab[i][..., None]) * scale).astype(q.dtype)
            dk = dk + jnp.einsum("bgrqk,bgrqd->bgkd", ds, qb[i], preferred_element_type=jnp.float32)
            dq_i = jnp.einsum("bgrqk,bgkd->bgrqd", ds, k_j, preferred_element_type=jnp.float32)
            return dk, dv, dq.at[i].add(dq_i)

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        # queries at or below the diagonal (and within the window)
        dk, dv, dq = jax.lax.fori_loop(j, _last_query_block(j, n, window), step, (zeros, zeros, dq))
        return dq, (dk, dv)

    dq0 = jnp.zeros(qb.shape, jnp.float32)
    dq, (dk_b, dv_b) = jax.lax.scan(one_key_block, dq0, (jnp.arange(n), kb, vb, validb))
    unblock = lambda x, axis, like: jnp.moveaxis(x, 0, axis).reshape(like.shape).astype(like.dtype)
    return unblock(dq, 3, q), unblock(dk_b, 2, k), unblock(dv_b, 2, v), None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---- cuDNN (GPU) -------------------------------------------------------------------------

def _cudnn(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT, window: int = 0):
    t = q_BxTxHxD.shape[1]
    start_B = jnp.argmax(valid_BxT, axis=1).astype(jnp.int32)
    length_B = valid_BxT.sum(axis=1).astype(jnp.int32)
    # Valid columns are contiguous from `start`: rotate them to the front, where cuDNN's
    # per-row lengths mask the rest; causality is unchanged by the shift.
    fwd_idx = (jnp.arange(t)[None] + start_B[:, None]) % t
    back_idx = (jnp.arange(t)[None] - start_B[:, None]) % t
    take = lambda x, idx: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)
    out = jax.nn.dot_product_attention(
        take(q_BxTxHxD, fwd_idx), take(k_BxTxGxD, fwd_idx), take(v_BxTxGxD, fwd_idx), is_causal=True,
        query_seq_lengths=jnp.maximum(length_B, 1), key_value_seq_lengths=jnp.maximum(length_B, 1),
        local_window_size=(window - 1, 0) if window else None, implementation="cudnn")
    out = jnp.where(valid_BxT[:, :, None, None], take(out, back_idx), 0)
    b, _, h, d = q_BxTxHxD.shape
    return out.reshape(b, t, h * d)


# ---- splash (TPU) ------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _splash_kernel(heads: int, t: int, interpret: bool, window: int = 0):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    blk = next(b for b in (512, 256, 128) if t % b == 0)
    sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                          block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    one = sm.LocalMask((t, t), window_size=(window - 1, 0), offset=0) if window else sm.CausalMask((t, t))
    mask = sm.MultiHeadMask([one] * heads)
    return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret), sk


def _splash_local(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT, interpret: bool = False, window: int = 0):
    b, t, h, d = q_BxTxHxD.shape
    pad = (-t) % 128  # kernel blocks are multiples of 128 columns; extra columns are pad
    if pad:
        widen = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT = map(widen, (q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT))
    kernel, sk = _splash_kernel(h, t + pad, interpret, window)
    q = (q_BxTxHxD * (1.0 / math.sqrt(d))).astype(q_BxTxHxD.dtype).transpose(0, 2, 1, 3)
    k, v = k_BxTxGxD.transpose(0, 2, 1, 3), v_BxTxGxD.transpose(0, 2, 1, 3)
    seg = valid_BxT.astype(jnp.int32)
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sk.SegmentIds(s, s)))(q, k, v, seg)
    return out.transpose(0, 2, 1, 3)[:, :t].reshape(b, t, h * d)


def _splash(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT, spec: Spec, window: int = 0):
    from jax.sharding import PartitionSpec as P
    mesh = spec.mesh
    local = functools.partial(_splash_local, window=window)
    if mesh is None:  # one device: no partitioning to do
        return local(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT)
    b, h, g = q_BxTxHxD.shape[0], q_BxTxHxD.shape[2], k_BxTxGxD.shape[2]
    nb = int(np.prod([mesh.shape[a] for a in spec.batch_axes])) if spec.batch_axes else 1
    batch = spec.batch_axes if spec.batch_axes and b % nb == 0 else None
    ht = mesh.shape[spec.head_axis] if spec.head_axis else 1
    head = spec.head_axis if ht > 1 and h % ht == 0 and g % ht == 0 else None
    qkv = P(batch, None, head, None)
    # A Mosaic kernel cannot be partitioned by XLA: each device runs it on its own shard.
    f = jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, P(batch, None)),
                      out_specs=P(batch, None, head), check_vma=False)
    return f(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, valid_BxT)
