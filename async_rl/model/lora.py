"""LoRA adapters on the policy's projections: what they are, which tensors are the base.

Owns: `LoraSpec` (rank, scale, targeted projections; built from `learner.lora_*`), the
adapter pair a `transformer.Linear` carries (A [d_in, r], normal with std 1/sqrt(d_in); B
[r, d_out], zeros: a new adapter changes nothing), its forward term scale * (x A) B, the
filters that split a model's state into adapters and frozen base, merging adapters into the
base's kernels (export), and the base's digest that a checkpoint records. Adapters are
Flax's own `nnx.LoRAParam` variables (a subclass of `nnx.Param`), so every tree utility that
reads Params (shardings, casts, checkpoint digests) treats them as parameters. Does not
own: the optimizer (learner), publication (session), files (checkpoint, export).

See docs/design.md, "LoRA".
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from async_rl.config import LORA_GROUPS, Config, LearnerConfig

# Every projection an adapter can target, in the order a spec lists them.
PROJECTIONS = sum(LORA_GROUPS.values(), ())
# The adapters of a model's state, and the frozen rest (every other Param).
ADAPTERS = nnx.LoRAParam
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
# Adapters are trained in fp32 whatever the base's storage dtype: a bf16 adapter loses small
# Adam updates, and at rank r the pair is a fraction of a percent of the base's bytes.
ADAPTER_DTYPE = jnp.float32


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    projections: tuple[str, ...]  # of PROJECTIONS
    seed: int = 0  # seeds A; its own stream, so the base draws what a full-weight model draws

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def projections(lc: LearnerConfig) -> tuple[str, ...]:
    """The projections `learner.lora_targets` names (groups expanded), in PROJECTIONS order."""
    want = lc.lora_projections()
    return tuple(p for p in PROJECTIONS if p in want)


def spec(cfg: Config) -> LoraSpec | None:
    """The run's adapters, or None for full-weight training."""
    lc = cfg.learner
    return LoraSpec(lc.lora_rank, lc.lora_alpha, projections(lc), cfg.run.seed) if lc.lora_rank else None


def init_pair(d_in: int, d_out: int, rank: int, key, stack: int, axes: tuple) -> tuple[nnx.LoRAParam, nnx.LoRAParam]:
    """(A, B) for one projection, with a leading [stack] axis when stacked (per-layer keys)."""
    ashape, bshape = (d_in, rank), (rank, d_out)
    aaxes, baxes = (axes[0], None), (None, axes[1])
    if stack:
        ashape, bshape = (stack,) + ashape, (stack,) + bshape
        aaxes, baxes = ("layers",) + aaxes, ("layers",) + baxes
    a = jax.random.normal(key, ashape, ADAPTER_DTYPE) / math.sqrt(d_in)
    return nnx.LoRAParam(a, axes=aaxes), nnx.LoRAParam(jnp.zeros(bshape, ADAPTER_DTYPE), axes=baxes)


def delta(x, a, b, scale: float, dtype):
    """scale * (x A) B in the compute dtype: two thin matmuls, never a merged [d_in, d_out]."""
    xa = jnp.dot(x.astype(dtype), a.astype(dtype))
    return (jnp.dot(xa, b.astype(dtype)) * jnp.asarray(scale, dtype)).astype(dtype)


def merged(base: nnx.State, adapters: nnx.State, scale: float) -> nnx.State:
    """The base with every adapted kernel replaced by W + scale * A B (in fp32, then the
    kernel's dtype): one set of weights that computes what base + adapters compute."""
    flat_a = dict(nnx.to_flat_state(adapters))
    out = []
    for path, v in nnx.to_flat_state(base):
        if path[-1] == "kernel" and path[:-1] + ("lora_a",) in flat_a:
            a = flat_a[path[:-1] + ("lora_a",)].get_value().astype(jnp.float32)
            b = flat_a[path[:-1] + ("lora_b",)].get_value().astype(jnp.float32)
            w = v.get_value()
            v = v.replace((w.astype(jnp.float32) + scale * (a @ b)).astype(w.dtype))
        out.append((path, v))
    return nnx.from_flat_state(out)


def adapter_bytes(adapters) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(adapters))


# ---- the base a checkpoint's adapters were trained on ---------------------------------------

def base_reference(cfg: Config, base_params=None) -> dict:
    """What a LoRA checkpoint records of its frozen base: where it came from (model.hf_path,
    or the init seed of a random model) and a digest of its weights. A Hugging Face base is
    digested from its files (config.json and every *.safetensors, whole), a random one from
    its parameters' bytes (`base_params`)."""
    if cfg.model.hf_path:
        return {"hf_path": cfg.model.hf_path, "digest": files_digest(cfg.model.hf_path)}
    return {"seed": cfg.run.seed, "digest": weights_digest(base_params)}


def weights_digest(params) -> str:
    """blake2b over every parameter's path and bytes, in path order (host copies, one at a time)."""
    h = hashlib.blake2b(digest_size=16)
    for path, v in sorted(nnx.to_flat_state(params), key=lambda kv: tuple(map(str, kv[0]))):
        h.update(".".join(map(str, path)).encode())
        h.update(np.asarray(jax.device_get(v.get_value())).tobytes())
    return h.hexdigest()


def files_digest(path: str | Path) -> str:
    """blake2b over config.json and the *.safetensors files of a Hugging Face directory, by name."""
    root = Path(path).expanduser()
    h = hashlib.blake2b(digest_size=16)
    for f in sorted([root / "config.json", *root.glob("*.safetensors")]):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 23):
                h.update(chunk)
    return h.hexdigest()


def describe_base(ref: dict) -> str:
    return f"model.hf_path={ref['hf_path']!r}" if "hf_path" in ref else f"a random base (run.seed={ref.get('seed')})"


def check_base(saved: dict | None, now: dict, where: str) -> None:
    """Refuses (ConfigError) adapters trained on another base than `now`; one line."""
    from async_rl.config import ConfigError
    if saved is None or saved.get("digest") == now.get("digest"):
        return
    raise ConfigError(f"{describe_base(now)}: the LoRA adapters in {where} were trained on {describe_base(saved)} "
                      f"(digest {saved.get('digest')}); this base's digest is {now.get('digest')}: restore the base "
                      "they were trained on or use a new run.dir (nothing was changed)")


def host_tree(state) -> dict[str, np.ndarray]:
    """{dotted path: host array} of an nnx.State (tests, export)."""
    return {".".join(map(str, p)): np.asarray(jax.device_get(v.get_value())) for p, v in nnx.to_flat_state(state)}
