"""LoRA runs end to end: the checkpoint holds the adapters and their optimizer state (not the
base), a resumed run's adapters are bit-identical to the saved ones, a changed base is refused
in one line touching nothing, and a run SIGKILLed at random moments trains every prompt once
(docs/design.md, "LoRA"; I1, I5)."""
import json
import random

import pytest
from helpers import cfg, lineage, tree_digest
from test_crash import crash_and_finish

from async_rl import config as C
from async_rl.run.train import train
from async_rl.state.audit import audit
from async_rl.state.items import saved_arrays
from async_rl.state.layout import step_dir

LORA = ["learner.lora_rank=4", "learner.lora_alpha=8", "learner.lr=3e-3", "learner.warmup_steps=0"]
BASE = ["data.num_records=12", "rollout.prompts_per_step=2", "checkpoint.every_steps=2"]


def test_checkpoint_holds_adapters_restores_them_bit_identically_and_refuses_another_base(tmp_path):
    first = train(cfg(tmp_path, *LORA, *BASE, "train.max_steps=3"))
    ckpts = tmp_path / "checkpoints"
    saved = saved_arrays(step_dir(ckpts, 3) / "state")
    params = [k for k in saved if k.startswith("params.")]
    assert params and all(".lora_a" in k or ".lora_b" in k for k in params)  # no base weight in it
    assert all(".lora_" in k for k in saved if k.startswith("opt.") and len(saved[k][0]) > 1)  # moments: adapters'
    meta = json.loads((step_dir(ckpts, 3) / "meta" / "metadata").read_text())
    assert meta["lora_base"]["seed"] == 0 and len(meta["lora_base"]["digest"]) == 32
    # resumed with nothing left to train: the run reports the adapters it restored
    again = train(cfg(tmp_path, *LORA, *BASE, "train.max_steps=3"))
    assert again.fingerprint == first.fingerprint and again.step == 3
    # another base under the same adapters (a random base is its seed's): one line, nothing touched
    before = tree_digest(tmp_path)
    with pytest.raises(C.ConfigError) as e:
        train(cfg(tmp_path, *LORA, *BASE, "train.max_steps=5", "run.seed=7"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("a random base (run.seed=7): the LoRA adapters in") and \
        "run.seed=0" in msg and "nothing was changed" in msg
    assert tree_digest(tmp_path) == before
    # and the run goes on with its own base: every prompt once
    train(cfg(tmp_path, *LORA, *BASE, "train.max_steps=0"))
    rep = audit(tmp_path)
    assert rep["ok"], rep
    assert sorted(r["prompt_id"] for r in lineage(tmp_path)) == list(range(12))


CRASH = ["data.num_records=16", "rollout.prompts_per_step=2", "data.num_epochs=1", "checkpoint.every_steps=1",
         "checkpoint.keep=2", *LORA]


@pytest.mark.slow
def test_lora_crash_short(tmp_path, xla_cache):
    """Four SIGKILLs (inside a save, right after one, at random moments after steps), resumed each time."""
    rng = random.Random(0)
    schedule = [("at", "ckpt_write:2"), ("random", 3, rng.uniform(0, 0.4)), ("at", "ckpt_saved:4"),
                ("random", 6, rng.uniform(0, 0.4))]
    final = crash_and_finish(tmp_path, CRASH, xla_cache, schedule=schedule)
    assert final["delivered"] >= 4 and final["reason"] == "data_exhausted"
    rep = audit(tmp_path)
    assert rep["ok"], rep
    assert sorted(r["prompt_id"] for r in lineage(tmp_path)) == list(range(16))


@pytest.mark.soak
@pytest.mark.parametrize("partial", [False, True])
def test_soak_lora_crash_matrix(tmp_path, xla_cache, partial):
    """The full-weight matrix's schedule (8+ kills, random moments seeded) with LoRA on."""
    overrides = [*CRASH, "data.num_records=32", f"rollout.partial={str(partial).lower()}"]  # 16 steps: every kill lands
    final = crash_and_finish(tmp_path, overrides, xla_cache, seed=3)
    assert final["reason"] == "data_exhausted"
    rep = audit(tmp_path)
    assert rep["ok"], rep
    assert sorted(r["prompt_id"] for r in lineage(tmp_path)) == list(range(32))
