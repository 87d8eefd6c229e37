"""The paged engine (`engine.kv_layout=paged`): the same tokens and logprobs as the slot engine,
group prompts sharing their pages, and a pool too small for the batch evicting samples that
continue from their recorded tokens, none lost and none generated twice."""

import jax
import numpy as np
import pytest
from test_engine import CFG, EOS, P, V, tiny_model

from async_rl.config import ModelConfig
from async_rl.rollout.decoding import generate_all
from async_rl.rollout.engine import Engine
from async_rl.rollout.paged_engine import PagedEngine

N = 12  # longer than the slot engine tests' samples: the pool runs out mid-sample

pytestmark = pytest.mark.usefixtures("compile_cache")


def build(graphdef, cls=Engine, cfg=CFG, **kw):
    return cls(cfg, graphdef, vocab_size=V, slots=4, max_prompt_len=P, max_new_tokens=N, temperature=1.0, top_k=0,
               top_p=1.0, seed=7, devices=jax.devices()[:1], steps_per_call=3, **kw)


def run(engine, params, prompts, caps):
    return generate_all(engine, engine.load_params(params), prompts, samples=3, eos_id=EOS, max_tokens=caps)


def same(a, b, atol=1e-5):
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            np.testing.assert_array_equal(s.tokens, t.tokens)
            np.testing.assert_allclose(s.logprobs, t.logprobs, atol=atol)


@pytest.mark.parametrize("page_size", [1, 5])
def test_paged_equals_slots_when_the_pool_holds_every_slot(model, prompts, page_size):
    graphdef, params = model
    caps = np.random.RandomState(1).randint(1, N + 2, (len(prompts), 3)).tolist()
    want = run(build(graphdef), params, prompts, caps)
    paged = build(graphdef, PagedEngine, page_size=page_size)
    same(run(paged, params, prompts, caps), want)
    assert paged.evictions == 0
    paged.pool.check()


def test_a_pool_a_quarter_of_what_the_slots_need_evicts_and_loses_nothing(model, prompts):
    """Evicted samples come back as lost slots and continue from their recorded tokens: the
    completions equal the slot engine's (keys are per sample and position)."""
    graphdef, params = model
    caps = [[N] * 3 for _ in prompts]  # every sample runs long, so the pool runs out
    want = run(build(graphdef), params, prompts, caps)
    page = 4
    need = 4 * (-(-(P + N) // page) + 1) * page
    paged = build(graphdef, PagedEngine, page_size=page, pool_tokens=need // 4 + page)
    # an evicted sample's tokens so far are prefilled again, as a whole row: fp32 rounding differs
    same(run(paged, params, prompts, caps), want, atol=1e-4)
    assert paged.evictions > 0
    paged.pool.check()


def test_a_group_s_samples_share_their_prompt_s_full_pages(model):
    graphdef, params = model
    eng = build(graphdef, PagedEngine, page_size=2)
    prompt = np.arange(4, 4 + 7, dtype=np.int32)  # 7 tokens: 3 full pages and one partial
    prefix = eng.prefill(eng.load_params(params), prompt)
    st = eng.insert_many(prefix, eng.init_decode_state(), [(s, 0, 0, s) for s in range(3)])
    tables = [eng.pool.pages(s) for s in range(3)]
    assert tables[0][:3] == tables[1][:3] == tables[2][:3]  # shared, counted
    assert len({t[3] for t in tables}) == 3  # the partial page is each sample's own
    assert (eng.pool.refs[tables[0][:3]] == 4).all()  # the row's holder and three samples
    eng.release_prefix(prefix)
    eng.free_many(st, range(3))
    eng.pool.check()
    assert eng.pool.free == eng.pool.n_pages - 1


def test_sliding_window_layers_read_only_their_window(model, prompts):
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, tie_embeddings=False, gemma=True,
                      qk_norm=True, sliding_window=3, global_every=2)
    graphdef, params = tiny_model(cfg, seed=1)
    caps = [[N] * 3 for _ in prompts]
    same(run(build(graphdef, PagedEngine, cfg, page_size=4), params, prompts, caps),
         run(build(graphdef, cfg=cfg), params, prompts, caps))


def test_with_one_table_width_a_sample_is_bit_identical_whatever_its_slot_pages_and_neighbours(model, prompts):
    """run.determinism reads every page a sequence may hold (`windows=False`): a sample's logprobs
    do not depend on which slot and pages it got or what else ran (the property resume relies on)."""
    graphdef, params = model
    eng = build(graphdef, PagedEngine, page_size=4, windows=False)
    p = eng.load_params(params)
    caps = [[N] * 3 for _ in prompts]
    a = generate_all(eng, p, prompts, samples=3, eos_id=EOS, max_tokens=caps)
    order = list(range(len(prompts)))[::-1]
    b = generate_all(eng, p, [prompts[i] for i in order], samples=3, eos_id=EOS, ordinals=order,
                     max_tokens=[caps[i] for i in order])
    b = [b[order.index(i)] for i in range(len(prompts))]
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            np.testing.assert_array_equal(s.tokens, t.tokens)
            np.testing.assert_array_equal(s.logprobs, t.logprobs)


def test_room_offers_new_samples_only_the_pages_left_beside_the_live_samples_growth(model):
    """`room`: the pages free (or held only by prefill rows, or by the offered slots' ended
    samples), less a call's growth for each live sample, over what a new sample takes at least
    (its copied page and its first call's). K = 3 tokens a call, pages of 4: a new sample 2 pages."""
    graphdef, params = model
    for pool_tokens, want_one, want_ended in ((48, 1, 3), (24, 0, 1)):  # 12 pages; 6, one sequence's least
        eng = build(graphdef, PagedEngine, page_size=4, pool_tokens=pool_tokens)
        st = eng.init_decode_state()
        assert eng.room(st, [0, 1, 2, 3]) == min(4, eng.pool.free // 2)
        prefix = eng.prefill(eng.load_params(params), np.arange(4, 11, dtype=np.int32))
        st = eng.insert_many(prefix, st, [(s, 0, 0, s) for s in range(3)])  # 7 tokens: the row's 2 pages, 1 copy each
        assert eng.pool.free == eng.pool.n_pages - 1 - 5
        assert eng.room(st, [3]) == want_one  # 48: (7 free + the row's own page - 3 growing) // 2; 24: none
        assert eng.room(st, [1, 2, 3]) == want_ended  # slots 1, 2 ended: their copies are spare, they do not grow
