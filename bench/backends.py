"""Rollout backends for the engine bench (`bench/engine.py --backend builtin,vllm`).

Owns: parsing `--backend`, the checkpoint both backends read (the bench's random model
written as a Hugging Face directory), building each backend's `Rollout` with the same
slots, chunk size, lengths and sampling settings. Does not own: timing or tables
(engine.py), the loop that drives them (`async_rl.rollout.decoding.generate_all`, over the same
`Rollout` interface the pump drives), the backends (`async_rl.rollout.interface`, `async_rl.rollout.vllm_backend`).
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass

from async_rl.model import hf
from async_rl.rollout.interface import BuiltinRollout

KNOWN = ("builtin", "vllm")


def parse(text: str) -> list[str]:
    """The --backend list; with vllm asked for and not importable, one line and exit 2."""
    names = [n for n in text.split(",") if n]
    bad = sorted(set(names) - set(KNOWN))
    if bad or not names:
        print(f"--backend: unknown {bad} (known: {', '.join(KNOWN)})", file=sys.stderr)
        sys.exit(2)
    if "vllm" in names:
        from async_rl.rollout import vllm_backend as vllm_rollout

        if (why := vllm_rollout.available()) is not None:
            print(f"--backend vllm: {' '.join(why.split())} (`make venv-vllm` builds .venv-vllm with it)",
                  file=sys.stderr)
            sys.exit(2)
        vllm_rollout.split_gpu_memory(VLLM_GPU_FRACTION)  # before JAX first touches a GPU
    return list(dict.fromkeys(names))


VLLM_GPU_FRACTION = 0.45  # engine.gpu_memory_utilization's default


@dataclass
class Setup:
    """What every backend shares: the engine's sizes, the sampling settings the engine was
    built with, its params, and the checkpoint directory they were written to (None without vllm)."""
    engine: object
    sampling: dict  # temperature, top_k, top_p
    params: object
    model_cfg: object
    vocab: int
    dtype: str
    seed: int
    hf_dir: str | None = None


def write_checkpoint(params, model_cfg, vocab: int, dtype: str) -> tempfile.TemporaryDirectory:
    """The bench's model as a Hugging Face directory in a temporary directory (removed at exit).
    The builtin engine keeps the params written: the same weights bit for bit."""
    tmp = tempfile.TemporaryDirectory(prefix="bench-engine-hf-")
    hf.save_hf(params, model_cfg, vocab, tmp.name, dtype=dtype)
    return tmp


def make(name: str, st: Setup):
    """(rollout, seconds to start it) for one backend with the engine's sizes and sampling."""
    t0 = time.perf_counter()
    eng = st.engine
    if name == "builtin":
        r = BuiltinRollout(eng, st.params, 0)
    else:
        from async_rl.rollout.vllm_backend import VLLMRollout

        r = VLLMRollout(hf_path=st.hf_dir, slots=eng.max_concurrent_decodes, steps_per_call=eng.steps_per_call,
                        max_prompt_len=eng.max_prompt_len, max_new_tokens=eng.max_new_tokens,
                        seed=st.seed, stop_ids=(), **st.sampling,
                        dtype=st.dtype, tie_embeddings=st.model_cfg.tie_embeddings,
                        gpu_memory_utilization=VLLM_GPU_FRACTION, cpu_kv_cache_gib=1, n_tokens=st.vocab)
    return r, time.perf_counter() - t0
