"""Processes, device meshes and shardings for the learner and the engine.

Owns: joining a multi-process job (`init_distributed`) and small cross-process agreements
(`agree`), splitting the devices between learner and engine (`mesh.engine_devices`), every
device mesh's layout (`build_mesh`: topology-aware on TPU, the run's and `async-rl plan`'s alike),
the learner Mesh with axes (data, fsdp, expert, tensor), the rules that turn a parameter's logical
`axes` metadata into a PartitionSpec, optimizer-state shardings, the batch sharding, and
host-local batches -> global arrays. Does not own: what the arrays mean (model,
learner) or moving weights into the engine (engine.load_params)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from async_rl.config import ConfigError, MeshConfig
from async_rl.errors import RunFailure

AXES = ("data", "fsdp", "expert", "tensor")
# an expert-parallel device holds some experts and computes every block but the experts' on its
# own rows, so the expert axis splits the batch like a data axis
BATCH_AXES = ("data", "fsdp", "expert")
# logical axis name (model Param metadata `axes`) -> mesh axis
RULES = {"vocab": "tensor", "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
         "experts": "expert"}


@dataclass(frozen=True)
class Devices:
    learner: Mesh
    engine: list  # the engine's devices (this process's share)
    shared: bool  # engine and learner use the same devices
    engine_all: list = field(default_factory=list)  # every process's engine devices, by process


def init_distributed() -> bool:
    """Joins a multi-process job when the launcher asks for one.

    `ASYNC_RL_DISTRIBUTED=1` (or `JAX_COORDINATOR_ADDRESS` set) calls
    `jax.distributed.initialize`, which takes the coordinator from JAX_COORDINATOR_ADDRESS and
    the process count and id from ASYNC_RL_NUM_PROCESSES / ASYNC_RL_PROCESS_ID when set, or
    detects a TPU pod, SLURM or Open MPI job itself. Must run before anything touches devices.
    JAX's preemption service is turned off: it installs a SIGTERM handler of its own that
    would swallow the signal our step loop stops on (every process stops at the step
    boundary where any was signalled, through `agree`).
    """
    if os.environ.get("ASYNC_RL_DISTRIBUTED", "") != "1" and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return False
    num = os.environ.get("ASYNC_RL_NUM_PROCESSES")
    pid = os.environ.get("ASYNC_RL_PROCESS_ID")
    from async_rl import signals
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(num_processes=int(num) if num else None, process_id=int(pid) if pid else None)
    signals.reassert()
    return True


def agree(values) -> np.ndarray:
    """Every process's `values` (a flat list of numbers), as a [process_count, n] array."""
    local = np.asarray(values, np.float64).reshape(1, -1)
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(local, tiled=True))


class PeerFailedError(RunFailure):
    """Another process of the job failed; this one stopped with it at the same agreement."""


def agree_or_fail(values, error: BaseException | None) -> np.ndarray:
    """`agree(values)` with one more column: whether each process has failed (`error`, not yet
    raised). When any has, every process raises here, together: this process its own error,
    the others PeerFailedError naming the first failed process and its error's first line.
    Without it a failed process leaves the collectives the others still wait in."""
    flags = agree([*values, error is not None])
    failed = np.flatnonzero(flags[:, -1])
    if not len(failed):
        return flags[:, :-1]
    texts = agree_text(_first_line(error) if error is not None else "")  # every process takes part
    if error is not None:
        raise error
    i = int(failed[0])
    raise PeerFailedError(f"process {i} of {jax.process_count()} failed: {texts[i]}")


def agree_text(text: str, size: int = 400) -> list[str]:
    """Every process's `text` (UTF-8, cut to `size` bytes), by process; a collective like `agree`."""
    b = text.encode()[:size]
    row = np.zeros(size + 1)
    row[0] = len(b)
    row[1:1 + len(b)] = np.frombuffer(b, np.uint8)
    return [bytes(r[1:1 + int(r[0])].astype(np.uint8)).decode(errors="replace") for r in agree(row)]


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def make_devices(cfg: MeshConfig) -> Devices:
    """This run's devices: `split_devices` over every process's devices, this process's engine share."""
    return split_devices(jax.devices(), cfg, jax.process_index())


def split_devices(devices: list, cfg: MeshConfig, process: int | None = None) -> Devices:
    """Splits `devices` (every process's) and builds the learner mesh; errors name the mesh.* field.

    Each process gives its last `mesh.engine_devices` devices (by id) to its own engine; the
    learner mesh spans the remaining devices of every process, process by process. `engine`
    is the share of `process` (None: the first). The run (`make_devices`) and `async-rl plan`
    (a topology's devices) both split and lay out here, so the plan compiles the run's meshes."""
    k = cfg.engine_devices
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    fewest = min(len(ds) for ds in by_process.values())
    if k >= fewest:
        raise ConfigError(f"mesh.engine_devices={k}: must be < the {fewest} devices of each process "
                          "(the learner needs at least one)")
    learner, engine_all = [], []
    for _, ds in sorted(by_process.items()):
        ds = sorted(ds, key=lambda d: d.id)
        learner += ds[:len(ds) - k]
        engine_all.append(ds[len(ds) - k:] if k else ds)
    order = sorted(by_process)
    engine = engine_all[order.index(order[0] if process is None else process)]
    return Devices(learner=learner_mesh(learner, cfg), engine=list(engine), shared=not k, engine_all=engine_all)


def learner_mesh(devices: list, cfg: MeshConfig) -> Mesh:
    """The learner mesh (data, fsdp, expert, tensor) over `devices`, sized by mesh.*."""
    n, rest = len(devices), cfg.fsdp * cfg.expert * cfg.tensor
    data = cfg.data if cfg.data != -1 else n // rest
    if data < 1 or data * rest != n:
        raise ConfigError(f"mesh.data={cfg.data} mesh.fsdp={cfg.fsdp} mesh.expert={cfg.expert} "
                          f"mesh.tensor={cfg.tensor}: product must equal the {n} learner devices")
    return build_mesh(devices, (data, cfg.fsdp, cfg.expert, cfg.tensor), AXES)


def build_mesh(devices: list, shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
    """A Mesh of `shape` over `devices`, laid out by `layout`. Every Mesh of the package is built
    here or in `stacked_mesh`, so the plan and the run lay the same devices out alike."""
    return Mesh(layout(devices, shape), axes)


def stacked_mesh(groups: list[list], shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
    """A Mesh with a leading axis over `groups` (one per process), each group laid out as
    `build_mesh(group, shape, ...)` lays it out; `axes` names the leading axis first."""
    return Mesh(np.stack([layout(g, shape) for g in groups]), axes)


def layout(devices: list, shape: tuple[int, ...]) -> np.ndarray:
    """`devices` as an array of `shape`, the last axes (the most communication) on the closest
    devices. On TPU: over the torus (`mesh_utils.create_device_mesh`); devices of several
    slices each hold a block of the outer axes (`create_hybrid_device_mesh`; the data axis first,
    the slices' links being the slowest). Elsewhere, and for a TPU subset that is no whole
    cuboid of chips (a learner beside engine devices): the order given, which for the run's
    meshes is process by process, by id, so a GPU node holds a block of the inner axes."""
    devices = list(devices)
    if len(devices) != int(np.prod(shape)):
        raise ValueError(f"{len(devices)} devices cannot form a mesh of shape {shape}")
    grid = _torus(devices, shape) if devices[0].platform == "tpu" else None
    return grid if grid is not None else np.array(devices, dtype=object).reshape(shape)


def _torus(devices: list, shape: tuple[int, ...]) -> np.ndarray | None:
    from jax.experimental import mesh_utils
    n_slices = len({getattr(d, "slice_index", None) or 0 for d in devices})
    try:
        if n_slices == 1:
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        outer, left = [], n_slices
        for size in shape:
            outer.append(math.gcd(left, size))
            left //= outer[-1]
        if left != 1:
            return None  # the slice count does not divide the axes: the order given
        inner = tuple(size // o for size, o in zip(shape, outer))
        return mesh_utils.create_hybrid_device_mesh(inner, outer, devices, allow_split_physical_axes=True)
    except (AssertionError, ValueError, NotImplementedError):  # mesh_utils' ways of refusing a set of devices
        return None


def batch_shards(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def spec_for(shape: tuple[int, ...], axes: tuple | None, mesh: Mesh, skip: tuple = ()) -> P:
    """PartitionSpec from logical axes; an axis that does not divide its dim stays replicated,
    and so does one mapped to a mesh axis in `skip`."""
    if not axes:
        return P()
    out = []
    for dim, name in zip(shape, axes):
        m = RULES.get(name) if name else None
        m = m if m in mesh.shape else None  # the engine mesh has no fsdp axis
        out.append(m if m and m not in skip and mesh.shape[m] > 1 and dim % mesh.shape[m] == 0 else None)
    return P(*out)


def layer_gatherer(mesh: Mesh, dtype, keep: tuple = ()):
    """For one layer's parameters inside the layer scan: cast matrices and biases to the
    compute dtype, then all-gather them over fsdp (tensor-parallel splits stay). Without
    it the partitioner may keep a weight split on its input dim and accumulate fp32
    partial products of the activations instead (measured: 3x the bytes per layer on v5e).
    Parameters with a logical axis in `keep` are cast only: their module gathers them."""
    dtype = jax.numpy.dtype(dtype)

    def one(v):
        axes = getattr(v, "axes", None)
        x = v.get_value()
        if axes is None:
            return v
        axes = axes[len(axes) - x.ndim:]  # a sliced stacked parameter keeps its "layers" name
        if x.dtype != dtype and "embed" in axes and x.ndim >= 1 and axes != ("embed",):
            x = x.astype(dtype)  # norm scales stay in their (fp32) dtype
        if mesh.shape["fsdp"] > 1 and not set(axes) & set(keep):
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(x.shape, axes, mesh, skip=("fsdp",))))
        return v.replace(x)

    if mesh.shape["fsdp"] == 1 and jax.numpy.dtype(dtype) == jax.numpy.float32:
        return None
    return lambda state: jax.tree.map(one, state, is_leaf=is_var)


def is_var(x) -> bool:
    """An nnx.Variable box: the leaf of a parameter tree (its metadata names the sharding)."""
    return isinstance(x, nnx.Variable)


def param_shardings(params: nnx.State, mesh: Mesh):
    """NamedShardings for an nnx.State of Params (concrete or abstract), from their `axes`.

    The result keeps the State's Variable nodes (each holding a NamedSharding), so it has
    the params' exact tree structure and serves as jit in/out_shardings and restore target.
    """
    def one(v):
        return v.replace(NamedSharding(mesh, spec_for(tuple(v.shape), getattr(v, "axes", None), mesh)))
    return jax.tree.map(one, params, is_leaf=is_var)


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
