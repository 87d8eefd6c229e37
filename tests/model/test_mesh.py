"""Device meshes: one module builds them all (`sharding.build_mesh`), TPU devices laid out over
the torus and over slices, every other device in the order given. The plan and the run
building the same grids: tests/plan/test_plan.py."""

import re
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pytest

from async_rl.config import ConfigError, MeshConfig
from async_rl.model import sharding

ROOT = Path(__file__).resolve().parents[2]


def test_only_sharding_constructs_a_mesh():
    builders = re.compile(r"\b(Mesh|make_mesh|create_device_mesh|create_hybrid_device_mesh)\(")
    where = sorted(str(p.relative_to(ROOT)) for d in ("async_rl", "bench") for p in (ROOT / d).rglob("*.py")
                   if builders.search(p.read_text()))
    assert where == ["async_rl/model/sharding.py"]


@dataclass(frozen=True)
class FakeTpu:
    """What mesh_utils reads of a TPU device: its chip's place in the torus, host and slice."""
    id: int
    coords: tuple
    process_index: int
    slice_index: int = 0
    core_on_chip: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v4"  # a kind without a hand-made ordering: laid out from coords alone


def pod(x: int, y: int, slices: int = 1) -> list[FakeTpu]:
    """x by y chips per slice, 2x2 chips per host, listed host by host (as jax.devices() is)."""
    out = []
    for s in range(slices):
        hosts = [(hx, hy) for hy in range(0, y, 2) for hx in range(0, x, 2)]
        for h, (hx, hy) in enumerate(hosts):
            for cy in (hy, hy + 1):
                for cx in (hx, hx + 1):
                    out.append(FakeTpu(1000 * s + cy * x + cx, (cx, cy, 0), s * len(hosts) + h, s))
    return out


def hops(a: FakeTpu, b: FakeTpu) -> int:
    return sum(abs(i - j) for i, j in zip(a.coords, b.coords))


def test_tpu_devices_are_laid_out_over_the_torus():
    devs = pod(4, 4)
    grid = sharding.layout(devs, (4, 1, 4))
    assert sorted(d.id for d in grid.flat) == sorted(d.id for d in devs)
    # each tensor group is a line of neighbouring chips; host order alone would jump across hosts
    assert all(hops(row[i], row[i + 1]) == 1 for row in grid.reshape(4, 4) for i in range(3))
    plain = np.array(devs, dtype=object).reshape(4, 4)
    assert not all(hops(row[i], row[i + 1]) == 1 for row in plain for i in range(3))


def test_slices_each_hold_a_block_of_the_outer_axes():
    devs = pod(2, 4, slices=2)
    grid = sharding.layout(devs, (2, 4, 2))  # data over the slices
    assert [{d.slice_index for d in grid[i].flat} for i in range(2)] == [{0}, {1}]
    assert all(hops(row[0], row[1]) == 1 for row in grid.reshape(8, 2))
    grid = sharding.layout(devs, (1, 16, 1))  # no data axis to spare: fsdp's halves
    assert [d.slice_index for d in grid.flat] == [0] * 8 + [1] * 8


def test_a_tpu_subset_with_a_hole_keeps_the_order_given():
    devs = pod(2, 2)[:3]  # a learner beside one engine chip: no whole cuboid
    assert list(sharding.layout(devs, (3, 1, 1)).flat) == devs


def test_other_devices_keep_the_order_given():
    devs = jax.devices()[:4][::-1]
    assert list(sharding.build_mesh(devs, (2, 1, 1, 2), sharding.AXES).devices.flat) == devs
    with pytest.raises(ValueError, match="cannot form a mesh"):
        sharding.layout(devs, (3, 1, 1))


def test_split_gives_each_process_its_engine_share():
    devs = pod(4, 4)  # 4 hosts of 4 chips
    run = sharding.split_devices(devs, MeshConfig(fsdp=3, engine_devices=1), process=2)
    by_id = sorted(devs, key=lambda d: d.id)
    ids = lambda ds: [d.id for d in ds]
    assert [ids(e) for e in run.engine_all] == [[max(d.id for d in devs if d.process_index == p)] for p in range(4)]
    assert run.engine == run.engine_all[2] and not run.shared
    assert sorted(d.id for d in run.learner.devices.flat) == sorted(set(ids(by_id)) - {e[0].id for e in run.engine_all})
    with pytest.raises(ConfigError, match="mesh.engine_devices=4"):
        sharding.split_devices(devs, MeshConfig(engine_devices=4))
