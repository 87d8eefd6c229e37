"""`async-rl export RUN_DIR [--step N] --out DIR`: a run's policy as a Hugging Face directory.

Owns: finding the run's config and committed checkpoint steps, restoring only the model
parameters from a step's `state` item (not the optimizer, iterator or ledger), and
assembling the output directory: weights and config.json (through `hf.save_hf`) plus the
tokenizer files when the run used a Hugging Face tokenizer. Does not own: the tensor
layout or config.json fields (`hf`), the checkpoint format (`checkpoint`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from . import config as C
from . import hf
from .model import Transformer
from .tokenizer import HFTokenizer, build_tokenizer

# Files a tokenizer directory may hold that a server needs beside the weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def committed_steps(ckpt_dir: Path) -> list[int]:
    """Steps Orbax has committed: it renames `<step>.orbax-checkpoint-tmp-*` to `<step>` last."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.is_dir() and p.name.isdigit())


def _host_sharding() -> jax.sharding.Sharding:
    # Restore on the host CPU when the platform has one: a model that fills a run's devices
    # need not fit on one of them.
    try:
        dev = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        dev = jax.local_devices()[0]
    return jax.sharding.SingleDeviceSharding(dev)


def restore_params(state_dir: Path, model_cfg: C.ModelConfig, vocab_size: int) -> nnx.State:
    """The `params` half of a checkpoint's `state` item, on one host device."""
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, vocab_size, rngs=nnx.Rngs(0)))
    _, aparams = nnx.split(abstract, nnx.Param)
    sh = _host_sharding()
    target = {"params": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), aparams)}
    ckptr = ocp.PyTreeCheckpointer()
    try:
        restored = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    except Exception as e:  # orbax raises many types for a damaged or mismatched step
        raise ValueError(f"{state_dir}: cannot restore the model parameters "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    finally:
        ckptr.close()
    return restored["params"]


def _base_config(cfg: C.Config) -> dict | None:
    """The run's original config.json, so fields we do not model (token ids, ...) survive."""
    if not cfg.model.hf_path:
        return None
    try:
        return hf.read_config(cfg.model.hf_path)
    except hf.HFError:  # moved or deleted since training: write the config from the run's fields
        return None


def load_run(run_dir: str | Path):
    """(config, tokenizer, vocabulary size, committed steps, checkpoint dir) of a run, read-only."""
    run = Path(run_dir).absolute()  # Orbax wants absolute paths
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: no such run directory")
    cfg_path = run / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: missing (is {run} a run directory?)")
    try:
        cfg = C.from_dict(yaml.safe_load(cfg_path.read_text()) or {})
    except yaml.YAMLError as e:
        raise C.ConfigError(f"{cfg_path}: not valid YAML ({e})") from None
    ckpt_dir = run / "checkpoints"
    steps = committed_steps(ckpt_dir)
    if not steps:
        raise FileNotFoundError(f"{ckpt_dir}: no committed checkpoint")
    # The run's vocabulary: config.json's for HF models, else the tokenizer's (as train sets it).
    tok = build_tokenizer(cfg.tokenizer, synthetic=cfg.data.source == "synthetic" and cfg.data.task != "word_problem")
    return cfg, tok, cfg.model.vocab_size or tok.vocab_size, steps, ckpt_dir


def export(run_dir: str | Path, out_dir: str | Path, step: int | None = None, *, dtype: str | None = None) -> Path:
    """Writes checkpoint `step` (default: the latest) of `run_dir` to `out_dir`; returns it.

    `dtype` casts the weights (e.g. "bfloat16" for serving); None keeps the trained dtype,
    which loads back bit-identically."""
    cfg, tok, vocab, steps, ckpt_dir = load_run(run_dir)
    cfg_path = Path(run_dir) / "config.yaml"
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(f"--step {step}: no committed checkpoint step {step} in {ckpt_dir} (steps: "
                         f"{', '.join(map(str, steps))})")
    state_dir = ckpt_dir / str(step) / "state"
    if not state_dir.is_dir():
        raise FileNotFoundError(f"{state_dir}: missing (checkpoint step {step} has no model state)")
    if cfg.model.learned_positions:
        raise ValueError(f"model.learned_positions={cfg.model.learned_positions} in {cfg_path}: a learned "
                         "position table has no Hugging Face Llama/Qwen2 equivalent; such a run cannot be exported")
    params = restore_params(state_dir, cfg.model, vocab)
    extra = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    base = _base_config(cfg)
    out = hf.save_hf(params, cfg.model, vocab, out_dir, dtype=dtype, base_config=base,
                     extra_config=None if base else extra)
    if isinstance(tok, HFTokenizer):
        # generation_config.json usually sits beside the original weights, not the tokenizer
        dirs = [tok.path] + ([Path(cfg.model.hf_path).expanduser()] if cfg.model.hf_path else [])
        for name in TOKENIZER_FILES:
            src = next((d / name for d in dirs if (d / name).is_file()), None)
            if src is not None and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)
    return out
