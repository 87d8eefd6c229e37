"""Decoder-only transformer policy (Flax NNX): the one network engine and learner share.

Owns: the parameter tree (names, shapes, logical `axes` metadata per parameter), the
full-sequence forward pass, the prefill/decode pair over a stacked KV cache, and the
sequence layout those share. Does not own: sharding (reads `axes` elsewhere), the
attention kernels (`attention`), sampling and slot management (`engine`), losses
(`learner`), checkpoint conversion.

Layers are stacked: every block parameter has a leading [n_layers] axis (logical axis
"layers"), and the passes scan one block over it, so compile time does not grow with
depth. `remat` checkpoints each block (its input is kept, the rest is recomputed in the
backward pass).

Sequence layout. A row has width T = P + N (P = max prompt length, N = max new tokens).
A prompt of length L is left-padded into columns [P-L, P); the completion starts at
column P. `start = P - L` is the first valid column, the RoPE position of a column is
`column - start`, and pad columns are masked out as keys. Because every consumer uses
this layout, the engine's logprobs and the learner's recomputation see the same
computation up to floating-point reassociation. A narrower row (the learner's length
buckets) keeps the same RoPE positions and passes `col_offset`, the absolute column of
its first column, for the learned position table.

Routing replay (an MoE model): `hidden` can take the experts every layer uses per column
(`routes_BxTxLxK`, ids as `moe.MoE.route` orders them; -1 rows route themselves), and
`prefill_at` / `decode` / `decode_paged` can return the experts they used (`experts=True`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from async_rl.config import ModelConfig
from async_rl.model import attention, moe, paged_attention
from async_rl.model import lora as lora_mod
from async_rl.model.sharding import is_var as _is_var

REMAT = ("none", "block", "dots")


class KVCache(TypedDict):
    # kv heads before columns: a decode step's attention reads each head's [T, hd] block
    # as it lies (columns first made the TPU compiler copy a transposed layer per step)
    k: jax.Array  # [n_layers, B, Hkv, T, hd]; after RoPE
    v: jax.Array  # as k


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Recent:
    """The columns a multi-step decode call has made so far, kept beside the cache: inside a
    call the cache is only read, and `write_recent` puts these into it once at the call's
    end. (Written every step, a cache whose head dim is under the TPU's 128 lanes, laid out
    with its columns minor, is copied to another layout and back per token: 4.7x the bytes
    of weights + KV cache per step on the Qwen2.5-0.5B shape at 256 slots.)"""
    k: jax.Array  # [n_layers, B, Hkv, K, hd]: column c0_B + j at j
    v: jax.Array  # [n_layers, B, Hkv, K, hd]
    n: jax.Array  # int32 scalar: columns held (the call's decode steps so far)
    c0_B: jax.Array  # int32: each row's column at the call's start


def init_recent(cache: KVCache, steps: int, c0_B) -> Recent:
    shape = cache["k"].shape[:3] + (steps,) + cache["k"].shape[4:]
    return Recent(k=jnp.zeros(shape, cache["k"].dtype), v=jnp.zeros(shape, cache["v"].dtype), n=jnp.int32(0),
                  c0_B=c0_B)


def write_recent(cache: KVCache, recent: Recent) -> KVCache:
    """The recent columns j < n written at c0_B + j; those past the cache's width are dropped."""
    width, steps = cache["k"].shape[3], recent.k.shape[3]
    j = jnp.arange(steps)
    cols_BxK = jnp.where(j[None] < recent.n, recent.c0_B[:, None] + j[None], width)
    rows_Bx1 = jnp.arange(cols_BxK.shape[0])[:, None]
    # [:, rows, :, cols] puts the indexed axes first: updates are [B, K, L, Hkv, hd]
    write = lambda c, new: c.at[:, rows_Bx1, :, cols_BxK].set(new.transpose(1, 3, 0, 2, 4).astype(c.dtype),
                                                                mode="drop")
    return {"k": write(cache["k"], recent.k), "v": write(cache["v"], recent.v)}


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """Zeroed cache; layers stacked first and batch second so a slot is `[:, s]`."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.resolved_head_dim)
    return {n: jnp.zeros(shape, dtype) for n in ("k", "v")}


def layout(prompt_len: int, max_prompt_len: int, width: int, n_filled: int | None = None):
    """(start, positions_T, valid_T) for one row; `n_filled` columns from `start` are valid."""
    start = max_prompt_len - prompt_len
    n_filled = prompt_len if n_filled is None else n_filled
    cols = np.arange(width)
    valid = (cols >= start) & (cols < start + n_filled)
    positions = np.maximum(cols - start, 0).astype(np.int32)
    return start, positions, valid


def default_attention(cfg: ModelConfig) -> attention.Spec:
    """`cfg.attention` for the default backend, unpartitioned (callers with a mesh resolve their own)."""
    return attention.resolve(cfg.attention, jax.default_backend(), cfg.dtype)


def _stacked(stack: int, shape: tuple, axes: tuple):
    return ((stack,) + shape, ("layers",) + axes) if stack else (shape, axes)


class Linear(nnx.Module):
    """x W (+ b); with `lora` (a LoraSpec and this projection's key) also scale * (x A) B."""

    def __init__(self, d_in: int, d_out: int, axes: tuple, *, bias: bool, std: float, cfg: ModelConfig,
                 rngs: nnx.Rngs, stack: int = 0, lora: tuple | None = None):
        pdt = jnp.dtype(cfg.param_dtype)
        self.dtype = jnp.dtype(cfg.dtype)
        shape, kaxes = _stacked(stack, (d_in, d_out), axes)
        self.kernel = nnx.Param(std * jax.random.normal(rngs.params(), shape, pdt), axes=kaxes)
        bshape, baxes = _stacked(stack, (d_out,), (axes[1],))
        self.bias = nnx.Param(jnp.zeros(bshape, pdt), axes=baxes) if bias else None
        if lora is not None:
            spec, key = lora
            self.lora_a, self.lora_b = lora_mod.init_pair(d_in, d_out, spec.rank, key, stack, axes)
            self.lora_scale = spec.scale
        else:
            self.lora_a = self.lora_b = None

    def delta(self, x):
        """The adapter's term for input x (None without an adapter)."""
        if self.lora_a is None:
            return None
        return lora_mod.delta(x, self.lora_a[...], self.lora_b[...], self.lora_scale, self.dtype)

    def __call__(self, x):
        y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        d = self.delta(x)
        return y if d is None else y + d


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, cfg: ModelConfig, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(cfg.dtype)
        init = jax.random.normal(rngs.params(), (vocab, dim), jnp.dtype(cfg.param_dtype)) / math.sqrt(dim)
        self.embedding = nnx.Param(init, axes=("vocab", "embed"))

    def __call__(self, tokens):
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)

    def attend(self, x):
        """Tied output projection; accumulates in fp32 so logits are fp32 whatever the dtype."""
        return jnp.einsum("...d,vd->...v", x.astype(self.dtype), self.embedding[...].astype(self.dtype),
                          preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """Gemma's norms (`cfg.gemma`) multiply by 1 + scale, so their scale starts at 0; HF
    checkpoints store that scale as is, so no conversion happens at load or export."""

    def __init__(self, dim: int, *, cfg: ModelConfig, stack: int = 0, axis: str | None = "embed"):
        self.eps = cfg.norm_eps
        self.dtype = jnp.dtype(cfg.dtype)
        self.plus_one = cfg.gemma
        shape, axes = _stacked(stack, (dim,), (axis,))
        init = jnp.zeros if self.plus_one else jnp.ones
        self.scale = nnx.Param(init(shape, jnp.dtype(cfg.param_dtype)), axes=axes)

    def __call__(self, x):
        # fp32 statistics: bf16 mean-of-squares loses enough precision to move logprobs.
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (y * (1.0 + scale if self.plus_one else scale)).astype(self.dtype)


def rope_scaling(cfg: ModelConfig) -> tuple:
    """The static scaling arguments of `rope` for a config; () when RoPE is unscaled."""
    if cfg.rope_scaling == "none":
        return ()
    return (cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max_positions)


def _scaled_inv_freq(inv_freq, kind: str, factor: float, low: float, high: float, original: int):
    """HF `rope_scaling`: linear slows every frequency; llama3 slows only the long wavelengths
    (above original/low), keeps the short ones (below original/high) and blends in between."""
    if kind == "linear":
        return inv_freq / factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, blended, out)


def rope(x_BxTxHxD, positions_BxT, theta: float, scaling: tuple = ()):
    """HF-Llama rotary embedding: non-interleaved halves, rotate_half, computed in fp32.
    `scaling` comes from `rope_scaling(cfg)`."""
    hd = x_BxTxHxD.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    if scaling:
        inv_freq = _scaled_inv_freq(inv_freq, *scaling)
    freqs = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x = x_BxTxHxD.astype(jnp.float32)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * cos + rotated * sin).astype(x_BxTxHxD.dtype)


def _lora_for(lora: tuple | None, name: str, index: int) -> tuple | None:
    """(spec, key) for projection `name` when the spec targets it; `lora` is (spec, block key)."""
    if lora is None or name not in lora[0].projections:
        return None
    return lora[0], jax.random.fold_in(lora[1], index)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int = 0, lora: tuple | None = None):
        d, h, g, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        self.n_heads, self.n_kv_heads, self.head_dim, self.theta = h, g, hd, cfg.rope_theta
        self.rope_scaling = rope_scaling(cfg)
        self.local_theta = (cfg.rope_local_theta or cfg.rope_theta) if cfg.sliding_window else 0.0
        # Kernels divide scores by sqrt(head_dim); q is rescaled so they divide by sqrt(this).
        qpas = cfg.query_pre_attn_scalar
        self.q_scale = math.sqrt(hd / qpas) if qpas and qpas != hd else 1.0
        std = 1.0 / math.sqrt(d)
        kw = dict(bias=cfg.qkv_bias, std=std, cfg=cfg, rngs=rngs, stack=stack)
        self.q = Linear(d, h * hd, ("embed", "heads"), **kw, lora=_lora_for(lora, "q", 0))
        self.k = Linear(d, g * hd, ("embed", "kv_heads"), **kw, lora=_lora_for(lora, "k", 1))
        self.v = Linear(d, g * hd, ("embed", "kv_heads"), **kw, lora=_lora_for(lora, "v", 2))
        # Residual-branch outputs scaled down so the stream's variance stays O(1) with depth.
        o_std = 1.0 / math.sqrt(h * hd) / math.sqrt(2 * cfg.n_layers)
        self.o = Linear(h * hd, d, ("heads", "embed"), bias=False, std=o_std, cfg=cfg, rngs=rngs, stack=stack,
                        lora=_lora_for(lora, "o", 3))
        if cfg.qk_norm:  # one [hd] scale shared by every head
            self.q_norm = RMSNorm(hd, cfg=cfg, stack=stack, axis=None)
            self.k_norm = RMSNorm(hd, cfg=cfg, stack=stack, axis=None)
        else:
            self.q_norm = self.k_norm = None

    def _rope(self, x, positions_BxT, local):
        """RoPE of a global layer, or where `local` (a traced bool) of a sliding-window layer
        (its own base, unscaled); both are computed and one kept, so layers stay one scan."""
        out = rope(x, positions_BxT, self.theta, self.rope_scaling)
        if local is None or not self.local_theta:
            return out
        return jnp.where(local, rope(x, positions_BxT, self.local_theta), out)

    def qkv(self, x_BxTxD, positions_BxT, pin: bool = False, local=None):
        """`pin`: RoPE reads the q and k projections as computed (decode, see below).
        `local`: whether this layer is a sliding-window one (None: the model has none)."""
        b, t, _ = x_BxTxD.shape
        q, k = self.q(x_BxTxD), self.k(x_BxTxD)
        if pin:
            # Otherwise XLA folds RoPE's half-rotation (slices, concat) into the q and k
            # kernels: a decode step on TPU then copies and transposes them every token
            # (8B plan: 1.31x / 1.52x the bytes of weights + KV cache per step on v5p / v6e,
            # 1.07x / 1.02x pinned). The barrier changes no value.
            q, k = jax.lax.optimization_barrier((q, k))
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim)
        v = self.v(x_BxTxD).reshape(b, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self._rope(q, positions_BxT, local)
        if self.q_scale != 1.0:
            q = (q * self.q_scale).astype(q.dtype)
        return q, self._rope(k, positions_BxT, local), v


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int = 0, lora: tuple | None = None):
        d, f = cfg.d_model, cfg.d_ff
        kw = dict(bias=False, cfg=cfg, rngs=rngs, stack=stack)
        self.gate = Linear(d, f, ("embed", "mlp"), std=1 / math.sqrt(d), **kw, lora=_lora_for(lora, "gate", 4))
        self.up = Linear(d, f, ("embed", "mlp"), std=1 / math.sqrt(d), **kw, lora=_lora_for(lora, "up", 5))
        self.down = Linear(f, d, ("mlp", "embed"), std=1 / math.sqrt(f) / math.sqrt(2 * cfg.n_layers), **kw,
                           lora=_lora_for(lora, "down", 6))
        # Gemma's GeGLU uses the tanh approximation of gelu (HF gelu_pytorch_tanh)
        self.act = functools.partial(jax.nn.gelu, approximate=True) if cfg.gemma else jax.nn.silu

    def __call__(self, x, shard=lambda y, features=False: y):
        rows = x.size // x.shape[-1]
        if rows < 4 * x.shape[-1]:  # decode: a few rows; stacking would copy the weights every token
            return self.down(self.act(self.gate(x)) * self.up(x))
        # Many rows (training, prefill): one matmul for gate and up (stacked, not concatenated,
        # so a tensor-parallel shard of the F axis stays on its device); the backward pass then
        # writes one transposed copy of x instead of two (9% of the small model's train step).
        dt = self.gate.dtype
        w_Dx2xF = jnp.stack([self.gate.kernel[...], self.up.kernel[...]], axis=1).astype(dt)
        y = jnp.einsum("...d,dkf->...kf", x.astype(dt), w_Dx2xF)
        g, u = y[..., 0, :], y[..., 1, :]
        if (dg := self.gate.delta(x)) is not None:
            g = g + dg
        if (du := self.up.delta(x)) is not None:
            u = u + du
        return self.down(shard(self.act(g) * u, features=True))


class Block(nnx.Module):
    """One transformer block; built with `stack=L` it holds all L blocks' parameters."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int = 0, lora: tuple | None = None):
        self.attn_norm = RMSNorm(cfg.d_model, cfg=cfg, stack=stack)
        self.attn = Attention(cfg, rngs=rngs, stack=stack, lora=lora)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg=cfg, stack=stack)
        self.mlp = moe.MoE(cfg, rngs=rngs, stack=stack) if cfg.moe else MLP(cfg, rngs=rngs, stack=stack, lora=lora)
        # Gemma normalises each branch's output too, before it joins the residual stream
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg=cfg, stack=stack) if cfg.gemma else None
        self.post_mlp_norm = RMSNorm(cfg.d_model, cfg=cfg, stack=stack) if cfg.gemma else None

    def qkv(self, x_BxTxD, positions_BxT, pin: bool = False, local=None):
        return self.attn.qkv(self.attn_norm(x_BxTxD), positions_BxT, pin, local)

    def finish(self, x_BxTxD, attn_BxTxE, shard=lambda y, features=False: y, valid_BxT=None, spec=None,
               routes_BxTxK=None):
        """Output projection, residual and MLP, given the attention output; `shard` pins
        activation layouts (`attention.Spec.shard`). Returns (x, the MoE router's `moe.stats`
        over the `valid_BxT` tokens (None without, or for a dense block), the experts used
        [B, T, k] (None for a dense block)). `spec`: the attention.Spec whose platform and mesh
        pick the experts' kernel (`moe.MoE.experts`); `routes_BxTxK`: experts to use (`moe.MoE.route`)."""
        a = self.attn.o(attn_BxTxE)
        x = shard(x_BxTxD + (a if self.post_attn_norm is None else self.post_attn_norm(a)))
        if isinstance(self.mlp, moe.MoE):
            m, router, e_BxTxK = self.mlp.routed(self.mlp_norm(x), valid_BxT, spec, routes_BxTxK)
        else:
            m, router, e_BxTxK = self.mlp(self.mlp_norm(x), shard), None, None
        x = shard(x + (m if self.post_mlp_norm is None else self.post_mlp_norm(m)))
        return x, router, e_BxTxK


def _stack_blocks(blocks: list[Block], cfg: ModelConfig, lora=None) -> Block:
    """One Block holding `blocks`' parameters stacked on a leading "layers" axis. Blocks are
    initialised one by one, so a model draws the same initial values as unstacked layers."""
    shape_lora = None if lora is None else (lora, jax.random.key(0))
    stacked = nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0), stack=len(blocks), lora=shape_lora))
    target = jax.tree_util.tree_flatten_with_path(nnx.state(stacked), is_leaf=_is_var)[0]
    per_layer = [jax.tree.leaves(nnx.state(b), is_leaf=_is_var) for b in blocks]
    for i, (_, var) in enumerate(target):
        var.set_value(jnp.stack([layer[i].get_value() for layer in per_layer]))
    return stacked


def _unstacked(tree, n: int) -> list:
    """Each of the `n` layers' slices of a tree stacked over layers, as static slices: one split
    per leaf (its transpose is one concatenation, not n padded updates)."""
    parts = jax.tree.map(lambda a: jnp.split(a, a.shape[0]), tree)
    return [jax.tree.map(lambda p: p[i][0], parts, is_leaf=lambda p: isinstance(p, list)) for i in range(n)]


def _policy(remat: str):
    if remat not in REMAT:
        raise ValueError(f"learner.remat={remat!r}: must be one of {', '.join(REMAT)}")
    return {"block": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.checkpoint_dots}.get(remat)


# Logit of an id outside the tokenizer: exp() of it is exactly 0 in fp32 (so it is never
# drawn and adds nothing to a softmax or an entropy), yet finite, so 0 * logp stays 0.
OUTSIDE_LOGIT = -1e30


class Transformer(nnx.Module):
    """Holds only `nnx.Param`s, so `nnx.split(model)` gives (graphdef, params).

    `n_tokens`: the tokenizer's vocabulary size when the embedding has more rows (Hugging
    Face checkpoints pad it); logits of ids >= n_tokens are `OUTSIDE_LOGIT`. It lives in the
    graphdef, so the engine's sampling and the learner's logprobs share the mask.

    `lora`: a `lora.LoraSpec`; the targeted projections then also hold adapters
    (`nnx.LoRAParam`, drawn from their own key, so the base is what it is without them)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, *, rngs: nnx.Rngs, n_tokens: int = 0,
                 lora: lora_mod.LoraSpec | None = None):
        self.cfg = cfg
        self.n_tokens = n_tokens if 0 < n_tokens < vocab_size else 0
        self.embed = Embed(vocab_size, cfg.d_model, cfg=cfg, rngs=rngs)
        key = None if lora is None else jax.random.fold_in(jax.random.key(lora.seed), 0x10A)
        self.layers = _stack_blocks([Block(cfg, rngs=rngs, lora=None if lora is None else
                                           (lora, jax.random.fold_in(key, i))) for i in range(cfg.n_layers)],
                                    cfg, lora)
        self.final_norm = RMSNorm(cfg.d_model, cfg=cfg)
        # Optional learned table indexed by column: prompts end at a fixed column, so a
        # position-keyed task (reversal) sees "=" at the same absolute index every time.
        if cfg.learned_positions:
            init = jax.random.normal(rngs.params(), (cfg.learned_positions, cfg.d_model)) / math.sqrt(cfg.d_model)
            self.pos_embed = nnx.Param(init.astype(cfg.param_dtype), axes=(None, "embed"))
        else:
            self.pos_embed = None
        if cfg.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.d_model, vocab_size, ("embed", "vocab"), bias=False,
                                  std=1 / math.sqrt(cfg.d_model), cfg=cfg, rngs=rngs)

    def _local_L(self):
        """[n_layers] bool, True for sliding-window layers; None when the model has none."""
        return jnp.asarray(self.cfg.local_layers()) if self.cfg.sliding_window else None

    def _embed(self, tokens, cols):
        x = self.embed(tokens)
        if self.cfg.gemma:  # the scale rounded to the compute dtype first, as HF Gemma does
            x = x * jnp.asarray(math.sqrt(self.cfg.d_model), x.dtype)
        if self.pos_embed is None:
            return x
        return x + self.pos_embed[...][cols].astype(x.dtype)

    def _logits(self, x):
        x = self.final_norm(x)
        if self.lm_head is None:
            logits = self.embed.attend(x)
        else:
            logits = jnp.einsum("...d,dv->...v", x, self.lm_head.kernel[...].astype(x.dtype),
                                preferred_element_type=jnp.float32)
        if cap := self.cfg.final_logit_softcap:
            logits = cap * jnp.tanh(logits / cap)
        if not self.n_tokens:
            return logits
        return jnp.where(jnp.arange(logits.shape[-1]) < self.n_tokens, logits, OUTSIDE_LOGIT)

    def _scan(self, body, carry, xs=None, *, remat: str = "none", unroll: bool | int = 1, gather=None):
        """Runs `body(carry, block, xs_i) -> (carry, y_i)` over the stacked blocks; `gather`
        prepares one layer's parameters (e.g. `sharding.layer_gatherer`) inside the step."""
        graphdef, blocks = nnx.split(self.layers)

        def step(c, args):
            params, x_i = args
            return body(c, nnx.merge(graphdef, gather(params) if gather else params), x_i)

        policy = _policy(remat)
        if remat != "none":
            # Inside a scan CSE cannot merge the recomputation with the forward pass; in
            # straight-line code it would, keeping every activation after all.
            step = jax.checkpoint(step, policy=policy, prevent_cse=unroll is True)
        if unroll is not True:
            return jax.lax.scan(step, carry, (blocks, xs), unroll=unroll)
        # Fully unrolled: straight-line code with static slices (a scan with unroll=True still
        # leaves XLA a one-trip loop, whose body XLA:CPU runs on one core).
        ys = []
        for args in _unstacked((blocks, xs), self.cfg.n_layers):
            carry, y = step(carry, args)
            ys.append(y)
        return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys) if ys and ys[0] is not None else None

    def _check_moe(self, what: str, routes_BxTxLxK=None, shape=()):
        if not self.cfg.moe:
            raise ValueError(f"{what}: a dense model has no expert routes")
        want = tuple(shape) + (self.cfg.n_layers, self.cfg.n_experts_per_token)
        if routes_BxTxLxK is not None and tuple(routes_BxTxLxK.shape) != want:
            raise ValueError(f"{what}: routes of shape {tuple(routes_BxTxLxK.shape)}, expected {want}")

    def _trunk(self, tokens_BxT, positions_BxT, valid_BxT, *, col_offset=0, attn=None, remat="none",
               unroll=1, gather=None, keep_cache=False, router=False, routes_BxTxLxK=None, experts=False):
        """(x, cache or None, per-layer router stats or None, experts used [B, T, L, k] or None)."""
        t = tokens_BxT.shape[1]
        spec = attn or default_attention(self.cfg)
        x = self._embed(tokens_BxT, jnp.arange(t)[None] + col_offset)
        window = self.cfg.sliding_window
        forced_LxBxTxK = None
        if routes_BxTxLxK is not None:
            self._check_moe("routes_BxTxLxK", routes_BxTxLxK, tokens_BxT.shape)
            forced_LxBxTxK = jnp.asarray(routes_BxTxLxK).astype(jnp.int32).transpose(2, 0, 1, 3)

        def body(x, block, xs):
            local, forced = xs
            q, k, v = block.qkv(spec.shard(x), positions_BxT, local=local)
            if local is None:
                out = attention.self_attention(q, k, v, valid_BxT, spec)
            else:  # one kernel runs per layer: the windowed one on local layers
                out = jax.lax.cond(local, lambda *a: attention.self_attention(*a, spec, window=window),
                                   lambda *a: attention.self_attention(*a, spec), q, k, v, valid_BxT)
            x, stats, e_BxTxK = block.finish(x, out, spec.shard, valid_BxT if router else None, spec, forced)
            return x, ((k.swapaxes(1, 2), v.swapaxes(1, 2)) if keep_cache else None, stats,
                       e_BxTxK if experts else None)

        x, (kv, stats_L, e_LxBxTxK) = self._scan(body, x, (self._local_L(), forced_LxBxTxK), remat=remat,
                                                 unroll=unroll, gather=gather)
        e_BxTxLxK = None if e_LxBxTxK is None else e_LxBxTxK.transpose(1, 2, 0, 3).astype(jnp.int32)
        return x, ({"k": kv[0], "v": kv[1]} if keep_cache else None), stats_L, e_BxTxLxK

    def hidden(self, tokens_BxT, positions_BxT, valid_BxT, *, col_offset=0, attn=None, remat: str = "none",
               unroll: bool | int = 1, gather=None, router: bool = False, routes_BxTxLxK=None):
        """Residual stream after the last block [B, T, D] (before the final norm).

        `attn`: a resolved `attention.Spec` (default: `model.attention` on the default
        backend); `remat`: none | block | dots; `unroll`: layers per scan iteration (True: all);
        `gather`: see `_scan`. `router`: returns (x, per-layer `moe.stats` [n_layers] each, or
        None for a dense model). `routes_BxTxLxK` (int, an MoE model only): the experts each
        layer uses at each column, a row of -1 where the layer routes that column itself."""
        x, _, stats_L, _ = self._trunk(tokens_BxT, positions_BxT, valid_BxT, col_offset=col_offset, attn=attn,
                                       remat=remat, unroll=unroll, gather=gather, router=router,
                                       routes_BxTxLxK=routes_BxTxLxK)
        return (x, stats_L) if router else x

    def logits(self, x):
        """fp32 logits from `hidden` output (any leading shape)."""
        return self._logits(x)

    def __call__(self, tokens_BxT, positions_BxT, valid_BxT, *, attn=None):
        """Logits [B, T, V] fp32; query i sees key j iff j <= i and valid[j]."""
        return self._logits(self.hidden(tokens_BxT, positions_BxT, valid_BxT, attn=attn))

    def prefill(self, tokens_BxT, positions_BxT, valid_BxT, *, attn=None):
        """Same computation as `__call__`, plus the KV cache of all T columns."""
        x, cache, _, _ = self._trunk(tokens_BxT, positions_BxT, valid_BxT, attn=attn, keep_cache=True)
        return self._logits(x), cache

    def prefill_at(self, tokens_BxT, positions_BxT, valid_BxT, cols_B, *, attn=None, col_offset=0,
                   experts: bool = False):
        """`prefill`, but logits only at one column per row (skips a [T, V] projection).
        `col_offset`: the absolute column of column 0 (a row narrower than P + N). `experts`
        (an MoE model): also returns the experts used at every column, int32 [B, T, L, k]."""
        if experts:
            self._check_moe("prefill_at(experts=True)")
        x, cache, _, e_BxTxLxK = self._trunk(tokens_BxT, positions_BxT, valid_BxT, attn=attn, keep_cache=True,
                                             col_offset=col_offset, experts=experts)
        x_BxD = jnp.take_along_axis(x, cols_B[:, None, None], axis=1)[:, 0]
        return (self._logits(x_BxD), cache) + ((e_BxTxLxK,) if experts else ())

    def decode(self, tokens_B, positions_B, cols_B, starts_B, cache: KVCache, window: int | None = None,
               unroll: bool | int = 1, recent: Recent | None = None, experts: bool = False):
        """One token per row at column `cols_B`; attends cache columns [starts_B, cols_B).
        plus its own key. `window` (static): only the first `window` columns are read, so
        attention costs what the rows hold, not the cache's width; every `cols_B` of a live
        row must be below it.

        The cache is only read inside the layer loop; every layer's new k/v row is written
        by one scatter after it (written in the loop, the TPU compiler copied the cache).
        With `recent` (a multi-step call) the cache holds columns below `recent.c0_B` and
        is not written: the recent columns are attended as a block of their own and this
        token's k/v joins them.

        Returns (logits [B, V] fp32, cache with this token's k/v written at cols_B), or
        with `recent`, (logits, recent holding one more column); `experts` (an MoE model):
        and the experts this token used, int32 [B, L, k]."""
        if experts:
            self._check_moe("decode(experts=True)")
        b = tokens_B.shape[0]
        width = cache["k"].shape[3]
        t = width if window is None else min(window, width)
        c = jnp.arange(t)
        below_B = cols_B if recent is None else recent.c0_B
        mask_BxT = (c[None] >= starts_B[:, None]) & (c[None] < below_B[:, None])
        if recent is not None:
            mask_BxK = jnp.broadcast_to(jnp.arange(recent.k.shape[3])[None] < recent.n, (b, recent.k.shape[3]))
        local_L, w = self._local_L(), self.cfg.sliding_window
        if local_L is not None:
            # Sliding-window layers see only columns less than `w` back: the full cache
            # stays, the mask narrows (cols_B - column < w), as the full-row kernels do.
            near_BxT = mask_BxT & (c[None] > cols_B[:, None] - w)
            if recent is not None:
                near_BxK = mask_BxK & (recent.c0_B[:, None] + jnp.arange(recent.k.shape[3])[None] > cols_B[:, None] - w)
        x = self._embed(tokens_B[:, None], cols_B[:, None])

        def body(x, block, i):
            local = None if local_L is None else local_L[i]
            q, k, v = block.qkv(x, positions_B[:, None], pin=True, local=local)
            m_BxT = mask_BxT if local is None else jnp.where(local, near_BxT, mask_BxT)
            # this layer's [B, Hkv, t, hd], read where it lies
            keys, values = cache["k"][i, :, :, :t].astype(k.dtype), cache["v"][i, :, :, :t].astype(v.dtype)
            if recent is not None:
                m_BxK = mask_BxK if local is None else jnp.where(local, near_BxK, mask_BxK)
            extra = () if recent is None else ((recent.k[i].astype(k.dtype), recent.v[i].astype(v.dtype), m_BxK),)
            x, _, e_Bx1xK = block.finish(x, attention.one_query(q, keys, values, m_BxT, k[:, 0], v[:, 0], extra))
            return x, (k[:, 0], v[:, 0], e_Bx1xK[:, 0] if experts else None)

        x, (k_LxBxGxD, v_LxBxGxD, e_LxBxK) = self._scan(body, x, jnp.arange(self.cfg.n_layers), unroll=unroll)
        tail = (e_LxBxK.swapaxes(0, 1).astype(jnp.int32),) if experts else ()
        if recent is not None:
            put = lambda r, new: r.at[:, :, :, recent.n].set(new.astype(r.dtype))
            return (self._logits(x[:, 0]), dataclasses.replace(recent, k=put(recent.k, k_LxBxGxD),
                                                               v=put(recent.v, v_LxBxGxD), n=recent.n + 1)) + tail
        rows = jnp.arange(b)
        # [:, rows, :, cols] puts the indexed (row) axis first: updates are [B, L, Hkv, hd]
        write = lambda c, new: c.at[:, rows, :, cols_B].set(new.swapaxes(0, 1).astype(c.dtype))
        return (self._logits(x[:, 0]), {"k": write(cache["k"], k_LxBxGxD), "v": write(cache["v"], v_LxBxGxD)}) + tail

    def decode_paged(self, tokens_B, positions_B, cols_B, pool: KVCache, table_BxW, *, impl: str = "xla",
                     experts: bool = False):
        """`decode` over a paged pool (`model.paged_attention`): row b's token is its
        `positions_B[b]`-th, its k/v is written at that position of the pages `table_BxW[b]`
        names, and it attends positions 0 .. positions_B[b]. `cols_B`: its engine column
        (learned position embeddings). Pool k/v: a list of one array per layer, each
        [Hkv, pages, page_size, hd], so a kernel reads a layer's pool where it lies (a slice of a
        stacked pool is a copy of that layer's pool per step); the layers run unrolled.
        Returns (logits [B, V] fp32, pool with every layer's new k/v written), and with
        `experts` (an MoE model) the experts this token used, int32 [B, L, k]."""
        if experts:
            self._check_moe("decode_paged(experts=True)")
        lens_B = positions_B + 1
        local = self.cfg.local_layers() if self.cfg.sliding_window else (None,) * self.cfg.n_layers
        x = self._embed(tokens_B[:, None], cols_B[:, None])
        b, p = tokens_B.shape[0], pool["k"][0].shape[2]
        page_B = jnp.take_along_axis(table_BxW, (positions_B // p)[:, None], axis=1)[:, 0]
        put = lambda c, new: c.at[:, page_B, positions_B % p].set(new[:, 0].swapaxes(0, 1).astype(c.dtype))  # noqa: E731
        graphdef, blocks = nnx.split(self.layers)
        ks, vs, es = list(pool["k"]), list(pool["v"]), []
        for i, params in enumerate(_unstacked(blocks, self.cfg.n_layers)):
            block = nnx.merge(graphdef, params)
            flag = None if local[i] is None else jnp.asarray(local[i])
            q, k, v = block.qkv(x, positions_B[:, None], pin=True, local=flag)
            ks[i], vs[i] = put(ks[i], k), put(vs[i], v)
            out = paged_attention.decode(q[:, 0], ks[i], vs[i], lens_B, table_BxW, impl=impl,
                                         window=self.cfg.sliding_window if local[i] else 0)
            x, _, e_Bx1xK = block.finish(x, out.reshape(b, 1, -1))
            es.append(e_Bx1xK)
        tail = (jnp.stack([e[:, 0] for e in es], axis=1).astype(jnp.int32),) if experts else ()
        return (self._logits(x[:, 0]), {"k": ks, "v": vs}) + tail
