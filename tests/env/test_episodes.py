"""Multi-turn episodes in training: the tool task learns with its env and not without, a run
whose env calls an external service is killed at random moments and every prompt is still
trained once with every observation what the service answered, and a misbehaving env step
fails the run with one line and loses nothing."""
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import lineage, rollouts, run_cli
from test_crash import crash_and_finish

from async_rl.state.audit import audit
from async_rl.store import runfiles

HERE = Path(__file__).parent
# the tool task at the tests' small shapes: episodes of call (3 tokens), value (5), call, value, answer
EPISODE = ["data.task=recall", "data.min_digits=4", "data.max_digits=4", "model.learned_positions=0",
           "rollout.max_new_tokens=20", "rollout.turn_max_tokens=3"]
BASE = ["data.num_records=32", "rollout.prompts_per_step=2", "data.num_epochs=1", "checkpoint.every_steps=1",
        "checkpoint.keep=2", "log.rollouts=true"]


def _tiny_tools(run_dir, *overrides):
    return subprocess.run([sys.executable, "-m", "async_rl", "train", "--config", "configs/tiny-tools.yaml",
                           f"run.dir={run_dir}", "log.progress=false", "log.tensorboard=false", "log.plot=false",
                           f"run.compilation_cache={os.environ.get('ASYNC_RL_TEST_XLA_CACHE', '')}", *overrides],
                          capture_output=True, text=True, timeout=600)


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.soak  # CI time (80 s); the kill tests train multi-turn episodes in CI
def test_the_tool_task_learns_with_its_env(tmp_path):
    r = _tiny_tools(tmp_path / "tools", "eval.every_steps=150", "eval.num_records=64")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _metrics(tmp_path / "tools")
    assert sum(m["rollout/reward_mean"] for m in rows[-5:]) / 5 >= 0.9, [m["rollout/reward_mean"] for m in rows[-10:]]
    assert rows[-1]["eval/accuracy"] >= 0.9 and rows[-1]["rollout/env_steps"] > 0


@pytest.mark.soak  # the job above shows the tool works, this that nothing else does
def test_the_tool_task_fails_without_its_env(tmp_path):
    r = _tiny_tools(tmp_path / "control", "rollout.env=", "eval.every_steps=150", "eval.num_records=64")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _metrics(tmp_path / "control")
    assert sum(m["rollout/reward_mean"] for m in rows[-5:]) / 5 < 0.5 and rows[-1]["eval/accuracy"] < 0.1


@pytest.fixture
def service(tmp_path, monkeypatch):
    """The keyed service on loopback, and the env that calls it importable by the run."""
    log, port_file = tmp_path / "service.jsonl", tmp_path / "port"
    proc = subprocess.Popen([sys.executable, str(HERE / "keyed_service.py"), str(log), str(port_file), "0"])
    try:
        end = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < end, "the service did not start"
            time.sleep(0.05)
        monkeypatch.setenv("ASYNC_RL_TEST_SERVICE", f"http://127.0.0.1:{port_file.read_text()}")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))
        yield log
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _check_episodes(run_dir, service_log, delivered: int, max_concurrent: int) -> dict:
    rep = audit(run_dir)
    assert rep["ok"], rep
    assert sorted(r["prompt_id"] for r in lineage(run_dir)) == list(range(32))
    asked = [json.loads(x) for x in service_log.read_text().splitlines()]
    answers = {a["key"]: a["observation"] for a in asked}
    seen = 0
    for row in rollouts(run_dir):
        for s in row["samples"]:
            turns = s["turns"]
            assert [int(t["key"].rsplit("/", 1)[1]) for t in turns] == [0, 1, 2], turns
            for t in turns[:2]:  # the two tool turns: what the service said for exactly that key
                assert t["observation"] == answers[t["key"]], (t, answers.get(t["key"]))
                seen += 1
    assert seen == len(answers) == 32 * 4 * 2  # every answered key is in a trained episode
    again = sum(Counter(a["key"] for a in asked).values()) - len(answers)
    # only steps in flight at a kill are asked again: at most the env steps running at once, per kill
    assert again <= delivered * max_concurrent, (again, delivered)
    env = rep["env_steps"]
    assert env["recorded"] == 32 * 4 * 3 and env["unused"] == 0 and env["requested_again"] >= again
    return {"again": again, **env}


def _schedule(rng: random.Random, kills: int) -> list[tuple]:
    """Kills at saves first (each session starts before the step it names), then at env requests
    and at random moments after a step: each reachable wherever the session before stopped."""
    schedule = [("at", "ckpt_write:2"), ("at", "ckpt_saved:4"), ("at", "env_submit:30"),
                ("random", 7, rng.uniform(0, 0.3)), ("at", "env_submit:20"), ("random", 10, rng.uniform(0, 0.3))]
    schedule = schedule[:kills]
    return schedule + [("at", f"env_submit:{rng.randint(5, 25)}") for _ in range(kills - len(schedule))]


def _killed_and_checked(run, service_log, overrides, cache, schedule, timeout=300.0) -> dict:
    """The multi-turn run on `run` (a folder or a gs:// URL) killed by `schedule`, then run to its
    end and checked (`_check_episodes`): what was delivered and asked again, and the wall time."""
    t0 = time.monotonic()
    out = crash_and_finish(run, [*BASE, *EPISODE, "rollout.env=service_env:make", *overrides], cache,
                           schedule=schedule, timeout=timeout)
    assert out["delivered"] >= len(schedule) - 2, out
    got = {"delivered": out["delivered"], **_check_episodes(run, service_log, out["delivered"], 16),
           "wall_s": round(time.monotonic() - t0)}
    print("multi-turn crash:", got)
    return got


@pytest.mark.parametrize("partial, kills", [(False, 6), pytest.param(True, 10, marks=pytest.mark.soak),
                                            pytest.param(False, 10, marks=pytest.mark.soak)],
                         ids=["whole", "partial-soak", "whole-soak"])
def test_multi_turn_run_killed_at_random_moments_trains_every_prompt_once(tmp_path, xla_cache, service, partial,
                                                                         kills):
    schedule = _schedule(random.Random(4 + kills + partial), kills)
    _killed_and_checked(tmp_path / "run", service, [f"rollout.partial={partial}"], xla_cache, schedule)


@pytest.mark.soak  # CI time: every kill restarts against the bucket (the gs:// run dir's own kills run in CI)
def test_multi_turn_run_on_gcs_killed_at_random_moments_trains_every_prompt_once(gcs_endpoint, xla_cache, service):
    """The same on a gs:// run dir (fake-gcs-server on loopback): the ledger, checkpoints and
    journal that keep episodes' env steps live in the bucket."""
    from objstore import new_bucket
    _killed_and_checked(f"{new_bucket('gs')}/run", service, ["rollout.partial=true"], xla_cache,
                        _schedule(random.Random(6), 6))


@pytest.mark.soak  # every restart starts vLLM: make soak-vllm
def test_multi_turn_run_on_vllm_killed_at_random_moments_trains_every_prompt_once(tmp_path, service, monkeypatch):
    """The same generating with vLLM (a tiny random Qwen2 whose tokenizer has the task's digits
    and `=`): an episode continues from the prompt and every token so far, observations
    included, and only the reply's tokens are sampled; their versions and behaviour logprobs are
    recorded, the observations' are masked."""
    from test_vllm_crash import TIMEOUT, VLLM, WORDS, vllm_model

    from async_rl.buffer.ledger import OBSERVATION
    from async_rl.rollout.vllm_backend import available
    if (why := available()) is not None:
        pytest.skip(why)
    # one device, as the vLLM backend has: split over the 4 forced ones, the learner's step on
    # this Qwen2 at 28 columns took XLA over 9 minutes to compile (seconds on one)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    run = tmp_path / "run"
    # five kills: inside a save, at env requests (one early, in the first steps' episodes), after a step
    rng = random.Random(5)
    schedule = [("at", "ckpt_write:2"), ("at", "env_submit:12"), ("random", 4, rng.uniform(0, 0.5)),
                ("at", "env_submit:25"), ("random", 8, rng.uniform(0, 0.5))]
    _killed_and_checked(run, service, [f"model.hf_path={vllm_model(tmp_path)}", *VLLM, "rollout.partial=true"], None,
                        schedule, timeout=TIMEOUT)
    for s in (s for row in rollouts(run) for s in row["samples"]):
        fed = [i for i, v in enumerate(s["versions"]) if v == OBSERVATION]
        # the two tool turns' observations are in the stream as the tokenizer reads them, masked
        assert "".join(WORDS[s["tokens"][i]] for i in fed) == "".join(t["observation"] for t in s["turns"][:2])
        assert all(s["logprobs"][i] == 0.0 for i in fed)
        assert all(v >= 0 and math.isfinite(lp) and lp <= 0 for v, lp in zip(s["versions"], s["logprobs"])
                   if v != OBSERVATION), s  # the replies': sampled by vLLM, under weights it ran


@pytest.mark.parametrize("bad, says", [
    ("raise", "raised ConnectionError"),
    # CI time: the same path (a failed step raised on the pump thread); EnvRunner's own tests cover both in CI
    pytest.param("state", "not JSON", marks=pytest.mark.soak),
    pytest.param("hang", "did not return within rollout.env_timeout_s=3 s", marks=pytest.mark.soak),
    pytest.param("deep", "a state nested more than 32 levels deep (limit rollout.env_state_max_depth=32",
                 marks=pytest.mark.soak)])
def test_a_bad_env_step_fails_the_run_with_one_line_and_a_resume_continues(tmp_path, xla_cache, monkeypatch, bad,
                                                                            says):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))
    run = tmp_path / "run"
    args = [*BASE, "data.task=recall", "data.min_digits=4", "data.max_digits=4", "model.learned_positions=0",
            "rollout.max_new_tokens=12", "rollout.turn_max_tokens=3", "rollout.env=bad_env:make",
            "rollout.env_timeout_s=3", "data.num_records=16"]
    monkeypatch.setenv("ASYNC_RL_TEST_BAD", bad)
    monkeypatch.setenv("ASYNC_RL_TEST_BAD_PROMPT", "9")
    r = run_cli(run, *args, cache=xla_cache, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and says in last, r.stderr[-3000:]
    assert re.search(r"prompt_id=9 sample=\d+ turn=0 \(key \w+/9/0/\d+/0\)", last), last
    assert "Traceback" not in r.stderr
    if bad == "raise":  # the line names the file that keeps the step's traceback
        kept = Path(last.rsplit("; traceback in ", 1)[1])
        assert kept.parent == run / runfiles.ENV_ERRORS and kept.is_file(), last
        assert 'raise ConnectionError("the tool' in kept.read_text() and "bad_env.py" in kept.read_text()
    monkeypatch.delenv("ASYNC_RL_TEST_BAD")
    if bad == "raise":  # the env's code changed since the kill: refused, run.dir untouched, unless accepted
        monkeypatch.setenv("ASYNC_RL_TEST_ENV_VERSION", "2")
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        r = run_cli(run, *args, cache=xla_cache, timeout=300)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "rollout.env=bad_env:make: version '1' -> '2'" in last, r.stderr[-3000:]
        assert "run.env_changed=accept" in last and "Traceback" not in r.stderr
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
        args.append("run.env_changed=accept")
    r = run_cli(run, *args, cache=xla_cache, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert audit(run)["ok"] and sorted(x["prompt_id"] for x in lineage(run)) == list(range(16))
    if bad == "raise":
        assert json.loads((run / runfiles.ENV_IDENTITY).read_text())["rollout.env"]["version"] == "2"


@pytest.mark.slow
def test_a_distilled_multi_turn_lora_run_scores_the_policy_s_tokens_and_never_the_env_s(tmp_path, xla_cache):
    """learner.distill on episodes of the recall env (call, tool observation, answer), with no
    reward, the student a LoRA one: the teacher (a recall run) scores the step's tokens, the
    adapters train, and the mean behaviour logprob
    the step distilled against is exactly the mean over the policy's tokens in rollouts.jsonl:
    the env's observation tokens (version OBSERVATION) are outside the distilled tokens."""
    small = [*BASE, *EPISODE, "rollout.env=recall", "data.num_records=8"]
    r = run_cli(tmp_path / "teacher", *small, "train.max_steps=2", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli(tmp_path / "student", *small, "train.max_steps=3", "learner.distill=reverse_kl",
                f"learner.teacher={tmp_path / 'teacher'}", "rollout.reward=none", "learner.lora_rank=4",
                cache=xla_cache)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "learner/student_logp" in m]
    assert [m["step"] for m in trained] == [1, 2, 3]
    by_step, observed = {}, 0
    for row in rollouts(tmp_path / "student"):
        for s in row["samples"]:
            own = [lp for lp, v in zip(s["logprobs"], s["versions"]) if v != -1]  # ledger.OBSERVATION
            observed += len(s["versions"]) - len(own)
            by_step.setdefault(row["step"], []).extend(own)
    assert observed > 0  # the episodes did call the tool
    for m in trained:
        assert math.isfinite(m["learner/distill_reverse_kl"]) and math.isfinite(m["learner/teacher_logp"])
        assert m["learner/grad_norm"] > 0
        assert m["learner/student_logp"] == pytest.approx(sum(by_step[m["step"]]) / len(by_step[m["step"]]), abs=1e-5)
