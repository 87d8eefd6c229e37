"""Every item of a checkpoint step is verified before use: a truncated, bit-flipped or
deleted item makes the step damaged (named), and the previous step is chosen; a config
that does not fit a healthy step is refused, not called damaged (docs/design.md, "Run
directory safety")."""
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cfg

from async_rl import config as C
from async_rl.run.build import build
from async_rl.run.train import train
from async_rl.state.items import state_digests

OV = ["data.num_records=16", "rollout.prompts_per_step=4", "checkpoint.every_steps=2", "checkpoint.keep=3",
      "train.max_steps=4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "run"
    train(cfg(root, *OV))
    return root


def _choose(run_dir: Path, *overrides: str):
    c = cfg(run_dir, *OV, *overrides)
    parts = build(c, run_dir, log=lambda m: None)
    return parts.ckpt.restore_latest(parts.learner.abstract_state(), cfg=c, warn=lambda m: None)


def _data_files(d: Path) -> list[Path]:
    """The item's data: for `state` every array-data file Orbax wrote (which of them hold live
    values depends on its layout), else the largest file."""
    files = [p for p in d.rglob("*") if p.is_file() and p.name != "commit_success.txt"]
    if d.name == "state":
        return [p for p in files if p.parent.name == "d"]
    return [max(files, key=lambda p: p.stat().st_size)]


def _truncate(item: Path) -> None:
    for f in _data_files(item):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip(item: Path) -> None:
    for f in _data_files(item):
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x10
        f.write_bytes(bytes(b))


def _delete(item: Path) -> None:
    shutil.rmtree(item)


@pytest.mark.parametrize("fault", [_truncate, _flip, _delete], ids=["truncated", "bit_flip", "deleted"])
@pytest.mark.parametrize("item", ["state", "data", "ledger", "meta"])
def test_a_damaged_item_falls_back_to_the_previous_step(run, tmp_path, item, fault):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    fault(copy / "checkpoints" / "4" / item)
    choice = _choose(copy)
    assert choice.restored is not None and choice.restored.step == 2
    assert [d.step for d in choice.damaged] == [4]
    assert choice.damaged[0].why.startswith(f"{item}:"), choice.damaged[0].why
    assert (copy / "checkpoints" / "4").exists()  # choosing reads only; setting aside is train's


def test_a_healthy_step_restores_with_matching_digests(run):
    choice = _choose(run)
    assert choice.restored.step == 4 and not choice.damaged
    assert choice.restored.meta["digests"]["state"] == state_digests(choice.restored.state)[0]


@pytest.mark.parametrize("change, kind", [("model.d_model=48", "state"), ("learner.grad_clip=0", "state"),
                                          ("data.seed=5", "stream"), ("sampler.name=fifo", "stream"),
                                          ("data.num_epochs=3", None), ("rollout.max_new_tokens=3", "lowered"),
                                          ("rollout.max_new_tokens=8", None)])
def test_a_config_that_does_not_fit_is_refused_not_damaged(run, change, kind):
    extra = ["sampler.max_staleness=1"] if "fifo" in change else []
    if kind is None:  # more epochs: free to change
        assert _choose(run, change).restored.step == 4
        return
    with pytest.raises(C.ConfigError) as e:
        _choose(run, change, *extra)
    assert change.split("=")[0] in str(e.value) and "nothing was changed" in str(e.value)


def test_reset_optimizer_restores_the_parameters_only(run):
    choice = _choose(run, "learner.grad_clip=0", "run.reset_optimizer=true")
    r = choice.restored
    assert r.reset_optimizer and r.state["opt"] is None and r.step == 4


def test_state_digest_sees_any_single_element_change_and_ignores_sharding():
    x = jnp.arange(24, dtype=jnp.float32).reshape(4, 6)
    base, finite = state_digests({"a": x, "b": jnp.ones((3,), jnp.bfloat16), "n": jnp.int32(3)})
    assert finite
    for i in range(24):
        y = x.reshape(-1).at[i].add(1e-6 if i else 1.0).reshape(4, 6)
        assert state_digests({"a": y, "b": jnp.ones((3,), jnp.bfloat16), "n": jnp.int32(3)})[0]["a"] != base["a"]
    swapped = x.reshape(-1)[::-1].reshape(4, 6)  # same values, other places
    assert state_digests({"a": swapped})[0]["a"] != base["a"]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b")))
    assert state_digests({"a": sharded})[0]["a"] == base["a"]
    assert not state_digests({"a": x.at[0, 0].set(jnp.nan)})[1]


def test_ledger_validation_catches_inconsistent_arrays():
    from async_rl.buffer.ledger import Ledger
    led = Ledger(2)
    for i in range(3):
        g = led.add({"prompt_id": i, "epoch": 0, "prompt": "1=", "answer": "1",
                     "prompt_tokens": np.ones(2, np.int32)}, target_step=1)
        g.samples[0].tokens, g.samples[0].logprobs, g.samples[0].versions = [3, 4], [-0.1, -0.2], [1, 2]
    snap = led.snapshot()
    snap.validate(max_version=2)
    with pytest.raises(ValueError, match="versions"):
        snap.validate(max_version=1)  # tokens generated with weights newer than the saved ones
    broken = {"sample_lens": snap.arrays["sample_lens"] + 1,
              "group_ints": snap.arrays["group_ints"] * np.array([0, 1, 1, 1, 1]),  # ordinals collide
              "reward": np.where(np.arange(6) == 1, 0.5, snap.arrays["reward"])}  # unfinished, rewarded
    for name, arr in broken.items():
        with pytest.raises(ValueError):
            type(snap)(header=snap.header, arrays=dict(snap.arrays, **{name: arr})).validate()


def test_two_swapped_words_in_the_ledger_are_refused(tmp_path):
    """The ledger arrays' digest sees a reordering that keeps every byte (a sum of words would not)."""
    from async_rl.buffer.ledger import Ledger
    from async_rl.state.items import Damaged, LedgerHandler, LedgerSave, process_prefix_here, read_ledger
    led = Ledger(2)
    for i in range(3):
        g = led.add({"prompt_id": i, "epoch": 0, "prompt": "1=", "answer": "1",
                     "prompt_tokens": np.arange(1, 9, dtype=np.int32)}, target_step=1)
        g.samples[0].tokens, g.samples[0].logprobs, g.samples[0].versions = [3, 4], [-0.1, -0.2], [0, 0]
    LedgerHandler().save(tmp_path, LedgerSave(cut=led.snapshot(), step=1))
    pre = process_prefix_here()
    assert read_ledger(tmp_path, pre).header["next_ordinal"] == 3
    header = json.loads((tmp_path / f"{pre}.json").read_text())
    binf = tmp_path / f"{pre}.bin"
    raw = bytearray(binf.read_bytes())
    tokens = header["arrays"]["prompt_tokens"]
    lo = tokens["offset"]  # tokens 1..8 of the first prompt: words (1, 2) and (3, 4) differ
    raw[lo:lo + 8], raw[lo + 8:lo + 16] = raw[lo + 8:lo + 16], raw[lo:lo + 8]
    binf.write_bytes(bytes(raw))
    with pytest.raises(Damaged, match="prompt_tokens"):
        read_ledger(tmp_path, pre)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_the_ledgers_routes_go_through_the_checkpoint_item(tmp_path, dtype):
    """Routing replay's optional arrays are written, digested and read back like the others."""
    from async_rl.buffer.ledger import Ledger
    from async_rl.state.items import Damaged, LedgerHandler, LedgerSave, process_prefix_here, read_ledger
    led = Ledger(2)
    rows = np.random.default_rng(1).integers(0, 250, (2 + 3 - 1, 4, 2)).astype(dtype)
    g = led.add({"prompt_id": 0, "epoch": 0, "prompt": "1=", "answer": "1",
                 "prompt_tokens": np.arange(1, 3, dtype=np.int32)}, target_step=1)
    s = g.samples[1]
    s.tokens, s.logprobs, s.versions, s.routes = [3, 4, 5], [-0.1, -0.2, -0.3], [0, 0, 0], [rows[:1], rows[1:]]
    LedgerHandler().save(tmp_path, LedgerSave(cut=led.capture(), step=1))
    pre = process_prefix_here()
    snap = read_ledger(tmp_path, pre)
    assert snap.arrays["routes"].dtype == dtype and snap.arrays["route_lens"].tolist() == [0, 4]
    back = Ledger.from_snapshot(snap).groups[0].samples
    assert back[0].routes == [] and back[1].route_rows().dtype == dtype
    np.testing.assert_array_equal(back[1].route_rows(), rows)
    header = json.loads((tmp_path / f"{pre}.json").read_text())
    binf = tmp_path / f"{pre}.bin"
    raw = bytearray(binf.read_bytes())
    raw[header["arrays"]["routes"]["offset"]] ^= 1  # one expert id changed
    binf.write_bytes(bytes(raw))
    with pytest.raises(Damaged, match="routes"):
        read_ledger(tmp_path, pre)
