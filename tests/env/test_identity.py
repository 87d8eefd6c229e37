"""The code identity of rollout.env and rollout.reward recorded with a run, and a resume under
changed code refused in one line (or accepted and recorded)."""
import importlib
import json
import sys

import pytest
from helpers import MODEL

from async_rl import config as C
from async_rl.config import ConfigError
from async_rl.env import identity
from async_rl.env.interface import load_env
from async_rl.store import runfiles

ENV_V1 = '''
class Env:
    max_turns = 2
    version = "1"
    def step(self, key, messages, state):
        return {"observation": "a", "done": False, "state": state}

def make():
    return Env()

def score(text, answer):
    return 1.0
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    monkeypatch.syspath_prepend(str(src))
    path = src / "idenv.py"
    path.write_text(ENV_V1)
    yield path
    sys.modules.pop("idenv", None)


def _code(path, reload=False):
    if reload:
        importlib.reload(sys.modules["idenv"])
    cfg = C.load(None, [*MODEL, "rollout.env=idenv:make", "rollout.reward=idenv:score"])
    from async_rl.data.rewards import reward_for_config
    return identity.identity(cfg, load_env(cfg.rollout.env, cfg), reward_for_config(cfg)[1])


def test_a_resume_under_changed_env_code_is_refused_unless_accepted(module, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    code = _code(module)
    env = code["rollout.env"]
    assert env["spec"] == "idenv:make" and env["version"] == "1" and len(env["sources"]["idenv"]) == 64
    assert code["rollout.reward"]["sources"] == env["sources"]
    identity.check(run, code, "refuse", print)  # nothing recorded yet: nothing to compare
    (run / runfiles.ENV_IDENTITY).write_text(identity.text(code))
    identity.check(run, _code(module, reload=True), "refuse", print)  # the same code resumes
    saved = (run / runfiles.ENV_IDENTITY).read_bytes()
    module.write_text(ENV_V1.replace('version = "1"', 'version = "2"').replace("return 1.0", "return 0.5"))
    new = _code(module, reload=True)
    with pytest.raises(ConfigError) as e:
        identity.check(run, new, "refuse", print)
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 2 and msg.startswith(f"{run}: the code this run's episodes")
    assert "rollout.env=idenv:make: version '1' -> '2'" in msg
    assert f"rollout.env=idenv:make: source of module idenv sha256 {env['sources']['idenv'][:12]} -> " in msg
    assert "rollout.reward=idenv:score: source of module idenv" in msg and "run.env_changed=accept" in msg
    assert (run / runfiles.ENV_IDENTITY).read_bytes() == saved
    said = []
    identity.check(run, new, "accept", said.append)
    assert said and said[0].startswith("run.env_changed=accept: going on with changed code (rollout.env=idenv:make")


def test_builtins_are_named_by_spec_and_a_changed_spec_is_left_to_the_config(tmp_path):
    cfg = C.load(None, [*MODEL, "data.task=recall", "rollout.env=recall"])
    from async_rl.data.rewards import reward_for_config
    code = identity.identity(cfg, load_env("recall", cfg), reward_for_config(cfg)[1])
    assert code == {"rollout.env": {"spec": "recall"}, "rollout.reward": {"spec": reward_for_config(cfg)[0]}}
    (tmp_path / runfiles.ENV_IDENTITY).write_text(json.dumps({"rollout.env": {"spec": "lookup"}}))
    identity.check(tmp_path, code, "refuse", print)
    (tmp_path / runfiles.ENV_IDENTITY).write_text("[1]")
    with pytest.raises(ConfigError, match="env.json: not the run's code identity"):
        identity.check(tmp_path, code, "refuse", print)
