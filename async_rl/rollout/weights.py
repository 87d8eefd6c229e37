"""Published weights as one file, and what a trainer and a generation server must agree on.

Owns: the weights file (`save`, `load`): an engine-layout parameter tree (what
`Engine.update_params` takes) flattened into one `.npz`, one entry per leaf named by its
path (`embed/embedding/value`), plus `__version__` and `__dtypes__` (every leaf's dtype name,
JSON; dtypes NumPy cannot store, bfloat16, are kept as raw unsigned views), written
atomically through `store.storage` (local, gs://, s3://); checking a file's leaves against
the engine's tree (`load` names the first leaf that differs); the tree a server checks files
against (`engine_like`); the fingerprint (`fingerprint`, `mismatch`): the fields that must be
equal between a trainer and a server for the server's tokens to be the trainer's. Does not
own: when weights are published or swapped in (`server_loop`), serving them (`server`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import zipfile
from pathlib import Path

import jax
import numpy as np

from async_rl.model.sharding import is_var
from async_rl.store import storage

VERSION_KEY, DTYPES_KEY = "__version__", "__dtypes__"


def _flat(tree) -> list[tuple[str, object]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path, simple=True, separator="/"), x) for path, x in leaves]


def _storable(x: np.ndarray) -> np.ndarray:
    """`x` as NumPy can write it: a dtype of its own (ml_dtypes' bfloat16, float8) as raw bits."""
    return x if x.dtype.kind in "biufc" else x.view(f"u{x.dtype.itemsize}")


def keys(tree) -> list[str]:
    """The leaf names of a tree, as a weights file names them."""
    return [k for k, _ in _flat(tree)]


def is_adapter(key: str) -> bool:
    """A LoRA adapter's leaf (`layers/attn/q/lora_a/value`): what changes from version to version
    when only adapters train; every other leaf is the frozen base."""
    return "/lora_a/" in key or "/lora_b/" in key


def save(uri, params, version: int, only=None) -> None:
    """Writes `params` (an engine-layout tree) and `version` to `uri` at once: a reader sees the
    previous file or this one, never part of it. `only(key)`: the leaves to write (a LoRA run
    writes its base once and its adapters per version)."""
    entries, dtypes = {}, {}
    for key, x in _flat(params):
        if only is not None and not only(key):
            continue
        a = np.asarray(x)
        entries[key], dtypes[key] = _storable(a), a.dtype.name
    entries[VERSION_KEY] = np.asarray(int(version), np.int64)
    entries[DTYPES_KEY] = np.asarray(json.dumps(dtypes, sort_keys=True))
    buf = io.BytesIO()
    np.savez(buf, **entries)
    storage.write_atomic(uri, buf.getvalue())


def _open(uri, data: bytes):
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise ValueError(f"{uri}: not a weights file ({' '.join(str(e).split())[:200]})") from None


def load(uri, like, base: dict | None = None):
    """The tree saved at `uri`, shaped as `like` (the engine's tree, arrays or
    `jax.ShapeDtypeStruct`s) with NumPy leaves; leaves the file lacks come from `base` (key ->
    array: `load_leaves` of a base file) where given. ValueError (one line) naming the first
    leaf that is missing, extra, or of another shape or dtype."""
    expected = _flat(like)
    have = load_leaves(uri)
    extra = sorted(set(have) - {k for k, _ in expected})
    if extra:
        raise ValueError(f"{uri}: leaf {extra[0]} in the file is not in the engine's tree")
    leaves = []
    for key, want in expected:
        a = have.get(key, (base or {}).get(key))
        if a is None:
            raise ValueError(f"{uri}: leaf {key} missing from the file")
        if a.shape != tuple(want.shape) or a.dtype != np.dtype(want.dtype):
            raise ValueError(f"{uri}: leaf {key} is {a.dtype.name}{list(a.shape)} in the file, the engine's is "
                             f"{np.dtype(want.dtype).name}{list(want.shape)}")
        leaves.append(a)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


def load_leaves(uri) -> dict:
    """Every leaf of a weights file by key, in its saved dtype (NumPy)."""
    out = {}
    with _open(uri, storage.read_bytes(uri)) as f:
        names = set(f.files)
        if DTYPES_KEY not in names:
            raise ValueError(f"{uri}: not a weights file (no {DTYPES_KEY} entry)")
        dtypes = json.loads(str(f[DTYPES_KEY]))
        for key in sorted(names - {VERSION_KEY, DTYPES_KEY}):
            raw = f[key]
            dtype = np.dtype(jax.numpy.dtype(dtypes.get(key, raw.dtype.name)))
            out[key] = raw if raw.dtype == dtype else raw.view(dtype)
    return out


def hf_named(leaves: dict, *, tie_embeddings: bool = False):
    """(HF tensor name, NumPy array in the HF layout) for each leaf of a full weights file
    (`load_leaves`), one at a time: what another engine loads (a vLLM fleet server). A tied
    head is given as `lm_head.weight` too (vLLM's in-place reload expects it)."""
    from async_rl.model import hf

    keys = {k: k.removesuffix("/value").replace("/", ".") for k in leaves}
    gemma = hf.is_gemma(keys.values())
    for key, ours in keys.items():
        x = leaves[key]
        for name, _, layer, transposed in hf.hf_tensors(ours, tuple(x.shape), gemma):
            y = x if layer is None else x[layer]
            y = np.ascontiguousarray(y.T if transposed else y)
            yield name, y
            if tie_embeddings and name == "model.embed_tokens.weight":
                yield "lm_head.weight", y


def engine_like(engine, abstract):
    """The tree an engine's weights file must match: `abstract` (the model's parameters, any
    dtype) with each leaf in the engine's dtype (`Engine.param_dtype`)."""
    def one(v):
        x = v.get_value()
        return v.replace(jax.ShapeDtypeStruct(x.shape, engine.param_dtype(v)))
    return jax.tree.map(one, abstract, is_leaf=is_var)


# ---- fingerprint ---------------------------------------------------------------------------

def tokenizer_digest(tok) -> str:
    """sha256 of what decides a tokenizer's ids: its kind, size, special and stop ids, and its
    vocabulary (the alphabet of the char tokenizer, the bytes of a Hugging Face tokenizer.json)."""
    ident = {"kind": type(tok).__name__, "vocab_size": int(tok.vocab_size),
             "pad": getattr(tok, "pad_id", None), "bos": getattr(tok, "bos_id", None), "eos": tok.eos_id,
             "stops": [int(t) for t in getattr(tok, "stop_ids", (tok.eos_id,))]}
    if getattr(tok, "alphabet", None) is not None:
        ident["alphabet"] = tok.alphabet
    if getattr(tok, "path", None) is not None:
        ident["tokenizer.json"] = hashlib.sha256((Path(tok.path) / "tokenizer.json").read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


# what a copy of the same checkpoint may differ in without serving other tokens
_HF_VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")


def hf_fingerprint(path) -> dict:
    """What a vLLM fleet server and a trainer must agree on, from the Hugging Face directory
    each names: its config (less where it was written and its storage dtype) and its
    tokenizer.json, each as sha256."""
    p = Path(path)
    hc = {k: v for k, v in json.loads((p / "config.json").read_text()).items() if k not in _HF_VOLATILE}
    tok = p / "tokenizer.json"
    return {"hf.config": hashlib.sha256(json.dumps(hc, sort_keys=True).encode()).hexdigest(),
            "hf.tokenizer": hashlib.sha256(tok.read_bytes()).hexdigest() if tok.exists() else "(none)"}


def _plain(v):
    if isinstance(v, bool):
        return int(v)
    if v is None:
        return ""
    return v if isinstance(v, (str, int, float)) else str(v)


def fingerprint(cfg, tok) -> dict:
    """A flat dict (str -> str | int | float) of what must be equal between a trainer and a
    server: the model's fields (all but its path), the vocabulary size, the tokenizer's digest,
    the LoRA adapters' shape, the sampling settings and lengths, and the sampling seed."""
    out = {f"model.{k}": _plain(v) for k, v in dataclasses.asdict(cfg.model).items() if k != "hf_path"}
    out["vocab_size"] = int(cfg.model.vocab_size or tok.vocab_size)
    out["tokenizer"] = tokenizer_digest(tok)
    lc = cfg.learner
    if lc.lora_rank:
        out |= {"lora.rank": int(lc.lora_rank), "lora.alpha": float(lc.lora_alpha), "lora.targets": str(lc.lora_targets)}
    e = cfg.engine
    out |= {"engine.temperature": float(e.temperature), "engine.top_k": int(e.top_k), "engine.top_p": float(e.top_p),
            "engine.max_prompt_len": int(e.max_prompt_len), "rollout.max_new_tokens": int(cfg.rollout.max_new_tokens),
            "run.seed": int(cfg.run.seed), "run.determinism": int(cfg.run.determinism)}
    return out


def mismatch(a: dict, b: dict) -> str | None:
    """The first field (in sorted order) whose value differs between two fingerprints, as
    `field: A vs B` (`(absent)` for a field one lacks); None where they are equal."""
    for k in sorted(set(a) | set(b)):
        if a.get(k, ...) != b.get(k, ...):
            show = [repr(d[k]) if k in d else "(absent)" for d in (a, b)]
            return f"{k}: {show[0]} vs {show[1]}"
    return None
