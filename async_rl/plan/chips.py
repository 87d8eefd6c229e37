"""The accelerator table: each TPU and GPU the project plans for or benchmarks on, with its figures.

Owns: per-device figures (usable or published HBM, published dense bf16 peak FLOP/s, HBM
bandwidth), how a live or described device is matched to its row (`for_device`), the GPU
names `async-rl plan --topology` takes and the description file each compiles against
(`gpu_specs/`), and the nominal figures of forced host devices. Does not own: topologies
(plan, plan_gpu), what the figures are used for (plan's roofline, the benches' MFU).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int  # usable HBM per device, bytes (TPU: as the compiler enforces it; GPU: published)
    peak_flops: float  # published dense bf16 FLOP/s per device
    hbm_bandwidth: float  # published HBM bytes/s per device
    kind: str = ""  # the device_kind it matches (GPUs: a substring of it)
    spec: str = ""  # GPUs: the GpuTargetConfig file in async_rl/gpu_specs/


# Cloud TPU system architecture pages; usable HBM from the compiler's own out-of-memory
# message for each topology. v4 exposes each of a chip's 2 cores as a device.
TPUS = {c.kind: c for c in (
    Chip("v5e", int(15.75 * GiB), 197e12, 819e9, kind="TPU v5 lite"),
    Chip("v5p", int(95.74 * GiB), 459e12, 2765e9, kind="TPU v5"),
    Chip("v6e", int(31.25 * GiB), 918e12, 1640e9, kind="TPU v6 lite"),
    Chip("v4 (per core)", int(15.25 * GiB), 137.5e12, 614e9, kind="TPU v4"),
)}

# By `--topology` name. NVIDIA's datasheets: H100 Tensor Core GPU (SXM5), H200 Tensor Core
# GPU (SXM), A100 Tensor Core GPU (SXM4 80GB), DGX B200 (per GPU: 1,440 GB and 72 PFLOPS FP8
# over 8 GPUs). Dense figures, i.e. without 2:4 sparsity; memory in decimal bytes.
GPUS = {
    "h100": Chip("H100 SXM 80GB", 80 * 10 ** 9, 989e12, 3.35e12, kind="H100", spec="h100_sxm.txtpb"),
    "h200": Chip("H200 SXM 141GB", 141 * 10 ** 9, 989e12, 4.8e12, kind="H200", spec="h200_sxm.txtpb"),
    "a100-80g": Chip("A100 SXM 80GB", 80 * 10 ** 9, 312e12, 2.039e12, kind="A100", spec="a100_sxm_80.txtpb"),
    "b200": Chip("B200 180GB", 180 * 10 ** 9, 2.25e15, 8e12, kind="B200", spec="b200.txtpb"),
}

# Forced host devices have no published figures: nominal ones, so plan logic can be tested.
NOMINAL_CPU = Chip("cpu (nominal figures)", 16 * GiB, 1e12, 1e11)


def for_device(device) -> Chip | None:
    """The row of a device (live, or from a topology description); None when it has none."""
    kind = getattr(device, "device_kind", "")
    if kind in TPUS:
        return TPUS[kind]
    return next((c for c in GPUS.values() if c.kind in kind), None)
