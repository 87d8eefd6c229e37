"""The command line as a user meets it: user modules named from the folder they sit in, a saved
run's code imported only when the user asks for it, help and messages that say what they mean."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import FAST, run_cli

from async_rl.run.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _script(tmp_path: Path) -> Path:
    """The `async-rl` console script as pip writes it: Python puts the script's folder, not the
    working directory, first on its path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "async-rl"
    script.write_text("import sys\nfrom async_rl.run.cli import main\nsys.exit(main())\n")
    return script


def test_a_user_module_beside_the_working_directory_is_imported(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_envs.py").write_text("def calculator():\n    raise RuntimeError('my_envs was imported')\n")
    (work / "my_rewards.py").write_text("score = 3\n")
    base = [sys.executable, str(_script(tmp_path)), "train", "--config", str(ROOT / "configs/tiny.yaml"),
            f"run.dir={work / 'run'}", *FAST]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([*base, "rollout.env=my_envs:calculator"], cwd=work, capture_output=True, text=True,
                       timeout=180, env=env)
    assert r.returncode == 2 and "the factory raised RuntimeError: my_envs was imported" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([*base, "rollout.reward=my_rewards:score"], cwd=work, capture_output=True, text=True,
                       timeout=180, env=env)
    assert r.returncode == 2 and "'score' in 'my_rewards' is not callable" in r.stderr, r.stderr[-2000:]
    # a module that is nowhere: the line says where it was looked for
    r = subprocess.run([*base, "rollout.env=elsewhere_envs:make"], cwd=work, capture_output=True, text=True,
                       timeout=180, env=env)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and f"looked in the working directory ({work})" in err[0], r.stderr


ENV_MODULE = '''
from pathlib import Path
Path(__file__).with_name("imported.marker").write_text("imported")
KEYS = []

class Done:
    max_turns = 2
    def step(self, key, messages, state):
        KEYS.append(key)
        return {"observation": None, "done": True, "state": {}}

def make():
    return Done()
'''


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, xla_cache):
    """A finished tiny run with checkpoints at steps 1 and 2."""
    run = tmp_path_factory.mktemp("cli") / "run"
    r = run_cli(run, "data.num_records=16", "rollout.prompts_per_step=4", "train.max_steps=2",
                "checkpoint.every_steps=1", "checkpoint.keep=2", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    return run


def _foreign(run: Path, dst: Path, **rollout) -> Path:
    shutil.copytree(run, dst)
    doc = yaml.safe_load((dst / "config.yaml").read_text())
    doc["rollout"].update(rollout)
    (dst / "config.yaml").write_text(yaml.safe_dump(doc))
    return dst


def test_eval_runs_no_code_a_saved_config_names_unless_asked(two_steps, tmp_path, monkeypatch, capsys):
    (tmp_path / "stepkeys_env.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "imported.marker"
    small = ["eval.num_records=4"]
    for i, rollout in enumerate([{"env": "stepkeys_env:make"}, {"reward": "stepkeys_env:make"},
                                 {"env": "mcp", "mcp_server": f"touch {marker}"}]):
        run = _foreign(two_steps, tmp_path / f"foreign{i}", **rollout)
        assert main(["eval", str(run), *small]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        field, value = list(rollout.items())[-1]
        assert len(err) == 1 and f"rollout.{field}={value!r}" in err[0] and "--trust-code" in err[0], err
        assert not marker.exists()
        main(["export", str(run), "--out", str(tmp_path / f"out{i}")])  # export reads the config, runs none of it
        capsys.readouterr()
        assert not marker.exists() and "stepkeys_env" not in sys.modules
    # the project's own env and reward are no one's foreign code
    assert main(["eval", str(_foreign(two_steps, tmp_path / "own", reward="digits")), *small]) == 0
    # trusted: imported and run
    assert main(["eval", str(tmp_path / "foreign0"), "--trust-code", *small]) == 0 and marker.exists()


def test_eval_env_step_keys_name_the_step_evaluated(two_steps, tmp_path, monkeypatch, capsys):
    (tmp_path / "stepkeys_env.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "stepkeys_env", raising=False)
    keys = {}
    for step in (1, 2):  # named on the command line: the user's own code, run without --trust-code
        assert main(["eval", str(two_steps), "--step", str(step), "rollout.env=stepkeys_env:make",
                     "eval.num_records=4"]) == 0, capsys.readouterr().err
        mod = sys.modules["stepkeys_env"]
        keys[step], mod.KEYS[:] = list(mod.KEYS), []
    assert keys[1] and keys[2]
    assert {k.epoch for k in keys[1]} == {1} and {k.epoch for k in keys[2]} == {2}
    assert not {str(k) for k in keys[1]} & {str(k) for k in keys[2]}
    assert all(str(k).split("/")[-5] == "eval" for k in keys[1])


def test_train_help_and_the_env_table_name_every_built_in_env(capsys):
    from async_rl.env.interface import BUILTIN_ENVS
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("rollout.env "))
    table = (ROOT / "docs/envs-and-tools.md").read_text()
    for name in BUILTIN_ENVS:
        assert name in line, line
        assert f"\n| `{name}` |" in table, name


def test_serve_without_the_fleet_extra_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    assert main(["serve", "--config", str(ROOT / "configs/tiny.yaml"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'async_rl[fleet]'" in err[0], err
