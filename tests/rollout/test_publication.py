"""Weights publication (`rollout.publication`) on its own: versions written once and in order,
the newest few kept, a LoRA run's base once, and a server's fetch of what was written."""

import asyncio

import numpy as np
import pytest
from flax import nnx

from async_rl import config as C
from async_rl.rollout import weights
from async_rl.rollout.publication import KEEP_VERSIONS, Fetcher, Publication


def _publication(tmp_path, *extra):
    cfg = C.load("configs/tiny.yaml", ["engine.backend=remote", "engine.servers=http://127.0.0.1:1", *extra])
    return Publication(cfg, tmp_path / "run", client=None, on_change=lambda: None)


def _tree(v: float, lora: bool = False) -> nnx.State:
    """An engine-layout tree in miniature (leaves `embed/value`, `layers/w/value`, `layers/lora_a/value`)."""
    layer = {"w": nnx.Param(np.full((2, 3), v, np.float32))}
    if lora:
        layer["lora_a"] = nnx.LoRAParam(np.full((3, 1), v + 0.5, np.float32))
    return nnx.State({"embed": nnx.Param(np.arange(6, dtype=np.float32).reshape(2, 3)), "layers": layer})


class _Engine:
    """What `Fetcher` asks of an engine: laying a checked tree out (here, as it is)."""

    @staticmethod
    def load_params(tree):
        return tree


def test_versions_are_written_once_in_order_and_the_newest_few_kept(tmp_path):
    pub = _publication(tmp_path)

    async def publish(v):
        return await pub.publish_newer(_tree(v), v)
    assert asyncio.run(publish(3))
    assert not asyncio.run(publish(3)) and not asyncio.run(publish(2)), "a version no newer was written again"
    for v in range(4, 9):
        assert asyncio.run(publish(v))
    files = sorted(p.name for p in pub.dir.iterdir() if p.suffix == ".npz")
    assert files == [f"v{v:010d}.npz" for v in range(9 - KEEP_VERSIONS, 9)]
    assert pub.given == set(range(3, 9)) and pub.current == (8, str(pub.dir / files[-1]))
    fetched = Fetcher(_Engine(), _tree(0)).fetch(pub.current[1])
    np.testing.assert_array_equal(fetched["layers"]["w"].get_value(), np.full((2, 3), 8, np.float32))


def test_a_lora_run_writes_its_base_once_and_adapters_per_version(tmp_path):
    pub = _publication(tmp_path)
    first = pub.publish(_tree(1, lora=True), 1)
    base_bytes = (pub.dir / "base.npz").read_bytes()
    second = pub.publish(_tree(2, lora=True), 2)
    assert (pub.dir / "base.npz").read_bytes() == base_bytes, "the base was written again"
    assert sorted(weights.load_leaves(second)) == ["layers/lora_a/value"]
    assert sorted(weights.load_leaves(pub.base_uri)) == ["embed/value", "layers/w/value"]
    fetcher = Fetcher(_Engine(), _tree(0, lora=True))
    got = fetcher.fetch(second, base=pub.base_uri)
    np.testing.assert_array_equal(got["layers"]["lora_a"].get_value(), np.full((3, 1), 2.5, np.float32))
    np.testing.assert_array_equal(got["layers"]["w"].get_value(), np.full((2, 3), 1, np.float32))
    with pytest.raises(ValueError, match="leaf embed/value missing from the file"):
        Fetcher(_Engine(), _tree(0, lora=True)).fetch(first)  # adapters alone, and no base named
