"""GPU topologies for `async-rl plan`: compile for 8 x H100 (or H200, A100, B200) on any host.

Owns: GPU topology names ("h100:8", "h100:4x8" = nodes x GPUs per node) -> compile-only
CUDA devices, the GPU target descriptions shipped in `gpu_specs/`, and the cost model of a
program compiled for them. Does not own: the GPU figures and which description each
compiles against (chips), the plan itself, its report or JSON (plan).

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
from importlib import resources

from async_rl import config as C
from async_rl.plan.chips import GPUS, Chip

_NAME = re.compile(r"([a-z0-9-]+):(?:(\d+)x)?(\d+)")


def is_gpu(name: str) -> bool:
    m = _NAME.fullmatch(name)
    return bool(m) and m.group(1) in GPUS


def target_config(gpu: str) -> str:
    """The GpuTargetConfig text proto for one of `chips.GPUS` (shipped with the package)."""
    return resources.files("async_rl.plan").joinpath("gpu_specs", GPUS[gpu].spec).read_text()


def topology(name: str) -> tuple[list, Chip]:
    """(devices, chip) for "h100:8" (one node) or "h100:4x8" (4 nodes of 8)."""
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
    # keep nodes contiguous: the mesh's minor (tensor, then fsdp) axes stay inside a node
    return sorted(desc.devices, key=lambda d: (d.process_index, d.id)), GPUS[gpu]


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
