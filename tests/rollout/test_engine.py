"""Engine: greedy == naive decoding, logprobs == full-model recomputation, sampling keys
independent of slot and schedule, continuation from a saved prefix, weight swaps without
recompiling, and a fixed number of compilations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import CACHE_LAYOUTS
from naive_decoder import naive_generate

from async_rl.config import ModelConfig
from async_rl.model.transformer import Transformer, layout
from async_rl.rollout.decoding import generate_all
from async_rl.rollout.engine import Engine
from async_rl.rollout.interface import BuiltinRollout
from async_rl.rollout.sampling import nucleus_V, sample_token

V, P, N, EOS = 40, 8, 8, 2
CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, qkv_bias=True,
                  tie_embeddings=False)

pytestmark = pytest.mark.usefixtures("compile_cache")


def tiny_model(cfg=CFG, seed=0):
    graphdef, params = nnx.split(Transformer(cfg, V, rngs=nnx.Rngs(seed)))
    # Scaled-up weights give varied, peaked outputs (random init repeats one token).
    return graphdef, jax.tree.map(lambda x: x * 3.0, params)


def tiny_prompts():
    rs = np.random.RandomState(0)
    return [rs.randint(4, V, rs.randint(1, P + 1)).astype(np.int32) for _ in range(7)]


def make_engine(graphdef, *, slots=4, temperature=0.0, top_k=0, top_p=1.0, devices="one", **kw):
    devices = jax.devices()[:1] if devices == "one" else devices
    return Engine(CFG, graphdef, vocab_size=V, slots=slots, max_prompt_len=P, max_new_tokens=N,
                  temperature=temperature, top_k=top_k, top_p=top_p, seed=7, devices=devices, **kw)


@pytest.fixture(scope="module")
def engine(model):
    """`make_engine(graphdef, **kw)`, built once per module for each setting: for the tests that
    only generate with an engine (each builds its own where it swaps weights or counts compilations)."""
    made, defaults = {}, dict(slots=4, temperature=0.0, top_k=0, top_p=1.0, devices="one")

    def get(**kw):
        key = tuple(sorted({**defaults, **kw}.items()))
        if key not in made:
            made[key] = make_engine(model[0], **kw)
        return made[key]
    return get


def scorer(graphdef):
    """What the learner computes: log_softmax(logits / T) of the whole row at once."""
    forward = jax.jit(lambda params, *a: nnx.merge(graphdef, params)(*a))

    def logprobs(params, prompt, tokens, temperature):
        start, positions, valid = layout(len(prompt), P, P + N, n_filled=len(prompt) + len(tokens))
        row = np.zeros(P + N, np.int32)
        row[start:P] = prompt
        row[P:P + len(tokens)] = tokens
        logits = forward(params, row[None], positions[None], valid[None])[0]
        logp = jax.nn.log_softmax(logits[P - 1:P - 1 + len(tokens)] / (temperature or 1.0))
        return np.asarray(logp[np.arange(len(tokens)), tokens])
    return logprobs


def test_greedy_matches_naive_across_refills_and_compiles_once(model, prompts):
    graphdef, params = model
    eng = make_engine(graphdef)
    out = generate_all(eng, eng.load_params(params), prompts, samples=2, eos_id=EOS)
    # one window (P + N is the smallest); its decode with and without the last forward pass
    assert eng.compile_counts() == {"prefill": 1, "insert": 1, "generate": 2, "free": 1}
    for i, prompt in enumerate(prompts):
        ref = naive_generate(graphdef, params, prompt, max_new_tokens=N, eos_id=EOS, temperature=0.0,
                             top_k=0, top_p=1.0, seed=7, ordinal=i, sample=0, max_prompt_len=P)
        for s in range(2):
            np.testing.assert_array_equal(out[i][s].tokens, ref.tokens)
            np.testing.assert_allclose(out[i][s].logprobs, ref.logprobs, atol=1e-4, rtol=0)
    assert len({len(c.tokens) for row in out for c in row}) > 1, "test wants some EOS stops"


def test_inserting_any_number_of_rows_of_one_prefix_shape_is_one_program(model, prompts):
    """The insert's program depends on the prefix's shape only, not on how many slots a call
    fills: a long multi-turn run that inserts 1, 2, 3... rows at a time does not compile (and
    hold) a program per count."""
    graphdef, params = model
    eng = make_engine(graphdef, slots=8)
    params = eng.load_params(params)
    prefix = eng.prefill_many(params, [(p, None) for p in prompts[:4]])  # one shape: 4 rows
    st = eng.init_decode_state()
    for n in (1, 2, 3, 5):
        st = eng.insert_many(prefix, st, [(i, i % 4, i, 0) for i in range(n)])
        st = eng.free_many(st, range(n))
    assert eng.compile_counts()["insert"] == 1


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9), (0.0, 0, 1.0)])
def test_logprobs_match_full_model(model, prompts, engine, temperature, top_k, top_p):
    graphdef, params = model
    eng = engine(temperature=temperature, top_k=top_k, top_p=top_p)
    out = generate_all(eng, eng.load_params(params), prompts[:5], samples=2, eos_id=EOS)
    score = scorer(graphdef)
    worst = 0.0
    for i, prompt in enumerate(prompts[:5]):
        for c in out[i]:
            ref = score(params, prompt, c.tokens, temperature)
            worst = max(worst, float(np.abs(ref - c.logprobs).max()))
            assert c.logprobs.dtype == np.float32
    assert worst <= 1e-4


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (6, 0.8)])
def test_sampled_tokens_independent_of_slot_batch_and_order(model, prompts, engine, top_k, top_p):
    graphdef, params = model
    eng = engine(temperature=1.0, top_k=top_k, top_p=top_p)
    p = eng.load_params(params)
    a = generate_all(eng, p, prompts, samples=3, eos_id=EOS)
    # Reversed order with the same ordinals: every sample lands in another slot, next to
    # other neighbours, refilled at other moments.
    order = list(range(len(prompts)))[::-1]
    b = generate_all(eng, p, [prompts[i] for i in order], samples=3, eos_id=EOS, ordinals=order)
    b = [b[order.index(i)] for i in range(len(prompts))]
    # Another slot count is another compiled program; tokens must still agree.
    eng2 = engine(slots=3, temperature=1.0, top_k=top_k, top_p=top_p)
    c = generate_all(eng2, eng2.load_params(params), prompts, samples=3, eos_id=EOS)
    distinct = set()
    for i in range(len(prompts)):
        for s in range(3):
            np.testing.assert_array_equal(a[i][s].tokens, b[i][s].tokens)
            np.testing.assert_array_equal(a[i][s].tokens, c[i][s].tokens)
            # Same compiled program, other slot and neighbours: bit-identical on CPU.
            np.testing.assert_array_equal(a[i][s].logprobs, b[i][s].logprobs)
            np.testing.assert_allclose(a[i][s].logprobs, c[i][s].logprobs, atol=1e-4, rtol=0)
            distinct.add(tuple(a[i][s].tokens))
    assert len(distinct) > len(prompts), "samples of one prompt should differ"


def test_sharded_slots_over_all_devices_match_one_device(model, prompts, engine):
    graphdef, params = model
    assert len(jax.devices()) == 4
    one = engine(temperature=1.0)
    many = make_engine(graphdef, temperature=1.0, devices=None)
    k0 = many.init_decode_state().arrays.cache["k"]  # [L, S, ...]
    assert k0.sharding.spec[1] == "data"
    a = generate_all(one, one.load_params(params), prompts, samples=2, eos_id=EOS)
    b = generate_all(many, many.load_params(params), prompts, samples=2, eos_id=EOS)
    for ra, rb in zip(a, b):
        for ca, cb in zip(ra, rb):
            np.testing.assert_array_equal(ca.tokens, cb.tokens)
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continue_from_completion_prefix(model, prompts, engine, temperature):
    graphdef, params = model
    eng = engine(temperature=temperature)
    p = eng.load_params(params)
    full = generate_all(eng, p, prompts[:3], eos_id=None, ordinals=[10, 11, 12])
    state = eng.init_decode_state()
    for slot, (i, k) in enumerate([(0, 1), (1, 3), (2, N - 1)]):
        prefix = eng.prefill(p, prompts[i], completion=full[i][0].tokens[:k])
        state = eng.insert(prefix, state, slot, ordinal=10 + i, sample=0)
    got = {0: [], 1: [], 2: []}
    for _ in range(N):
        state, toks, lps = eng.generate(p, state)
        for slot in got:
            got[slot].append((toks[slot], lps[slot]))
    for slot, (i, k) in enumerate([(0, 1), (1, 3), (2, N - 1)]):
        rest = full[i][0]
        np.testing.assert_array_equal([t for t, _ in got[slot][:N - k]], rest.tokens[k:])
        np.testing.assert_allclose([lp for _, lp in got[slot][:N - k]], rest.logprobs[k:], atol=1e-5)
    with pytest.raises(ValueError):
        eng.prefill(p, prompts[0], completion=np.zeros(N, np.int32))
    with pytest.raises(ValueError):
        eng.prefill(p, np.zeros(P + 1, np.int32))


def test_update_params_changes_outputs_without_recompiling(model, prompts):
    graphdef, params = model
    eng = make_engine(graphdef)
    eng.update_params(params, version=1)
    before = generate_all(eng, eng.params, prompts, eos_id=None)
    counts = eng.compile_counts()
    new = jax.tree.map(lambda x: x * 0.8 + 0.05, params)
    eng.update_params(new, version=2)
    assert eng.version == 2
    after = generate_all(eng, eng.params, prompts, eos_id=None)
    assert eng.compile_counts() == counts == {"prefill": 1, "insert": 1, "generate": 2, "free": 1}
    assert any((a[0].tokens != b[0].tokens).any() for a, b in zip(before, after))
    ref = naive_generate(graphdef, new, prompts[0], max_new_tokens=N, eos_id=None, temperature=0.0,
                         top_k=0, top_p=1.0, seed=7, ordinal=0, sample=0, max_prompt_len=P)
    np.testing.assert_array_equal(after[0][0].tokens, ref.tokens)
    with pytest.raises(ValueError):
        eng.update_params(jax.tree.map(lambda x: x[..., :1], params), version=3)


def test_top_k_and_top_p_truncate_but_logprob_does_not():
    logits = jax.numpy.asarray(np.random.RandomState(5).randn(V).astype(np.float32) * 3)
    keys = jax.random.split(jax.random.PRNGKey(0), 200)
    logp = np.asarray(jax.nn.log_softmax(logits / 0.5))
    top4 = set(np.argsort(-np.asarray(logits))[:4].tolist())
    draw = jax.jit(jax.vmap(lambda k, t=0.5: sample_token(logits, k, temperature=t, top_k=4, top_p=1.0)))
    toks, lps = draw(keys)
    assert set(np.asarray(toks).tolist()) <= top4 and len(set(np.asarray(toks).tolist())) > 1
    np.testing.assert_allclose(lps, logp[np.asarray(toks)], atol=1e-6)
    greedy = int(np.argmax(logits))
    toks, _ = jax.vmap(lambda k: sample_token(logits, k, temperature=1.0, top_k=0, top_p=1e-6))(keys)
    assert set(np.asarray(toks).tolist()) == {greedy}


def test_the_top_p_set_found_without_a_sort_is_the_sorted_cumulative_one():
    """nucleus_V against the definition (sort, keep while the mass before a token is < top_p,
    ties kept together), on rows with ties, -inf (top-k cut) entries, one dominant token."""
    rs = np.random.RandomState(3)
    rows = [rs.randn(V).astype(np.float32) * s for s in (0.3, 1.0, 4.0)]
    rows.append(np.round(rs.randn(V) * 2).astype(np.float32))  # many ties
    rows.append(np.where(rs.rand(V) < 0.5, -np.inf, rs.randn(V)).astype(np.float32))
    rows.append(np.r_[np.float32(30.0), rs.randn(V - 1).astype(np.float32)])
    for x in rows:
        for top_p in (1e-6, 0.1, 0.5, 0.9, 0.999):
            got = np.asarray(jax.jit(nucleus_V, static_argnums=1)(jnp.asarray(x), top_p))
            order = np.argsort(-x, kind="stable")
            p = np.exp(x[order] - x.max()) / np.exp(x - x.max()).sum()
            cutoff = x[order][(np.cumsum(p) - p) < top_p].min()
            np.testing.assert_array_equal(got, x >= cutoff, err_msg=f"top_p {top_p}")


@pytest.mark.parametrize("devices,layout", [("one", "stacked"), (None, "stacked"), ("one", "recent"),
                                            (None, "recent")])
def test_generate_steps_equals_single_steps(model, prompts, engine, devices, layout):
    """K decode steps in one call produce the tokens and logprobs of K single calls of the
    stacked cache, in every cache layout."""
    graphdef, params = model
    one = engine(temperature=1.0, top_k=5, devices=devices, recent=False)
    devices = jax.devices()[:1] if devices == "one" else jax.devices()
    many = Engine(CFG, graphdef, vocab_size=V, slots=4, max_prompt_len=P, max_new_tokens=N, temperature=1.0,
                  top_k=5, top_p=1.0, seed=7, devices=devices, steps_per_call=3, **CACHE_LAYOUTS[layout])
    assert many.recent == (layout == "recent")
    p1, pk = one.load_params(params), many.load_params(params)
    s1, sk = one.init_decode_state(), many.init_decode_state()
    for slot in range(4):
        pre = one.prefill(p1, prompts[slot])
        s1 = one.insert(pre, s1, slot, ordinal=slot, sample=1)
        sk = many.insert(many.prefill(pk, prompts[slot]), sk, slot, ordinal=slot, sample=1)
    toks, lps = [], []
    for _ in range(6):
        s1, t, l = one.generate(p1, s1)
        toks.append(t)
        lps.append(l)
    got_t, got_l = [], []
    for _ in range(2):
        sk, t, l = many.generate_steps(pk, sk)
        assert t.shape == (3, 4)
        got_t.append(t)
        got_l.append(l)
    np.testing.assert_array_equal(np.concatenate(got_t), np.stack(toks))
    np.testing.assert_allclose(np.concatenate(got_l), np.stack(lps), atol=1e-6)
    with pytest.raises(ValueError, match="steps=2"):  # one token or K: the two compiled decodes
        many.generate_steps(pk, sk, 2)


@pytest.mark.parametrize("k,layout", [(1, "stacked"), (4, "stacked"), (4, "recent")])
def test_no_forward_pass_after_every_slot_s_last_column(model, prompts, k, layout):
    """Once every active slot samples its last column (P + N - 1) in a call, the forward pass
    after it has no use and is not compiled into that call; tokens and logprobs stay those
    of the decode that runs it."""
    graphdef, params = model
    engines = [Engine(CFG, graphdef, vocab_size=V, slots=4, max_prompt_len=P, max_new_tokens=N, temperature=1.0,
                      top_k=0, top_p=1.0, seed=7, devices=jax.devices()[:1], steps_per_call=k, **CACHE_LAYOUTS[layout])
               for _ in range(2)]
    engines[1].last_forward = lambda state, steps: True  # the reference runs every forward pass
    outs = []
    for eng in engines:
        p, st = eng.load_params(params), eng.init_decode_state()
        for slot in range(3):  # slot 3 stays inactive: it never holds the decode back
            st = eng.insert(eng.prefill(p, prompts[slot]), st, slot, ordinal=slot, sample=0)
        calls = []
        for _ in range(N // k):
            calls.append(eng.last_forward(st, k))
            st, t, l = eng.generate_steps(p, st)
            calls.append((t[:, :3], l[:, :3]))
        outs.append(calls)
    skips, ref = outs
    assert [c for c in skips if isinstance(c, bool)] == [True] * (N // k - 1) + [False]
    for a, b in zip(skips, ref):
        if not isinstance(a, bool):
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_allclose(a[1], b[1], atol=1e-6, rtol=0)
    assert engines[0].compile_counts()["generate"] == 2 and engines[1].compile_counts()["generate"] == 1


def test_generate_all_in_chunks_equals_one_token_per_call(model, prompts, engine):
    """K tokens per call, ends found per chunk, freed slots refilled: the same completions as
    one token per call, with stop tokens and per-sample length caps both ending samples; and
    the same again with each chunk fetched before the next is dispatched (`ahead` = 0: no
    sample runs a chunk past its end)."""
    graphdef, params = model
    one = engine(temperature=1.0, slots=3)
    many = Engine(CFG, graphdef, vocab_size=V, slots=3, max_prompt_len=P, max_new_tokens=N, temperature=1.0,
                  top_k=0, top_p=1.0, seed=7, devices=jax.devices()[:1], steps_per_call=3)
    caps = np.random.RandomState(1).randint(1, N + 2, (len(prompts), 2)).tolist()
    for stop in (EOS, (EOS, 5, 9)):
        a = generate_all(one, one.load_params(params), prompts, samples=2, eos_id=stop, max_tokens=caps)
        b = generate_all(many, many.load_params(params), prompts, samples=2, eos_id=stop, max_tokens=caps)
        fetched_first = BuiltinRollout(many, many.load_params(params), 0, prefill_rows=1)
        fetched_first.ahead = 0
        c = generate_all(fetched_first, None, prompts, samples=2, eos_id=stop, max_tokens=caps, max_new_tokens=N)
        stops = {stop} if isinstance(stop, int) else set(stop)
        for i in range(len(prompts)):
            for s in range(2):
                np.testing.assert_array_equal(a[i][s].tokens, b[i][s].tokens)
                np.testing.assert_allclose(a[i][s].logprobs, b[i][s].logprobs, atol=1e-6)
                np.testing.assert_array_equal(c[i][s].tokens, b[i][s].tokens)
                np.testing.assert_array_equal(c[i][s].logprobs, b[i][s].logprobs)
                n = len(b[i][s].tokens)
                assert n <= min(caps[i][s], N)
                assert n == min(caps[i][s], N) or b[i][s].tokens[-1] in stops
                assert not stops & set(b[i][s].tokens[:-1].tolist())
