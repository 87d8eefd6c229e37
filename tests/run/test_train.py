"""End-to-end training in-process: lineage exactly-once, remainders, learning signal."""
import time
from collections import Counter

import numpy as np
import pytest
from helpers import cfg, lineage, steps_of

from async_rl.run.train import train
from async_rl.state.audit import audit


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_every_prompt_trained_exactly_once(tmp_path, lookahead):
    c = cfg(tmp_path, "data.num_records=24", "rollout.prompts_per_step=4", f"sampler.max_lookahead={lookahead}")
    res = train(c)
    assert res.step == 6 and res.reason == "data_exhausted"
    rows = lineage(tmp_path)
    assert sorted(r["prompt_id"] for r in rows) == list(range(24))
    # in_order: step s trains exactly ordinals 4(s-1) .. 4s-1, generated at most `lookahead` versions back
    for r in rows:
        assert r["step"] == r["ordinal"] // 4 + 1
        assert all(r["step"] - 1 - lookahead <= v <= r["step"] - 1 for v in r["versions"])
    rep = audit(tmp_path)
    assert rep["ok"] and rep["epochs"][0]["trained_once"] == 24


def test_remainder_step_trains_the_rest(tmp_path):
    res = train(cfg(tmp_path, "data.num_records=26", "rollout.prompts_per_step=4", "data.shuffle=false",
                    "engine.steps_per_call=3"))
    steps = steps_of(tmp_path)
    assert res.step == 7 and len(steps) == 7
    assert steps[7] == [24, 25]
    assert Counter(p for ids in steps.values() for p in ids) == Counter(range(26))


def test_two_epochs_each_prompt_once_per_epoch(tmp_path):
    train(cfg(tmp_path, "data.num_records=10", "rollout.prompts_per_step=4", "data.num_epochs=2"))
    rows = lineage(tmp_path)
    for e in (0, 1):
        assert sorted(r["prompt_id"] for r in rows if r["epoch"] == e) == list(range(10))
    assert audit(tmp_path)["ok"]


def test_max_steps_ends_cleanly(tmp_path):
    res = train(cfg(tmp_path, "data.num_records=64", "rollout.prompts_per_step=4", "train.max_steps=3"))
    assert res.step == 3 and res.reason == "max_steps"
    assert max(r["step"] for r in lineage(tmp_path)) == 3
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3


@pytest.mark.slow
def test_short_run_improves_reward(tmp_path):
    # the tiny preset's model and task; 70 steps of 32 prompts x 8 samples (the held-out
    # evaluation is off: the rollout reward is what is asserted; test_evaluate covers eval)
    from async_rl import config as C
    c = C.load("configs/tiny.yaml", [f"run.dir={tmp_path}", "log.progress=false", "log.tensorboard=false",
                                     "run.compilation_cache=", "rollout.prompts_per_step=32",
                                     "train.max_steps=70", "checkpoint.every_steps=0", "eval.every_steps=0"])
    res = train(c)
    r = [h["rollout/reward_mean"] for h in res.history]
    first, last = np.mean(r[:5]), np.mean(r[-5:])
    assert last > first + 0.2, (first, last)
    assert (tmp_path / "reward.png").stat().st_size > 1000


def test_disjoint_engine_devices_and_kl(tmp_path):
    # 4 devices: 1 for the engine, 3 for the learner (data=3); a KL penalty to the initial policy
    res = train(cfg(tmp_path, "data.num_records=12", "rollout.prompts_per_step=3", "mesh.engine_devices=1",
                    "learner.kl_coef=0.05", "sampler.max_lookahead=1"))
    assert res.step == 4
    assert all("learner/kl" in h and h["learner/kl"] >= -1e-6 for h in res.history)  # k3 >= 0 up to rounding
    assert res.history[0]["learner/kl"] == pytest.approx(0.0, abs=1e-6)  # step 1 trains the initial policy
    assert sorted(r["prompt_id"] for r in lineage(tmp_path)) == list(range(12))




def test_a_model_too_large_for_memory_is_refused_at_start(tmp_path):
    from helpers import cfg

    from async_rl.config import ConfigError
    from async_rl.model import flops
    from async_rl.plan import memory
    from async_rl.run.train import train
    with pytest.raises(ConfigError, match=r"the run needs at least .* GiB .*run\.memory_check=false"):
        train(cfg(tmp_path, "model.d_model=65536", "model.n_layers=64", "model.d_ff=131072"))
    assert not (tmp_path / "lineage.jsonl").exists()
    small = cfg(tmp_path, "model.d_model=64", "model.n_layers=2", "model.d_ff=256")
    assert flops.param_count(small.model, 16) < 200_000 and sum(memory.estimate(small, 16).values()) < 2**24


def test_the_compilation_cache_holds_the_runs_programs_and_then_the_callers_settings_return(tmp_path):
    """run.compilation_cache takes every program the run compiles, even after the caller has
    compiled (JAX settles its cache settings at the first compile); once the run ends the
    caller's settings are back and its later compilations are not written there."""
    import jax
    import jax.numpy as jnp

    from async_rl.run.build import compilation_cache
    before = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                    "jax_persistent_cache_min_compile_time_secs")}
    jax.jit(lambda x: x + 11)(jnp.ones(3))  # the caller compiles first
    with compilation_cache(str(tmp_path / "cache")):
        jax.jit(lambda x: x * 13 - 1)(jnp.ones(5))
    written = set((tmp_path / "cache").iterdir())
    assert written
    jax.jit(lambda x: x * 17 - 2)(jnp.ones(6))
    assert set((tmp_path / "cache").iterdir()) == written
    assert {k: getattr(jax.config, k) for k in before} == before


def test_a_non_finite_step_is_never_saved_and_skip_goes_on_without_it(tmp_path, monkeypatch):
    """Step 3's loss is NaN. learner.nonfinite=fail stops the run naming step 3 with its checkpoints
    finite; the resume under skip trains past it: step 3's update is not applied, its groups are
    consumed (lineage) and named in drops.jsonl, and every prompt is still trained exactly once."""
    import math

    from helpers import checkpoint_steps, run_jsonl

    import async_rl.run.train as train_mod
    from async_rl.state.checkpoint import NonFiniteError
    build_batch, calls = train_mod.build_batch, {"n": 0, "poison": 3}

    def poisoned(rows, **kw):
        calls["n"] += 1
        if calls["n"] == calls["poison"]:
            rows = [rows[0]._replace(reward=float("nan")), *rows[1:]]
        return build_batch(rows, **kw)
    monkeypatch.setattr(train_mod, "build_batch", poisoned)
    args = ["data.num_records=16", "rollout.prompts_per_step=4", "checkpoint.every_steps=1"]
    with pytest.raises(NonFiniteError) as e:
        train(cfg(tmp_path, *args))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("step 3: ") and "not applied" in msg and "nonfinite=skip" in msg, msg
    assert checkpoint_steps(tmp_path) == [1, 2]
    calls.update(n=0, poison=1)  # the resumed run's first step is step 3
    res = train(cfg(tmp_path, *args, "learner.nonfinite=skip"))
    assert res.exit_code == 0 and res.step == 4
    rows = {r["step"]: r for r in run_jsonl(tmp_path, "metrics.jsonl")}
    assert rows[3]["learner/skipped_updates"] == 1 and rows[4]["learner/skipped_updates"] == 0
    assert rows[3]["learner/loss"] is None and math.isfinite(rows[4]["learner/loss"])
    drops = [d for d in run_jsonl(tmp_path, "drops.jsonl") if d["reason"] == "nonfinite"]
    assert sorted(d["step"] for d in drops) == [3] * 4 and all(d["updates_skipped"] == 1 for d in drops)
    assert audit(tmp_path)["ok"] and sorted(steps_of(tmp_path)) == [1, 2, 3, 4]


def test_the_compilation_cache_stays_under_its_cap_evicting_the_least_recently_used(tmp_path):
    """run.compilation_cache_max_gb caps the folder: entries written before a cap was set (no
    access time) are evicted oldest first when a capped run starts, and every program it
    compiles is written, evicting older ones, so the folder never passes the cap."""
    import jax
    import jax.numpy as jnp

    from async_rl.run.build import compilation_cache
    folder, x = tmp_path / "cache", jnp.ones(9)  # only the programs below go in the cache

    def compile_(i):
        jax.jit(lambda x: x * (i + 100) - i)(x)

    def entries():
        return sorted(folder.glob("*-cache"), key=lambda p: p.stat().st_mtime_ns)

    def total():
        return sum(p.stat().st_size for p in entries())

    with compilation_cache(str(folder)):  # no cap
        for i in range(4):
            compile_(i)
            time.sleep(0.01)
    old = entries()
    assert len(old) == 4
    cap = 2.5 * max(p.stat().st_size for p in old)  # room for two entries
    with compilation_cache(str(folder), cap / 1e9):
        assert total() <= cap and {p.name for p in entries()} == {p.name for p in old[2:]}  # the oldest went
        for i in range(4, 7):
            compile_(i)
            assert total() <= cap
            assert len(entries()) == 2
    assert not {*entries()} & {*old}  # each program the capped run compiled was written


def test_a_cache_folder_that_changes_under_the_trim_warns_and_the_run_goes_on(tmp_path, monkeypatch):
    """Another process writing or evicting the same cache folder can take an entry between our
    look and JAX's eviction (FileNotFoundError): trimming warns in one line and never raises."""
    from jax._src import lru_cache

    from async_rl.run.build import trim_compilation_cache
    (tmp_path / f"a{lru_cache._CACHE_SUFFIX}").write_bytes(b"x" * 10)
    calls = []

    def gone(self):
        calls.append(1)
        raise FileNotFoundError(2, "No such file or directory", str(tmp_path / f"a{lru_cache._ATIME_SUFFIX}"))
    monkeypatch.setattr(lru_cache.LRUCache, "_evict_if_needed", gone)
    lines = []
    trim_compilation_cache(tmp_path, 5, log=lines.append)
    assert len(calls) == 3 and len(lines) == 1 and "\n" not in lines[0], (calls, lines)
    assert lines[0].startswith("warning: run.compilation_cache=") and "FileNotFoundError" in lines[0]
