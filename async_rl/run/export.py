"""`async-rl export RUN_DIR [--step N] --out DIR`: a run's policy as a Hugging Face directory.
A LoRA run's is its base with the adapters merged in, plus the adapters alone as a PEFT
directory in `DIR/adapter` (adapter_config.json + adapter_model.safetensors).

Owns: assembling the output directory: weights and config.json (through `hf.save_hf`) plus
the tokenizer files when the run used a Hugging Face tokenizer, written whole into a
temporary directory beside `--out` and swapped into place (a previous export survives a kill
at any moment); refusing an `--out` that is a file or holds other files. Does not own: the
tensor layout or config.json fields (`hf`), choosing and reading a verified step (`saved_run`).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from async_rl import config as C
from async_rl import faults
from async_rl.data.tokenizer import HFTokenizer
from async_rl.errors import UsageError
from async_rl.model import hf, lora
from async_rl.state.saved_run import open_run, read_lora, read_params
from async_rl.store import runfiles


class ExportError(UsageError):
    """An --out that cannot be written as asked (exit 2); nothing was changed."""

# A LoRA run's PEFT adapter directory, inside the export
ADAPTER_DIR = "adapter"
# Files a tokenizer directory may hold that a server needs beside the weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def _base_config(cfg: C.Config) -> dict | None:
    """The run's original config.json, so fields we do not model (token ids, ...) survive."""
    if not cfg.model.hf_path:
        return None
    try:
        return hf.read_config(cfg.model.hf_path)
    except hf.HFError:  # moved or deleted since training: write the config from the run's fields
        return None


def _refuse_out(out: Path) -> None:
    """An --out that is a file, or a directory holding files an export does not write (they
    would be replaced with it), is refused before anything is read."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: an existing file, not a directory; choose a new or existing export "
                          "directory (nothing was changed)")
    if out.is_dir():
        ours = {"config.json", hf.INDEX, ADAPTER_DIR, *TOKENIZER_FILES}
        other = sorted(p.name for p in out.iterdir()
                       if not (p.name in ours or (p.name.startswith("model") and p.name.endswith(".safetensors"))))
        if other:
            raise ExportError(f"--out {out}: a directory holding files an export does not write "
                              f"({', '.join(other[:3])}{', ...' if len(other) > 3 else ''}); choose a new directory "
                              "or a previous export (nothing was changed)")


def _swap_in(tmp: Path, out: Path) -> None:
    """Puts the finished export `tmp` at `out`: one atomic exchange where the OS has one (a
    SIGKILL at any moment leaves the previous export or the new one at `out`)."""
    if not out.exists():
        os.rename(tmp, out)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None and fn(-100, bytes(tmp), -100, bytes(out), 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
        faults.point("export", 2)
        shutil.rmtree(tmp)  # now the previous export
        return
    old = tmp.with_name(tmp.name + ".old")  # no exchange here: the previous export is kept beside until renamed
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old)


def _clear_stale(parent: Path, name: str) -> None:
    """Temporaries of exports to `name` whose process is gone (killed mid-export)."""
    for p in parent.glob(f".{name}.export-*"):
        try:
            os.kill(int(p.name.split("-")[-2]), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, IndexError, OSError):
            continue


def export(run_dir: str | Path, out_dir: str | Path, step: int | None = None, *, dtype: str | None = None,
           warn: Callable[[str], None] = print) -> tuple[Path, int]:
    """Writes checkpoint `step` (default: the newest that verifies) of `run_dir` to `out_dir`;
    returns (out_dir, step).

    `dtype` casts the weights (e.g. "bfloat16" for serving); None keeps the trained dtype,
    which loads back bit-identically."""
    out = Path(out_dir).expanduser().absolute()
    _refuse_out(out)
    run = open_run(run_dir)
    cfg, tok, vocab = run.cfg, run.tok, run.vocab
    if cfg.model.learned_positions:
        raise ValueError(f"model.learned_positions={cfg.model.learned_positions} in {run.run_dir / runfiles.CONFIG}: "
                         "a learned position table has no Hugging Face Llama/Qwen2 equivalent; such a run cannot "
                         "be exported")
    adapters = None
    if cfg.learner.lora_rank:
        step, adapters, base_params = read_lora(run, step, warn=warn)
        params = lora.merged(base_params, adapters, lora.spec(cfg).scale)
    else:
        step, params = read_params(run, step, warn=warn)
    extra = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    base = _base_config(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(out.parent, out.name)
    # written whole beside the target, then swapped in: a previous export survives any kill
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-{os.getpid()}-", dir=out.parent))
    try:
        hf.save_hf(params, cfg.model, vocab, tmp, dtype=dtype, base_config=base, extra_config=None if base else extra)
        if adapters is not None:
            hf.save_peft(adapters, tmp / ADAPTER_DIR, rank=cfg.learner.lora_rank, alpha=cfg.learner.lora_alpha,
                         base_path=cfg.model.hf_path, gemma=cfg.model.gemma)
        if isinstance(tok, HFTokenizer):
            # generation_config.json usually sits beside the original weights, not the tokenizer
            dirs = [tok.path] + ([Path(cfg.model.hf_path).expanduser()] if cfg.model.hf_path else [])
            for name in TOKENIZER_FILES:
                src = next((d / name for d in dirs if (d / name).is_file()), None)
                if src is not None:
                    shutil.copyfile(src, tmp / name)
        faults.point("export", 1)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would outlive the rename
        _swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, step


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m
