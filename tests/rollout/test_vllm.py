"""The vLLM rollout backend on a small random Qwen2 checkpoint: behaviour logprobs against the
learner's, weights loaded in place, exact per-token versions, continuations of saved
samples; and behaviour logprobs on random Qwen3 and Gemma 3 checkpoints. One vLLM engine for
most of the module (its start-up dominates); skipped without vLLM."""
import functools
import json
import subprocess
import sys

import numpy as np
import pytest
from test_hf import CONFIGS, load, random_weights, write_checkpoint

from async_rl import config as C
from async_rl.model import hf
from async_rl.rollout.interface import Start

T = 0.7  # sampling temperature: the logprobs must be the ones after it
K, SLOTS, P, N = 4, 4, 6, 12
NT = 80  # the tokenizer's size: the checkpoint's 96 embedding rows pad it, the rest are never sampled


def test_vllm_backend_refuses_deterministic_mode():
    with pytest.raises(C.ConfigError, match=r"run\.determinism"):
        C.load("configs/tiny.yaml", ["engine.backend=vllm", "run.determinism=true", "model.hf_path=/nowhere",
                                     "model.learned_positions=0"])
    with pytest.raises(C.ConfigError, match=r"model\.hf_path"):
        C.load("configs/tiny.yaml", ["engine.backend=vllm"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from async_rl.rollout.vllm_backend import available

    if (why := available()) is not None:
        pytest.skip(why)
    # head_dim 32: vLLM's CPU attention has no kernel for 16
    hc = dict(CONFIGS["qwen2"], num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    path = write_checkpoint(tmp_path_factory.mktemp("qwen2"), hc, random_weights(hc))
    return (path, *load(path))


def rollout(path, **sampling):
    from async_rl.rollout.vllm_backend import VLLMRollout

    return VLLMRollout(hf_path=str(path), slots=SLOTS, steps_per_call=K, max_prompt_len=P, max_new_tokens=N,
                       temperature=T, seed=0, stop_ids=(0,), dtype="float32", tie_embeddings=True,
                       gpu_memory_utilization=0.5, cpu_kv_cache_gib=1, n_tokens=NT, **sampling)


EVAL_SLOTS = 2  # room in the module's engine for a view beside its training slots


@pytest.fixture(scope="module")
def setup(checkpoint):
    path, mcfg, params, graphdef, _ = checkpoint
    r = rollout(path, top_k=0, top_p=1.0, spare_slots=EVAL_SLOTS)
    yield r, mcfg, params, graphdef
    r.close()


def prompts(n, seed=0):
    return [np.random.default_rng(seed + i).integers(1, 96, P).astype(np.int32) for i in range(n)]


def run(r, starts, swap_after=None, new=None):
    """Steps until every started sample ended; {slot: (tokens, logprobs, versions)}."""
    r.start(starts)
    out = {s.slot: ([], [], []) for s in starts}
    budget = {s.slot: s.budget for s in starts}
    calls = 0
    while any(out[s][0][-1:] != [0] and len(out[s][0]) < budget[s] for s in out):
        live = [s in out and out[s][0][-1:] != [0] and len(out[s][0]) < budget[s] for s in range(SLOTS)]
        c = r.collect(r.step(live))
        calls += 1
        for s in out:
            if not live[s]:
                continue
            for k in range(K):
                if out[s][0][-1:] == [0] or len(out[s][0]) == budget[s]:
                    break
                out[s][0].append(int(c.tokens_KxS[k, s]))
                out[s][1].append(float(c.logprobs_KxS[k, s]))
                out[s][2].append(int(c.versions_KxS[k, s]))
        if calls == swap_after:
            r.swap(*new)
    return out


def scaled_logits(graphdef, params, context, tokens):
    """logits / T over the tokenizer's ids where each of `tokens` was drawn (teacher forcing).
    The sequence is padded at the end to one width (a causal model's earlier logits ignore
    it), so every call shares one compiled program."""
    seq = np.concatenate([context, np.asarray(tokens, np.int32)])
    n = len(seq)
    seq = np.pad(seq, (0, max(0, P + N - n)))[None]
    logits = np.asarray(forward(graphdef)(params, seq, np.arange(seq.shape[1])[None].astype(np.int32),
                                          np.ones(seq.shape, bool)))[0].astype(np.float64)
    return logits[len(context) - 1:n - 1, :NT] / T


@functools.cache
def forward(graphdef):
    """The model's logits as one jitted function of (params, tokens, positions, valid) per graph."""
    import jax
    from flax import nnx
    return jax.jit(lambda params, *a: nnx.merge(graphdef, params)(*a))


def learner_logprobs(graphdef, params, context, tokens):
    """log softmax(logits / T) over the tokenizer's ids of each token given everything before it."""
    z = scaled_logits(graphdef, params, context, tokens)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    return z[np.arange(len(tokens)), tokens] - lse


def perturbed(params, seed=1):
    rng = np.random.default_rng(seed)
    import jax
    return jax.tree.map(lambda x: x + 0.05 * rng.normal(size=x.shape).astype(np.float32), params)


def test_behaviour_logprobs_match_the_learner(setup):
    r, _, params, graphdef = setup
    r.swap(params, 0)
    ps = prompts(2)
    out = run(r, [Start(slot, slot // 2, slot % 2, ps[slot // 2], (), N) for slot in range(SLOTS)])
    gap = max(np.abs(np.asarray(lp) - learner_logprobs(graphdef, params, ps[s // 2], t)).max()
              for s, (t, lp, _) in out.items())
    assert gap <= 1e-4, gap
    assert all(v == [0] * len(t) for t, _, v in out.values())
    assert max(max(t) for t, _, _ in out.values()) < NT


def test_a_sample_draws_the_same_tokens_in_any_slot_and_batch(setup):
    r, _, params, _ = setup
    r.swap(params, 0)
    ps = prompts(4, seed=40)
    alone = run(r, [Start(0, 40, 1, ps[0], (), N)])[0][0]
    batch = run(r, [Start(s, 40 + (s + 3) % 4, 1, ps[(s + 3) % 4], (), N) for s in range(SLOTS)])
    assert batch[1][0] == alone  # slot 1 holds ordinal 40 now, beside three others
    other = run(r, [Start(2, 40, 0, ps[0], (), N)])[2][0]
    assert other != alone or len(alone) == 1  # another sample of the group draws its own tokens


def test_weights_swap_in_place_and_versions_are_exact(setup):
    r, _, params, graphdef = setup
    r.swap(params, 0)
    new = perturbed(params)  # the embedding changes too: the tied head must follow
    ps = prompts(4, seed=10)
    out = run(r, [Start(s, 10 + s, 0, ps[s], (), N) for s in range(SLOTS)], swap_after=1, new=(new, 1))
    for t, _, v in out.values():
        assert v[:K] == [0] * min(K, len(t)) and v[K:] == [1] * (len(t) - K)
    fresh = run(r, [Start(0, 20, 0, ps[0], (), N)])[0]
    assert fresh[2] == [1] * len(fresh[0])
    gap = np.abs(np.asarray(fresh[1]) - learner_logprobs(graphdef, new, ps[0], fresh[0])).max()
    assert gap <= 1e-4, gap  # vLLM runs the new weights, not the checkpoint's


def test_a_saved_sample_continues_with_its_remaining_budget(setup):
    r, _, params, graphdef = setup
    r.swap(params, 0)
    p = prompts(1, seed=30)[0]
    saved = [int(t) for t in np.random.default_rng(3).integers(1, 96, 5)]
    t, lp, _ = run(r, [Start(1, 30, 0, p, tuple(saved), N - len(saved))])[1]
    assert 1 <= len(t) <= N - len(saved) and (len(t) == N - len(saved) or t[-1] == 0)
    gap = np.abs(np.asarray(lp) - learner_logprobs(graphdef, params, np.concatenate([p, saved]), t)).max()
    assert gap <= 1e-4, gap


def test_an_episode_turn_continues_after_an_observation(setup):
    """A multi-turn episode's next turn: the request's prompt is the prompt, the reply and the
    observation's tokens (not the policy's); only the turn's budget is sampled, each token with
    the logprob given that whole prefix and the version of the weights that made it."""
    r, _, params, graphdef = setup
    r.swap(params, 0)
    p = prompts(1, seed=50)[0]
    reply = run(r, [Start(0, 50, 0, p, (), 3)])[0][0]
    obs = [int(t) for t in np.random.default_rng(5).integers(1, NT, 4)]  # what the env said, tokenised
    new = perturbed(params, seed=2)
    r.swap(new, 1)  # published while the env step ran
    t, lp, v = run(r, [Start(2, 50, 0, p, (*reply, *obs), 3)])[2]
    assert 1 <= len(t) <= 3 and v == [1] * len(t)
    gap = np.abs(np.asarray(lp) - learner_logprobs(graphdef, new, np.concatenate([p, reply, obs]), t)).max()
    assert gap <= 1e-4, gap


def test_published_weights_reach_vllm_through_dlpack_without_a_copy(setup):
    """Every HF tensor is handed over; one already on vLLM's device in the HF layout is the same
    memory on both sides (on a GPU: the weights never leave it)."""
    import jax

    from async_rl.rollout.vllm_backend import torch_weights

    r, _, params, _ = setup
    here = jax.device_put(params, r.device)
    arrays = dict(hf.hf_arrays(here))
    tensors = dict(torch_weights(here, True, r.device))
    assert "model.embed_tokens.weight" in arrays and "model.layers.1.self_attn.q_proj.bias" in arrays
    assert set(tensors) == set(arrays) | {"lm_head.weight"}
    emb = arrays["model.embed_tokens.weight"]
    assert tensors["model.embed_tokens.weight"].data_ptr() == emb.unsafe_buffer_pointer()
    assert tensors["lm_head.weight"] is tensors["model.embed_tokens.weight"]  # the tied head
    for name, t in dict(torch_weights(params, True, r.device)).items():  # sharded: gathered
        np.testing.assert_array_equal(t.numpy(), np.asarray(arrays.get(name, emb)))


def test_an_eval_view_runs_beside_training_samples_on_the_same_engine(setup):
    """Greedy evaluation on a view of the engine while another thread generates training
    samples on it: each sees only its own requests' tokens, the view's are the learner's
    argmax, the training samples keep the learner's logprobs and the engine's version."""
    import threading

    from async_rl.rollout.decoding import generate_all

    r, _, params, graphdef = setup
    r.swap(params, 3)
    ev = r.view(EVAL_SLOTS, temperature=0.0)
    ps = prompts(SLOTS + 3, seed=60)
    train: dict = {}
    t = threading.Thread(target=lambda: train.update(run(r, [Start(s, 60 + s, 0, ps[s], (), N)
                                                             for s in range(SLOTS)])))
    t.start()
    comps = generate_all(ev, None, ps[SLOTS:], eos_id=0, ordinals=[1 << 30, 1 + (1 << 30), 2 + (1 << 30)],
                         max_new_tokens=N)  # three prompts through two slots: one refill
    t.join(timeout=120)
    assert not t.is_alive() and sorted(train) == list(range(SLOTS))
    for p, (c,) in zip(ps[SLOTS:], comps):
        assert 1 <= len(c.tokens) <= N
        assert list(scaled_logits(graphdef, params, p, c.tokens).argmax(-1)) == c.tokens.tolist()
    for s, (tk, lp, v) in train.items():
        assert v == [3] * len(tk)
        assert np.abs(np.asarray(lp) - learner_logprobs(graphdef, params, ps[s], tk)).max() <= 1e-4


RANK, ALPHA = 4, 8.0  # LoRA: vLLM pads rank 4 to its max_lora_rank 8


@pytest.fixture(scope="module")
def lora_setup(checkpoint):
    """A LoRA engine on the checkpoint (the base) and the learner's view of it: (rollout, graphdef
    with adapters, plain graphdef, base params, two sets of adapted params)."""
    import jax
    from flax import nnx

    from async_rl.model import lora
    from async_rl.model.transformer import Transformer

    path, mcfg, params, graphdef, _ = checkpoint
    spec = lora.LoraSpec(RANK, ALPHA, lora.PROJECTIONS)
    abstract = nnx.eval_shape(lambda: Transformer(mcfg, mcfg.vocab_size, rngs=nnx.Rngs(0), lora=spec))
    lgraph, aparams = nnx.split(abstract, nnx.Param)
    base = jax.tree.map(np.asarray, params)  # on the host: adapters join it uncommitted

    def adapted(seed):
        rng = np.random.default_rng(seed)
        ad = jax.tree.map(lambda a: (0.3 * rng.normal(size=a.shape)).astype(np.float32),
                          nnx.filter_state(aparams, nnx.LoRAParam))
        return nnx.merge_state(base, ad)

    r = rollout(path, top_k=0, top_p=1.0, enforce_eager=True, lora=spec)
    yield r, lgraph, graphdef, base, adapted(1), adapted(2)
    r.close()


def take(c, out, live):
    """Appends a chunk's tokens of the live slots to `out` ({slot: (tokens, logprobs, versions)})."""
    for s in out:
        for k in range(K):
            if not live[s] or out[s][0][-1:] == [0] or len(out[s][0]) == N:
                break
            out[s][0].append(int(c.tokens_KxS[k, s]))
            out[s][1].append(float(c.logprobs_KxS[k, s]))
            out[s][2].append(int(c.versions_KxS[k, s]))


def going(out, s):
    return s in out and out[s][0][-1:] != [0] and len(out[s][0]) < N


def test_lora_behaviour_logprobs_are_the_learners_with_its_adapters(lora_setup):
    """vLLM runs the checkpoint as the base and the published adapters beside it: the behaviour
    logprobs are the learner's with the adapters applied, not the base's."""
    r, lgraph, graphdef, base, ad1, _ = lora_setup
    r.swap(ad1, 1)
    ps = prompts(2, seed=80)
    out = run(r, [Start(slot, 80 + slot // 2, slot % 2, ps[slot // 2], (), N) for slot in range(SLOTS)])
    gap = max(np.abs(np.asarray(lp) - learner_logprobs(lgraph, ad1, ps[s // 2], t)).max() for s, (t, lp, _) in out.items())
    off = max(np.abs(np.asarray(lp) - learner_logprobs(graphdef, base, ps[s // 2], t)).max() for s, (t, lp, _) in out.items())
    assert gap <= 1e-4, gap
    assert off > 1e-2, off  # the adapters are really applied
    assert all(v == [1] * len(t) for t, _, v in out.values())


def test_a_lora_request_keeps_its_adapters_and_the_old_version_goes_with_its_last_request(lora_setup):
    """A request started under version 1 runs version 1's adapters to its end and its tokens say
    1, while one started after the swap to version 2 runs and says 2; version 1 stays loaded
    while its request lives and goes (from vLLM and its directory) when it ends; an aborted
    request frees its version too."""
    r, lgraph, _, _, ad1, ad2 = lora_setup
    r.swap(ad1, 1)
    path1 = r.s.adapters.newest.path
    ps = prompts(3, seed=90)
    r.start([Start(0, 90, 0, ps[0], (), N)])
    out = {0: ([], [], []), 1: ([], [], [])}
    live = [True, False, False, False]
    take(r.collect(r.step(live)), out, live)
    assert len(out[0][0]) == K and going(out, 0)  # in flight across the swap
    r.swap(ad2, 2)
    assert r.loaded_versions == [1, 2] and path1.is_dir()
    r.start([Start(1, 91, 0, ps[1], (), N)])
    while going(out, 0) or going(out, 1):
        live = [going(out, s) for s in range(SLOTS)]
        take(r.collect(r.step(live)), out, live)
        if not going(out, 0):
            assert r.loaded_versions == [2] and not path1.exists()  # its last request ended
    (t0, lp0, v0), (t1, lp1, v1) = out[0], out[1]
    assert v0 == [1] * len(t0) and v1 == [2] * len(t1) and len(t0) > K
    assert np.abs(np.asarray(lp0) - learner_logprobs(lgraph, ad1, ps[0], t0)).max() <= 1e-4
    assert np.abs(np.asarray(lp1) - learner_logprobs(lgraph, ad2, ps[1], t1)).max() <= 1e-4
    r.stop([0, 1])
    r.start([Start(2, 92, 0, ps[2], (), N)])
    r.collect(r.step([False, False, True, False]))
    r.swap(ad1, 3)
    assert r.loaded_versions == [2, 3]
    r.stop([2])  # aborted: version 2 has no request left
    assert r.loaded_versions == [3]


TOP_K, TOP_P = 5, 0.8


def test_behaviour_logprobs_with_top_k_and_top_p_are_the_learners(checkpoint):
    """Top-k and top-p restrict what is drawn; the behaviour logprobs stay the learner's (log
    softmax(logits / T) before truncation, as the built-in engine's `sample_token` returns),
    not vLLM's own renormalised over the kept tokens."""
    path, _, params, graphdef, _ = checkpoint
    r = rollout(path, top_k=TOP_K, top_p=TOP_P, enforce_eager=True)  # eager: no second compile warm-up
    try:
        ps = prompts(2, seed=50)
        out = run(r, [Start(slot, 50 + slot // 2, slot % 2, ps[slot // 2], (), N) for slot in range(SLOTS)])
    finally:
        r.close()
    gap, drawn = 0.0, 0
    for s, (t, lp, _) in out.items():
        gap = max(gap, np.abs(np.asarray(lp) - learner_logprobs(graphdef, params, ps[s // 2], t)).max())
        for z, tok in zip(scaled_logits(graphdef, params, ps[s // 2], t), t):
            order = np.argsort(-z)[:TOP_K]  # the top-k, most likely first
            assert tok in order
            probs = np.exp(z[order] - z[order].max())
            probs /= probs.sum()
            before = probs[:list(order).index(tok)].sum()  # nucleus: mass of the likelier kept tokens
            assert before < TOP_P + 1e-4, (before, TOP_P)
            drawn += 1
    assert gap <= 1e-4, gap
    assert drawn >= SLOTS


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_behaviour_logprobs_match_the_learner_for_qwen3_and_gemma3(tmp_path, checkpoint, arch):
    """vLLM's own Qwen3 / Gemma 3 (q/k norm; Gemma's 1 + w norms, post-branch norms, sliding
    window 4 < the 18 columns, its local RoPE base, query_pre_attn_scalar, logit soft cap)
    against the learner on the same tokens. checkpoint: skips without vLLM."""
    hc = dict(CONFIGS[arch], head_dim=32, max_position_embeddings=64)  # 32: vLLM's CPU attention kernels
    path = write_checkpoint(tmp_path / arch, hc, random_weights(hc))
    _, params, graphdef, _ = load(path)
    from async_rl.rollout.vllm_backend import VLLMRollout
    r = VLLMRollout(hf_path=str(path), slots=SLOTS, steps_per_call=K, max_prompt_len=P, max_new_tokens=N,
                    temperature=T, seed=0, stop_ids=(0,), dtype="float32", tie_embeddings=hc["tie_word_embeddings"],
                    gpu_memory_utilization=0.5, cpu_kv_cache_gib=1, n_tokens=NT, top_k=0, top_p=1.0,
                    enforce_eager=True, params=params)
    try:
        ps = prompts(2, seed=70)
        out = run(r, [Start(slot, 70 + slot // 2, slot % 2, ps[slot // 2], (), N) for slot in range(SLOTS)])
    finally:
        r.close()
    gap = max(np.abs(np.asarray(lp) - learner_logprobs(graphdef, params, ps[s // 2], t)).max()
              for s, (t, lp, _) in out.items())
    print(f"\n{arch}: max |vLLM - learner| behaviour logprob = {gap:.2e} over "
          f"{sum(len(t) for t, _, _ in out.values())} tokens")
    assert gap <= 1e-4, gap
    assert sum(len(t) for t, _, _ in out.values()) >= SLOTS * 2


def test_a_prompt_cached_before_a_swap_is_computed_again_with_the_new_weights(tmp_path):
    """Prefix caching is on: a sample that starts after a swap, with the prompt of a sample
    still running from before it (its blocks held, so the cache cannot be reset), is computed
    with the new weights (the stale-block class of vLLM #42125), while a second sample of the
    same version reads the prompt from the cache."""
    from async_rl.rollout.vllm_backend import VLLMRollout, available

    if (why := available()) is not None:
        pytest.skip(why)
    # a prompt of more than one of vLLM's CPU blocks (128 tokens): only whole blocks are cached
    hc = dict(CONFIGS["qwen2"], num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    path = write_checkpoint(tmp_path, hc, random_weights(hc))
    _, params, graphdef, _ = load(path)
    long_p = 140
    r = VLLMRollout(hf_path=str(path), slots=SLOTS, steps_per_call=K, max_prompt_len=long_p, max_new_tokens=N,
                    temperature=T, seed=0, stop_ids=(), dtype="float32", tie_embeddings=True,
                    gpu_memory_utilization=0.5, cpu_kv_cache_gib=1, n_tokens=NT, top_k=0, top_p=1.0)
    try:
        r.swap(params, 0)
        p = np.random.default_rng(7).integers(1, NT, long_p).astype(np.int32)
        r.start([Start(0, 1, 0, p, (), N)])
        c = r.collect(r.step([True, False, False, False]))  # prefilled, a chunk made: it keeps running
        assert (c.versions_KxS[:, 0] == 0).all()
        new = perturbed(params, seed=3)
        r.swap(new, 1)
        before = r.cached_tokens
        after = {}
        for slot, sample in ((1, 1), (2, 2)):  # one after the other: the second may read the first's blocks
            r.start([Start(slot, 1, sample, p, (), N)])
            live = [False] * SLOTS
            live[0] = live[slot] = True
            got = r.collect(r.step(live))
            after[slot] = (got.tokens_KxS[:, slot].tolist(), got.logprobs_KxS[:, slot])
            assert (got.versions_KxS[:, slot] == 1).all()
        for tokens, lps in after.values():  # the new weights' logprobs: no block computed under the old
            gap = np.abs(lps - learner_logprobs(graphdef, new, p, tokens)).max()
            assert gap <= 1e-4, gap
        stale = np.abs(after[1][1] - learner_logprobs(graphdef, params, p, after[1][0])).max()
        assert stale > 1e-3, stale  # the old weights would give other logprobs: the check can fail
        assert r.cached_tokens - before >= 128  # the second sample read a block the first computed
    finally:
        r.close()


def test_a_lora_run_on_vllm_sends_vllm_its_adapters(tmp_path, capsys, monkeypatch, checkpoint):
    """A short LoRA run with engine.backend=vllm: vLLM starts on the checkpoint (the learner's
    base) and each published version crosses as adapters; the last loaded is the final step's,
    equal to the saved adapters, the audit passes and no adapter folder is left behind."""
    from flax import nnx
    from test_vllm_crash import vllm_run_overrides

    from async_rl.model import lora
    from async_rl.rollout.vllm_backend import VLLMRollout
    from async_rl.run import cli
    from async_rl.state.audit import audit
    from async_rl.state.saved_run import open_run, read_lora

    loaded, folders = [], set()
    swap = VLLMRollout.swap

    def recording(self, params, version):
        swap(self, params, version)
        loaded.append((version, lora.host_tree(nnx.filter_state(params, nnx.LoRAParam))))
        folders.add(self.s.adapters.root)
    monkeypatch.setattr(VLLMRollout, "swap", recording)
    args = [*vllm_run_overrides(tmp_path), "learner.lora_rank=4", "learner.lora_alpha=8", "learner.lr=3e-3",
            "learner.warmup_steps=0"]
    rc = cli.main(["train", "--config", "configs/tiny.yaml", *args, f"run.dir={tmp_path / 'run'}",
                   "train.max_steps=3", "eval.every_steps=3", "log.progress=false", "log.tensorboard=false",
                   "log.plot=false"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    rep = audit(tmp_path / "run")
    assert rep["ok"], rep
    assert [v for v, _ in loaded][0] == 0 and loaded[-1][0] == 3
    _, saved, _ = read_lora(open_run(tmp_path / "run"), 3)
    final = lora.host_tree(saved)
    assert final.keys() == loaded[-1][1].keys() and np.abs(final["layers.attn.q.lora_b"]).max() > 0  # trained
    for k, v in final.items():
        np.testing.assert_allclose(loaded[-1][1][k], v, atol=1e-6, rtol=0)
    assert len(folders) == 1 and not folders.pop().exists()  # the backend's PEFT folder went at close


def test_a_run_on_vllm_evaluates_on_its_engine(tmp_path, capsys, checkpoint):  # checkpoint: skips without vLLM
    """A short run with engine.backend=vllm and held-out evaluation: the evaluator is a view of
    the run's vLLM engine (no built-in engine of its own); it scores steps 2 and 3. Last in the
    module: the run's vLLM engine, once collected, tears down vLLM's process-wide groups."""
    from test_vllm_crash import vllm_run_overrides

    from async_rl.obs.metrics import read_jsonl
    from async_rl.run import cli

    args = vllm_run_overrides(tmp_path)
    rc = cli.main(["train", "--config", "configs/tiny.yaml", *args, f"run.dir={tmp_path / 'run'}",
                   "train.max_steps=3", "eval.every_steps=2", "log.progress=false", "log.tensorboard=false",
                   "log.plot=false"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    assert "on the run's vLLM engine" in out.out + out.err
    evals = {m["step"]: m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "eval/accuracy" in m}
    assert sorted(evals) == [2, 3] and all(m["eval/completion_tokens"] >= 1 for m in evals.values())
    # `async-rl eval` starts a vLLM engine of its own (a process of its own: see above) and,
    # greedy, scores the saved step as the run did
    r = subprocess.run([sys.executable, "-m", "async_rl", "eval", str(tmp_path / "run"), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["step"] == 3
    assert {k: got[k] for k in evals[3] if k.startswith("eval/")} == {k: v for k, v in evals[3].items()
                                                                    if k.startswith("eval/")}

