"""Transformer: parameter names and axes, decode path == full path, layout invariance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from async_rl.config import ModelConfig
from async_rl.model import Transformer, init_cache, layout

V, P, N = 40, 8, 8
T = P + N
AXIS_NAMES = {"vocab", "embed", "heads", "kv_heads", "mlp", None}

VARIANTS = {
    "gqa_bias_untied": dict(n_heads=4, n_kv_heads=2, qkv_bias=True, tie_embeddings=False),
    "mha_tied": dict(n_heads=4, n_kv_heads=4),
    "mqa_headdim": dict(n_heads=4, n_kv_heads=1, head_dim=16),
}


def make(scale=3.0, **kw):
    cfg = ModelConfig(d_model=32, n_layers=2, d_ff=64, **kw)
    model = Transformer(cfg, V, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    # Larger weights than init give peaked, varied logits, a harder test than near-uniform ones.
    params = jax.tree.map(lambda x: x * scale, params)
    return cfg, nnx.merge(graphdef, params)


def fwd(model, *args):
    return jax.jit(lambda *a: model(*a))(*args)


def flat_params(model):
    st = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(st, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {".".join(str(getattr(k, "key", k)) for k in path): v for path, v in leaves}


def test_param_paths_shapes_and_axes():
    cfg, model = make(n_heads=4, n_kv_heads=2, qkv_bias=True, tie_embeddings=False)
    d, f, hd = 32, 64, cfg.resolved_head_dim
    want = {"embed.embedding": ((V, d), ("vocab", "embed")), "final_norm.scale": ((d,), ("embed",)),
            "lm_head.kernel": ((d, V), ("embed", "vocab"))}
    for i in range(cfg.n_layers):
        want |= {
            f"layers.{i}.attn_norm.scale": ((d,), ("embed",)),
            f"layers.{i}.mlp_norm.scale": ((d,), ("embed",)),
            f"layers.{i}.attn.q.kernel": ((d, 4 * hd), ("embed", "heads")),
            f"layers.{i}.attn.k.kernel": ((d, 2 * hd), ("embed", "kv_heads")),
            f"layers.{i}.attn.v.kernel": ((d, 2 * hd), ("embed", "kv_heads")),
            f"layers.{i}.attn.o.kernel": ((4 * hd, d), ("heads", "embed")),
            f"layers.{i}.attn.q.bias": ((4 * hd,), ("heads",)),
            f"layers.{i}.attn.k.bias": ((2 * hd,), ("kv_heads",)),
            f"layers.{i}.attn.v.bias": ((2 * hd,), ("kv_heads",)),
            f"layers.{i}.mlp.gate.kernel": ((d, f), ("embed", "mlp")),
            f"layers.{i}.mlp.up.kernel": ((d, f), ("embed", "mlp")),
            f"layers.{i}.mlp.down.kernel": ((f, d), ("mlp", "embed")),
        }
    got = flat_params(model)
    assert set(got) == set(want)
    for name, (shape, axes) in want.items():
        assert got[name][...].shape == shape, name
        assert got[name].axes == axes, name
    # The sharding module reads axes exactly like this; every leaf must answer.
    axes_tree = jax.tree.map(lambda v: v.axes, nnx.state(model, nnx.Param),
                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert len(jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, tuple))) == len(want)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_axes_one_name_per_dim_and_no_extras(variant):
    cfg, model = make(**VARIANTS[variant])
    got = flat_params(model)
    for name, var in got.items():
        assert len(var.axes) == var[...].ndim and set(var.axes) <= AXIS_NAMES, name
    assert ("lm_head.kernel" in got) == (not cfg.tie_embeddings)
    assert any(k.endswith("q.bias") for k in got) == cfg.qkv_bias
    # The model holds nothing but parameters, so split gives (graphdef, params).
    assert len(jax.tree.leaves(nnx.state(model))) == len(got)


def rows(rs, lengths, n_filled_extra):
    toks, pos, valid, starts = [], [], [], []
    for L in lengths:
        start, p, v = layout(L, P, T, n_filled=L + n_filled_extra)
        t = np.zeros(T, np.int32)
        t[start:] = rs.randint(0, V, T - start)
        toks.append(t), pos.append(p), valid.append(v), starts.append(start)
    return np.stack(toks), np.stack(pos), np.stack(valid), np.asarray(starts, np.int32)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decode_path_matches_full_path(variant):
    cfg, model = make(scale=1.0, **VARIANTS[variant])
    rs = np.random.RandomState(1)
    lengths = [1, 5, 8]
    toks, pos_full, valid_full, starts = rows(rs, lengths, N)
    full = jax.jit(lambda t, p, v: model(t, p, v))(toks, pos_full, valid_full)
    # Prefill the prompt plus k completion tokens, then decode the remaining columns.
    k = 2
    _, pos_pre, valid_pre, _ = rows(np.random.RandomState(1), lengths, k)
    logits, cache = jax.jit(lambda t, p, v: model.prefill(t, p, v))(toks, pos_pre, valid_pre)
    for b, L in enumerate(lengths):
        np.testing.assert_allclose(logits[b, P + k - 1], full[b, P + k - 1], atol=1e-5, rtol=0)
    assert cache["k"].shape == (cfg.n_layers, 3, T, cfg.n_kv_heads, cfg.resolved_head_dim)
    decode = jax.jit(lambda *a: model.decode(*a))
    for col in range(P + k, T):
        cols = np.full(3, col, np.int32)
        lg, cache = decode(toks[:, col], cols - starts, cols, starts, cache)
        np.testing.assert_allclose(lg, full[:, col], atol=1e-5, rtol=0)


def test_decode_from_empty_cache_matches_full_path():
    cfg, model = make(scale=1.0, **VARIANTS["gqa_bias_untied"])
    toks, pos, valid, starts = rows(np.random.RandomState(2), [3, 6], N)
    full = fwd(model, toks, pos, valid)
    cache = init_cache(cfg, 2, T, jnp.float32)
    decode = jax.jit(lambda *a: model.decode(*a))
    cols = starts.copy()
    for _ in range(T - int(starts.min())):
        c = np.minimum(cols, T - 1)
        lg, cache = decode(toks[np.arange(2), c], c - starts, c, starts, cache)
        for b in range(2):
            if cols[b] < T:
                np.testing.assert_allclose(lg[b], full[b, cols[b]], atol=1e-5, rtol=0)
        cols += 1


def test_left_padding_and_position_offset_do_not_change_logits():
    _, model = make(scale=1.0, **VARIANTS["gqa_bias_untied"])
    seq = np.random.RandomState(3).randint(0, V, 6).astype(np.int32)
    a = fwd(model, seq[None], np.arange(6)[None], np.ones((1, 6), bool))[0]
    padded = np.concatenate([np.full(5, 7, np.int32), seq])  # garbage in pad columns
    valid = np.arange(11) >= 5
    b = fwd(model, padded[None], np.maximum(np.arange(11) - 5, 0)[None], valid[None])[0, 5:]
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_fully_padded_rows_are_finite_and_logits_fp32():
    _, model = make(dtype="bfloat16", **VARIANTS["mha_tied"])
    toks = np.zeros((2, T), np.int32)
    logits = fwd(model, toks, np.zeros((2, T), np.int32), np.zeros((2, T), bool))
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())


def test_bf16_compute_tracks_fp32():
    cfg32, m32 = make(**VARIANTS["gqa_bias_untied"])
    g, params = nnx.split(m32)
    m16 = nnx.merge(nnx.split(make(dtype="bfloat16", **VARIANTS["gqa_bias_untied"])[1])[0], params)
    toks, pos, valid, _ = rows(np.random.RandomState(4), [4], N)
    p32 = jax.nn.softmax(fwd(m32, toks, pos, valid))
    p16 = jax.nn.softmax(fwd(m16, toks, pos, valid))
    assert float(jnp.abs(p32 - p16).max()) < 0.1
