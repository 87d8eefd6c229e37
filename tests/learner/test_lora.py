"""LoRA: its config fields, the frozen base and adapter-only training, publication of adapters,
the checkpoint's adapters and base digest, and the PEFT export (docs/design.md, "LoRA")."""
from __future__ import annotations

import pytest

from async_rl import config as C
from async_rl.state import compat


@pytest.mark.parametrize("override, needle", [
    ("learner.lora_rank=-1", "learner.lora_rank=-1: must be >= 0"),
    ("learner.lora_alpha=0", "learner.lora_alpha=0.0: must be > 0"),
    ("learner.lora_targets=attention,conv", "learner.lora_targets='attention,conv': unknown projection 'conv'"),
    ("learner.lora_targets=", "learner.lora_targets='': unknown projection ''"),
])
def test_nonsense_lora_fields_are_refused_in_one_line(override, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load("configs/tiny.yaml", ["learner.lora_rank=4", override])
    assert str(e.value).startswith(needle) and "\n" not in str(e.value)


def test_lora_targets_name_groups_or_single_projections():
    lc = C.load("configs/tiny.yaml", ["learner.lora_rank=8", "learner.lora_targets=mlp, q"]).learner
    assert lc.lora_projections == ("q", "gate", "up", "down")
    assert C.LearnerConfig().lora_rank == 0  # off unless asked for
    assert C.LearnerConfig(lora_rank=2).lora_projections == C.LORA_PROJECTIONS


def test_lora_with_the_vllm_backend_is_refused():
    with pytest.raises(C.ConfigError, match="learner.lora_rank=4: needs engine.backend=builtin"):
        C.load("configs/tiny.yaml", ["learner.lora_rank=4", "engine.backend=vllm", "model.hf_path=/x"])


@pytest.mark.parametrize("key, saved, now", [
    ("lora_rank", 0, 8), ("lora_rank", 8, 16), ("lora_alpha", 16.0, 32.0), ("lora_targets", "mlp", "attention")])
def test_changing_lora_on_resume_is_its_own_refused_kind(key, saved, now):
    cfg = C.load("configs/tiny.yaml", ["learner.lora_rank=8", f"learner.{key}={now}"])
    old = C.to_dict(cfg)
    old["learner"] = dict(old["learner"], **{key: saved})
    got = [c for c in compat.changes(old, cfg) if c.key == f"learner.{key}"]
    assert [c.kind for c in got] == ["lora"]
