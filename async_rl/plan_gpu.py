"""GPU topologies for `async-rl plan`: compile for 8 x H100 (or H200, A100, B200) on any host.

Owns: GPU topology names ("h100:8", "h100:4x8" = nodes x GPUs per node) -> compile-only
CUDA devices, the GPU figures (HBM, published peak dense bf16 FLOP/s and HBM bandwidth),
the GPU target descriptions shipped in `gpu_specs/`, and the cost model of a program
compiled for them. Does not own: the plan itself, its report or JSON (plan).

How: the CUDA PJRT plugin (the `gpu-plan` extra) compiles for a GPU described by a text
GpuTargetConfig, with no GPU and no CUDA driver, when JAX runs on the CPU platform
(JAX_PLATFORMS=cpu, which the plan command sets; otherwise the plugin probes for a driver and
does not register). A program compiled this way has no cost analysis of its own, so its
optimised HLO module is costed by XLA's HLO cost analysis on the CPU client: the same
counting rules (2 FLOPs per multiply-add, operand and result bytes per instruction).
cuDNN's fused attention is a custom call, opaque to that count: the plan adds its FLOPs
from the causal formula, as it does for TPU's splash kernels.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

from . import config as C


@dataclass(frozen=True)
class Gpu:
    spec: str  # file in async_rl/gpu_specs/
    name: str
    hbm_bytes: int  # published memory per GPU (decimal bytes)
    peak_flops: float  # published dense bf16 tensor-core FLOP/s per GPU
    hbm_bandwidth: float  # published HBM bytes/s per GPU


# NVIDIA's datasheets: H100 Tensor Core GPU (SXM5), H200 Tensor Core GPU (SXM), A100 Tensor
# Core GPU (SXM4 80GB), DGX B200 (per GPU: 1,440 GB and 72 PFLOPS FP8 over 8 GPUs). Dense
# figures, i.e. without 2:4 sparsity.
GPUS = {
    "h100": Gpu("h100_sxm.txtpb", "H100 SXM 80GB", 80 * 10 ** 9, 989e12, 3.35e12),
    "h200": Gpu("h200_sxm.txtpb", "H200 SXM 141GB", 141 * 10 ** 9, 989e12, 4.8e12),
    "a100-80g": Gpu("a100_sxm_80.txtpb", "A100 SXM 80GB", 80 * 10 ** 9, 312e12, 2.039e12),
    "b200": Gpu("b200.txtpb", "B200 180GB", 180 * 10 ** 9, 2.25e15, 8e12),
}
_NAME = re.compile(r"([a-z0-9-]+):(?:(\d+)x)?(\d+)")


def is_gpu(name: str) -> bool:
    m = _NAME.fullmatch(name)
    return bool(m) and m.group(1) in GPUS


def target_config(gpu: str) -> str:
    """The GpuTargetConfig text proto for one of GPUS (shipped with the package)."""
    return resources.files("async_rl").joinpath("gpu_specs", GPUS[gpu].spec).read_text()


def topology(name: str):
    """(devices, plan.Chip) for "h100:8" (one node) or "h100:4x8" (4 nodes of 8)."""
    from .plan import Chip
    m = _NAME.fullmatch(name)
    if not m or m.group(1) not in GPUS:
        raise C.ConfigError(f"--topology={name}: GPU names are {', '.join(k + ':8' for k in GPUS)} or NODESxGPUS "
                            "such as h100:4x8")
    gpu, nodes, per_node = m.group(1), int(m.group(2) or 1), int(m.group(3))
    if nodes < 1 or not 1 <= per_node <= 8:
        raise C.ConfigError(f"--topology={name}: 1 to 8 GPUs per node, at least one node")
    try:
        import jax
        from jax.experimental import topologies
        if jax.config.jax_platforms != "cpu":
            raise RuntimeError("JAX_PLATFORMS must be cpu before jax starts (the CUDA plugin needs it to compile "
                               "without a GPU)")
        desc = topologies.get_topology_desc(platform="cuda", target_config=target_config(gpu),
                                            topology=f"{nodes}x1x{per_node}")
    except Exception as e:  # no plugin, or the plugin refused the description
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise C.ConfigError(f"--topology={name}: cannot describe this GPU topology ({why}); it needs the CUDA "
                            "compiler plugin: pip install -e '.[gpu-plan]'") from None
    g = GPUS[gpu]
    # keep nodes contiguous: the mesh's minor (tensor, then fsdp) axes stay inside a node
    devs = sorted(desc.devices, key=lambda d: (d.process_index, d.id))
    return devs, Chip(g.name, g.hbm_bytes, g.peak_flops, g.hbm_bandwidth)


def hlo_cost(compiled) -> tuple[float, float]:
    """(FLOPs, bytes accessed) per device of a program compiled for a GPU description."""
    import jax
    from jax._src.lib import _jax
    cpu = jax.devices("cpu")[0].client
    total = [0.0, 0.0]
    for module in compiled.runtime_executable().hlo_modules():
        ca = _jax.hlo_module_cost_analysis(cpu, module)
        total[0] += float(ca.get("flops", 0.0))
        total[1] += float(ca.get("bytes accessed", 0.0))
    return total[0], total[1]


def uses_cudnn_attention(compiled) -> bool:
    """Whether the compiled program runs cuDNN's fused attention (its custom calls)."""
    return "__cudnn$fmha" in compiled.as_text()
