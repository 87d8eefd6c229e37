"""Transformer: parameter names and axes, decode path == full path, layout invariance,
attention kernels and rematerialisation agree with the plain path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from async_rl.config import ModelConfig
from async_rl.model import attention
from async_rl.model.transformer import Transformer, init_cache, layout

V, P, N = 40, 8, 8
T = P + N
AXIS_NAMES = {"layers", "vocab", "embed", "heads", "kv_heads", "mlp", None}

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
    L = cfg.n_layers
    stacked = {  # every block parameter carries a leading [n_layers] axis
        "attn_norm.scale": ((d,), ("embed",)),
        "mlp_norm.scale": ((d,), ("embed",)),
        "attn.q.kernel": ((d, 4 * hd), ("embed", "heads")),
        "attn.k.kernel": ((d, 2 * hd), ("embed", "kv_heads")),
        "attn.v.kernel": ((d, 2 * hd), ("embed", "kv_heads")),
        "attn.o.kernel": ((4 * hd, d), ("heads", "embed")),
        "attn.q.bias": ((4 * hd,), ("heads",)),
        "attn.k.bias": ((2 * hd,), ("kv_heads",)),
        "attn.v.bias": ((2 * hd,), ("kv_heads",)),
        "mlp.gate.kernel": ((d, f), ("embed", "mlp")),
        "mlp.up.kernel": ((d, f), ("embed", "mlp")),
        "mlp.down.kernel": ((f, d), ("mlp", "embed")),
    }
    want |= {f"layers.{k}": ((L,) + shape, ("layers",) + axes) for k, (shape, axes) in stacked.items()}
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
    assert cache["k"].shape == (cfg.n_layers, 3, cfg.n_kv_heads, T, cfg.resolved_head_dim)
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


# --- attention kernels and rematerialisation ------------------------------------------------

def padded_rows(rs, T_, lengths):
    """Left-padded rows (one fully padded) with completions that end early."""
    toks = rs.randint(0, V, (len(lengths) + 1, T_)).astype(np.int32)
    valid = np.zeros(toks.shape, bool)
    pos = np.zeros(toks.shape, np.int32)
    for b, (start, n) in enumerate(lengths):
        valid[b, start:start + n] = True
        pos[b, start:] = np.arange(T_ - start)
    return toks, pos, valid


# one variant in CI (GQA, biases, untied head); every variant under `make soak`
@pytest.mark.parametrize("variant", [v if v == "gqa_bias_untied" else pytest.param(v, marks=pytest.mark.soak)
                                     for v in sorted(VARIANTS)])
def test_blockwise_attention_matches_the_plain_path(variant, monkeypatch):
    monkeypatch.setattr(attention, "BLOCK", 8)  # several blocks (and a ragged last one) on a short row
    _, model = make(scale=1.0, **VARIANTS[variant])
    toks, pos, valid = padded_rows(np.random.RandomState(5), 21, [(3, 15), (0, 21), (12, 4)])
    g, params = nnx.split(model)
    spec = lambda impl: attention.Spec(impl)

    def loss(p, impl):
        logits = nnx.merge(g, p)(toks, pos, valid, attn=spec(impl))
        return (jax.nn.log_softmax(logits) * valid[..., None]).sum(), logits

    (l_x, logits_x), g_x = jax.jit(jax.value_and_grad(lambda p: loss(p, "xla"), has_aux=True))(params)
    (l_b, logits_b), g_b = jax.jit(jax.value_and_grad(lambda p: loss(p, "blockwise"), has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(logits_b)[valid], np.asarray(logits_x)[valid], atol=1e-4, rtol=0)
    assert bool(jnp.isfinite(logits_b).all())  # the fully padded row too
    for a, b in zip(jax.tree.leaves(g_b), jax.tree.leaves(g_x)):
        np.testing.assert_allclose(a, b, atol=1e-4 * float(jnp.abs(b).max()) + 1e-6, rtol=0)
    # prefill's cache and logits take the same kernel
    lg, cache = jax.jit(lambda *a: model.prefill(*a, attn=spec("blockwise")))(toks, pos, valid)
    lg_x, cache_x = jax.jit(lambda *a: model.prefill(*a, attn=spec("xla")))(toks, pos, valid)
    np.testing.assert_allclose(np.asarray(lg)[valid], np.asarray(lg_x)[valid], atol=1e-4, rtol=0)
    # (pad columns' keys come from their own, never-read outputs)
    col_major = lambda c: np.asarray(c).swapaxes(2, 3)  # [L, B, Hkv, T, hd] -> [L, B, T, Hkv, hd]
    np.testing.assert_allclose(col_major(cache["k"])[:, valid], col_major(cache_x["k"])[:, valid], atol=1e-4,
                               rtol=0)


def test_splash_kernel_matches_the_plain_path_in_interpret_mode():
    # the TPU kernel itself, run by the Pallas interpreter on CPU: GQA, segment-id padding
    rs = np.random.RandomState(6)
    B, T_, H, G, D = 2, 40, 4, 2, 16
    q, k, v = (jnp.asarray(rs.randn(B, T_, h, D), jnp.float32) for h in (H, G, G))
    valid = np.zeros((B, T_), bool)
    valid[0, 7:33] = True
    valid[1, :] = True
    ref = attention.masked(q, k, v, attention.causal_mask(jnp.asarray(valid)))
    w = jnp.asarray(rs.randn(B, T_, H * D), jnp.float32) * valid[:, :, None]
    f = lambda fn: jax.value_and_grad(lambda q, k, v: (fn(q, k, v) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    (_, g_ref) = f(lambda q, k, v: attention.masked(q, k, v, attention.causal_mask(jnp.asarray(valid))))
    (_, g_spl) = f(lambda q, k, v: attention._splash_local(q, k, v, jnp.asarray(valid), interpret=True))
    out = attention._splash_local(q, k, v, jnp.asarray(valid), interpret=True)
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=1e-4, rtol=0)
    for a, b in zip(g_spl, g_ref):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("remat", ["block", "dots"])
def test_remat_changes_memory_not_gradients(remat):
    _, model = make(scale=1.0, **VARIANTS["gqa_bias_untied"])
    toks, pos, valid = padded_rows(np.random.RandomState(7), 16, [(2, 14), (5, 6)])
    g, params = nnx.split(model)

    def grads(r):
        f = lambda p: nnx.merge(g, p).hidden(toks, pos, valid, remat=r).sum()
        return jax.jit(jax.grad(f))(params)

    for a, b in zip(jax.tree.leaves(grads(remat)), jax.tree.leaves(grads("none"))):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()), rtol=0)


def test_attention_choices_resolve_per_platform():
    assert attention.resolve("auto", "cpu", "float32").impl == "blockwise"
    assert attention.resolve("auto", "tpu", "bfloat16").impl == "splash"
    assert attention.resolve("auto", "gpu", "bfloat16") == attention.Spec("cudnn", strict=False, platform="gpu")
    assert attention.resolve("auto", "gpu", "float32").impl == "blockwise"  # cuDNN flash needs 16-bit
    for bad, platform in (("splash", "cpu"), ("cudnn", "cpu"), ("flash", "cpu")):
        with pytest.raises(ValueError, match="model.attention"):
            attention.resolve(bad, platform, "float32")
