"""Faults in a run's files and disk, each with a real training subprocess: what the run does
is never a silent fresh start, a lost committed step, or a crash loop (docs/design.md, "Run
directory safety"; the fault table in docs/resume-and-faults.md lists one row per test here)."""
import json
import shutil
import signal

import pytest
from helpers import checkpoint_steps, lineage, run_cli

from async_rl.run.cli import main
from async_rl.state.audit import audit

BASE = ["data.num_records=40", "rollout.prompts_per_step=4", "checkpoint.every_steps=2", "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def _four_steps(tmp_path_factory, xla_cache):
    """`train.max_steps=4` of BASE (checkpoints 2 and 4), trained once: the tests that start
    from it take a copy each."""
    run = tmp_path_factory.mktemp("four_steps")
    r = run_cli(run, *BASE, "train.max_steps=4", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    return run


@pytest.fixture
def run(_four_steps, tmp_path):
    """A copy of the 4-step run in this test's tmp_path (returned)."""
    shutil.copytree(_four_steps, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _flip_middle(path):
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0x10
    path.write_bytes(bytes(b))


def _finish_and_audit(run_dir, cache):
    r = run_cli(run_dir, *BASE, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(x["prompt_id"] for x in lineage(run_dir)) == list(range(40))
    assert audit(run_dir)["ok"]
    return r


@pytest.mark.parametrize("item", ["state", "ledger"])
def test_a_flipped_byte_sets_the_step_aside(run, xla_cache, item):
    d = run / "checkpoints" / "4" / item
    if item == "state":  # one byte in each array-data file (which ones hold live values varies)
        for f in (p for p in d.rglob("*") if p.is_file() and p.parent.name == "d"):
            _flip_middle(f)
    else:
        _flip_middle(next(d.glob("*.bin")))
    r = run_cli(run, *BASE, "train.max_steps=6", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint step 4" in r.stderr and f"({item}:" in r.stderr and "resumed step 2" in r.stderr
    assert "Event loop is closed" not in r.stderr and "Traceback" not in r.stderr
    assert [p.name.split("_")[1] for p in (run / "damaged").iterdir()] == ["4"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(x.get("learner/loss") is not None for x in rows)  # no NaN was trained on
    _finish_and_audit(run, xla_cache)


@pytest.mark.parametrize("where", ["ledger", "commit"])
def test_disk_full_during_a_save_stops_with_the_last_step_intact(tmp_path, xla_cache, where):
    r = run_cli(tmp_path, *BASE, "train.max_steps=8", cache=xla_cache, fault=f"enospc:{where}:6")
    assert r.returncode == 1, r.stderr[-3000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "checkpoint step 6" in err[0] and "No space left" in err[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert checkpoint_steps(tmp_path) == [2, 4]
    r = _finish_and_audit(tmp_path, xla_cache)
    assert "resumed step 4" in r.stderr


def test_sigkill_while_setting_a_damaged_step_aside(run, xla_cache):
    (run / "checkpoints" / "4" / "meta" / "metadata").write_text("{")
    r = run_cli(run, *BASE, cache=xla_cache, kill_at="set_aside:4")
    assert r.returncode == -signal.SIGKILL
    r = _finish_and_audit(run, xla_cache)  # the restart sets it aside again and goes on
    assert "resumed step 2" in r.stderr


def test_a_corrupt_lineage_line_names_its_line_and_the_run_goes_on(run, xla_cache, capsys):
    lines = (run / "lineage.jsonl").read_text().splitlines(keepends=True)
    lines[2] = lines[2].replace('"prompt_id"', '"prompt_i\\u0000"', 1)
    (run / "lineage.jsonl").write_text("".join(lines))
    assert main(["audit", str(run)]) == 2
    assert "lineage.jsonl:3" in capsys.readouterr().err
    r = run_cli(run, *BASE, "train.max_steps=6", cache=xla_cache)  # training never reads old lines back
    assert r.returncode == 0 and "resumed step 4" in r.stderr, r.stderr[-2000:]
