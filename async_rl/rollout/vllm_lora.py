"""LoRA on the vLLM backend: one vLLM adapter per published version (`learner.lora_rank` > 0).

Owns: the vLLM engine settings that LoRA needs (`engine_args`), the backend's private folder
of PEFT adapter directories (one per version, written by `hf.save_peft`: vLLM loads adapters
only from a directory), registering each version as a `LoRARequest` under a name and an int
id of its own, counting the requests that use each, and freeing a version (vLLM's
`remove_lora`, then its directory) once no request uses it and a newer one is loaded. Does
not own: the engine's requests (`vllm_backend`), PEFT's tensor names (`hf`).

The folder is `run.dir/.vllm_lora` (`.vllm_lora.p<i>` for process i), emptied when the backend
starts and removed when it closes, so a session killed with SIGKILL leaves its adapters only
in run.dir, until the next start; a run.dir on an object store (vLLM reads local folders only)
uses a folder in the system's temporary folder instead.

A request keeps the adapter it started with for its life, so its tokens carry that
adapter's version (see docs/design.md, "LoRA").
"""

from __future__ import annotations

import math
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import jax
from flax import nnx

from async_rl.model import hf
from async_rl.store import runfiles, storage

# The values vLLM accepts for max_lora_rank; an adapter of a smaller rank is zero-padded to it.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(rank: int) -> int:
    """vLLM's smallest max_lora_rank that holds adapters of `rank` (config refuses a larger rank)."""
    return next(r for r in VLLM_RANKS if r >= rank)


def engine_args(rank: int, slots: int, max_new_tokens: int, steps_per_call: int) -> dict:
    """`LLM(...)` settings for adapters of `rank`. A request receives at least steps_per_call
    tokens per backend step and weights change only between steps, so its life spans at most
    ceil(max_new_tokens / steps_per_call) swaps: that many versions plus one are in flight at
    most (evaluation runs between publications, on the newest). vLLM holds that many adapters
    per batch (`max_loras`); were one more needed, its request would wait, not fail."""
    loras = max(1, min(slots, math.ceil(max_new_tokens / steps_per_call) + 2))
    return dict(enable_lora=True, max_lora_rank=max_lora_rank(rank), max_loras=loras, max_cpu_loras=loras + 1)


def folder(run_dir: str, process_index: int) -> Path | None:
    """Where this process's adapter directories go: in a local run.dir; None (a temporary
    folder) for one on an object store."""
    if not run_dir or storage.is_remote(run_dir):
        return None
    return runfiles.vllm_lora_dir(Path(run_dir).expanduser(), process_index)


@dataclass(eq=False)
class Loaded:
    version: int  # the published version whose adapters these are
    request: object  # vllm's LoRARequest
    path: Path
    users: int = 0  # live requests that started with it (any view)


class Adapters:
    """The versions whose adapters vLLM holds; callers hold the backend's engine lock."""

    def __init__(self, engine, *, rank: int, alpha: float, gemma: bool = False, root: Path | None = None):
        self.engine, self.rank, self.alpha, self.gemma = engine, rank, alpha, gemma
        if root is None:
            self.root = Path(tempfile.mkdtemp(prefix="async_rl_vllm_lora_"))
        else:
            shutil.rmtree(root, ignore_errors=True)  # a killed session's adapters
            root.mkdir(parents=True)
            self.root = root
        # removed at close, or when this is collected or the process exits without one
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self.loaded: dict[int, Loaded] = {}  # lora id -> what it holds
        self.newest: Loaded | None = None  # what requests started from now on use
        self.serial = 0  # ids are never reused: vLLM caches an adapter by its id (a reuse would run stale tensors)

    @property
    def versions(self) -> list[int]:
        """Versions loaded in vLLM, oldest first."""
        return sorted(a.version for a in self.loaded.values())

    def load(self, params, version: int) -> None:
        """Writes the adapters of `params` (an nnx.State holding nnx.LoRAParam leaves, beside the
        base or alone) as a PEFT directory and registers it as `version`, the newest."""
        from vllm.lora.request import LoRARequest

        adapters = nnx.filter_state(params, nnx.LoRAParam)
        if not jax.tree.leaves(adapters):
            raise ValueError(f"vllm: the weights of version {version} hold no LoRA adapters (learner.lora_rank "
                             f"{self.rank} expects them)")
        self.serial += 1
        name = f"v{version}-{self.serial}"
        path = hf.save_peft(adapters, self.root / name, rank=self.rank, alpha=self.alpha, gemma=self.gemma)
        req = LoRARequest(lora_name=name, lora_int_id=self.serial, lora_path=str(path))
        try:
            if not self.engine.add_lora(req):
                raise RuntimeError(f"vllm: could not load the adapters of version {version} ({path})")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        old, self.newest = self.newest, Loaded(version, req, path)
        self.loaded[self.serial] = self.newest
        if old is not None:
            self._free_if_unused(old)

    def acquire(self) -> Loaded:
        """The newest adapters, for a request starting now (paired with one `release`)."""
        if self.newest is None:
            raise RuntimeError("vllm: a request started before any LoRA adapters were loaded (swap first)")
        self.newest.users += 1
        return self.newest

    def release(self, a: Loaded) -> None:
        a.users -= 1
        self._free_if_unused(a)

    def _free_if_unused(self, a: Loaded) -> None:
        if a.users > 0 or a is self.newest:
            return
        self.engine.remove_lora(a.request.lora_int_id)
        shutil.rmtree(a.path, ignore_errors=True)
        del self.loaded[a.request.lora_int_id]

    def close(self) -> None:
        """Removes the folder (vLLM keeps what it loaded until the engine goes)."""
        self.loaded.clear()
        self.newest = None
        self._cleanup()

