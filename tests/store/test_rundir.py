"""The run directory is never destroyed by an ordinary operation (docs/design.md, "Run
directory safety"): a second launch, a bad or read-only run.dir, a signal during start-up,
a directory that has lost every checkpoint. Real training subprocesses (a refusal repeated
in-process)."""
import contextlib
import os
import shutil
import signal
import subprocess

import pytest
from helpers import cfg, checkpoint_steps, cli_args, handles_sigterm, lineage, run_cli, spawn, tree_digest, wait_for_step, wait_until

from async_rl.run.train import train
from async_rl.state.audit import audit
from async_rl.state.checkpoint import CheckpointError

BASE = ["data.num_records=48", "rollout.prompts_per_step=4", "checkpoint.every_steps=2"]


@pytest.fixture(scope="module")
def _four_steps(tmp_path_factory, xla_cache):
    """`train.max_steps=4` of BASE (checkpoints 2 and 4), trained once: the tests that start
    from it take a copy each."""
    run = tmp_path_factory.mktemp("four_steps")
    r = run_cli(run, *BASE, "train.max_steps=4", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    return run


@pytest.fixture
def four_steps(_four_steps, tmp_path):
    """A copy of the 4-step run in this test's tmp_path (returned)."""
    shutil.copytree(_four_steps, tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_second_process_on_a_run_dir_in_use_exits_2_and_touches_nothing(tmp_path, xla_cache):
    # slow steps: the first run must outlive the second's start-up and refusal (12 steps in all)
    first = spawn(tmp_path, *BASE, cache=xla_cache, delay="step:2")
    try:
        assert wait_for_step(tmp_path, 2, first)
        mine = ("config.yaml", "data.json", ".lock")  # files the running process no longer writes
        before = tree_digest(tmp_path, only=mine)
        r = run_cli(tmp_path, *BASE, cache=xla_cache)
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"pid {first.pid}" in r.stderr and "in use" in r.stderr and "Traceback" not in r.stderr
        assert first.poll() is None  # it really was in use while refused
        assert tree_digest(tmp_path, only=mine) == before
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0, first.stderr.read()[-2000:]
    r = run_cli(tmp_path, *BASE, cache=xla_cache)  # the holder is gone: the run resumes and ends
    assert r.returncode == 0, r.stderr[-2000:]
    rows = lineage(tmp_path)
    assert sorted(x["prompt_id"] for x in rows) == list(range(48))
    assert audit(tmp_path)["ok"]


def test_a_deleted_lock_file_does_not_let_a_second_run_in(tmp_path, xla_cache):
    """The lock is on the run directory itself, which cannot be unlinked under a live run:
    deleting `.lock` changes nothing; the holder writes it again at its next step."""
    first = spawn(tmp_path, *BASE, "data.num_epochs=50", cache=xla_cache, delay="step:0.5")  # lives until stopped
    try:
        assert wait_for_step(tmp_path, 2, first, timeout=300)
        (tmp_path / ".lock").unlink()
        r = run_cli(tmp_path, *BASE, "data.num_epochs=50", cache=xla_cache)
        assert r.returncode == 2, r.stderr[-2000:]
        err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert len(err) == 1 and "in use" in err[0] and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert first.poll() is None
        wait_until(lambda: f'"pid": {first.pid}' in _read(tmp_path / ".lock"), 60, "the lock file written again")
        r = run_cli(tmp_path, *BASE, "data.num_epochs=50", cache=xla_cache)
        assert r.returncode == 2 and f"pid {first.pid}" in r.stderr, r.stderr[-2000:]
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0, first.stderr.read()[-2000:]
    assert checkpoint_steps(tmp_path) and audit(tmp_path)["ok"]


def _read(p) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def test_lock_of_a_killed_process_does_not_block_its_restart(tmp_path, xla_cache):
    p = spawn(tmp_path, *BASE, cache=xla_cache, delay="step:0.2")
    assert wait_for_step(tmp_path, 3, p)
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    assert (tmp_path / ".lock").exists()  # left behind, still naming the dead holder
    r = run_cli(tmp_path, *BASE, cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    assert audit(tmp_path)["ok"]


@pytest.mark.parametrize("kind", ["file", "under_a_file", "read_only"])
def test_unusable_run_dir_is_a_one_line_error(tmp_path, kind):
    target = tmp_path / "run"
    if kind == "file":
        target.write_text("not a directory")
    elif kind == "under_a_file":
        (tmp_path / "f").write_text("x")
        target = tmp_path / "f" / "run"
    else:
        target.mkdir()
        (target / "lineage.jsonl").write_text("")
    with _read_only(target if kind == "read_only" else None):
        r = subprocess.run(cli_args(target, "train.max_steps=1"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "run.dir=" in err[0] and "Traceback" not in r.stderr, r.stderr[-2000:]
    if kind == "read_only":
        assert "not writable" in err[0]


@contextlib.contextmanager
def _read_only(path):
    """A directory no process may write into: permission bits, or for root (who ignores them)
    the immutable attribute."""
    if path is None:
        yield
        return
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("running as root without chattr +i: no way to make a directory read-only")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_sigterm_during_start_up_exits_0_and_changes_nothing(four_steps, xla_cache):
    tmp_path = four_steps
    before = tree_digest(tmp_path)
    # the signal lands as soon as the CLI handles it: while it imports, builds and restores
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(cli_args(tmp_path, *BASE, "train.max_steps=8", f"run.compilation_cache={xla_cache}"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_until(lambda: handles_sigterm(p.pid) or p.poll() is not None, 60, "SIGTERM handler")
        p.send_signal(signal.SIGTERM)
        rc, err = p.wait(timeout=120), p.stderr.read()
    finally:
        p.kill()
    assert rc == 0, err[-2000:]
    assert "SIGTERM during start-up: stopped before changing anything" in err, err[-2000:]
    assert tree_digest(tmp_path) == before
    assert max(x["step"] for x in lineage(tmp_path)) == 4


def test_history_without_a_restorable_step_is_refused_until_restart(four_steps, xla_cache):
    tmp_path = four_steps
    for s in checkpoint_steps(tmp_path):  # every step loses its ledger file
        next((tmp_path / "checkpoints" / str(s) / "ledger").glob("*.bin")).unlink()
    r = run_cli(tmp_path, *BASE, "train.max_steps=6", cache=xla_cache)
    assert r.returncode == 2 and "refusing to start over" in r.stderr, r.stderr[-2000:]
    assert (tmp_path / "damaged").is_dir() is False  # a refusal moves nothing
    before = tree_digest(tmp_path)
    for _ in range(2):  # the refusal holds on every invocation (in-process: the same refusal, fewer start-ups)
        with pytest.raises(CheckpointError, match="run.resume=restart"):
            train(cfg(tmp_path, *BASE, "train.max_steps=6"))
        assert tree_digest(tmp_path) == before
    lines = (tmp_path / "lineage.jsonl").read_bytes()
    r = run_cli(tmp_path, *BASE, "train.max_steps=2", "run.resume=restart", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    prev = list((tmp_path / "previous").iterdir())
    assert len(prev) == 1 and (prev[0] / "lineage.jsonl").read_bytes() == lines  # kept, not deleted
    assert max(x["step"] for x in lineage(tmp_path)) == 2 and audit(tmp_path)["ok"]


def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path, xla_cache):
    ov = [*BASE, "checkpoint.every_steps=0"]
    p = spawn(tmp_path, *ov, cache=xla_cache, delay="step:0.2")
    assert wait_for_step(tmp_path, 2, p)
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    assert lineage(tmp_path) and not checkpoint_steps(tmp_path)
    r = run_cli(tmp_path, *ov, cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "committed no checkpoint" in r.stderr
    assert sorted(x["prompt_id"] for x in lineage(tmp_path)) == list(range(48))
    assert audit(tmp_path)["ok"]


def test_non_finite_training_stops_before_saving(four_steps, xla_cache):
    tmp_path = four_steps
    steps = checkpoint_steps(tmp_path)
    # an fp32 learning rate of inf: the first update makes the parameters non-finite
    r = run_cli(tmp_path, *BASE, "learner.lr=1e39", "learner.warmup_steps=0", "checkpoint.every_steps=1",
                cache=xla_cache)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "diverged" in r.stderr and "Traceback" not in r.stderr
    assert checkpoint_steps(tmp_path) == steps  # nothing saved over the good steps
    r = run_cli(tmp_path, *BASE, cache=xla_cache)  # back to a sane learning rate: resumes from step 4
    assert r.returncode == 0 and "resumed step 4" in r.stderr, r.stderr[-2000:]
    assert audit(tmp_path)["ok"]


def test_a_restart_killed_half_way_is_named_and_finished(tmp_path, xla_cache):
    from async_rl.store import rundir, runfiles
    r = run_cli(tmp_path, *BASE, "train.max_steps=2", "checkpoint.every_steps=2", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    next((tmp_path / "checkpoints" / "2" / "ledger").glob("*.bin")).unlink()  # no restorable step
    lines = (tmp_path / "lineage.jsonl").read_bytes()
    items = [f for g in runfiles.HISTORY for f in tmp_path.glob(g)] + \
        [tmp_path / n for n in runfiles.HISTORY_DIRS + runfiles.MANIFESTS if (tmp_path / n).exists()]
    # killed with everything moved but the mark that a checkpoint covered the logs
    r = run_cli(tmp_path, *BASE, "run.resume=restart", kill_at=f"restart:{len(items) - 1}", cache=xla_cache)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert rundir.history(tmp_path) == {} and (tmp_path / runfiles.MARKER).exists()
    before = tree_digest(tmp_path)
    r = run_cli(tmp_path, *BASE, "train.max_steps=2", cache=xla_cache)
    assert r.returncode == 2 and "()" not in r.stderr, r.stderr[-2000:]
    assert "run.resume=restart was interrupted" in r.stderr and "pass run.resume=restart again" in r.stderr
    assert tree_digest(tmp_path) == before
    r = run_cli(tmp_path, *BASE, "train.max_steps=2", "run.resume=restart", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    prev = list((tmp_path / "previous").iterdir())
    assert len(prev) == 1 and (prev[0] / "lineage.jsonl").read_bytes() == lines
    assert (prev[0] / runfiles.MARKER).exists() and not (tmp_path / runfiles.RESTARTING).exists()
    assert max(x["step"] for x in lineage(tmp_path)) == 2 and audit(tmp_path)["ok"]
