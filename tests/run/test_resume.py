"""Resume scenarios, each with real training subprocesses (docs/design.md I2, I3, I5, I7)."""
import collections
import json
import shutil

import numpy as np
import pytest
from helpers import FAST, cfg, checkpoint_steps, lineage, read_ledger, rollouts, run_cli, steps_of, tree_digest

from async_rl.config import ConfigError
from async_rl.run.cli import main
from async_rl.run.train import train
from async_rl.state.audit import audit

PPS = 3  # prompts per step
BASE = ["data.shuffle=false", "data.num_records=24", f"rollout.prompts_per_step={PPS}"]


def refused_cli(capsys, run_dir, *overrides) -> str:
    """`async-rl train` in-process (a refusal happens before anything is compiled or written: no
    process of its own needed), which must exit 2 with one `error:` line; its stderr."""
    code = main(["train", "--config", "configs/tiny.yaml", f"run.dir={run_dir}", *FAST, *overrides])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert len([line for line in err.splitlines() if line.startswith("error: ")]) == 1, err[-2000:]
    return err


# 4 steps of BASE buffering 3 steps ahead, checkpoints 2 and 4
AHEAD = [*BASE, "sampler.max_lookahead=3", "checkpoint.every_steps=2", "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def _four_ahead(tmp_path_factory, xla_cache):
    """AHEAD trained to step 4 once: the tests that start from it take a copy each."""
    run = tmp_path_factory.mktemp("four_ahead")
    r = run_cli(run, *AHEAD, "train.max_steps=4", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    return run


@pytest.fixture
def four_ahead(_four_ahead, tmp_path):
    """A copy of the 4-step AHEAD run in tmp_path / "run"."""
    return shutil.copytree(_four_ahead, tmp_path / "run")


# CI runs lookahead 3 (more groups buffered across the resume; the shared AHEAD run); the same
# path at 1 under `make soak`
@pytest.mark.parametrize("lookahead", [pytest.param(1, marks=pytest.mark.soak), 3])
def test_buffered_run_ahead(tmp_path, xla_cache, request, lookahead):
    ov = [*BASE, f"sampler.max_lookahead={lookahead}", "checkpoint.every_steps=2", "checkpoint.keep=3"]
    if lookahead == 3:
        run = request.getfixturevalue("four_ahead")
    else:
        run = tmp_path
        r = run_cli(run, *ov, "train.max_steps=4", cache=xla_cache)
        assert r.returncode == 0, r.stderr
    r = run_cli(run, *ov, "train.max_steps=6", cache=xla_cache)
    assert r.returncode == 0, r.stderr
    assert "resumed step 4" in r.stderr
    steps = steps_of(run)
    assert steps[5] == [12, 13, 14] and steps[6] == [15, 16, 17]
    assert sorted(p for s in range(1, 7) for p in steps[s]) == list(range(18))


def test_oversampled_generation(tmp_path, xla_cache):
    base = ["data.shuffle=false", "data.num_records=8", "rollout.prompts_per_step=2", "sampler.max_lookahead=2"]
    r = run_cli(tmp_path, *base, "train.max_steps=1", cache=xla_cache)
    assert r.returncode == 0, r.stderr
    assert steps_of(tmp_path) == {1: [0, 1]}
    r = run_cli(tmp_path, *base, "train.max_steps=2", cache=xla_cache)
    assert r.returncode == 0, r.stderr
    assert steps_of(tmp_path)[2] == [2, 3]


def _resume_from(src, dst, step):
    """A copy of run `src` whose newest checkpoint is `step` (later ones removed)."""
    shutil.copytree(src, dst)
    for s in checkpoint_steps(dst):
        if s > step:
            shutil.rmtree(dst / "checkpoints" / str(s))
    return dst


@pytest.mark.slow
def test_partly_filled_step_and_in_flight_samples(tmp_path, xla_cache):
    # a slow engine (few slots, long completions, 30 ms a token) and a learner that rests
    # 0.3 s after each step: a save catches a step to come with some of its groups READY and
    # the rest part-way through generation, pending or not yet drawn (how far ahead the pump
    # is at a save varies), and one catches a sample part-way through
    slow = [*BASE, "sampler.max_lookahead=1", "engine.max_concurrent_decodes=4", "rollout.max_new_tokens=12",
            "data.max_digits=6", "model.learned_positions=24", "checkpoint.every_steps=1", "checkpoint.keep=100", "checkpoint.async=false",
            "log.rollouts=true", "train.max_steps=6"]
    src = tmp_path / "src"
    r = run_cli(src, *slow, cache=xla_cache, delay="generate:0.03,step:0.3")
    assert r.returncode == 0, r.stderr
    caught = {}  # saved step -> its ledger and what it caught: "partial" (step), "inflight" (sample)
    for s in checkpoint_steps(src)[:-1]:
        led = read_ledger(src, s)
        ready = collections.Counter(g.target_step for g in led.groups.values() if g.state.name == "READY" and g.target_step > s)
        kinds = {"partial"} if any(n < PPS for n in ready.values()) else set()
        if any(x.tokens and not x.done for g in led.groups.values() for x in g.samples):
            kinds.add("inflight")
        caught[s] = (led, kinds)
    found = {k: [s for s in caught if k in caught[s][1]] for k in ("partial", "inflight")}
    assert found["partial"] and found["inflight"], "no save caught a partly generated step"
    # one resume where one save caught both, else one from each kind's first save
    both = [s for s in caught if len(caught[s][1]) == 2]
    for s in both[:1] or sorted({found["partial"][0], found["inflight"][0]}):
        led = caught[s][0]
        run = _resume_from(src, tmp_path / f"from{s}", s)
        r = run_cli(run, *slow[:-1], "train.max_steps=6", cache=xla_cache)
        assert r.returncode == 0, r.stderr
        assert f"resumed step {s}" in r.stderr
        trained = {row["ordinal"]: row for row in rollouts(run) if row["step"] > s}
        for g in led.groups.values():
            if g.target_step > 6:
                continue
            row = trained[g.ordinal]
            assert row["step"] == g.target_step  # trained in its originally stamped step
            assert row["prompt_tokens"] == [int(t) for t in g.prompt_tokens]
            for saved, got in zip(g.samples, row["samples"]):
                assert len(got["logprobs"]) == len(got["tokens"])
                if saved.done:  # READY or finished samples are not generated again
                    assert got["tokens"] == saved.tokens and got["reward"] == saved.reward
                    assert np.allclose(got["logprobs"], saved.logprobs, atol=0, rtol=1e-6)
                else:  # in-flight samples continue from their saved tokens
                    assert got["tokens"][:len(saved.tokens)] == saved.tokens
                    assert got["versions"][:len(saved.versions)] == saved.versions
                    assert np.allclose(got["logprobs"][:len(saved.logprobs)], saved.logprobs, atol=0, rtol=1e-6)
        steps = steps_of(run)
        assert sorted(p for ids in steps.values() for p in ids) == list(range(18))


# CI runs two epochs (the boundary inside and at the end of the data); one epoch under `make soak`
@pytest.mark.parametrize("epochs", [pytest.param(1, marks=pytest.mark.soak), 2])
@pytest.mark.slow
def test_exhaustion_on_a_batch_boundary(tmp_path, xla_cache, epochs):
    base = ["data.num_records=8", "rollout.prompts_per_step=2", f"data.num_epochs={epochs}"]
    total = 4 * epochs
    for stop in (total, total - 1):
        run = tmp_path / f"stop{stop}"
        r = run_cli(run, *base, f"train.max_steps={stop}", cache=xla_cache)
        assert r.returncode == 0, r.stderr
        r = run_cli(run, *base, "train.max_steps=0", cache=xla_cache)
        assert r.returncode == 0, r.stderr
        rows = lineage(run)
        assert len(rows) == 8 * epochs and max(x["step"] for x in rows) == total
        for e in range(epochs):
            assert sorted(x["prompt_id"] for x in rows if x["epoch"] == e) == list(range(8))
        final = json.loads((run / "final.json").read_text())
        assert final["exhausted"] and final["reason"] == "data_exhausted"
        assert audit(run)["ok"]
        # a further resume finds the exhausted iterator and trains nothing
        r = run_cli(run, *base, cache=xla_cache)
        assert r.returncode == 0 and len(lineage(run)) == 8 * epochs


@pytest.mark.slow
def test_a_refused_resume_touches_nothing(tmp_path, xla_cache, capsys):
    r = run_cli(tmp_path, *BASE, "train.max_steps=2", "checkpoint.every_steps=1", cache=xla_cache)
    assert r.returncode == 0, r.stderr
    before = tree_digest(tmp_path, skip=("e2",))
    refusals = [("data.seed=7",), ("rollout.samples_per_prompt=8",), ("data.num_records=30",),
                ("learner.grad_clip=0",), ("model.d_model=48",), ("data.num_epochs=1", "data.num_records=24"),
                ("rollout.max_new_tokens=3",)]
    with_epochs = run_cli(tmp_path / "e2", *BASE, "data.num_epochs=2", "train.max_steps=1", cache=xla_cache)
    assert with_epochs.returncode == 0, with_epochs.stderr
    assert "data.seed" in refused_cli(capsys, tmp_path, *BASE, "data.seed=7")  # the command line: exit 2, one line
    for change in refusals:  # in-process (faster): the same refusal, raised before anything is written
        where = tmp_path / "e2" if "data.num_epochs=1" in change else tmp_path
        snap = tree_digest(where)
        for _ in range(2):  # and the refusal holds on every invocation
            with pytest.raises(ConfigError) as e:
                train(cfg(where, *BASE, *change))
            assert change[0].split("=")[0] in str(e.value) and "nothing was changed" in str(e.value)
            assert tree_digest(where) == snap, change
    assert tree_digest(tmp_path, skip=("e2",)) == before
    assert audit(tmp_path)["ok"] and (tmp_path / "final.json").exists()
    r = run_cli(tmp_path, *BASE, "train.max_steps=3", "learner.lr=5e-4", cache=xla_cache)
    assert r.returncode == 0, r.stderr
    changed = next(ln for ln in r.stderr.splitlines() if "changed since step 2:" in ln)
    assert "learner.lr: saved 0.001, now 0.0005" in changed


def test_more_epochs_continue_a_finished_run(tmp_path, xla_cache):
    ov = ["data.num_records=8", "rollout.prompts_per_step=4"]
    r = run_cli(tmp_path, *ov, cache=xla_cache)
    assert r.returncode == 0 and json.loads((tmp_path / "final.json").read_text())["exhausted"], r.stderr
    r = run_cli(tmp_path, *ov, "data.num_epochs=2", cache=xla_cache)
    assert r.returncode == 0, r.stderr
    rows = lineage(tmp_path)
    assert sorted((x["epoch"], x["prompt_id"]) for x in rows) == [(e, i) for e in (0, 1) for i in range(8)]
    assert audit(tmp_path)["ok"]


def test_damaged_latest_step_falls_back(four_ahead, xla_cache):
    run = four_ahead  # its saved ledgers hold groups buffered for up to 3 steps ahead
    assert checkpoint_steps(run) == [2, 4]
    victim = next((run / "checkpoints" / "4" / "ledger").glob("*.bin"))
    victim.write_bytes(victim.read_bytes()[:10])  # truncated
    r = run_cli(run, *AHEAD, "train.max_steps=5", cache=xla_cache)
    assert r.returncode == 0, r.stderr
    assert "checkpoint step 4" in r.stderr and "damaged" in r.stderr
    assert "resumed step 2" in r.stderr
    assert (run / "damaged").exists()
    steps = steps_of(run)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert sorted(p for ids in steps.values() for p in ids) == list(range(15))


def test_an_edited_or_grown_prompt_file_is_refused_and_a_moved_one_is_not(tmp_path, xla_cache, capsys):
    data = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"{i}{i + 1}=", "answer": f"{i + 1}{i}"}) + "\n" for i in range(12)]
    data.write_text("".join(lines))
    ov = ["data.source=jsonl", "data.num_records=0", "data.shuffle=false", "rollout.reward=exact_match",
          "rollout.prompts_per_step=3", "checkpoint.every_steps=2"]
    r = run_cli(tmp_path / "run", *ov, f"data.path={data}", "train.max_steps=2", cache=xla_cache)
    assert r.returncode == 0, r.stderr
    before = tree_digest(tmp_path / "run")
    data.write_text("".join([lines[1], lines[0], *lines[2:]]))  # same size, same line count
    err = refused_cli(capsys, tmp_path / "run", *ov, f"data.path={data}", "train.max_steps=4")
    assert "prompt file changed" in err and "line 1 (prompt_id 0)" in err, err[-2000:]
    assert tree_digest(tmp_path / "run") == before
    data.write_text("".join([*lines, json.dumps({"prompt": "77=", "answer": "77"}) + "\n"]))  # grown by a line
    refused_cli(capsys, tmp_path / "run", *ov, f"data.path={data}", "train.max_steps=4")
    assert tree_digest(tmp_path / "run") == before
    moved = tmp_path / "elsewhere" / "prompts.jsonl"
    moved.parent.mkdir()
    moved.write_text("".join(lines))
    data.unlink()
    r = run_cli(tmp_path / "run", *ov, f"data.path={moved}", "train.max_steps=4", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed step 2" in r.stderr
    assert sorted(p for ids in steps_of(tmp_path / "run").values() for p in ids) == list(range(12))


@pytest.mark.slow
def test_rollouts_turned_off_and_on_again_keep_earlier_sessions(tmp_path):
    ov = [*BASE, "checkpoint.every_steps=2"]
    train(cfg(tmp_path, *ov, "log.rollouts=true", "train.max_steps=2"))
    train(cfg(tmp_path, *ov, "log.rollouts=false", "train.max_steps=4"))
    train(cfg(tmp_path, *ov, "log.rollouts=true", "train.max_steps=6"))
    assert sorted({r["step"] for r in rollouts(tmp_path)}) == [1, 2, 5, 6]
    assert audit(tmp_path)["ok"]
