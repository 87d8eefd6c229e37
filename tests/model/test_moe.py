"""Mixture of experts (Qwen3-MoE): the dropless expert compute against a dense loop, the router's
statistics, the load-balancing loss reaching the router in the learner's step (micro-batching
equal to the unsplit update), and bad checkpoints and configs refused in one line. Logits
against a NumPy reference and transformers are in test_hf.py; engine vs learner logprobs and
export round trips in test_architectures.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_hf import CONFIGS, load, random_weights, write_checkpoint
from test_learner import batch_of, make, random_rows

from async_rl import config as C
from async_rl.config import ConfigError, ModelConfig
from async_rl.model import hf, moe

MOE = ("model.qk_norm=true", "model.n_experts=4", "model.n_experts_per_token=2", "model.d_ff_expert=32",
       "model.n_layers=1")


def test_dropless_experts_equal_every_expert_run_on_every_token():
    cfg = ModelConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, qk_norm=True, n_experts=5,
                      n_experts_per_token=3, d_ff_expert=8, norm_topk_prob=False)
    layer = moe.MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 7, 16))
    probs, w, e = layer.route(x.reshape(-1, 16))
    got = layer(x).reshape(-1, 16)
    xs = x.reshape(-1, 16)
    want = jnp.zeros_like(xs)
    for j in range(5):  # every expert on every token, kept where the router chose it
        out = (jax.nn.silu(xs @ layer.experts_gate[...][j]) * (xs @ layer.experts_up[...][j])) @ layer.experts_down[...][j]
        want += ((e == j) * w).sum(-1, keepdims=True) * out
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert len({int(i) for i in np.asarray(e).ravel()}) > 1  # several experts actually used
    # gradients (the pairs' gathers have hand-written ones) against autodiff of the loop
    probe = jax.random.normal(jax.random.key(2), xs.shape)

    def loop(x, gate, up, down):
        out = jnp.zeros_like(x)
        for j in range(5):
            out += ((e == j) * w).sum(-1, keepdims=True) * ((jax.nn.silu(x @ gate[j]) * (x @ up[j])) @ down[j])
        return (out * probe).sum()
    ws = (layer.experts_gate[...], layer.experts_up[...], layer.experts_down[...])
    ours = jax.grad(lambda x, *ws: (moe._experts(x, w, e, *ws, impl="xla") * probe).sum(),
                    argnums=(0, 1, 2, 3))(xs, *ws)
    for a, b in zip(ours, jax.grad(loop, argnums=(0, 1, 2, 3))(xs, *ws)):
        np.testing.assert_allclose(a, b, atol=1e-4)
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(np.asarray(probs), np.asarray(e), -1))


def test_router_statistics_count_only_valid_tokens():
    probs = jnp.asarray([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8]])
    e = jnp.asarray([[0], [0], [2]])
    s = moe.stats(probs, e, jnp.asarray([True, True, False]))
    # valid tokens: both to expert 0; mean probabilities (0.65, 0.25, 0.1)
    assert float(s["aux"]) == pytest.approx(3 * (1.0 * 0.65))
    assert float(s["load"]) == pytest.approx(2 / (2 / 3))
    ent = -(np.asarray(probs[:2]) * np.log(np.asarray(probs[:2]))).sum(-1).mean()
    assert float(s["entropy"]) == pytest.approx(ent, rel=1e-6)
    even = moe.stats(jnp.full((4, 4), 0.25), jnp.asarray([[0, 1], [2, 3], [0, 1], [2, 3]]), jnp.ones(4, bool))
    assert float(even["aux"]) == pytest.approx(2.0) and float(even["load"]) == pytest.approx(1.0)


def _step(*overrides):
    cfg, learner = make(*MOE, *overrides)
    state = learner.init_state(learner.init_params())
    state, metrics = learner.step(state, batch_of(cfg, random_rows(cfg, seed=2)))
    return jax.device_get(state["params"]), jax.device_get(metrics)


def test_the_load_balancing_loss_trains_the_router_and_micro_batches_add_up_to_the_update():
    params, m = _step()
    assert m["learner/expert_load_max"] >= m["learner/expert_load_l0"] >= 1.0
    assert 0 < m["learner/router_entropy"] <= np.log(4) + 1e-6
    assert m["learner/router_aux"] >= 1.0  # 2 (= k) at an even load, more when uneven
    flat = lambda p: dict(nnx.to_flat_state(p))  # noqa: E731
    # the aux loss moves the router: with its weight 0 the router's update differs
    none, m0 = _step("model.router_aux_coef=0")
    router = ("layers", "mlp", "router")
    assert not np.allclose(flat(none)[router].get_value(), flat(params)[router].get_value(), atol=1e-7)
    # micro-batches: every token-linear term adds up to the unsplit update; the aux loss (a
    # product of two means) is each micro-batch's own, weighted by its tokens
    split0, ms0 = _step("model.router_aux_coef=0", "learner.micro_batch_rows=4")
    for k in ("learner/router_entropy", "learner/loss"):
        assert ms0[k] == pytest.approx(m0[k], rel=1e-4), k
    for path, v in flat(none).items():
        np.testing.assert_allclose(flat(split0)[path].get_value(), v.get_value(), atol=5e-5, err_msg=str(path))  # lr 3e-3
    _, ms = _step("learner.micro_batch_rows=4")
    assert ms["learner/router_aux"] == pytest.approx(m["learner/router_aux"], rel=2e-2)


@pytest.mark.parametrize("change, says", [
    (dict(num_experts_per_tok=5), r"n_experts_per_token=5: must be in \[1, model.n_experts \(4\)\]"),
    (dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\]: dense blocks between MoE blocks are not supported"),
    (dict(decoder_sparse_step=2), r"decoder_sparse_step=2: dense blocks between"),
])
def test_moe_configs_no_block_here_computes_are_refused_in_one_line(tmp_path, change, says):
    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIGS["qwen3_moe"], **change)))
    with pytest.raises(hf.HFError, match=says) as e:
        hf.model_config_from_hf(tmp_path, ModelConfig())
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_a_missing_or_misshaped_expert_is_named(tmp_path):
    hc, root = CONFIGS["qwen3_moe"], tmp_path
    w = random_weights(hc)
    missing = {k: v for k, v in w.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}
    with pytest.raises(hf.HFError, match=r"'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight' \(for parameter "
                                         r"layers\.mlp\.experts_up\[1, 3\]\) is missing"):
        load(write_checkpoint(root / "a", hc, missing))
    bad = dict(w, **{"model.layers.0.mlp.experts.2.down_proj.weight": np.zeros((64, 23), np.float32)})
    with pytest.raises(hf.HFError, match=r"experts\.2\.down_proj\.weight.*shape \[64, 23\], expected \[64, 24\]"):
        load(write_checkpoint(root / "b", hc, bad))


def test_lora_on_moe_experts_is_refused_and_attention_adapters_train():
    with pytest.raises(ConfigError, match=r"learner.lora_targets='attention,mlp': MoE blocks take no adapters on "
                                          r"their experts \(gate, up, down\); set learner.lora_targets=attention"):
        C.load("configs/tiny-moe.yaml", ["learner.lora_rank=4"])
    with pytest.raises(ConfigError, match=r"their experts \(up\)"):
        C.load("configs/tiny-moe.yaml", ["learner.lora_rank=4", "learner.lora_targets=attention,up"])
    params, m = _step("learner.lora_rank=4", "learner.lora_targets=attention")
    assert np.isfinite(m["learner/loss"]) and m["learner/router_aux"] > 0
    b = dict(nnx.to_flat_state(params))[("layers", "attn", "q", "lora_b")].get_value()
    assert np.abs(b).max() > 0  # B starts at zero: the adapter took a step


def test_the_tpu_grouped_matmul_equals_ragged_dot_with_gradients_in_interpret_mode():
    """megablox's gmm (and tgmm for the weights' gradient), the learner's on a TPU, run by the
    Pallas interpreter: the rows of empty and uneven groups, and rows past the groups' sum."""
    rs = np.random.RandomState(0)
    x = jnp.asarray(rs.randn(40, 32), jnp.float32)
    w = jnp.asarray(rs.randn(3, 32, 48), jnp.float32)
    sizes = jnp.asarray([10, 0, 27], jnp.int32)  # 3 rows belong to no group
    probe = jnp.asarray(rs.randn(40, 48), jnp.float32)

    def loss(impl):
        return jax.value_and_grad(lambda x, w: (moe.grouped(x, w, sizes, impl, interpret=True) * probe).sum(),
                                  argnums=(0, 1))(x, w)
    (v_ref, (dx_ref, dw_ref)), (v, (dx, dw)) = loss("xla"), loss("megablox")
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, atol=1e-4)  # rows past the sum: zero gradient (an expert
    assert float(jnp.abs(dx[37:]).max()) == 0.0  # parallel device's pairs for experts held elsewhere)
    assert float(jnp.abs(moe.grouped(x, w, sizes, "megablox", interpret=True)[37:]).max()) == 0.0
    np.testing.assert_allclose(dw, dw_ref, atol=1e-4)
    assert float(jnp.abs(dw[1]).max()) == 0.0  # the empty group's expert gets no gradient


# ---- routing replay: given experts in place of the router's top-k ----------------------------
R_CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, qk_norm=True, n_experts=4,
                    n_experts_per_token=2, d_ff_expert=16)


def _moe_model(cfg=R_CFG):
    from async_rl.model.transformer import Transformer
    graphdef, params = nnx.split(Transformer(cfg, 40, rngs=nnx.Rngs(0)))
    return graphdef, jax.tree.map(lambda x: x * 3.0, params)  # peaked routing: no near-ties


def _rows(t=12):
    from async_rl.model.transformer import layout
    rs = np.random.RandomState(3)
    tokens, positions, valid = np.zeros((2, t), np.int32), np.zeros((2, t), np.int32), np.zeros((2, t), bool)
    for b, n in enumerate((t, t - 5)):  # the second row left-padded
        start, positions[b], valid[b] = layout(n, t, t)
        tokens[b, start:] = rs.randint(1, 40, n)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid)


def test_route_takes_forced_experts_weighted_by_the_router_and_minus_one_rows_route_themselves():
    layer = moe.MoE(R_CFG, rngs=nnx.Rngs(0))
    x_NxD = jax.random.normal(jax.random.key(1), (6, 32))
    probs, w_own, e_own = layer.route(x_NxD)
    forced = (np.asarray(e_own) + 1) % 4
    forced[::2] = -1
    _, w, e = layer.route(x_NxD, jnp.asarray(forced, jnp.int16))
    np.testing.assert_array_equal(np.asarray(e)[::2], np.asarray(e_own)[::2])
    np.testing.assert_array_equal(np.asarray(e)[1::2], forced[1::2])
    p = np.take_along_axis(np.asarray(probs)[1::2], forced[1::2], -1)
    np.testing.assert_allclose(np.asarray(w)[1::2], p / p.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(w)[::2], np.asarray(w_own)[::2], rtol=1e-6)


def test_hidden_replays_given_routes_and_the_router_still_gets_gradients():
    graphdef, params = _moe_model()
    model = nnx.merge(graphdef, params)
    tokens, positions, valid = _rows()
    _, _, own_BxTxLxK = model.prefill_at(tokens, positions, valid, jnp.zeros(2, jnp.int32), experts=True)
    assert own_BxTxLxK.shape == (2, 12, 2, 2) and own_BxTxLxK.dtype == jnp.int32
    free = model.hidden(tokens, positions, valid)
    # its own experts, and -1 (route yourself) for half the columns: the same output
    np.testing.assert_allclose(model.hidden(tokens, positions, valid, routes_BxTxLxK=own_BxTxLxK), free, atol=1e-6)
    mixed = np.asarray(own_BxTxLxK).copy()
    mixed[:, ::2] = -1
    np.testing.assert_allclose(model.hidden(tokens, positions, valid, routes_BxTxLxK=mixed), free, atol=1e-6)
    # other experts: another output, and the router is still trained through their weights
    other = (own_BxTxLxK + 1) % 4
    assert float(jnp.abs(model.hidden(tokens, positions, valid, routes_BxTxLxK=other) - free).max()) > 1e-3
    probe = jax.random.normal(jax.random.key(4), free.shape)

    def loss(p):
        return (nnx.merge(graphdef, p).hidden(tokens, positions, valid, routes_BxTxLxK=other) * probe).sum()
    g = dict(nnx.to_flat_state(jax.grad(loss)(params)))[("layers", "mlp", "router")].get_value()
    assert float(jnp.abs(g).max(axis=(1, 2)).min()) > 1e-6  # every layer's router
    with pytest.raises(ValueError, match="routes of shape"):
        model.hidden(tokens, positions, valid, routes_BxTxLxK=own_BxTxLxK[:, :, :1])


def test_routes_on_a_dense_model_are_refused():
    from async_rl.model.transformer import Transformer
    dense = Transformer(ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64), 40, rngs=nnx.Rngs(0))
    tokens, positions, valid = _rows()
    with pytest.raises(ValueError, match="dense model"):
        dense.hidden(tokens, positions, valid, routes_BxTxLxK=jnp.zeros((2, 12, 2, 2), jnp.int32))
    with pytest.raises(ValueError, match="dense model"):
        dense.prefill_at(tokens, positions, valid, jnp.zeros(2, jnp.int32), experts=True)


@pytest.mark.parametrize("mesh", [("mesh.expert=2",), ("mesh.expert=4",), ("mesh.expert=2", "mesh.tensor=2")])
def test_experts_split_over_an_expert_axis_give_the_update_of_one_device(mesh):
    one, m1 = _step("model.router_aux_coef=0.01")
    cfg, learner = make(*MOE, "model.router_aux_coef=0.01", *mesh)
    state = learner.init_state(learner.init_params())
    gate = dict(nnx.to_flat_state(state["params"]))[("layers", "mlp", "experts_gate")].get_value()
    ep = cfg.mesh.expert
    assert gate.sharding.spec[1] == "expert"  # [layers, experts, D, F]: each device holds 4 / ep experts
    assert {s.data.shape[1] for s in gate.addressable_shards} == {4 // ep}
    state, m = learner.step(state, batch_of(cfg, random_rows(cfg, seed=2)))
    for k in ("learner/loss", "learner/router_aux", "learner/expert_load_max"):
        assert m[k] == pytest.approx(m1[k], rel=1e-4), k
    for path, v in dict(nnx.to_flat_state(jax.device_get(state["params"]))).items():
        np.testing.assert_allclose(v.get_value(), dict(nnx.to_flat_state(one))[path].get_value(), atol=5e-5,
                                   err_msg=str(path))


@pytest.mark.parametrize("overrides, says", [
    (("mesh.expert=3", "mesh.data=1"), r"mesh.expert=3: must divide model.n_experts \(8\)"),
    (("model.n_experts=0", "model.n_experts_per_token=0", "model.d_ff_expert=0", "mesh.expert=2"),
     r"mesh.expert=2: needs a mixture-of-experts model"),
])
def test_an_expert_axis_that_cannot_split_the_experts_is_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        C.load("configs/tiny-moe.yaml", list(overrides))
