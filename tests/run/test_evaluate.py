"""Held-out evaluation: disjoint from training, scored with the current weights, logged in the
step's metrics row, never touching the training stream, not repeated by a resume."""
import json
import shutil

import pytest
from helpers import cfg, lineage, run_cli

from async_rl import config as C
from async_rl.data.tokenizer import build_tokenizer
from async_rl.run.cli import main
from async_rl.run.evaluate import build_eval_set
from async_rl.state.audit import audit


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_synthetic_eval_set_is_held_out_in_ids_and_text(tmp_path):
    c = cfg(tmp_path, "data.num_records=2000", "eval.every_steps=1", "eval.num_records=300", "data.max_digits=3")
    tok = build_tokenizer(c.tokenizer, synthetic=True)
    es = build_eval_set(c, tok)
    from async_rl.data.dataset import synthetic_record
    train_text = {synthetic_record("reverse", 0, i, 3, 3)["prompt"] for i in range(2000)}
    eval_text = [tok.decode(p.tolist()) for p in es.prompts]
    assert len(es.prompts) == 300 and min(es.prompt_ids) >= 2000
    assert not set(eval_text) & train_text  # 3-digit strings collide often: they were left out
    assert build_eval_set(c, tok).prompt_ids == es.prompt_ids  # the same set every time


# a run evaluating every 2 steps (checkpoints 2 and 3)
EVAL_RUN = ["data.num_records=64", "rollout.prompts_per_step=4", "eval.every_steps=2", "eval.num_records=32",
            "checkpoint.every_steps=2", "train.max_steps=3"]


@pytest.fixture(scope="module")
def _three_steps(tmp_path_factory, xla_cache):
    """EVAL_RUN trained once, and what it said on stderr: the tests that start from it take a copy each."""
    run = tmp_path_factory.mktemp("three_steps")
    r = run_cli(run, *EVAL_RUN, cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    return run, r.stderr


@pytest.fixture
def three_steps(_three_steps, tmp_path):
    """A copy of the 3-step run in tmp_path / "run", and its stderr."""
    shutil.copytree(_three_steps[0], tmp_path / "run")
    return tmp_path / "run", _three_steps[1]


@pytest.mark.slow
def test_eval_in_training_and_from_the_command_line_agree(three_steps, xla_cache, capsys):
    run, stderr = three_steps
    rows = _metrics(run)
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert "eval/accuracy" not in rows[0] and "eval/accuracy" in rows[1] and "eval/accuracy" in rows[2]
    assert "held-out accuracy" in stderr
    # the eval prompts never entered the training stream: 3 steps x 4 prompts, each once
    ids = [x["prompt_id"] for x in lineage(run)]
    assert len(ids) == len(set(ids)) == 12 and max(ids) < 64 and audit(run)["ok"]
    assert main(["eval", str(run), "--json"]) == 0  # the saved step 3 scores as training scored it
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 3 and out["eval/reward_mean"] == rows[2]["eval/reward_mean"]
    # a resume does not repeat the eval its checkpoint kept, and adds the next ones
    r = run_cli(run, *EVAL_RUN[:-1], "train.max_steps=4", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = _metrics(run)
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert [x["step"] for x in rows if "eval/accuracy" in x] == [2, 3, 4]


@pytest.mark.slow
def test_eval_at_start_scores_the_starting_weights_once(tmp_path, xla_cache):
    ov = ["data.num_records=64", "rollout.prompts_per_step=4", "eval.every_steps=2", "eval.num_records=16",
          "eval.at_start=true", "checkpoint.every_steps=1", "train.max_steps=2"]
    r = run_cli(tmp_path, *ov, cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = _metrics(tmp_path)
    assert [x["step"] for x in rows] == [0, 1, 2] and "rollout/reward_mean" not in rows[0]
    done = r.stderr.strip().splitlines()[-1]
    assert f"held-out accuracy {rows[0]['eval/accuracy']:.3f} -> {rows[2]['eval/accuracy']:.3f}" in done
    assert "peak host RSS" in done
    # a resume keeps the step-0 row and does not score the starting weights again
    r = run_cli(tmp_path, *ov[:-1], "train.max_steps=3", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = _metrics(tmp_path)
    assert [x["step"] for x in rows] == [0, 1, 2, 3]
    # its end line compares with the run's start (step 0, kept from the first session), not its own first eval
    done = r.stderr.strip().splitlines()[-1]
    assert f"held-out accuracy {rows[0]['eval/accuracy']:.3f} -> {rows[3]['eval/accuracy']:.3f} (step 3)" in done
    assert f"mean reward {rows[1]['rollout/reward_mean']:.3f} -> " in done
    with pytest.raises(C.ConfigError, match="eval.at_start.*needs eval.every_steps > 0"):
        C.load("configs/tiny.yaml", ["eval.every_steps=0", "eval.at_start=true"])


@pytest.mark.slow  # beside the other test of the shared run (slow ones run first): trained once for both
def test_eval_from_a_prompt_file_and_usage_errors(tmp_path, three_steps, capsys):
    run, _ = three_steps
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}{i+1}=", "answer": f"{i+1}{i}"}) + "\n" for i in range(6)))
    assert main(["eval", str(run), f"eval.path={data}", "eval.samples_per_prompt=3"]) == 0
    out = capsys.readouterr().out
    assert "6 prompts" in out and "pass@3" in out
    assert main(["eval", str(run), "--step", "9"]) == 2
    assert "no committed checkpoint step 9" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nope")]) == 2
    c = C.load("configs/tiny.yaml", ["data.source=jsonl", f"data.path={data}", "rollout.reward=exact_match",
                                     "eval.every_steps=0"])
    with pytest.raises(C.ConfigError, match="eval.path"):
        C.replace(c, eval={"every_steps": 5})
