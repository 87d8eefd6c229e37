"""Decode attention over a paged KV pool: each sequence reads only the pages it holds.

Owns: the pool's device layout (one layer: `k_GxNxPxD` and `v_GxNxPxD`, G key-value heads
over N pages of P tokens: the layout of JAX's TPU paged attention kernel, so the same pool
feeds it), writing keys and values at their pages and offsets (`write` for one token per
sequence, `write_rows` for a prefill), and one-query decode attention (`decode`) by two
kernels with one contract:
  xla     gathers each sequence's table of W pages ([S, W*P] keys) and masks by length: it
          reads W pages per sequence, the table width the caller picked (a bucket of the longest)
  pallas  `jax.experimental.pallas.ops.tpu.paged_attention` (TPU; run in interpret mode on
          CPU by the tests): reads only the pages below each sequence's length. It has no
          sliding window: a windowed layer (Gemma 3's local ones) takes the xla path.
  pallas_gpu  `jax.experimental.pallas.ops.gpu.paged_attention` (Triton; `interpret` runs it on
          CPU in the tests): the same contract and layout, reads only held pages; no window.
Contract: sequence s sees keys 0 .. lens_S[s] - 1 (its own newest key written already), and
with a sliding `window` W > 0 only the last W of them; scores q.k / sqrt(hd) in fp32, softmax
in fp32. A sequence with length 0 gets some finite output, never read. Which pages a
sequence holds is `rollout.kv_pages`'; the engine's own cache layout is `model.transformer`'s.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from async_rl.model.attention import MASK_VALUE

IMPLS = ("xla", "pallas", "pallas_gpu")


def write(k_GxNxPxD, v_GxNxPxD, k_SxGxD, v_SxGxD, table_SxW, pos_S):
    """Each sequence's key and value for position pos_S[s], at its page and offset. Rows whose
    table is the null page write there (it is never read below a length)."""
    p = k_GxNxPxD.shape[2]
    page_S = jnp.take_along_axis(table_SxW, (pos_S // p)[:, None], axis=1)[:, 0]
    put = lambda pool, x: pool.at[:, page_S, pos_S % p].set(jnp.swapaxes(x, 0, 1).astype(pool.dtype))  # noqa: E731
    return put(k_GxNxPxD, k_SxGxD), put(v_GxNxPxD, v_SxGxD)


def write_rows(k_GxNxPxD, v_GxNxPxD, k_TxGxD, v_TxGxD, pages_W, start: int | jax.Array = 0):
    """One sequence's keys and values for positions start .. start + T - 1 (a prefill), at the
    pages `pages_W` it holds."""
    p = k_GxNxPxD.shape[2]
    pos_T = start + jnp.arange(k_TxGxD.shape[0])
    page_T, off_T = pages_W[pos_T // p], pos_T % p
    put = lambda pool, x: pool.at[:, page_T, off_T].set(jnp.swapaxes(x, 0, 1).astype(pool.dtype))  # noqa: E731
    return put(k_GxNxPxD, k_TxGxD), put(v_GxNxPxD, v_TxGxD)


def decode(q_SxHxD, k_GxNxPxD, v_GxNxPxD, lens_S, table_SxW, *, window: int = 0, impl: str = "xla",
           pages_per_block: int = 0, interpret: bool = False):
    """One query per sequence against its held keys: [S, H, D] in q's dtype.
    `pages_per_block` (pallas): pages per kernel block, dividing W (0: up to 8)."""
    if impl not in IMPLS:
        raise ValueError(f"paged attention: unknown kernel {impl!r} (known: {', '.join(IMPLS)})")
    if impl != "xla" and not window:
        kernel = _pallas if impl == "pallas" else functools.partial(_pallas_gpu, interpret=interpret)
        return kernel(q_SxHxD, k_GxNxPxD, v_GxNxPxD, lens_S, table_SxW, pages_per_block)
    s, h, d = q_SxHxD.shape
    g, _, p, _ = k_GxNxPxD.shape
    w = table_SxW.shape[1]
    k = k_GxNxPxD[:, table_SxW].reshape(g, s, w * p, d)  # [G, S, W*P, D]
    v = v_GxNxPxD[:, table_SxW].reshape(g, s, w * p, d)
    q = q_SxHxD.reshape(s, g, h // g, d)
    scores = jnp.einsum("sgrd,gskd->sgrk", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    j = jnp.arange(w * p)[None]
    visible_SxK = j < lens_S[:, None]
    if window:
        visible_SxK &= j >= lens_S[:, None] - window
    scores = jnp.where(visible_SxK[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("sgrk,gskd->sgrd", probs, v).reshape(s, h, d).astype(q_SxHxD.dtype)


def _pallas(q_SxHxD, k_GxNxPxD, v_GxNxPxD, lens_S, table_SxW, pages_per_block: int):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    w = table_SxW.shape[1]
    block = pages_per_block or max(b for b in range(1, min(w, 8) + 1) if w % b == 0)
    q = (q_SxHxD.astype(jnp.float32) / math.sqrt(q_SxHxD.shape[-1])).astype(q_SxHxD.dtype)
    return paged_attention(q, k_GxNxPxD, v_GxNxPxD, lens_S.astype(jnp.int32), table_SxW.astype(jnp.int32),
                           mask_value=MASK_VALUE, pages_per_compute_block=block)


def _pallas_gpu(q_SxHxD, k_GxNxPxD, v_GxNxPxD, lens_S, table_SxW, pages_per_block: int, interpret: bool = False):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    w = table_SxW.shape[1]
    part = w & -w  # pages per partition (partitions run in parallel): Triton's blocks are powers of two
    block = pages_per_block or min(part, 8)
    q = (q_SxHxD.astype(jnp.float32) / math.sqrt(q_SxHxD.shape[-1])).astype(q_SxHxD.dtype)
    return paged_attention(q, k_GxNxPxD, v_GxNxPxD, table_SxW.astype(jnp.int32), lens_S.astype(jnp.int32),
                           pages_per_compute_block=block, k_splits=w // part, mask_value=MASK_VALUE,
                           interpret=interpret).astype(q_SxHxD.dtype)
