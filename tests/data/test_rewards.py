"""Rewards: partial credit, math answer extraction and normalisation, the registry."""

import math
import random
import sys
import types

import pytest
from helpers import MODEL

from async_rl import config
from async_rl.config import ConfigError
from async_rl.data.rewards import extract_answer, get_reward, registered, reward_for_config, task_reward


@pytest.mark.parametrize("out, target, want", [
    ("4321", "4321", 1.0),
    (" 4321\n", "4321", 1.0),
    ("4320", "4321", 0.75),
    ("43", "4321", 0.5 - 0.5 * 2 / 4),  # a missing character costs more than a wrong one
    ("4390", "4321", 0.5),
    ("432100", "4321", 4 / 6),
    ("", "4321", 0.0),
    ("1234", "4321", 0.0),
])
def test_reverse_partial_credit(out, target, want):
    assert get_reward("reverse")(out, target) == pytest.approx(want)


@pytest.mark.parametrize("out, target, want", [
    ("1110", "1110", 1.0),
    ("110", "1110", 0.75),  # right-aligned: the three low digits match
    ("9110", "1110", 0.75),
    ("12345", "1234", 0.0),  # shifted by one: no digit in its place
    ("", "57", 0.0),
    (" 57 ", "57", 1.0),
])
def test_addition_right_aligned(out, target, want):
    assert get_reward("addition")(out, target) == pytest.approx(want)


def test_random_outputs_get_signal_and_stay_in_range():
    rng = random.Random(0)
    rewards = {name: [] for name in ("reverse", "addition", "exact_match", "math_answer")}
    for _ in range(500):
        target = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
        out = "".join(rng.choice("0123456789=+ ") for _ in range(rng.randint(0, 8)))
        for name, vals in rewards.items():
            r = get_reward(name)(out, target)
            assert isinstance(r, float) and 0.0 <= r <= 1.0
            vals.append(r)
    assert sum(rewards["reverse"]) > 0 and sum(rewards["addition"]) > 0


def test_exact_match_normalises_whitespace():
    em = get_reward("exact_match")
    assert em("  Paris\n", "Paris") == 1.0
    assert em("New   York", "New York") == 1.0
    assert em("paris", "Paris") == 0.0


MATH_CASES = [
    ("The answer is 1,234.", "1234", 1.0),
    ("so we get $1,234,567$", "1234567", 1.0),
    ("Total: 12", "1,200", 0.0),
    ("the result is -5.", "-5", 1.0),
    ("result \u22125", "-5", 1.0),
    ("10-5 = 5", "5", 1.0),
    ("10-5 = 5", "-5", 0.0),
    ("x = +7", "7", 1.0),
    ("It costs $2.50", "2.5", 1.0),
    ("2.50", "2.500", 1.0),
    ("about 50%", "50", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("3/4", "0.75", 1.0),
    ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("\\boxed{\\frac{-1}{2}}", "-1/2", 1.0),
    ("\\boxed{\\frac12}", "0.5", 1.0),
    ("so it's \\frac{6}{8} in the end", "3/4", 1.0),
    ("first 3, then \\boxed{7}. Check: 8", "7", 1.0),
    ("\\boxed{\\frac{\\sqrt{4}}{2}} wait no \\boxed{1}", "1", 1.0),
    ("\\boxed{x^{2}+1}", "x^2+1", 0.0),
    ("\\boxed{x^{2}+1}", "x^{2}+1", 1.0),
    ("\\boxed{\\text{(B)}}", "(B)", 1.0),
    ("\\boxed{x = 12}", "12", 1.0),
    ("\\boxed{12", "12", 1.0),  # unclosed box: falls back to the last number
    ("no numbers here", "3", 0.0),
    ("", "0", 0.0),
    ("the answer is 72", "Natalia sold 48/2 = 24 clips ... 48+24 = 72 #### 72", 1.0),
    ("the answer is 71", "#### 72", 0.0),
    ("\\boxed{5}", "The area is $\\boxed{5}$.", 1.0),
    ("\\boxed{1e3}", "1000", 1.0),
    ("\\boxed{0.333}", "1/3", 0.0),
]


@pytest.mark.parametrize("completion, ref, want", MATH_CASES)
def test_math_answer(completion, ref, want):
    assert get_reward("math_answer")(completion, ref) == want


def test_extract_answer_nested_boxed():
    assert extract_answer("\\boxed{\\frac{1}{\\sqrt{2}}}") == "\\frac{1}{\\sqrt{2}}"
    assert extract_answer("a \\boxed{1} b \\boxed{{2}}") == "{2}"
    assert extract_answer("1, 2, and 3.") == "3"
    assert extract_answer("nothing") is None


def test_module_function_loading(monkeypatch):
    mod = types.ModuleType("my_rewards")
    mod.good = lambda c, a: 0.5 if c == a else 0.25
    mod.bad_range = lambda c, a: 2.0
    mod.nan = lambda c, a: math.nan
    mod.not_callable = 3
    monkeypatch.setitem(sys.modules, "my_rewards", mod)
    assert get_reward("my_rewards:good")("a", "a") == 0.5
    with pytest.raises(ValueError, match="my_rewards:bad_range.*2.0"):
        get_reward("my_rewards:bad_range")("a", "b")
    with pytest.raises(ValueError, match="nan"):
        get_reward("my_rewards:nan")("a", "b")
    with pytest.raises(ConfigError, match="no attribute 'missing'"):
        get_reward("my_rewards:missing")
    with pytest.raises(ConfigError, match="not callable"):
        get_reward("my_rewards:not_callable")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        get_reward("no_such_module_xyz:f")
    with pytest.raises(ConfigError, match="unknown reward.*math_answer"):
        get_reward("nope")


def test_task_defaults():
    assert task_reward("reverse") == "reverse" and task_reward("addition") == "addition"
    assert set(registered()) >= {"reverse", "addition", "exact_match", "math_answer"}
    with pytest.raises(ConfigError, match="data.task"):
        task_reward("sorting")
    name, fn = reward_for_config(config.load(None, [*MODEL, "data.task=addition"]))
    assert name == "addition" and fn("57", "57") == 1.0
    with pytest.raises(ConfigError, match="rollout.reward is required"):
        reward_for_config(config.load(None, [*MODEL, "data.source=jsonl", "data.path=x.jsonl"]))
    name, _ = reward_for_config(config.load(None, [*MODEL, "data.source=jsonl", "data.path=x.jsonl",
                                                   "rollout.reward=math_answer"]))
    assert name == "math_answer"


# --- reward calls inside a run: values and time limit --------------------------------------

_SLOW_REWARD = '''
import pathlib, time
def hang(completion, answer):
    pathlib.Path(__file__).with_name("entered").touch()
    time.sleep(3600)
    return 0.0
'''


def _reward_module(tmp_path, monkeypatch):
    import os
    (tmp_path / "slow_reward.py").write_text(_SLOW_REWARD)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def test_a_hanging_reward_fails_the_run_naming_the_prompt(tmp_path, monkeypatch, xla_cache):
    import time

    from helpers import run_cli
    _reward_module(tmp_path, monkeypatch)
    t0 = time.monotonic()
    r = run_cli(tmp_path / "run", "rollout.reward=slow_reward:hang", "rollout.reward_timeout_s=2",
                "data.num_records=8", "rollout.prompts_per_step=4", cache=xla_cache, timeout=600)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "rollout.reward_timeout_s=2 s on prompt_id=" in last and "prompt '" in last, last
    assert (tmp_path / "entered").exists() and time.monotonic() - t0 < 600


def test_sigterm_during_a_hanging_reward_stops_the_run(tmp_path, monkeypatch, xla_cache):
    import signal

    from helpers import finish_job, spawn, wait_until
    _reward_module(tmp_path, monkeypatch)
    p = spawn(tmp_path / "run", "rollout.reward=slow_reward:hang", "rollout.reward_timeout_s=600",
              "data.num_records=8", "rollout.prompts_per_step=4", cache=xla_cache)
    wait_until(lambda: (tmp_path / "entered").exists() or p.poll() is not None, 600, "the reward call")
    assert p.poll() is None
    p.send_signal(signal.SIGTERM)
    assert finish_job([p], timeout=60) == [0]


@pytest.mark.parametrize("value", ["'0.5'", "True", "None", "float('nan')"])
def test_a_reward_that_is_not_a_real_number_stops_the_run_naming_it(tmp_path, value):
    from helpers import cfg

    from async_rl.data.rewards import _REGISTRY
    from async_rl.rollout.pump import RewardError
    from async_rl.run.train import train
    _REGISTRY["_test_bad_value"] = lambda completion, answer, v=eval(value): v
    try:
        with pytest.raises(RewardError) as e:
            train(cfg(tmp_path, "rollout.reward=_test_bad_value", "data.num_records=8", "rollout.prompts_per_step=4"))
    finally:
        del _REGISTRY["_test_bad_value"]
    assert "prompt_id=" in str(e.value) and "returned" in str(e.value), str(e.value)
    assert (repr(eval(value)) in str(e.value)), str(e.value)


def test_a_huge_reward_stops_the_run_and_the_last_checkpoint_resumes(tmp_path):
    """1e200 is finite in Python and inf in float32: refused before the ledger, the journal or a
    checkpoint holds it, so the run resumes from its last checkpoint once the reward is fixed."""
    import itertools
    import time

    from helpers import cfg, checkpoint_steps, steps_of

    from async_rl.data.rewards import _REGISTRY
    from async_rl.rollout.pump import RewardError
    from async_rl.run.train import train
    run, calls = tmp_path / "run", itertools.count(1)

    def huge(completion, answer):  # step 3's first sample, once a checkpoint is committed
        if next(calls) <= 32:  # steps 1 and 2: 4 prompts x 4 samples each
            return 0.5
        end = time.monotonic() + 120
        while not checkpoint_steps(run) and time.monotonic() < end:
            time.sleep(0.05)
        return 1e200
    _REGISTRY["_test_huge"] = huge  # the journal is on (the default)
    args = ["rollout.reward=_test_huge", "data.num_records=16", "rollout.prompts_per_step=4",
            "checkpoint.every_steps=1"]
    try:
        with pytest.raises(RewardError) as e:
            train(cfg(run, *args))
        _REGISTRY["_test_huge"] = lambda completion, answer: 0.5
        saved = checkpoint_steps(run)
        res = train(cfg(run, *args))
    finally:
        del _REGISTRY["_test_huge"]
    msg = str(e.value)
    assert "\n" not in msg and "1e+200" in msg and "prompt_id=" in msg and " sample " in msg, msg
    assert saved and res.exit_code == 0 and res.step == 4 and sorted(steps_of(run)) == [1, 2, 3, 4]
