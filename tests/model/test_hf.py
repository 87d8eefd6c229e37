"""HF checkpoints: tiny random Llama/Qwen2/Qwen3/Gemma 3 files load into sharded params whose logits match
an independent NumPy forward pass; save -> load is bit-identical; errors name what is wrong.
Tests marked `parity` compare against transformers itself (`make parity`)."""

import dataclasses
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn
from flax import nnx
from jax.sharding import Mesh

from async_rl import config as C
from async_rl.config import ConfigError, ModelConfig
from async_rl.model import hf, sharding
from async_rl.model.transformer import Transformer

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            hidden_act="silu", max_position_embeddings=256, torch_dtype="float32")
CONFIGS = {
    # GQA, untied head, llama3 rope scaling whose three frequency bands all occur at head_dim 16
    "llama3": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=2, head_dim=16,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                   rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_linear": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=4,
                         rope_theta=500.0, tie_word_embeddings=True, rope_scaling={"type": "linear", "factor": 2.0}),
    # MQA, qkv bias, tied embeddings, large theta
    "qwen2": dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_key_value_heads=1,
                  rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False),
    # q/k norm, a head width (32) not d_model / heads (16), untied head
    "qwen3": dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_key_value_heads=2, head_dim=32,
                  rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, attention_bias=False,
                  use_sliding_window=False),
    # Qwen3-MoE: 4 experts top-2 renormalised, untied; 8 experts top-3 as they come, tied
    "qwen3_moe": dict(BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_key_value_heads=2,
                      head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                      attention_bias=False, use_sliding_window=False, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      router_aux_loss_coef=0.001),
    "qwen3_moe_tied": dict(BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                           num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                           attention_bias=False, use_sliding_window=False, num_experts=8, num_experts_per_tok=3,
                           moe_intermediate_size=16, norm_topk_prob=False, decoder_sparse_step=1,
                           mlp_only_layers=[], router_aux_loss_coef=0.01),
    # Gemma 3 text: 1 + w norms, post-branch norms, GeGLU, scaled embeddings, q/k norm, two
    # sliding-window layers (window 4 < the 12 test columns) with their own RoPE base, then a
    # global one with linear scaling; query_pre_attn_scalar != head_dim; a final soft cap.
    "gemma3": dict({k: v for k, v in BASE.items() if k != "hidden_act"}, architectures=["Gemma3ForCausalLM"],
                   model_type="gemma3_text", num_hidden_layers=3, num_key_value_heads=2, head_dim=24,
                   hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_theta=1e6,
                   rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0},
                   sliding_window=4, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   query_pre_attn_scalar=20, final_logit_softcapping=30.0, attn_logit_softcapping=None,
                   tie_word_embeddings=True, attention_bias=False),
}
parity = pytest.mark.skipif(not os.environ.get("ASYNC_RL_PARITY"), reason="run by `make parity`")


def random_weights(hc: dict, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """HF-named tensors in HF layout ([out, in] for Linear weights)."""
    rng = np.random.default_rng(seed)
    d, f, V = hc["hidden_size"], hc["intermediate_size"], hc["vocab_size"]
    H, G = hc["num_attention_heads"], hc["num_key_value_heads"]
    hd = hc.get("head_dim") or d // H
    gemma = hc["model_type"].startswith("gemma")
    one = 0.0 if gemma else 1.0  # Gemma's norms scale by 1 + w
    emb = 0.4 / np.sqrt(d) if gemma else 0.4  # Gemma multiplies embeddings by sqrt(d)
    w = {"model.embed_tokens.weight": rng.normal(0, emb, (V, d)), "model.norm.weight": one + 0.1 * rng.normal(size=d)}
    if not hc["tie_word_embeddings"]:
        w["lm_head.weight"] = rng.normal(0, 0.2, (V, d))
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if gemma else []
    for i in range(hc["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n in norms:
            w[p + f"{n}.weight"] = one + 0.1 * rng.normal(size=d)
        if hc["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text"):
            for n in "qk":
                w[p + f"self_attn.{n}_norm.weight"] = one + 0.1 * rng.normal(size=hd)
        for n, rows in (("q", H * hd), ("k", G * hd), ("v", G * hd)):
            w[p + f"self_attn.{n}_proj.weight"] = rng.normal(0, 0.25, (rows, d))
            if hc["model_type"] == "qwen2":
                w[p + f"self_attn.{n}_proj.bias"] = rng.normal(0, 0.5, rows)
        w[p + "self_attn.o_proj.weight"] = rng.normal(0, 0.2, (d, H * hd))
        if hc["model_type"] == "qwen3_moe":
            fe = hc["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = rng.normal(0, 0.5, (hc["num_experts"], d))
            for e in range(hc["num_experts"]):
                w[p + f"mlp.experts.{e}.gate_proj.weight"] = rng.normal(0, 0.2, (fe, d))
                w[p + f"mlp.experts.{e}.up_proj.weight"] = rng.normal(0, 0.2, (fe, d))
                w[p + f"mlp.experts.{e}.down_proj.weight"] = rng.normal(0, 0.2, (d, fe))
            continue
        w[p + "mlp.gate_proj.weight"] = rng.normal(0, 0.2, (f, d))
        w[p + "mlp.up_proj.weight"] = rng.normal(0, 0.2, (f, d))
        w[p + "mlp.down_proj.weight"] = rng.normal(0, 0.15, (d, f))
    return {k: v.astype(dtype) for k, v in w.items()}


def write_checkpoint(path, hc: dict, weights: dict, shards: int = 1):
    """safetensors' own writer (not ours), optionally split over files with an index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hc))
    names = sorted(weights)
    if shards == 1:
        stn.save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    wmap = {}
    for i, part in enumerate(np.array_split(np.array(names), shards)):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        stn.save_file({n: weights[n] for n in part}, str(path / fname), metadata={"format": "pt"})
        wmap.update({n: fname for n in part})
    (path / hf.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return path


def reference_logits(hc: dict, w: dict, tokens, positions) -> np.ndarray:
    """Llama/Qwen2/Qwen3/Gemma 3 forward pass in float64, written from the published architectures."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    B, T = tokens.shape
    d, H, G = hc["hidden_size"], hc["num_attention_heads"], hc["num_key_value_heads"]
    hd, eps = hc.get("head_dim") or d // H, hc.get("rms_norm_eps", 1e-6)
    gemma, qk_norm = hc["model_type"] == "gemma3_text", hc["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text")
    local_layers = [t == "sliding_attention" for t in hc.get("layer_types", [])] or [False] * hc["num_hidden_layers"]
    inv = 1.0 / hc["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    sc = hc.get("rope_scaling") or {}
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "llama3":
        wl, old = 2 * np.pi / inv, sc["original_max_position_embeddings"]
        lo, hi = sc["low_freq_factor"], sc["high_freq_factor"]
        mix = (old / wl - lo) / (hi - lo)
        inv = np.where(wl < old / hi, inv, np.where(wl > old / lo, inv / sc["factor"],
                                                    (1 - mix) * inv / sc["factor"] + mix * inv))
    local_inv = 1.0 / hc.get("rope_local_base_freq", 1.0) ** (np.arange(0, hd, 2) / hd)  # unscaled

    def rotate(x, inv):  # pair i with i + hd/2 and turn it by the position's angle
        ang = positions[..., None] * inv
        cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
        a, b = x[..., :hd // 2], x[..., hd // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * ((1 + g) if gemma else g)

    def act(g):  # gelu (tanh approximation) for Gemma, else silu
        if gemma:
            return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
        return g / (1 + np.exp(-g))

    x = w["model.embed_tokens.weight"][tokens] * (np.sqrt(d) if gemma else 1.0)
    qi, ki = np.arange(T)[:, None], np.arange(T)[None]
    scale = hc["query_pre_attn_scalar"] ** -0.5 if gemma else hd ** -0.5
    for i in range(hc["num_hidden_layers"]):
        p = f"model.layers.{i}."
        local = local_layers[i]
        visible = (ki <= qi) & ((qi - ki < hc["sliding_window"]) if local else True)
        h = norm(x, w[p + "input_layernorm.weight"])
        proj = {n: h @ w[p + f"self_attn.{n}_proj.weight"].T + w.get(p + f"self_attn.{n}_proj.bias", 0.0)
                for n in "qkv"}
        q, k = proj["q"].reshape(B, T, H, hd), proj["k"].reshape(B, T, G, hd)
        if qk_norm:
            q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
        q, k = rotate(q, local_inv if local else inv), rotate(k, local_inv if local else inv)
        k = np.repeat(k, H // G, axis=2)
        v = np.repeat(proj["v"].reshape(B, T, G, hd), H // G, axis=2)
        s = np.where(visible, np.einsum("bqhd,bkhd->bhqk", q, k) * scale, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, T, H * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = x + (norm(o, w[p + "post_attention_layernorm.weight"]) if gemma else o)
        h = norm(x, w[p + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm") + ".weight"])
        if hc["model_type"] == "qwen3_moe":
            m = moe_reference(hc, w, p, h, act)
        else:
            g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            m = (act(g) * u) @ w[p + "mlp.down_proj.weight"].T
        x = x + (norm(m, w[p + "post_feedforward_layernorm.weight"]) if gemma else m)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    logits = norm(x, w["model.norm.weight"]) @ head.T
    if cap := hc.get("final_logit_softcapping"):
        logits = cap * np.tanh(logits / cap)
    return logits


def moe_reference(hc: dict, w: dict, p: str, h, act):
    """Qwen3-MoE's sparse block: softmax router, top-k (renormalised with norm_topk_prob), the
    chosen experts' SwiGLU outputs summed with those weights; every expert run on every token."""
    r = h @ w[p + "mlp.gate.weight"].T
    probs = np.exp(r - r.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[..., :hc["num_experts_per_tok"]]
    tw = np.take_along_axis(probs, top, -1)
    if hc["norm_topk_prob"]:
        tw /= tw.sum(-1, keepdims=True)
    m = np.zeros_like(h)
    for e in range(hc["num_experts"]):
        q = p + f"mlp.experts.{e}."
        out = (act(h @ w[q + "gate_proj.weight"].T) * (h @ w[q + "up_proj.weight"].T)) @ w[q + "down_proj.weight"].T
        m += ((top == e) * tw).sum(-1, keepdims=True) * out
    return m


def mesh_2x2() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(1, 2, 1, 2), sharding.AXES)


def load(path, mesh=None, param_dtype="float32"):
    """(model cfg, sharded params, graphdef) the way the learner builds them."""
    mcfg = hf.model_config_from_hf(path, ModelConfig(param_dtype=param_dtype))
    abstract = nnx.eval_shape(lambda: Transformer(mcfg, mcfg.vocab_size, rngs=nnx.Rngs(0)))
    graphdef, aparams = nnx.split(abstract, nnx.Param)
    shardings = sharding.param_shardings(aparams, mesh or mesh_2x2())
    return mcfg, hf.load_params(path, aparams, shardings), graphdef, shardings


def our_logits(graphdef, params, tokens, positions) -> np.ndarray:
    valid = np.ones(tokens.shape, bool)  # the weights an argument: closed over, they would be constants
    return np.asarray(jax.jit(lambda p, *a: nnx.merge(graphdef, p)(*a))(params, tokens, positions.astype(np.int32),
                                                                        valid))


def sample_inputs(V=96, B=2, T=12, offset=37):
    tokens = np.random.default_rng(1).integers(0, V, (B, T)).astype(np.int32)
    positions = np.broadcast_to(np.arange(T) + offset, (B, T))  # past the llama3 original context
    return tokens, positions


def flat(params) -> dict[str, np.ndarray]:
    named, _ = hf._flat(params)
    return {k: np.asarray(v.get_value()) for k, v in named}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_logits_match_numpy_reference(tmp_path, arch):
    hc = CONFIGS[arch]
    w = random_weights(hc)
    path = write_checkpoint(tmp_path / arch, hc, w)
    mcfg, params, graphdef, shardings = load(path)
    assert mcfg.qkv_bias == (arch == "qwen2") and mcfg.tie_embeddings == hc["tie_word_embeddings"]
    # every tensor sits in its target sharding (q.kernel is split over fsdp x tensor)
    for (name, p), (_, s) in zip(hf._flat(params)[0], hf._flat(shardings)[0]):
        assert p.get_value().sharding == s.get_value(), name
    q = params["layers"]["attn"]["q"]["kernel"].get_value()
    assert len({str(sh.index) for sh in q.addressable_shards}) == 4
    tokens, positions = sample_inputs()
    ours = our_logits(graphdef, params, tokens, positions)
    ref = reference_logits(hc, w, tokens, positions)
    err = np.abs(ours - ref).max()
    print(f"{arch}: max |logit diff| vs NumPy float64 = {err:.2e} (logit scale {np.abs(ref).max():.1f})")
    assert err < 1e-4


def test_save_load_round_trip_sharded_files(tmp_path):
    hc = CONFIGS["llama3"]
    w = random_weights(hc)
    mcfg, params, graphdef, _ = load(write_checkpoint(tmp_path / "src", hc, w, shards=3))
    out = hf.save_hf(params, mcfg, mcfg.vocab_size, tmp_path / "out", max_shard_bytes=60_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / hf.INDEX).read_text())
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    # safetensors' own reader sees the HF names, layout and values
    written = {k: v for f in files for k, v in stn.load_file(str(out / f)).items()}
    assert written.keys() == w.keys()
    assert all(np.array_equal(written[k], w[k]) for k in w)
    assert hf.model_config_from_hf(out, ModelConfig()) == mcfg
    # back in, on another mesh layout: bit-identical
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(4, 1, 1, 1), sharding.AXES)
    _, again, _, _ = load(out, mesh)
    a, b = flat(params), flat(again)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # re-exporting into the same directory as one file replaces the shards
    hf.save_hf(params, mcfg, mcfg.vocab_size, out)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"] and not (out / hf.INDEX).exists()


def test_gemma3_config_round_trips_with_the_field_types_transformers_validates(tmp_path):
    hc = CONFIGS["gemma3"]
    (tmp_path / "config.json").write_text(json.dumps(hc))
    mcfg = hf.model_config_from_hf(tmp_path, ModelConfig())
    doc = hf.hf_config(mcfg, mcfg.vocab_size, "float32")
    # Gemma3TextConfig refuses a float here ("expected int, got float")
    assert type(doc["query_pre_attn_scalar"]) is int and doc["query_pre_attn_scalar"] == 20
    assert doc["layer_types"] == hc["layer_types"] and doc["sliding_window"] == 4
    odd = dataclasses.replace(mcfg, query_pre_attn_scalar=20.5)
    assert hf.hf_config(odd, mcfg.vocab_size, "float32")["query_pre_attn_scalar"] == 20.5


def test_bf16_checkpoint_casts_exactly(tmp_path):
    hc = CONFIGS["qwen2"]
    w = random_weights(hc, dtype=ml_dtypes.bfloat16)
    path = write_checkpoint(tmp_path, hc, w)
    for dt in ("float32", "bfloat16"):
        _, params, _, _ = load(path, param_dtype=dt)
        got = flat(params)["embed.embedding"]
        assert got.dtype == np.dtype(dt if dt == "float32" else ml_dtypes.bfloat16)
        assert np.array_equal(got.astype(np.float32), w["model.embed_tokens.weight"].astype(np.float32))


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    hc = CONFIGS["llama3"]
    w = random_weights(hc)
    missing = dict(w)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(hf.HFError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' \(for parameter "
                                         r"layers\.mlp\.up\.kernel\[1\]\) is missing"):
        load(write_checkpoint(tmp_path / "a", hc, missing))
    bad = dict(w, **{"model.layers.0.self_attn.k_proj.weight": np.zeros((16, 64), np.float32)})
    with pytest.raises(hf.HFError, match=r"k_proj\.weight.*model\.safetensors: shape \[16, 64\], expected \[32, 64\]"):
        load(write_checkpoint(tmp_path / "b", hc, bad))
    extra = dict(w, **{"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)})
    with pytest.raises(hf.HFError, match=r"o_proj\.bias"):
        load(write_checkpoint(tmp_path / "c", hc, extra))
    path = write_checkpoint(tmp_path / "d", hc, w, shards=2)
    index = json.loads((path / hf.INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    (path / hf.INDEX).write_text(json.dumps(index))
    with pytest.raises(hf.HFError, match=r"model-00001-of-00002\.safetensors: has no tensor 'model\.norm\.weight'"):
        load(path)


def test_check_params_refuses_from_the_headers_what_load_params_would(tmp_path):
    """What train checks before it writes anything: the headers alone (a file's data is never read)."""
    hc = CONFIGS["qwen2"]
    w = random_weights(hc)
    path = write_checkpoint(tmp_path / "ok", hc, w)
    mcfg = hf.model_config_from_hf(path, ModelConfig())
    _, aparams = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, mcfg.vocab_size, rngs=nnx.Rngs(0))), nnx.Param)
    data = path / "model.safetensors"
    n = int.from_bytes(data.read_bytes()[:8], "little")
    data.write_bytes(data.read_bytes()[:8 + n] + b"\xff" * (data.stat().st_size - 8 - n))  # data bytes: garbage
    hf.check_params(path, aparams)
    bad = write_checkpoint(tmp_path / "bad", hc, dict(w, **{"model.norm.weight": np.zeros(3, np.float32)}))
    with pytest.raises(hf.HFError, match=r"'model\.norm\.weight' in .*: shape \[3\], expected \[64\]"):
        hf.check_params(bad, aparams)
    extra = write_checkpoint(tmp_path / "extra", hc, dict(w, **{"model.layers.0.mlp.up_proj.bias": np.zeros(128)}))
    with pytest.raises(hf.HFError, match=r"1 tensors match no parameter"):
        hf.check_params(extra, aparams)
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(hf.HFError, match=r"no \*\.safetensors files .*pytorch_model\.bin are PyTorch pickles"):
        hf.check_params(tmp_path / "torch", aparams)


@pytest.mark.parametrize("change, match", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type='gpt2' is not supported"),
    ({"architectures": ["MistralForCausalLM"]}, r"architectures=\['MistralForCausalLM'\] is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn' is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"rms_norm_eps": float("nan")}, "model.norm_eps=nan is not a finite number"),
    ({"rope_theta": float("inf")}, "model.rope_theta=inf is not a finite number"),
])
def test_unsupported_configs_are_config_errors(tmp_path, change, match):
    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIGS["llama3"], **change)))
    with pytest.raises(ConfigError, match=match):
        hf.model_config_from_hf(tmp_path, ModelConfig())


def test_resolve_takes_model_fields_and_tokenizer(tmp_path):
    write_checkpoint(tmp_path, CONFIGS["llama3"], random_weights(CONFIGS["llama3"]))
    base = C.load("configs/tiny.yaml", [f"model.hf_path={tmp_path}", "model.param_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        hf.resolve(base)
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = hf.resolve(base)
    m = cfg.model
    assert (m.d_model, m.n_kv_heads, m.head_dim, m.vocab_size, m.learned_positions) == (64, 2, 16, 96, 0)
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_positions) == ("llama3", 4.0, 64)
    assert m.param_dtype == "bfloat16" and cfg.tokenizer.path == str(tmp_path)
    assert hf.resolve(cfg) == cfg and hf.resolve(C.load("configs/tiny.yaml")) == C.load("configs/tiny.yaml")
    # v5-style rope_parameters
    hc = {k: v for k, v in CONFIGS["llama3"].items() if k not in ("rope_theta", "rope_scaling")}
    hc["rope_parameters"] = dict(CONFIGS["llama3"]["rope_scaling"], rope_theta=123.0)
    (tmp_path / "config.json").write_text(json.dumps(hc))
    want = dataclasses.replace(m, rope_theta=123.0, param_dtype="float32", hf_path="")
    assert hf.model_config_from_hf(tmp_path, ModelConfig()) == want


def test_learner_init_params_loads_the_checkpoint(tmp_path):
    from async_rl.learner.step import Learner
    w = random_weights(CONFIGS["qwen2"])
    write_checkpoint(tmp_path, CONFIGS["qwen2"], w)
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = hf.resolve(C.load("configs/tiny.yaml", [f"model.hf_path={tmp_path}", "mesh.tensor=2"]))
    learner = Learner(cfg, cfg.model.vocab_size, sharding.make_devices(cfg.mesh).learner)
    params = learner.init_params()
    assert jax.tree.structure(params) == jax.tree.structure(learner.abstract_params)
    got = flat(params)
    assert np.array_equal(got["layers.attn.q.bias"][0], w["model.layers.0.self_attn.q_proj.bias"])
    assert np.array_equal(got["layers.mlp.down.kernel"][1], w["model.layers.1.mlp.down_proj.weight"].T)


# --- parity with transformers (make parity) ----------------------------------------------

@parity
@pytest.mark.parity
@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("writer", ["safetensors", "save_hf"])
def test_logits_match_transformers(tmp_path, arch, writer):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hc = CONFIGS[arch]
    w = random_weights(hc)
    mcfg, params, graphdef, _ = load(write_checkpoint(tmp_path / "src", hc, w))
    # "save_hf": transformers reads the directory our exporter writes
    path = tmp_path / "src" if writer == "safetensors" else hf.save_hf(params, mcfg, mcfg.vocab_size, tmp_path / "out")
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "gemma3_text": transformers.Gemma3ForCausalLM}[hc["model_type"]]
    model = cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    tokens, positions = sample_inputs()
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(tokens).long(),
                       position_ids=torch.from_numpy(np.ascontiguousarray(positions)).long()).logits.numpy()
    ours = our_logits(graphdef, params, tokens, positions)
    ref = reference_logits(hc, w, tokens, positions)
    print(f"\nPARITY {arch:<13} {writer:<12} transformers {transformers.__version__}: max |ours - HF| = "
          f"{np.abs(ours - theirs).max():.2e}, max |NumPy ref - HF| = {np.abs(ref - theirs).max():.2e}")
    assert np.abs(ours - theirs).max() < 1e-4


# config.json of the published checkpoints (no weights needed): the parameter count must match
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643,
              "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
              "max_position_embeddings": 32768, "max_window_layers": 21, "num_attention_heads": 14,
              "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
              "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "use_sliding_window": False, "vocab_size": 151936}
LLAMA32_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
              "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
              "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
              "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256}


@pytest.mark.parametrize("hc, n_params", [(QWEN25_05B, 494_032_768), (LLAMA32_1B, 1_235_814_400)])
def test_published_configs_and_the_preset(tmp_path, hc, n_params):
    (tmp_path / "config.json").write_text(json.dumps(hc))
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = hf.resolve(C.load("configs/qwen2.5-0.5b.yaml", [f"model.hf_path={tmp_path}"]))
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, cfg.model.vocab_size, rngs=nnx.Rngs(0)))
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(abstract, nnx.Param))) == n_params
    assert cfg.tokenizer.path == str(tmp_path) and cfg.model.dtype == "bfloat16"
