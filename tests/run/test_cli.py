"""The command line as a user meets it: user modules named from the folder they sit in, a saved
run's code imported only when the user asks for it, help and messages that say what they mean."""
import os
import subprocess
import sys
from pathlib import Path

from helpers import FAST

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
