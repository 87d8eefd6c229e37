"""Routing replay in the built-in engines: the experts recorded for a prefill's positions
(`head_routes`) and for every sampled token (`generate_routed_async`) are exactly those the
learner's full-row forward of the MoE model chooses, in the slot and the paged engine, for
new samples and for a continuation prefilled from its saved tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_engine import P, V, tiny_model, tiny_prompts

from async_rl.config import ModelConfig
from async_rl.model import moe
from async_rl.model.transformer import layout
from async_rl.rollout.engine import Engine
from async_rl.rollout.paged_engine import PagedEngine

N, K = 8, 3  # K: tokens per call
CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, qk_norm=True, n_experts=4,
                  n_experts_per_token=2, d_ff_expert=16)

pytestmark = pytest.mark.usefixtures("compile_cache")


@pytest.fixture(scope="module")
def moe_model():
    return tiny_model(CFG)  # weights x3: peaked routing, so no top-k near-ties between programs


def build(graphdef, kind: str, routes: bool = True):
    cls, kw = (PagedEngine, dict(page_size=4)) if kind == "paged" else (Engine, {})
    devices = jax.devices() if kind == "sharded" else jax.devices()[:1]
    return cls(CFG, graphdef, vocab_size=V, slots=4, max_prompt_len=P, max_new_tokens=N, temperature=1.0, top_k=0,
               top_p=1.0, seed=7, devices=devices, steps_per_call=K, routes=routes, **kw)


def own_routes(graphdef, params, prompt, tokens) -> np.ndarray:
    """The learner's forward of prompt + tokens laid out in one P + N row routing itself: the
    experts at positions 0 .. n-2 (the ones behind a logit of a recorded token)."""
    n = len(prompt) + len(tokens)
    start, positions, valid = layout(len(prompt), P, P + N, n_filled=n)
    row = np.zeros(P + N, np.int32)
    row[start:P], row[P:P + len(tokens)] = prompt, tokens
    model = nnx.merge(graphdef, params)
    _, _, e_BxTxLxK = model.prefill_at(row[None], positions[None], valid[None], jnp.zeros(1, jnp.int32), experts=True)
    own = np.asarray(e_BxTxLxK)[0, start:start + n - 1]
    # replaying them in the learner's forward is its own routing
    x = model.hidden(row[None], positions[None], valid[None])
    routes = np.full((1, P + N, CFG.n_layers, 2), -1, np.int32)
    routes[0, start:start + n - 1] = own
    np.testing.assert_allclose(model.hidden(row[None], positions[None], valid[None], routes_BxTxLxK=routes), x,
                               atol=1e-6)
    return own


@pytest.mark.parametrize("kind", ["slots", "sharded", "paged"])
def test_recorded_routes_are_the_learner_forward_s_own(moe_model, kind):
    graphdef, params = moe_model
    prompts = tiny_prompts()[:2]
    eng = build(graphdef, kind)
    p = eng.load_params(params)
    prefix = eng.prefill_many(p, [(prompts[0], None), (prompts[1], None)])
    st = eng.insert_many(prefix, eng.init_decode_state(), [(0, 0, 0, 0), (1, 1, 1, 0), (3, 0, 0, 1)])
    toks, routes = [], []
    for _ in range(2):
        st, t, _, r = eng.generate_routed_async(p, st)
        assert r.shape == (K, 4, CFG.n_layers, 2) and r.dtype == moe.routes_dtype(CFG.n_experts)
        toks.append(np.asarray(t))
        routes.append(np.asarray(r))
    toks, routes = np.concatenate(toks), np.concatenate(routes)
    dt = moe.routes_dtype(CFG.n_experts)
    for slot, row in ((0, 0), (1, 1), (3, 0)):
        head = eng.head_routes(prefix, row)
        assert head.shape == (len(prompts[row]) - 1, CFG.n_layers, 2) and head.dtype == dt
        got = np.concatenate([head, routes[:, slot]])
        np.testing.assert_array_equal(got, own_routes(graphdef, params, prompts[row], toks[:, slot]).astype(dt))
    assert len(np.unique(routes)) > 1
    # a continuation prefilled from 4 saved tokens: its head covers them, and its first token's
    # routes are the forward's at the last of them
    cont = eng.prefill_many(p, [(prompts[0], toks[:4, 0])])
    want = own_routes(graphdef, params, prompts[0], toks[:5, 0]).astype(dt)
    np.testing.assert_array_equal(eng.head_routes(cont, 0), want[:-1])
    st = eng.insert_many(cont, eng.init_decode_state(), [(2, 0, 0, 0)])
    st, t, _, r = eng.generate_routed_async(p, st, 1)
    assert int(np.asarray(t)[0, 2]) == toks[4, 0]
    np.testing.assert_array_equal(np.asarray(r)[0, 2], want[-1])
    # the three-value call is unchanged
    st, t, lp = eng.generate_steps_async(p, st)
    assert t.shape == lp.shape == (K, 4)


def test_without_routes_nothing_is_recorded_and_a_dense_model_has_none(moe_model):
    graphdef, params = moe_model
    eng = build(graphdef, "slots", routes=False)
    p = eng.load_params(params)
    prefix = eng.prefill_many(p, [(tiny_prompts()[0], None)])
    st = eng.insert_many(prefix, eng.init_decode_state(), [(0, 0, 0, 0)])
    assert prefix.arrays.experts_BxWxLxK is None and st.arrays.experts_SxLxK is None
    _, t, _, r = eng.generate_routed_async(p, st)
    assert r is None and t.shape == (K, 4)
    with pytest.raises(ValueError, match="records no routes"):
        eng.head_routes(prefix, 0)
    dense = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    with pytest.raises(ValueError, match="dense model"):
        Engine(dense, graphdef, vocab_size=V, slots=4, max_prompt_len=P, max_new_tokens=N, temperature=1.0,
               top_k=0, top_p=1.0, seed=7, devices=jax.devices()[:1], routes=True)
