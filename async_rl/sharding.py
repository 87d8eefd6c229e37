"""Device meshes and shardings for the learner and the engine.

Owns: splitting devices between learner and engine (`mesh.engine_devices`), the learner
Mesh with axes (data, fsdp, tensor), the rules that turn a parameter's logical `axes`
metadata into a PartitionSpec, optimizer-state shardings, the batch sharding, and
host-local batches -> global arrays. Does not own: what the arrays mean (model,
learner) or moving weights into the engine (engine.load_params).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import ConfigError, MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
# logical axis name (model Param metadata `axes`) -> mesh axis
RULES = {"vocab": "tensor", "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor"}


@dataclass(frozen=True)
class Devices:
    learner: Mesh
    engine: list  # the engine's devices (this process's share)
    shared: bool  # engine and learner use the same devices


def make_devices(cfg: MeshConfig) -> Devices:
    """Splits devices and builds the learner mesh; errors name the mesh.* field."""
    local = jax.local_devices()
    k = cfg.engine_devices
    if k >= len(local):
        raise ConfigError(f"mesh.engine_devices={k}: must be < the {len(local)} devices of this process "
                          "(the learner needs at least one)")
    engine = local[len(local) - k:] if k else local
    engine_ids = {d.id for d in engine} if k else set()
    learner = [d for d in jax.devices() if d.id not in engine_ids]
    n = len(learner)
    rest = cfg.fsdp * cfg.tensor
    data = cfg.data if cfg.data != -1 else n // rest
    if data < 1 or data * rest != n:
        raise ConfigError(f"mesh.data={cfg.data} mesh.fsdp={cfg.fsdp} mesh.tensor={cfg.tensor}: "
                          f"product must equal the {n} learner devices")
    mesh = Mesh(np.array(learner).reshape(data, cfg.fsdp, cfg.tensor), AXES)
    return Devices(learner=mesh, engine=list(engine), shared=not k)


def batch_shards(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def spec_for(shape: tuple[int, ...], axes: tuple | None, mesh: Mesh) -> P:
    """PartitionSpec from logical axes; an axis that does not divide its dim stays replicated."""
    if not axes:
        return P()
    out = []
    for dim, name in zip(shape, axes):
        m = RULES.get(name) if name else None
        out.append(m if m and mesh.shape[m] > 1 and dim % mesh.shape[m] == 0 else None)
    return P(*out)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(params: nnx.State, mesh: Mesh):
    """NamedShardings for an nnx.State of Params (concrete or abstract), from their `axes`.

    The result keeps the State's Variable nodes (each holding a NamedSharding), so it has
    the params' exact tree structure and serves as jit in/out_shardings and restore target.
    """
    def one(v):
        return v.replace(NamedSharding(mesh, spec_for(tuple(v.shape), getattr(v, "axes", None), mesh)))
    return jax.tree.map(one, params, is_leaf=_is_var)


def opt_shardings(tx: optax.GradientTransformation, params, param_sh, mesh: Mesh):
    """Optimizer-state shardings: moments like their params, scalars (count) replicated."""
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(tx, lambda _, s: s, abstract, param_sh,
                                 transform_non_params=lambda _: NamedSharding(mesh, P()))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def global_batch(mesh: Mesh, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Host-local batch rows -> global arrays sharded along the batch axes."""
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim), v) for k, v in local.items()}


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
