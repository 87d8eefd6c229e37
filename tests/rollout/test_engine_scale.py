"""Engine at scale: ids outside the tokenizer are never drawn (and the learner agrees),
weights and KV cache in the compute dtype, tensor-parallel generation equal to one device,
decode windows over live columns, batched prefill."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import CACHE_LAYOUTS

from async_rl.config import ModelConfig
from async_rl.learner import losses
from async_rl.model.transformer import Transformer, layout
from async_rl.rollout.decoding import generate_all
from async_rl.rollout.engine import Engine

V, P, N, EOS = 40, 8, 8, 2
CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=64, qkv_bias=True, tie_embeddings=False)

pytestmark = pytest.mark.usefixtures("compile_cache")


def make_engine(cfg, graphdef, *, slots=4, temperature=0.0, devices=None, **kw):
    return Engine(cfg, graphdef, vocab_size=V, slots=slots, max_prompt_len=P, max_new_tokens=N,
                  temperature=temperature, top_k=0, top_p=1.0, seed=7,
                  devices=devices if devices is not None else jax.devices()[:1], **kw)


def prompts(n=7, seed=0):
    rs = np.random.RandomState(seed)
    return [rs.randint(4, 30, rs.randint(1, P + 1)).astype(np.int32) for _ in range(n)]


@functools.cache
def _hidden(graphdef):
    """The learner's hidden states of a whole row, compiled once per model (not dispatched op
    by op for each of a test's rows)."""
    return jax.jit(lambda params, row, positions, valid: nnx.merge(graphdef, params).hidden(row, positions, valid))


def learner_logprobs(graphdef, params, prompt, tokens, temperature):
    """What the learner computes: hidden states of the whole row, then `completion_logprobs`."""
    model = nnx.merge(graphdef, params)
    start, positions, valid = layout(len(prompt), P, P + N, n_filled=len(prompt) + len(tokens))
    row = np.zeros(P + N, np.int32)
    row[start:P] = prompt
    row[P:P + len(tokens)] = tokens
    x = _hidden(graphdef)(params, row[None], positions[None], valid[None])
    logp, ent = losses.completion_logprobs(model.logits, x[:, P - 1:P - 1 + len(tokens)],
                                           jnp.asarray(tokens)[None], temperature)
    return np.asarray(logp[0]), np.asarray(ent[0])


def test_ids_outside_the_tokenizer_are_never_sampled_and_learner_agrees():
    n_tok = 30
    model = Transformer(CFG, V, rngs=nnx.Rngs(0), n_tokens=n_tok)
    graphdef, params = nnx.split(model)
    params = jax.tree.map(lambda x: x * 3.0, params)
    # make the padded rows attractive: unmasked, they would be drawn often
    k = params["lm_head"]["kernel"]
    k.set_value(k.get_value().at[:, n_tok:].add(0.5))
    plain_graphdef = nnx.split(Transformer(CFG, V, rngs=nnx.Rngs(0)))[0]
    ps = prompts()
    plain = make_engine(CFG, plain_graphdef, temperature=1.0)
    drawn = generate_all(plain, plain.load_params(params), ps, samples=4, eos_id=None)
    assert max(int(c.tokens.max()) for row in drawn for c in row) >= n_tok, "test wants padded ids to be likely"

    eng = make_engine(CFG, graphdef, temperature=1.0)
    out = generate_all(eng, eng.load_params(params), ps, samples=4, eos_id=None)
    worst = 0.0
    for prompt, row in zip(ps, out):
        for c in row:
            assert int(c.tokens.max()) < n_tok
            logp, ent = learner_logprobs(graphdef, params, prompt, c.tokens, 1.0)
            assert np.isfinite(ent).all()
            worst = max(worst, float(np.abs(logp - c.logprobs).max()))
    assert worst <= 1e-4


@pytest.fixture(scope="module")
def model():
    graphdef, params = nnx.split(Transformer(CFG, V, rngs=nnx.Rngs(0)))
    return graphdef, jax.tree.map(lambda x: x * 3.0, params)


@pytest.mark.parametrize("tensor", [2, 4])
def test_tensor_parallel_generates_what_one_device_does(model, tensor):
    graphdef, params = model
    ps = prompts()
    one = make_engine(CFG, graphdef)
    tp = make_engine(CFG, graphdef, devices=jax.devices(), tensor=tensor)
    assert dict(tp.mesh.shape) == {"data": 4 // tensor, "tensor": tensor}
    p = tp.load_params(params)
    assert p["layers"]["attn"]["q"]["kernel"].sharding.spec[-1] == "tensor"
    k0 = tp.init_decode_state().arrays.cache["k"]  # [L, S, Hkv, T, hd]
    assert k0.sharding.spec[2] == "tensor"
    a = generate_all(one, one.load_params(params), ps, samples=2, eos_id=EOS)
    b = generate_all(tp, p, ps, samples=2, eos_id=EOS)
    worst = 0.0
    for prompt, ra, rb in zip(ps, a, b):
        for ca, cb in zip(ra, rb):
            np.testing.assert_array_equal(ca.tokens, cb.tokens)
            ref, _ = learner_logprobs(graphdef, params, prompt, cb.tokens, 0.0)
            worst = max(worst, float(np.abs(ref - cb.logprobs).max()))
    assert worst <= 1e-4
    assert tp.compile_counts()["generate"] == 2  # one window, with and without the last forward


def test_tensor_must_divide_devices_and_heads(model):
    from async_rl.config import ConfigError
    graphdef, _ = model
    with pytest.raises(ConfigError, match="engine.tensor=3"):
        make_engine(CFG, graphdef, devices=jax.devices(), tensor=3)
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    with pytest.raises(ConfigError, match="model.n_kv_heads=2"):
        make_engine(cfg, graphdef, devices=jax.devices(), tensor=4)


def test_weights_and_cache_in_the_compute_dtype():
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=64, dtype="bfloat16",
                      param_dtype="float32")
    graphdef, params = nnx.split(Transformer(cfg, V, rngs=nnx.Rngs(0)))
    eng = make_engine(cfg, graphdef)
    p = eng.load_params(params)
    assert p["layers"]["mlp"]["up"]["kernel"].dtype == jnp.bfloat16
    assert p["embed"]["embedding"].dtype == jnp.bfloat16
    assert p["final_norm"]["scale"].dtype == jnp.float32  # read in fp32 by the model
    assert {x.dtype for x in jax.tree.leaves(eng.init_decode_state().arrays.cache)} == {jnp.dtype(jnp.bfloat16)}
    # fresh buffers: a donating learner may free what it passed in
    assert p["embed"]["embedding"].unsafe_buffer_pointer() != params["embed"]["embedding"].unsafe_buffer_pointer()
    eng.update_params(p, version=1)
    assert eng.params is p  # already placed: no copy on swap
    out = generate_all(eng, p, prompts(3), eos_id=None)
    ref = generate_all(eng, eng.load_params(params), prompts(3), eos_id=None)
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(a[0].tokens, b[0].tokens)


def long_engine(graphdef, **kw):
    return Engine(CFG, graphdef, vocab_size=V, slots=4, max_prompt_len=P, max_new_tokens=40, temperature=1.0,
                  top_k=0, top_p=1.0, seed=7, devices=kw.pop("devices", jax.devices()[:1]), **kw)


@pytest.mark.parametrize("steps,layout", [(1, "stacked"), (3, "stacked"), (3, "recent")])
def test_decode_windows_match_full_width(model, steps, layout):
    """Windowed decode, in each KV-cache layout (written every step; or with a call's new
    columns kept beside it and written at its end), equals full-width decode writing every
    step."""
    graphdef, params = model
    win = long_engine(graphdef, steps_per_call=steps, **CACHE_LAYOUTS[layout])
    full = long_engine(graphdef, steps_per_call=steps, windows=False, recent=False)
    assert win.windows == (16, 32, 48) and full.windows == (48,)
    ps = prompts(6, seed=1)
    outs = []
    for eng in (win, full):
        p = eng.load_params(params)
        st = eng.init_decode_state()
        for slot in range(4):
            st = eng.insert(eng.prefill(p, ps[slot]), st, slot, ordinal=slot, sample=0)
        toks, lps, seen = [], [], []
        for i in range(40 // steps):
            if i == 5:  # a slot freed and refilled: its window restarts
                st = eng.free(st, 1)
                st = eng.insert(eng.prefill(p, ps[5]), st, 1, ordinal=5, sample=0)
            seen.append(eng.decode_window(st, steps))
            st, t, l = eng.generate_steps(p, st)
            toks.append(t)
            lps.append(l)
        outs.append((np.concatenate(toks), np.concatenate(lps), seen))
    (ta, la, seen), (tb, lb, _) = outs
    np.testing.assert_array_equal(ta, tb)
    np.testing.assert_allclose(la, lb, atol=1e-5, rtol=0)
    assert seen[0] == 16 and seen[-1] == 48 and set(seen) == {16, 32, 48}
    assert win.compile_counts()["generate"] == 3


def test_decode_window_survives_tree_transformations(model):
    """The slots' host mirror travels with their device arrays: a tree map, a block or a
    `dataclasses.replace` of the state keeps the narrow window (a mirror set beside the pytree
    was dropped by each, and decode silently read all P + N columns), and the engine refuses
    bare device arrays rather than guess their columns."""
    graphdef, params = model
    eng = long_engine(graphdef)
    p = eng.load_params(params)
    prefix = eng.prefill(p, prompts(1, seed=3)[0])
    moves = [lambda st: jax.tree.map(lambda x: x, st), jax.block_until_ready,
             lambda st: dataclasses.replace(st, arrays=jax.tree.map(jnp.copy, st.arrays))]
    for move in moves:  # each on a state of its own: generate donates the arrays it is given
        st = move(eng.insert(prefix, eng.init_decode_state(), 0, ordinal=0, sample=0))
        assert eng.decode_window(st) == 16
        st, _, _ = eng.generate(p, st)
        assert eng.decode_window(st) == 16 and eng.active_slots(st).tolist() == [True, False, False, False]
    assert eng.compile_counts()["generate"] == 1  # only the 16-column decode ever ran
    for call in (eng.decode_window, eng.active_slots, lambda a: eng.generate(p, a), lambda a: eng.free(a, 0)):
        with pytest.raises(TypeError, match="DecodeState"):
            call(st.arrays)


def test_batched_prefill_matches_one_at_a_time(model):
    graphdef, params = model
    eng = make_engine(CFG, graphdef, temperature=1.0, devices=jax.devices())
    p = eng.load_params(params)
    ps = prompts(4, seed=2)
    seqs = [(ps[0], None), (ps[1], np.array([5, 6, 7], np.int32)), (ps[2], None), (ps[3], np.array([9], np.int32))]
    results = []
    for batched in (False, True):
        st = eng.init_decode_state()
        many = eng.prefill_many(p, seqs) if batched else None
        if batched:  # every row in one insert call
            st = eng.insert_many(many, st, [(slot, slot, slot, 0) for slot in range(len(seqs))])
        for slot, (prompt, done) in enumerate([] if batched else seqs):
            st = eng.insert(eng.prefill(p, prompt, done), st, slot, ordinal=slot, sample=0)
        toks, lps = [], []
        for _ in range(N - 3):
            st, t, l = eng.generate(p, st)
            toks.append(t)
            lps.append(l)
        results.append((np.stack(toks), np.stack(lps)))
    (ta, la), (tb, lb) = results
    np.testing.assert_array_equal(ta, tb)
    np.testing.assert_allclose(la, lb, atol=1e-5, rtol=0)
    assert eng.prefill_many(p, seqs[:3]).arrays.cache["k"].shape[1:4:2] == (4, P + N - 1)  # bucketed rows, columns
