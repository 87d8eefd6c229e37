"""Qwen3, Qwen3-MoE and Gemma 3 pieces: the sliding-window attention kernels against the plain masked
path (forward and gradients), the engine's logprobs against the learner's recomputation,
export round trips, a multimodal Gemma 3 checkpoint's text model, and the config fields'
refusals. Logits against a NumPy reference and against transformers are in test_hf.py."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from naive_decoder import naive_generate
from test_hf import CONFIGS, flat, load, random_weights, reference_logits, sample_inputs, write_checkpoint

from async_rl.config import ConfigError, ModelConfig
from async_rl.model import attention, hf
from async_rl.model.transformer import Transformer, layout
from async_rl.rollout.decoding import generate_all
from async_rl.rollout.engine import Engine

V, P, N, EOS = 40, 8, 8, 2
SMALL = dict(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, tie_embeddings=False)
FAMILIES = {
    "qwen3": ModelConfig(**SMALL, head_dim=12, qk_norm=True),
    # window 3 with 16 columns: local layers see far less than the row; layer 2 is global
    "gemma3": ModelConfig(**SMALL, head_dim=12, qk_norm=True, gemma=True, sliding_window=3, global_every=3,
                          rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=10.0,
                          final_logit_softcap=8.0),
    "qwen3_moe": ModelConfig(**SMALL, head_dim=12, qk_norm=True, n_experts=4, n_experts_per_token=2, d_ff_expert=16),
}


def _qkv(rs, B, T, H, G, D):
    return (jnp.asarray(rs.randn(B, T, h, D), jnp.float32) for h in (H, G, G))


def _value_and_grads(fn, q, k, v, w):
    return jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v) * w).sum(), argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("window", [200, 700])
def test_blockwise_window_matches_the_masked_path(window):
    """Rows wider than a block: windows inside one block and across one, left padding, the
    skipped key blocks (forward) and query blocks (backward) contribute nothing."""
    rs = np.random.RandomState(0)
    B, T, H, G, D = 2, 1100, 2, 1, 8
    q, k, v = _qkv(rs, B, T, H, G, D)
    valid = np.ones((B, T), bool)
    valid[0, :90] = False
    valid = jnp.asarray(valid)
    w = jnp.asarray(rs.randn(B, T, H * D), jnp.float32) * valid[:, :, None]
    ref = _value_and_grads(lambda q, k, v: attention.masked(q, k, v, attention.causal_mask(valid, window)), q, k, v, w)
    got = _value_and_grads(lambda q, k, v: attention._blockwise(q, k, v, valid, window), q, k, v, w)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-4)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    unwindowed = _value_and_grads(lambda q, k, v: attention._blockwise(q, k, v, valid), q, k, v, w)
    assert abs(float(unwindowed[0] - ref[0])) > 1e-2  # the window changes the answer


def test_causal_mask_window_is_hf_convention():
    m = np.asarray(attention.causal_mask(jnp.ones((1, 6), bool), window=3))[0]
    assert m[5].tolist() == [False, False, False, True, True, True]  # i - j < 3
    assert m[1].tolist() == [True, True, False, False, False, False]


def test_splash_window_matches_the_masked_path_in_interpret_mode():
    rs = np.random.RandomState(1)
    B, T, H, G, D = 1, 40, 2, 1, 16
    q, k, v = _qkv(rs, B, T, H, G, D)
    valid = np.ones((B, T), bool)
    valid[0, :5] = False
    valid = jnp.asarray(valid)
    ref = attention.masked(q, k, v, attention.causal_mask(valid, 7))
    out = attention._splash_local(q, k, v, valid, interpret=True, window=7)
    np.testing.assert_allclose(np.asarray(out)[np.asarray(valid)], np.asarray(ref)[np.asarray(valid)], atol=1e-4)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    cfg = FAMILIES[request.param]
    graphdef, params = nnx.split(Transformer(cfg, V, rngs=nnx.Rngs(0)))
    # scaled-up weights give peaked, varied outputs; Gemma's norms scale by 1 + w, so shift those
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.3 if cfg.gemma and "norm" in jax.tree_util.keystr(p) else x * 3.0, params)
    return cfg, graphdef, params


@functools.cache
def _forward(graphdef):
    """The learner's full-row forward pass, compiled once per model (not dispatched op by op
    for each of the test's rows)."""
    return jax.jit(lambda params, row, positions, valid: nnx.merge(graphdef, params)(row, positions, valid))


def _full_logprobs(graphdef, params, prompt, tokens):
    start, positions, valid = layout(len(prompt), P, P + N, n_filled=len(prompt) + len(tokens))
    row = np.zeros(P + N, np.int32)
    row[start:P] = prompt
    row[P:P + len(tokens)] = tokens
    logits = _forward(graphdef)(params, row[None], positions[None], valid[None])[0]
    logp = jax.nn.log_softmax(logits[P - 1:P - 1 + len(tokens)])
    return np.asarray(logp[np.arange(len(tokens)), tokens])


# CI: Gemma 3's window under the multi-step (recent-columns) decode, Qwen3 under single steps;
# the other two pairs in soak
@pytest.mark.parametrize("family, steps", [("gemma3", 4), ("qwen3", 1), ("qwen3_moe", 4),
                                           pytest.param("gemma3", 1, marks=pytest.mark.soak),
                                           pytest.param("qwen3", 4, marks=pytest.mark.soak)],
                         indirect=["family"], ids=["gemma3-4", "qwen3-1", "qwen3_moe-4", "gemma3-1", "qwen3-4"])
def test_engine_logprobs_equal_the_learners(family, steps):
    """Prefill, single-step and multi-step decode (the recent-columns block) under the
    sliding window give the full-row forward pass's logprobs; greedy equals naive decoding."""
    cfg, graphdef, params = family
    rs = np.random.RandomState(0)
    prompts = [rs.randint(4, V, rs.randint(1, P + 1)).astype(np.int32) for _ in range(5)]
    for temperature in (1.0, 0.0):
        eng = Engine(cfg, graphdef, vocab_size=V, slots=4, max_prompt_len=P, max_new_tokens=N,
                     temperature=temperature, top_k=0, top_p=1.0, seed=7, devices=jax.devices()[:1],
                     steps_per_call=steps, recent=steps > 1)
        out = generate_all(eng, eng.load_params(params), prompts, samples=2, eos_id=EOS)
        worst = max(float(np.abs(_full_logprobs(graphdef, params, p, c.tokens) - c.logprobs).max())
                    for p, row in zip(prompts, out) for c in row)
        assert worst <= 1e-4
        if temperature == 0.0:
            for i, p in enumerate(prompts):
                ref = naive_generate(graphdef, params, p, max_new_tokens=N, eos_id=EOS, temperature=0.0, top_k=0,
                                     top_p=1.0, seed=7, ordinal=i, sample=0, max_prompt_len=P)
                np.testing.assert_array_equal(out[i][0].tokens, ref.tokens)
    assert max(len(c.tokens) for row in out for c in row) > cfg.sliding_window + 2 or not cfg.sliding_window


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "qwen3_moe"])
def test_export_round_trip(tmp_path, arch):
    """save_hf writes the family's config.json and tensor names; it reads back to the same
    config and bit-identical params."""
    hc = CONFIGS[arch]
    w = random_weights(hc)
    mcfg, params, _, _ = load(write_checkpoint(tmp_path / "src", hc, w))
    out = hf.save_hf(params, mcfg, mcfg.vocab_size, tmp_path / "out", base_config=hc)
    doc = json.loads((out / "config.json").read_text())
    assert (doc["model_type"], doc["architectures"]) == (hc["model_type"], hc["architectures"])
    assert hf.model_config_from_hf(out, ModelConfig()) == mcfg
    import safetensors.numpy as stn
    written = stn.load_file(str(out / "model.safetensors"))
    assert written.keys() == w.keys() and all(np.array_equal(written[k], w[k]) for k in w)


def test_multimodal_gemma3_loads_its_text_model(tmp_path):
    """model_type gemma3: text_config's fields (Gemma3TextConfig's defaults for the absent
    ones), the text tensors under language_model.*, the vision tower ignored."""
    text = {k: v for k, v in CONFIGS["gemma3"].items() if k not in ("architectures", "model_type", "head_dim")}
    hc = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
          "vision_config": {"hidden_size": 8}, "image_token_index": 5}
    w = random_weights(CONFIGS["gemma3"])
    renamed = {("language_model." + k): v for k, v in w.items()}
    renamed["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((2, 2), np.float32)
    renamed["multi_modal_projector.mm_input_projection_weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ConfigError, match="shape"):  # head_dim defaults to 256, as in transformers
        load(write_checkpoint(tmp_path / "a", hc, renamed))
    hc["text_config"]["head_dim"] = CONFIGS["gemma3"]["head_dim"]
    mcfg, params, graphdef, _ = load(write_checkpoint(tmp_path / "b", hc, renamed))
    assert mcfg.gemma and mcfg.sliding_window == 4 and mcfg.global_every == 3
    tokens, positions = sample_inputs()
    ours = np.asarray(jax.jit(lambda *a: nnx.merge(graphdef, params)(*a))(tokens, positions.astype(np.int32),
                                                                          np.ones(tokens.shape, bool)))
    assert np.abs(ours - reference_logits(CONFIGS["gemma3"], w, tokens, positions)).max() < 1e-4
    out = hf.save_hf(params, mcfg, mcfg.vocab_size, tmp_path / "out", base_config=hc)  # written text-only
    doc = json.loads((out / "config.json").read_text())
    assert doc["model_type"] == "gemma3_text" and "vision_config" not in doc and "text_config" not in doc
    assert hf.model_config_from_hf(out, ModelConfig()) == mcfg
    assert flat(load(out)[1]).keys() == flat(params).keys()


@pytest.mark.parametrize("change, match", [
    ({"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}, "layer_types is not every"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
])
def test_unsupported_gemma3_configs_are_refused(tmp_path, change, match):
    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIGS["gemma3"], **change)))
    with pytest.raises(ConfigError, match=match):
        hf.model_config_from_hf(tmp_path, ModelConfig())


def test_qwen3_attention_bias_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIGS["qwen3"], attention_bias=True)))
    with pytest.raises(ConfigError, match="attention_bias=True is not supported by async_rl's qwen3"):
        hf.model_config_from_hf(tmp_path, ModelConfig())


@pytest.mark.parametrize("fields, match", [
    (dict(qkv_bias=True, qk_norm=True), "model.qk_norm=True: cannot be combined with model.qkv_bias"),
    (dict(gemma=True), "model.qk_norm=False: must be true with model.gemma"),
    (dict(sliding_window=4, global_every=6), "model.sliding_window=4: needs model.gemma=true"),
    (dict(gemma=True, qk_norm=True, sliding_window=4), "model.global_every=0: must be set together"),
    (dict(gemma=True, qk_norm=True, rope_local_theta=1e4), "model.rope_local_theta=10000.0: needs model.sliding"),
    (dict(gemma=True, qk_norm=True, final_logit_softcap=-1.0), "model.final_logit_softcap=-1.0: must be >= 0"),
    (dict(query_pre_attn_scalar=256.0), "model.query_pre_attn_scalar=256.0: needs model.gemma"),
    (dict(qk_norm=True, n_experts=4, n_experts_per_token=5, d_ff_expert=8),
     r"model.n_experts_per_token=5: must be in \[1, model.n_experts \(4\)\]"),
    (dict(qk_norm=True, n_experts=4, n_experts_per_token=2), "model.d_ff_expert=0: must be > 0 with model.n_experts"),
    (dict(n_experts=4, n_experts_per_token=2, d_ff_expert=8), "model.n_experts=4: needs the Qwen3 block"),
    (dict(n_experts_per_token=2), "model.n_experts_per_token=2: needs model.n_experts > 0"),
])
def test_model_config_refuses_combinations_no_family_has(fields, match):
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig(**SMALL, **fields)
    assert "\n" not in str(e.value)


def test_local_layers_follow_hf_layer_types():
    cfg = dataclasses.replace(FAMILIES["gemma3"], n_layers=13, global_every=6)
    assert [i for i, local in enumerate(cfg.local_layers()) if not local] == [5, 11]
    assert FAMILIES["qwen3"].local_layers() == (False,) * 3
