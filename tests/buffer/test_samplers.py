"""fifo / windowed / in_order staleness control, partial rollouts, zero-variance filtering."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cfg, lineage, rollouts

from async_rl import config as C
from async_rl.buffer.ledger import Group, Sample
from async_rl.learner import losses
from async_rl.learner.step import Row, build_batch
from async_rl.run.train import train
from async_rl.state.audit import audit


def _check_staleness(run_dir, bound):
    rows = lineage(run_dir)
    assert rows
    for r in rows:
        if not r.get("filtered"):
            assert (r["step"] - 1) - min(r["versions"]) <= bound, r


def _train_with_delay(monkeypatch, delay: str, c):
    """`train(c)` with the fault module's `ASYNC_RL_DELAY` set (read when a point is reached)."""
    monkeypatch.setenv("ASYNC_RL_DELAY", delay)
    try:
        return train(c)
    finally:
        monkeypatch.delenv("ASYNC_RL_DELAY")


def _regenerations(run_dir, res, n_prompts: int) -> list[dict]:
    """The run's drops, checked: each is a regeneration (the rollouts thrown away, the prompt
    generated again), the metric counts each, and every prompt was still trained exactly once."""
    drops = [json.loads(l) for l in (run_dir / "drops.jsonl").read_text().splitlines()]
    assert all(d["reason"] == "stale" and d["what"] == "rollouts" for d in drops), drops
    assert res.history[-1]["data/regenerated"] == len(drops)
    assert sorted(r["prompt_id"] for r in lineage(run_dir)) == list(range(n_prompts))
    return drops


@pytest.mark.parametrize("name, staleness", [("fifo", 0), ("fifo", 2), ("windowed", 0), ("windowed", 1)])
def test_staleness_bound_and_exactly_once(tmp_path, monkeypatch, name, staleness):
    # a learner slower than generation with room for 4 steps of groups: windowed generates
    # ahead and must regenerate what goes stale; fifo draws only what it can train in time
    c = cfg(tmp_path, "data.num_records=40", "rollout.prompts_per_step=4", f"sampler.name={name}",
            f"sampler.max_staleness={staleness}", "engine.max_concurrent_decodes=8",
            "sampler.max_buffered_groups=16")
    res = _train_with_delay(monkeypatch, "step:0.1", c)
    assert res.reason == "data_exhausted"
    _check_staleness(tmp_path, staleness)
    assert audit(tmp_path)["ok"]
    drops = _regenerations(tmp_path, res, 40)
    if name == "windowed":
        assert drops, "no group went stale: the test did not exercise regeneration"


def test_windowed_trains_freshest_first_and_regenerates_stale(tmp_path, monkeypatch):
    # a learner slower than generation: the buffer holds groups of several versions
    c = cfg(tmp_path, "data.num_records=48", "rollout.prompts_per_step=4", "sampler.name=windowed",
            "sampler.max_staleness=0", "sampler.max_buffered_groups=12")
    res = _train_with_delay(monkeypatch, "step:0.15", c)
    _check_staleness(tmp_path, 0)
    assert _regenerations(tmp_path, res, 48)  # over-generated groups went stale
    assert res.history[-1]["perf/regen_tokens_per_1k"] > 0


@pytest.mark.slow
def test_partial_rollout_sample_carries_both_versions(tmp_path, monkeypatch):
    # long completions, few slots and a fast learner: publications land mid-sample
    c = cfg(tmp_path, "data.num_records=24", "rollout.prompts_per_step=2", "rollout.partial=true",
            "rollout.max_new_tokens=12", "model.learned_positions=24", "engine.max_concurrent_decodes=8",
            "sampler.max_lookahead=2", "log.rollouts=true")
    _train_with_delay(monkeypatch, "generate:0.004", c)
    straddling = [s for row in rollouts(tmp_path) for s in row["samples"] if len(set(s["versions"])) > 1]
    assert straddling, "no sample straddled a weight publication"
    for s in straddling:
        assert s["versions"] == sorted(s["versions"])  # continued under newer weights, never older
    assert sorted(r["prompt_id"] for r in lineage(tmp_path)) == list(range(24))


def test_importance_weights_use_per_token_behaviour_logprobs():
    # one sample generated under versions [3, 3, 4, 4]: its behaviour logprobs differ per token
    g = Group(ordinal=0, prompt_id=0, epoch=0, prompt="12=", answer="21", prompt_tokens=np.array([1, 4, 5, 15], np.int32),
              samples=[Sample(tokens=[5, 4, 2, 9], logprobs=[-0.5, -1.0, -0.2, -2.0], versions=[3, 3, 4, 4],
                              done=True, reward=1.0),
                       Sample(tokens=[4, 2], logprobs=[-0.1, -0.3], versions=[4, 4], done=True, reward=0.0)])
    rows = [Row(g.prompt_tokens, s.tokens, s.logprobs, s.versions, s.reward) for s in g.samples]
    b = build_batch(rows, n_rows=2, prompt_len=6, max_new=5, pad_id=0)
    np.testing.assert_array_equal(b.behav_logp_BxN[0, :4], np.float32([-0.5, -1.0, -0.2, -2.0]))
    np.testing.assert_array_equal(b.versions_BxN[0, :4], [3, 3, 4, 4])
    assert b.mask_BxN[0].tolist() == [True] * 4 + [False] and b.mask_BxN[1].tolist() == [True] * 2 + [False] * 3
    new = jnp.asarray(b.behav_logp_BxN) + jnp.array([[0.1, -0.2, 0.3, 0.0, 0.0], [0.05, 0.0, 0, 0, 0]])
    _, stats = losses.policy_loss(new, jnp.asarray(b.behav_logp_BxN), jnp.array([1.0, -1.0]),
                                  jnp.asarray(b.mask_BxN), clip_eps=0.2, correction="tis", is_cap=10.0)
    w = np.exp([0.1, -0.2, 0.3, 0.0, 0.05, 0.0])  # exp(new - behaviour), token by token
    assert float(stats["is_weight_mean"]) == pytest.approx(w.mean(), rel=1e-5)
    assert float(stats["is_weight_max"]) == pytest.approx(w.max(), rel=1e-5)


def test_zero_variance_groups_are_consumed_logged_and_counted(tmp_path):
    res = train(cfg(tmp_path, "data.num_records=24", "rollout.prompts_per_step=4", "rollout.filter_zero_variance=true"))
    rows = lineage(tmp_path)
    filtered = [r for r in rows if r.get("filtered")]
    assert filtered, "a random policy should produce some all-equal groups"
    assert sorted(r["prompt_id"] for r in rows) == list(range(24))  # each consumed exactly once
    drops = [json.loads(l) for l in (tmp_path / "drops.jsonl").read_text().splitlines()]
    assert sorted(d["prompt_id"] for d in drops) == sorted(r["prompt_id"] for r in filtered)
    assert all(d["reason"] == "zero_variance" and len(set(d["rewards"])) == 1 for d in drops)
    assert res.history[-1]["data/dropped/zero_variance"] == len(filtered)
    assert audit(tmp_path)["ok"]


def test_default_configs_drop_nothing(tmp_path):
    train(cfg(tmp_path, "data.num_records=16", "rollout.prompts_per_step=4"))
    assert (tmp_path / "drops.jsonl").read_text() == ""


@pytest.mark.parametrize("overrides, needle", [
    (["sampler.name=fifo"], "sampler.max_staleness"),
    (["sampler.name=fifo", "sampler.max_staleness=1", "sampler.max_buffered_groups=2"], "sampler.max_buffered_groups"),
    (["sampler.max_staleness=1"], "sampler.max_staleness"),
    (["sampler.name=windowed", "sampler.max_staleness=1", "run.determinism=true"], "run.determinism"),
    (["rollout.filter_zero_variance=true", "rollout.samples_per_prompt=1"], "rollout.filter_zero_variance"),
    (["rollout.samples_per_prompt=1"], "rollout.samples_per_prompt=1: must be >= 2: advantages are normalised"),
])
def test_configs_that_cannot_keep_the_invariants_are_refused(overrides, needle):
    with pytest.raises(C.ConfigError, match=needle.replace(".", r"\.")):
        C.load("configs/tiny.yaml", overrides)
