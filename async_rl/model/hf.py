"""Hugging Face-format causal LMs in and out: config.json + safetensors <-> our NNX params.

Owns: HF `config.json` -> `ModelConfig` fields (Llama, Qwen2, Qwen3 and Gemma 3 text
families: GQA, qkv bias, q/k norm, Gemma's block and sliding-window layers, tied or
untied embeddings, rope theta, linear/llama3 rope scaling), `resolve(cfg)`, the
name and layout mapping between HF tensors and our parameter paths, loading a checkpoint
(one file, several, or with `model.safetensors.index.json`) straight into target
shardings, and writing params back as an HF directory. Does not own: the network
(`model`), where params live (`sharding`, `learner`), run directories and tokenizer files
(`export`).

Each device's slice of each tensor is read with positioned reads (`os.preadv`) into a
buffer of that slice's size and placed by `jax.make_array_from_callback`. Nothing is
memory-mapped: mapped pages count toward resident memory until unmapped, page-cache reads
do not. So the host holds one tensor slice (plus a bounded read chunk) at a time. HF
Linear weights are [out, in], ours [in, out]: those are transposed on the way. Our block
parameters are stacked [n_layers, ...]: HF's per-layer tensors are written into the
stacked array one layer at a time on the devices, and read back out one layer at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from async_rl.config import Config, ConfigError, ModelConfig
from async_rl.model.sharding import is_var as _is_var


class HFError(ConfigError):
    """An HF checkpoint that cannot be used as given; names the file and tensor."""


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "gemma3": "Gemma3ForConditionalGeneration"}
# Gemma3TextConfig's defaults: a multimodal gemma3 config.json's text_config often omits them.
_GEMMA3_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                        rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=256, sliding_window=4096,
                        sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
INDEX = "model.safetensors.index.json"
_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
           "BF16": np.dtype(ml_dtypes.bfloat16)}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_CHUNK_BYTES = 32 << 20  # read granularity when a tensor must be transposed, cast or column-sliced
DEFAULT_SHARD_BYTES = 4 << 30

# --- config.json -----------------------------------------------------------------------


def read_config(path: str | Path) -> dict:
    cj = Path(path).expanduser() / "config.json"
    if not cj.is_file():
        where = f"no config.json in {cj.parent}" if cj.parent.is_dir() else "no such directory"
        raise HFError(f"model.hf_path={str(path)!r}: {where}")
    try:
        if not isinstance(doc := json.loads(cj.read_bytes()), dict):
            raise ValueError("expected a JSON object")
    except (OSError, ValueError) as e:
        raise HFError(f"{cj}: not a valid config ({e})") from None
    return doc


def _rope_fields(hc: dict, where: Path) -> dict:
    # transformers 4.x writes rope_theta + rope_scaling; 5.x writes rope_parameters (Gemma 3:
    # one entry per layer type, of which the global layers' is the scaled one).
    params = hc.get("rope_parameters") or {}
    params = params.get("full_attention", params) if isinstance(params, dict) else params
    scaling = hc.get("rope_scaling") or params
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise HFError(f"{where}: {name} is {value!r}, expected an object such as "
                          '{"rope_type": "linear", "factor": 2.0}')
    theta = hc.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out = dict(rope_theta=float(theta), rope_scaling="none", rope_factor=1.0, rope_low_freq_factor=1.0,
               rope_high_freq_factor=4.0, rope_original_max_positions=8192)
    if kind == "default":
        return out
    if kind not in ("linear", "llama3"):
        raise HFError(f"{where}: rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")
    try:
        out.update(rope_scaling=kind, rope_factor=float(scaling["factor"]))
        if kind == "llama3":
            out.update(rope_low_freq_factor=float(scaling["low_freq_factor"]),
                       rope_high_freq_factor=float(scaling["high_freq_factor"]),
                       rope_original_max_positions=int(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise HFError(f"{where}: rope scaling {kind!r} lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise HFError(f"{where}: rope scaling {kind!r} has a field that is not a number ({e})") from None
    return out


def _gemma3_text(hc: dict, where: Path) -> dict:
    """The text model's config: Gemma3TextConfig's defaults under the file's own fields (a
    multimodal gemma3 file nests them in text_config)."""
    text = hc.get("text_config") if hc.get("model_type") == "gemma3" else hc
    if not isinstance(text, dict):
        raise HFError(f"{where}: model_type 'gemma3' without a text_config object")
    return {**_GEMMA3_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}


def _global_every(hc: dict, where: Path) -> int:
    """Gemma 3's period of global layers, from layer_types (newer files) or sliding_window_pattern."""
    types, n = hc.get("layer_types"), int(hc["num_hidden_layers"])
    if not types:
        return int(hc["sliding_window_pattern"])
    every = next((i + 1 for i, t in enumerate(types) if t == "full_attention"), n + 1)
    want = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if list(types) != want:
        raise HFError(f"{where}: layer_types is not every n-th layer global, which is all async_rl models")
    return every


def _unsupported(hc: dict, mt: str) -> dict:
    """Variants our network does not compute: refused rather than loaded to silently differ."""
    gemma = mt.startswith("gemma3")
    act_key = "hidden_activation" if gemma else "hidden_act"
    return {act_key: hc.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
            != ("gelu_pytorch_tanh" if gemma else "silu"),
            "attention_bias": mt != "qwen2" and bool(hc.get("attention_bias")),
            "mlp_bias": bool(hc.get("mlp_bias")),
            "use_sliding_window": bool(hc.get("use_sliding_window")),
            "attn_logit_softcapping": hc.get("attn_logit_softcapping") is not None,
            "use_bidirectional_attention": bool(hc.get("use_bidirectional_attention"))}


def _moe_fields(hc: dict, mt: str, where: Path) -> dict:
    """Qwen3-MoE's expert fields; every block must be an MoE one (no dense blocks between)."""
    if mt != "qwen3_moe":
        return dict(n_experts=0, n_experts_per_token=0, d_ff_expert=0)
    if int(hc.get("decoder_sparse_step", 1)) != 1 or hc.get("mlp_only_layers"):
        key = "mlp_only_layers" if hc.get("mlp_only_layers") else "decoder_sparse_step"
        raise HFError(f"{where}: {key}={hc.get(key)!r}: dense blocks between MoE blocks are not supported "
                      "(every block must be an MoE one: decoder_sparse_step 1, mlp_only_layers [])")
    return dict(n_experts=int(hc["num_experts"]), n_experts_per_token=int(hc["num_experts_per_tok"]),
                d_ff_expert=int(hc["moe_intermediate_size"]), norm_topk_prob=bool(hc.get("norm_topk_prob", True)),
                router_aux_coef=float(hc.get("router_aux_loss_coef", 0.001)))


def model_config_from_hf(path: str | Path, base: ModelConfig) -> ModelConfig:
    """`base` with every architecture field taken from `path/config.json`; dtypes stay the base's."""
    hc = read_config(path)
    where = Path(path).expanduser() / "config.json"
    mt, archs = hc.get("model_type"), hc.get("architectures") or []
    supported = ", ".join(f"{a} (model_type {m})" for m, a in ARCHITECTURES.items())
    if mt not in ARCHITECTURES:
        raise HFError(f"{where}: model_type={mt!r} is not supported (supported: {supported})")
    if any(a != ARCHITECTURES[mt] for a in archs):
        raise HFError(f"{where}: architectures={archs} is not supported (supported: {supported})")
    gemma = mt in ("gemma3", "gemma3_text")
    if gemma:
        hc = _gemma3_text(hc, where)
    for key, bad in _unsupported(hc, mt).items():
        if bad:
            raise HFError(f"{where}: {key}={hc.get(key)!r} is not supported by async_rl's {mt} model")
    try:
        heads = int(hc["num_attention_heads"])
        fields = dict(vocab_size=int(hc["vocab_size"]), d_model=int(hc["hidden_size"]),
                      n_layers=int(hc["num_hidden_layers"]), n_heads=heads,
                      n_kv_heads=int(hc.get("num_key_value_heads") or heads),
                      head_dim=int(hc.get("head_dim") or int(hc["hidden_size"]) // heads),
                      d_ff=int(hc["intermediate_size"]), norm_eps=float(hc.get("rms_norm_eps", 1e-6)),
                      tie_embeddings=bool(hc.get("tie_word_embeddings", False)), qkv_bias=mt == "qwen2",
                      qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"), gemma=gemma,
                      learned_positions=0, **_rope_fields(hc, where), **_moe_fields(hc, mt, where))
        if gemma:
            local = (hc.get("rope_parameters") or {}).get("sliding_attention") or {}
            fields.update(sliding_window=int(hc["sliding_window"]), global_every=_global_every(hc, where),
                          rope_local_theta=float(local.get("rope_theta", hc["rope_local_base_freq"])),
                          query_pre_attn_scalar=float(hc["query_pre_attn_scalar"]),
                          final_logit_softcap=float(hc.get("final_logit_softcapping") or 0.0))
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise HFError(f"{where}: missing or invalid field ({type(e).__name__}: {e})") from None
    try:
        dataclasses.replace(base, **fields)
    except ConfigError as e:
        raise HFError(f"{where}: {e}") from None
    for k, v in fields.items():  # JSON's NaN and Infinity parse; a model built on them is NaN throughout
        if isinstance(v, float) and not math.isfinite(v):
            raise HFError(f"{where}: model.{k}={v} is not a finite number")
    return dataclasses.replace(base, **fields)


def resolve(cfg: Config) -> Config:
    """With `model.hf_path` set: model fields from its config.json, and its tokenizer when
    `tokenizer.path` is empty. Idempotent; without `model.hf_path`, returns `cfg` as is."""
    if not cfg.model.hf_path:
        return cfg
    model = model_config_from_hf(cfg.model.hf_path, cfg.model)
    tok = cfg.tokenizer
    if not tok.path and tok.kind in ("auto", "hf"):
        if not (Path(cfg.model.hf_path).expanduser() / "tokenizer.json").is_file():
            raise HFError(f"model.hf_path={cfg.model.hf_path!r}: no tokenizer.json there; set tokenizer.path")
        tok = dataclasses.replace(tok, path=cfg.model.hf_path)
    return dataclasses.replace(cfg, model=model, tokenizer=tok)


# --- names ------------------------------------------------------------------------------

# (our path pattern within a block or the model, HF name template, HF weight is [out, in] of our [in, out]).
# Block parameters are stacked [n_layers, ...] under `layers.` (one HF tensor per layer);
# an unstacked `layers.<i>.` path (a per-layer dict) names layer i alone.
_NAMES = [
    (r"embed\.embedding", "model.embed_tokens.weight", False),
    (r"final_norm\.scale", "model.norm.weight", False),
    (r"lm_head\.kernel", "lm_head.weight", True),
    (r"layers\.attn_norm\.scale", "model.layers.{i}.input_layernorm.weight", False),
    (r"layers\.mlp_norm\.scale", "model.layers.{i}.post_attention_layernorm.weight", False),
    (r"layers\.attn\.([qkvo])\.kernel", "model.layers.{i}.self_attn.{0}_proj.weight", True),
    (r"layers\.attn\.([qkv])\.bias", "model.layers.{i}.self_attn.{0}_proj.bias", False),
    (r"layers\.mlp\.(gate|up|down)\.kernel", "model.layers.{i}.mlp.{0}_proj.weight", True),
    # MoE: the router is HF's mlp.gate; our [E, D, F] experts are one HF tensor per expert
    (r"layers\.mlp\.router", "model.layers.{i}.mlp.gate.weight", True),
    (r"layers\.mlp\.experts_(gate|up|down)", "model.layers.{i}.mlp.experts.{e}.{0}_proj.weight", True),
]
_QK_NORM = (r"layers\.attn\.([qk])_norm\.scale", "model.layers.{i}.self_attn.{0}_norm.weight", False)
# Gemma 3 has four norms per block: its post_attention_layernorm is the attention output's
# norm, and the MLP's input norm is pre_feedforward_layernorm.
_GEMMA_NAMES = [
    (r"layers\.post_attn_norm\.scale", "model.layers.{i}.post_attention_layernorm.weight", False),
    (r"layers\.mlp_norm\.scale", "model.layers.{i}.pre_feedforward_layernorm.weight", False),
    (r"layers\.post_mlp_norm\.scale", "model.layers.{i}.post_feedforward_layernorm.weight", False),
]
# Tensors a checkpoint may carry that no parameter needs (old rotary caches, a tied head,
# a multimodal Gemma 3's vision tower and projector).
_IGNORABLE = re.compile(r"(.*\.rotary_emb\.inv_freq|lm_head\.weight|(model\.)?(vision_tower|multi_modal_projector)\..*)$")
# A multimodal Gemma 3 keeps its text model under one of these (transformers < 4.52, >= 4.52)
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))


def is_gemma(named_paths) -> bool:
    """Whether a parameter tree (its dotted paths) is a Gemma 3 model's (post-branch norms)."""
    return any(p.endswith("post_attn_norm.scale") for p in named_paths)


def hf_name(ours: str, gemma: bool = False) -> tuple[str, bool]:
    """(HF tensor name, transposed) for our dotted parameter path; a stacked block
    parameter's name keeps an `{i}` for the layer index (and an MoE expert's an `{e}` for the
    expert). `gemma`: the model is Gemma 3."""
    m = re.fullmatch(r"layers\.(\d+)\.(.*)", ours)
    path, layer = (f"layers.{m.group(2)}", m.group(1)) if m else (ours, None)
    for pat, tmpl, transposed in (_GEMMA_NAMES if gemma else []) + [_QK_NORM] + _NAMES:
        mm = re.fullmatch(pat, path)
        if mm:
            name = tmpl.format(*mm.groups(), i="{i}" if layer is None else layer, e="{e}")
            return name, transposed
    raise HFError(f"parameter {ours!r} has no Hugging Face Llama/Qwen/Gemma equivalent")


def hf_tensors(ours: str, shape: tuple, gemma: bool = False) -> list[tuple[str, str, tuple | None, bool]]:
    """[(HF name, our name for messages, index into our leading axes or None, transposed)]: the
    index is (layer,) for a stacked block parameter, (layer, expert) for an MoE expert's."""
    name, transposed = hf_name(ours, gemma)
    if "{i}" not in name:
        return [(name, ours, None, transposed)]
    if "{e}" not in name:
        return [(name.format(i=i), f"{ours}[{i}]", (i,), transposed) for i in range(shape[0])]
    return [(name.format(i=i, e=e), f"{ours}[{i}, {e}]", (i, e), transposed)
            for i in range(shape[0]) for e in range(shape[1])]


def _flat(tree) -> tuple[list[tuple[str, Any]], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_var)
    named = [(".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p), v) for p, v in leaves]
    return named, treedef


# --- safetensors reading -----------------------------------------------------------------

class _Tensor(NamedTuple):
    name: str
    file: Path
    dtype: Any  # np.dtype, or the safetensors name of a dtype we cannot read
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file


def _header(file: Path) -> dict[str, _Tensor]:
    try:
        with file.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            head = json.loads(f.read(n))
        size = file.stat().st_size
    except (OSError, ValueError) as e:
        raise HFError(f"{file}: not a readable safetensors file ({e})") from None
    out, _ = {}, head.pop("__metadata__", None)
    for name, t in head.items():
        b, e = t["data_offsets"]
        shape = tuple(int(s) for s in t["shape"])
        dt = _DTYPES.get(t["dtype"])
        if dt is not None and (e - b != math.prod(shape) * dt.itemsize or 8 + n + e > size):
            raise HFError(f"{file}: tensor {name!r} has a data range that does not match its shape {list(shape)}")
        out[name] = _Tensor(name, file, dt if dt is not None else t["dtype"], shape, 8 + n + b)
    return out


class _Checkpoint:
    """The tensors of an HF directory: by the index's weight_map, else every *.safetensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        idx = self.path / INDEX
        if idx.is_file():
            try:
                wmap = json.loads(idx.read_text())["weight_map"]
                if not isinstance(wmap, dict) or not all(isinstance(f, str) for f in wmap.values()):
                    raise ValueError("weight_map is not an object of tensor name -> file name")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HFError(f"{idx}: not a valid index ({e})") from None
            files = sorted(set(wmap.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                torch = sorted(p.name for p in self.path.glob("*.bin"))
                raise HFError(f"{self.path}: no *.safetensors files (and no {INDEX})" + (
                    f"; {', '.join(torch[:3])} are PyTorch pickles, which are not read: save the model with "
                    "safe_serialization=True" if torch else ""))
            wmap = None
        self.tensors: dict[str, _Tensor] = {}
        for fname in files:
            if not (self.path / fname).is_file():
                raise HFError(f"{idx}: names {fname}, which is not in {self.path}")
            for name, t in _header(self.path / fname).items():
                if wmap is None or wmap.get(name) == fname:
                    self.tensors[name] = t
        for name, fname in (wmap or {}).items():
            if name not in self.tensors:
                raise HFError(f"{self.path / fname}: has no tensor {name!r}, though {idx.name} maps it there")
        for old, new in _TEXT_PREFIXES:  # a multimodal checkpoint's text model, under its usual names
            self.tensors = {new + n[len(old):] if n.startswith(old) else n: t for n, t in self.tensors.items()}
        self._fds: dict[Path, int] = {}

    def get(self, name: str, ours: str, shape: tuple[int, ...]) -> _Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise HFError(f"tensor {name!r} (for parameter {ours}) is missing from {self.path}")
        if not isinstance(t.dtype, np.dtype):
            raise HFError(f"tensor {name!r} in {t.file}: dtype {t.dtype} is not supported ({', '.join(_DTYPES)} are)")
        if t.shape != shape:
            raise HFError(f"tensor {name!r} in {t.file}: shape {list(t.shape)}, expected {list(shape)} "
                          f"(for parameter {ours})")
        return t

    def _pread(self, t: _Tensor, buf: np.ndarray, start: int) -> None:
        fd = self._fds.get(t.file)
        if fd is None:
            fd = self._fds[t.file] = os.open(t.file, os.O_RDONLY)
        view, done = memoryview(buf.reshape(-1).view(np.uint8)), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], t.offset + start + done)
            if n <= 0:
                raise HFError(f"{t.file}: ended inside tensor {t.name!r}")
            done += n

    def read(self, t: _Tensor, index: tuple, transposed: bool, dtype: np.dtype) -> np.ndarray:
        """Our-layout slice `index` of tensor `t`, as `dtype`."""
        ours_shape = t.shape[::-1] if transposed else t.shape
        sl = [range(*s.indices(d)) for s, d in zip(index, ours_shape)]
        rows, cols = (sl[1], sl[0]) if transposed else (sl[0], sl[1] if len(sl) > 1 else None)
        out = np.empty(tuple(len(r) for r in sl), dtype)
        width = t.shape[1] if len(t.shape) > 1 else 1
        row_bytes = width * t.dtype.itemsize
        full_cols = cols is None or len(cols) == width
        if not transposed and full_cols and dtype == t.dtype:
            self._pread(t, out, rows.start * row_bytes)  # contiguous: straight into the result
            return out
        step = max(1, _CHUNK_BYTES // row_bytes)
        for r0 in range(rows.start, rows.stop, step):
            r1 = min(r0 + step, rows.stop)
            buf = np.empty((r1 - r0,) + t.shape[1:], t.dtype)
            self._pread(t, buf, r0 * row_bytes)
            block = buf if full_cols else buf[:, cols.start:cols.stop]
            if transposed:
                out[:, r0 - rows.start:r1 - rows.start] = block.T
            else:
                out[r0 - rows.start:r1 - rows.start] = block
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@functools.lru_cache(maxsize=None)
def _layer_writer(sharding):
    # in place (donated): the stacked array is written one layer (or expert) at a time on its devices
    def write(a, piece, index):
        return jax.lax.dynamic_update_slice(a, piece, tuple(index) + (0,) * (a.ndim - len(index)))
    return jax.jit(write, donate_argnums=0, out_shardings=sharding)


def _read_array(ckpt: _Checkpoint, t: _Tensor, shape: tuple, dtype: np.dtype, sharding, transposed: bool,
                lead: int = 0):
    """`t` as an array of `shape` in `sharding`, each device reading its own slice. `lead`:
    `shape` has that many leading axes of 1 that the file's tensor lacks."""
    cache: dict = {}  # devices that replicate a slice share one host copy

    def cb(index):
        key = tuple(s.indices(d) for s, d in zip(index, shape))
        if key not in cache:
            got = ckpt.read(t, index[lead:], transposed, dtype)
            cache[key] = got.reshape((1,) * lead + got.shape)
        return cache[key]

    arr = jax.make_array_from_callback(shape, sharding, cb)
    arr.block_until_ready()  # bound host memory: free this slice before reading the next
    return arr


def _plan(ckpt: _Checkpoint, named: list[tuple[str, Any]]) -> list[list[tuple[_Tensor, int | None, bool]]]:
    """For each parameter of `named`, the tensors it is read from: (tensor, layer index into
    our leading axis or None, transposed). Refuses, from the files' headers alone, a checkpoint
    that lacks a tensor, holds one of another shape or an unsupported dtype, or holds tensors
    no parameter takes."""
    used, plan = set(), []
    gemma = is_gemma(p for p, _ in named)
    for ours, var in named:
        shape, reads = tuple(var.shape), []
        for name, label, layer, transposed in hf_tensors(ours, shape, gemma):
            one = shape if layer is None else shape[len(layer):]
            reads.append((ckpt.get(name, label, one[::-1] if transposed else one), layer, transposed))
            used.add(name)
        plan.append(reads)
    extra = sorted(n for n in ckpt.tensors if n not in used and not _IGNORABLE.fullmatch(n))
    if extra:
        raise HFError(f"{ckpt.path}: {len(extra)} tensors match no parameter of this model "
                      f"(e.g. {', '.join(extra[:3])}); its config.json may not describe these weights")
    return plan


def check_params(path: str | Path, abstract_params) -> None:
    """Raises HFError where `load_params` would, reading only the files' headers."""
    _plan(_Checkpoint(path), _flat(abstract_params)[0])


def load_params(path: str | Path, abstract_params, shardings) -> nnx.State:
    """Params with the structure of `abstract_params` (an nnx.State of abstract Params), each
    placed in its sharding (a matching State of NamedShardings, or one Sharding for all).

    A stacked block parameter [n_layers, ...] is filled layer by layer on its devices: the
    host holds one layer's device slice at a time, as for any other tensor."""
    ckpt = _Checkpoint(path)
    named, treedef = _flat(abstract_params)
    plan = _plan(ckpt, named)
    sh = [shardings] * len(named) if isinstance(shardings, jax.sharding.Sharding) else \
        [v.get_value() if _is_var(v) else v for _, v in _flat(shardings)[0]]
    out = []
    try:
        for (ours, var), sharding, reads in zip(named, sh, plan):
            shape, dtype = tuple(var.shape), np.dtype(var.dtype)
            arr = None
            for t, layer, transposed in reads:
                if layer is None:
                    arr = _read_array(ckpt, t, shape, dtype, sharding, transposed)
                    continue
                piece = _read_array(ckpt, t, (1,) * len(layer) + shape[len(layer):], dtype, sharding, transposed,
                                    lead=len(layer))
                if arr is None:
                    arr = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
                arr = _layer_writer(sharding)(arr, piece, layer)
                arr.block_until_ready()
            out.append(var.replace(arr) if _is_var(var) else arr)
    finally:
        ckpt.close()
    return jax.tree_util.tree_unflatten(treedef, out)


# --- writing ----------------------------------------------------------------------------

def hf_config(model_cfg: ModelConfig, vocab_size: int, dtype: str, base: dict | None = None) -> dict:
    """config.json for our model: `base` (e.g. the original config.json) with every
    architecture field rewritten, so fields we do not model (token ids, ...) survive."""
    m = model_cfg
    mt = "gemma3_text" if m.gemma else "qwen3_moe" if m.moe else "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias \
        else "llama"
    base = base or {}
    if isinstance(base.get("text_config"), dict):  # a multimodal Gemma 3's: its text model is what is written
        base = {**{k: v for k, v in base.items() if not k.endswith("_config") and "token_index" not in k},
                **base["text_config"]}
    drop = ("rope_parameters", "dtype", "torch_dtype", "layer_types", "hidden_act", "hidden_activation")
    doc = {k: v for k, v in base.items() if k not in drop}
    scaling = None
    if model_cfg.rope_scaling != "none":
        scaling = {"rope_type": model_cfg.rope_scaling, "factor": model_cfg.rope_factor}
        if model_cfg.rope_scaling == "llama3":
            scaling.update(low_freq_factor=model_cfg.rope_low_freq_factor,
                           high_freq_factor=model_cfg.rope_high_freq_factor,
                           original_max_position_embeddings=model_cfg.rope_original_max_positions)
    doc.update(architectures=[ARCHITECTURES[mt]], model_type=mt, vocab_size=vocab_size,
               hidden_size=model_cfg.d_model, intermediate_size=model_cfg.d_ff,
               num_hidden_layers=model_cfg.n_layers, num_attention_heads=model_cfg.n_heads,
               num_key_value_heads=model_cfg.n_kv_heads, head_dim=model_cfg.resolved_head_dim,
               rms_norm_eps=model_cfg.norm_eps, rope_theta=model_cfg.rope_theta,
               rope_scaling=scaling, tie_word_embeddings=model_cfg.tie_embeddings, torch_dtype=dtype)
    if mt == "gemma3_text":
        every = m.global_every or m.n_layers + 1
        scalar = m.query_pre_attn_scalar or m.resolved_head_dim
        # transformers' Gemma3TextConfig validates this field as an int (published files write 256)
        scalar = int(scalar) if float(scalar).is_integer() else scalar
        doc.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False, attn_logit_softcapping=None,
                   query_pre_attn_scalar=scalar,
                   final_logit_softcapping=m.final_logit_softcap or None,
                   sliding_window=m.sliding_window or None, sliding_window_pattern=every,
                   rope_local_base_freq=m.rope_local_theta or m.rope_theta,
                   layer_types=["sliding_attention" if local else "full_attention" for local in m.local_layers()])
    else:
        doc["hidden_act"] = "silu"
        doc.update({"attention_bias": False, "mlp_bias": False} if mt == "llama" else {"use_sliding_window": False})
        if mt in ("qwen3", "qwen3_moe"):
            doc["attention_bias"] = False
        if mt == "qwen3_moe":
            doc.update(num_experts=m.n_experts, num_experts_per_tok=m.n_experts_per_token,
                       moe_intermediate_size=m.d_ff_expert, norm_topk_prob=m.norm_topk_prob,
                       router_aux_loss_coef=m.router_aux_coef, decoder_sparse_step=1, mlp_only_layers=[])
    doc.setdefault("max_position_embeddings", 8192)
    return doc


class _Layer:
    """Layer i (an `hf_tensors` index: (layer,) or (layer, expert)) of a stacked parameter,
    fetched to the host only when written."""

    def __init__(self, leaf, i: tuple):
        self.leaf, self.i, self.shape = leaf, i, tuple(leaf.shape[len(i):])

    def __call__(self):
        return self.leaf[self.i]


def _write_file(file: Path, items: list[tuple[str, Any, bool, np.dtype]]) -> None:
    """One safetensors file; each tensor is fetched, laid out and written one at a time."""
    head, off = {}, 0
    for name, leaf, transposed, dt in items:
        shape = list(leaf.shape[::-1] if transposed else leaf.shape)
        n = math.prod(shape) * dt.itemsize
        head[name] = {"dtype": _DTYPE_NAMES[dt], "shape": shape, "data_offsets": [off, off + n]}
        off += n
    head["__metadata__"] = {"format": "pt"}  # transformers refuses files without it
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with file.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, leaf, transposed, dt in items:
            host = np.asarray(jax.device_get(leaf() if callable(leaf) else leaf))
            host = np.ascontiguousarray(host.T if transposed else host).astype(dt, copy=False)
            f.write(memoryview(host.reshape(-1).view(np.uint8)))


def hf_arrays(params):
    """(HF name, array in the HF layout) for every tensor of `params`, one at a time, computed
    where the parameter lives (a layer's slice and a transpose are device ops; no host copy),
    e.g. to hand the weights to another engine in the same process without writing files."""
    named = _flat(params)[0]
    gemma = is_gemma(p for p, _ in named)
    for ours, leaf in named:
        leaf = leaf.get_value() if _is_var(leaf) else leaf
        for name, _, layer, transposed in hf_tensors(ours, tuple(leaf.shape), gemma):
            x = leaf if layer is None else leaf[layer]
            yield name, x.T if transposed else x


def save_hf(params, model_cfg: ModelConfig, vocab_size: int, out_dir: str | Path, *, dtype: str | None = None,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES, base_config: dict | None = None,
            extra_config: dict | None = None) -> Path:
    """Writes `params` as an HF directory (config.json + safetensors, sharded with an index
    when larger than `max_shard_bytes`). `dtype` (e.g. "bfloat16") casts; None keeps each
    parameter's own dtype, which `load_params` reads back bit-identically."""
    if model_cfg.learned_positions:
        raise HFError(f"model.learned_positions={model_cfg.learned_positions}: a learned position table has "
                      "no Hugging Face Llama/Qwen/Gemma equivalent; only models with learned_positions=0 export")
    items, named = [], _flat(params)[0]
    gemma = is_gemma(p for p, _ in named)
    for ours, leaf in named:
        leaf = leaf.get_value() if _is_var(leaf) else leaf
        dt = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype) if dtype else np.dtype(leaf.dtype)
        if dt not in _DTYPE_NAMES:
            raise HFError(f"dtype {dt} cannot be written to safetensors here (supported: {', '.join(_DTYPES)})")
        for name, _, layer, transposed in hf_tensors(ours, tuple(leaf.shape), gemma):
            items.append((name, leaf if layer is None else _Layer(leaf, layer), transposed, dt))
    items.sort(key=lambda it: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", it[0])])  # layer 2 < 10
    dts = {it[3].name for it in items}
    doc = hf_config(model_cfg, vocab_size, dts.pop() if len(dts) == 1 else "float32", base_config)
    doc.update(extra_config or {})
    shards, size = [[]], 0
    for it in items:
        n = math.prod(it[1].shape) * it[3].itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards, size = shards + [[]], 0
        shards[-1].append(it)
        size += n
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    # Files of an earlier export here would be read alongside the new ones.
    for old in [*out.glob("model*.safetensors"), out / INDEX]:
        old.unlink(missing_ok=True)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, shard in zip(names, shards):
        _write_file(out / fname, shard)
    if len(shards) > 1:
        total = sum(math.prod(it[1].shape) * it[3].itemsize for it in items)
        wmap = {it[0]: fname for fname, shard in zip(names, shards) for it in shard}
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=2))
    (out / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
    return out


# --- PEFT adapters --------------------------------------------------------------------------

PEFT_PREFIX = "base_model.model."  # PEFT's wrapper names the HF model's modules under this


def peft_tensors(adapters, gemma: bool = False) -> list[tuple[str, Any, bool]]:
    """(PEFT tensor name, leaf or layer, transposed) for each adapter of an nnx.State of
    `lora_a` [.., d_in, r] / `lora_b` [.., r, d_out]: PEFT's lora_A is [r, d_in] and lora_B
    [d_out, r], named after the HF projection (`...q_proj.lora_A.weight`)."""
    out = []
    for ours, leaf in _flat(adapters)[0]:
        leaf = leaf.get_value() if _is_var(leaf) else leaf
        module, _, which = ours.rpartition(".")
        suffix = {"lora_a": ".lora_A.weight", "lora_b": ".lora_B.weight"}[which]
        for name, _, layer, transposed in hf_tensors(f"{module}.kernel", tuple(leaf.shape), gemma):
            out.append((PEFT_PREFIX + name.removesuffix(".weight") + suffix,
                        leaf if layer is None else _Layer(leaf, layer), transposed))
    return out


def save_peft(adapters, out_dir: str | Path, *, rank: int, alpha: float, base_path: str = "",
              gemma: bool = False) -> Path:
    """Writes `adapters` as a PEFT LoRA directory: adapter_config.json and
    adapter_model.safetensors (fp32), which `peft.PeftModel.from_pretrained` puts on the base."""
    items = [(n, leaf, t, np.dtype(np.float32)) for n, leaf, t in peft_tensors(adapters, gemma)]
    items.sort(key=lambda it: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", it[0])])
    modules = sorted({n.split(".")[-3] for n, *_ in items})
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    _write_file(out / "adapter_model.safetensors", items)
    doc = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
           "target_modules": modules, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
           "use_rslora": False, "use_dora": False, "inference_mode": True, "init_lora_weights": True,
           "modules_to_save": None, "base_model_name_or_path": base_path}
    (out / "adapter_config.json").write_text(json.dumps(doc, indent=2) + "\n")
    return out
