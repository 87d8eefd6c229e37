"""Weights & Biases (offline): a job killed with SIGKILL and resumed is one W&B run whose history
holds every step's row as metrics.jsonl has it. Skipped where the wandb extra is not installed."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

wandb = pytest.importorskip("wandb")

from helpers import kill9, read_stderr, run_cli, spawn_job  # noqa: E402
from wandb_records import history_rows  # noqa: E402

from async_rl.obs.wandb_log import WandbLog  # noqa: E402
from async_rl.state.lineage import read_jsonl  # noqa: E402

OV = ["data.num_records=24", "rollout.prompts_per_step=2", "checkpoint.every_steps=6", "checkpoint.async=false",
      "log.wandb=true", "log.wandb_project=async_rl_test", "log.wandb_tags=ci,offline", "eval.every_steps=0"]


@pytest.mark.soak  # two training sessions: ~50 s of CPU, 4-5 min wall on the shared 2 cores
def test_a_killed_and_resumed_job_is_one_wandb_run_with_one_row_per_step(tmp_path, xla_cache, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ov = [*OV, f"run.compilation_cache={xla_cache}"]
    [p] = spawn_job(tmp_path, *ov, delay="step:0.3")
    metrics = tmp_path / "metrics.jsonl"
    end = time.monotonic() + 600
    while time.monotonic() < end and p.poll() is None:  # past the step-6 checkpoint, before the next
        if any(r["step"] >= 7 for r in read_jsonl(metrics)):
            break
        time.sleep(0.05)
    assert kill9(p), read_stderr(p)[-2000:]  # the kill is what ended session 1
    killed_at = max(r["step"] for r in read_jsonl(metrics))
    assert killed_at >= 7
    run_id = json.loads((tmp_path / "wandb.json").read_text())["id"]
    r = run_cli(tmp_path, *ov, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"wandb: run {run_id} (resumed" in r.stderr
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # two sessions ...
    files = [f for d in runs for f in d.glob("run-*.wandb")]
    assert [f.stem for f in files] == [f"run-{run_id}"] * 2  # ... of one run
    first, second = ([row["_step"] for row in history_rows(f)] for f in files)
    # session 1's log holds a prefix of its steps (wandb keeps its newest block in memory: a
    # SIGKILL loses it); offline there is no W&B state to ask, so session 2 sends every row of
    # metrics.jsonl (cut at its checkpoint) again, then its own steps: the whole history
    assert first == list(range(1, len(first) + 1)) and len(first) <= killed_at
    final = json.loads((tmp_path / "final.json").read_text())
    assert second == list(range(1, final["step"] + 1))
    assert [row["step"] for row in read_jsonl(metrics)] == second  # as metrics.jsonl has them
    resumed = int(re.search(r"resumed step (\d+)", r.stderr).group(1))
    assert resumed >= 6
    assert f"wandb: sent steps 1..{resumed} from metrics.jsonl" in r.stderr
    rows = [row for f in files for row in history_rows(f)]
    assert all("rollout/reward_mean" in row and "learner/clip_frac_high" in row for row in rows)
    # the resolved config is the run's config
    cfg_files = list(runs[-1].glob("files/config.yaml"))
    if cfg_files:
        assert "async_rl_test" in cfg_files[0].read_text()


# a session that hands steps 1..10 to wandb and is SIGKILLed
_KILLED_SESSION = """
import os, signal, sys
from pathlib import Path
from async_rl.obs.wandb_log import WandbLog
w = WandbLog(Path(sys.argv[1]), {"a": 1}, project="async_rl_test")
for s in range(1, 11):
    w.log(s, {"x": float(s)})
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_after_a_sigkill_offline_every_row_of_metrics_jsonl_is_sent_again(tmp_path, monkeypatch):
    """Offline, a session after a SIGKILL cannot ask W&B what it kept: it sends metrics.jsonl's rows
    (cut at checkpoint 6), then the steps run again; a session after a clean stop sends none twice."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    r = subprocess.run([sys.executable, "-c", _KILLED_SESSION, str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    lines = []
    w = WandbLog(tmp_path, {"a": 1}, project="async_rl_test", log=lines.append)
    assert w.logged == -1
    w.catch_up([{"step": s, "time": 0.0, "x": float(s)} for s in range(1, 7)])
    for s in range(5, 13):  # the steps after the checkpoint, run again
        w.log(s, {"x": float(s)})
    w.close()
    assert "wandb: sent steps 1..6 from metrics.jsonl" in lines
    files = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({f.name for f in files}) == 1  # two sessions of one run
    rows = history_rows(files[1])
    assert [row["_step"] for row in rows] == list(range(1, 13))
    assert all(row["x"] == row["_step"] for row in rows)
    assert json.loads((tmp_path / "wandb.json").read_text())["logged"] == 12
    w = WandbLog(tmp_path, {"a": 1}, project="async_rl_test", log=lines.append)
    assert w.logged == 12
    w.catch_up([{"step": s, "time": 0.0, "x": float(s)} for s in range(1, 13)])
    w.log(13, {"x": 13.0})
    w.close()
    files = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert [row["_step"] for row in history_rows(files[-1])] == [13]


# a session that hands steps 1..3 to wandb, then is killed with its wandb-core (its whole group)
_KILLED_WITH_CORE = """
import os, signal, sys
from pathlib import Path
from async_rl.obs.wandb_log import WandbLog
w = WandbLog(Path(sys.argv[1]), {"a": 1}, project="async_rl_test")
for s in range(1, 4):
    w.log(s, {"x": float(s)})
os.killpg(0, signal.SIGKILL)
"""


def test_a_session_killed_with_its_wandb_core_leaves_wandbs_temporary_files_only_in_run_dir(tmp_path, monkeypatch):
    """W&B's temporary folders (socket folder, media and artifact staging, debug logs) are made
    under run.dir/wandb/tmp, not in the system's temporary folder or ~/.cache: a SIGKILL of the
    session and its wandb-core leaves nothing outside run.dir, and the next start empties them."""
    run, system_tmp, home = tmp_path / "run", tmp_path / "system_tmp", tmp_path / "home"
    for d in (run, system_tmp, home):
        d.mkdir()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TMPDIR": str(system_tmp),
           "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "XDG_DATA_HOME": str(home / ".local")}
    r = subprocess.run([sys.executable, "-c", _KILLED_WITH_CORE, str(run)], capture_output=True, text=True,
                       timeout=300, env=env, start_new_session=True)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not any(system_tmp.iterdir()), sorted(system_tmp.iterdir())
    assert not any(p.is_file() for p in home.rglob("*")), sorted(home.rglob("*"))
    left = {p.name for p in (run / "wandb" / "tmp").iterdir()}
    assert left  # W&B's temporary folders, in run.dir
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    w = WandbLog(run, {"a": 1}, project="async_rl_test", log=lambda _: None)
    left -= {"cache", "data"}  # the killed session's own folders, named at random
    assert left and not left & {p.name for p in (run / "wandb" / "tmp").iterdir()}  # ... are gone
    w.close()
