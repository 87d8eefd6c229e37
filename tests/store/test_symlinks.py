"""Symbolic links inside run.dir are refused, never written through; run.dir itself may be one."""

from __future__ import annotations

import subprocess

import pytest
from helpers import cli_args, tree_digest

from async_rl.store import applog, rundir, runfiles, storage
from async_rl.store.runlock import RunLock
from async_rl.store.storage import SymlinkRefused

BYTES = b'{"outside": "run.dir"}\n' * 4
# every entry a run writes, appends to, truncates or moves in run.dir (files, then folders)
FILES = ["lineage.jsonl", "metrics.jsonl", "metrics.p1.jsonl", "lineage.p2.jsonl", "drops.jsonl",
         "rollouts.jsonl", "env_requests.jsonl", "env_requests.p1.jsonl", runfiles.RUN_ID, runfiles.LOCK,
         f"{runfiles.LOCK}.p1", runfiles.MARKER, runfiles.REWARD_PLOT, runfiles.CONFIG, runfiles.DATA,
         runfiles.FINAL, runfiles.WANDB_STATE, runfiles.RESTARTING, "journal/p0/00000001.jrn",
         "checkpoints/3/ledger", "tb/events.out.tfevents.1.host.1"]
FOLDERS = [runfiles.JOURNAL, "journal/p0", runfiles.DAMAGED, runfiles.PREVIOUS, runfiles.CHECKPOINTS,
           "checkpoints/3", runfiles.TB, runfiles.WANDB]


def plant(tmp_path, name: str):
    """run/<name> a link to a file (or folder holding one) outside run.dir; returns (run, outside)."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    if name in FOLDERS:
        (outside / "t").mkdir()
        (outside / "t" / "f").write_bytes(BYTES)
    else:
        (outside / "t").write_bytes(BYTES)
    (run / name).symlink_to(outside / "t")
    return run, outside


@pytest.mark.parametrize("name", FILES + FOLDERS)
def test_a_link_inside_run_dir_is_refused_naming_it(tmp_path, name):
    """The start-up check names the link in one line (exit 2 kind) before anything is read,
    cut or moved; the file outside and run.dir are byte-identical."""
    run, outside = plant(tmp_path, name)
    before, out_before = tree_digest(run), tree_digest(outside)
    with pytest.raises(SymlinkRefused) as e:
        rundir.check_usable(run)
    line = str(e.value)
    assert "\n" not in line and str(run / name) in line and "symbolic link" in line, line
    assert tree_digest(outside) == out_before and tree_digest(run) == before


@pytest.mark.parametrize("name", ["lineage.jsonl", "metrics.p1.jsonl", "journal/p0/00000001.jrn"])
def test_logs_never_open_or_cut_through_a_link(tmp_path, name):
    """Opening a log for append, or cutting it back on resume, refuses a link at its path."""
    run, outside = plant(tmp_path, name)
    for act in (lambda: applog.AppendLog(run / name), lambda: applog.cut(run / name, 0),
                lambda: applog.AppendLog(run / name, new=True)):
        with pytest.raises(SymlinkRefused, match="symbolic link"):
            act()
    assert (outside / "t").read_bytes() == BYTES


@pytest.mark.parametrize("name", [runfiles.CONFIG, runfiles.FINAL, runfiles.RUN_ID, runfiles.MARKER])
def test_manifests_and_moves_refuse_a_link(tmp_path, name):
    run, outside = plant(tmp_path, name)
    for act in (lambda: storage.write_atomic(run / name, b"x"), lambda: storage.create(run / name, b"x"),
                lambda: storage.remove(run / name), lambda: storage.move(run / name, run / "elsewhere")):
        with pytest.raises(SymlinkRefused):
            act()
    assert (outside / "t").read_bytes() == BYTES and (run / name).is_symlink()


@pytest.mark.parametrize("folder", [runfiles.PREVIOUS, runfiles.DAMAGED, "journal/p0"])
def test_a_linked_folder_is_not_made_or_moved_into(tmp_path, folder):
    run, outside = plant(tmp_path, folder)
    with pytest.raises(SymlinkRefused):
        storage.mkdirs(run / folder)
    (run / "x").write_bytes(b"x")
    with pytest.raises(SymlinkRefused):
        storage.move(run / "x", run / folder)
    assert tree_digest(outside) == {"t/f": __import__("hashlib").sha256(BYTES).hexdigest()}


@pytest.mark.parametrize("i", [0, 1])
def test_the_run_lock_refuses_a_linked_lock_file(tmp_path, i):
    run, outside = plant(tmp_path, runfiles.lock(tmp_path / "run", i).name)
    lock = RunLock(run, i)
    with pytest.raises(SymlinkRefused):
        lock.acquire(run)
    lock.release()
    assert (outside / "t").read_bytes() == BYTES


def test_run_dir_itself_may_be_a_link(tmp_path):
    """A run kept on another disk: run.dir (and its parent) a link to a real folder works."""
    real = tmp_path / "disk" / "run"
    real.mkdir(parents=True)
    (tmp_path / "parent").symlink_to(tmp_path / "disk")
    run = tmp_path / "parent" / "run"
    rundir.check_usable(run)
    log = applog.AppendLog(runfiles.lineage(run), new=True)
    log.append(b"{}\n")
    log.sync()
    applog.cut(runfiles.lineage(run), 1)
    log.close()
    storage.write_atomic(run / runfiles.CONFIG, b"a: 1\n")
    lock = RunLock(run)
    lock.acquire(run)
    lock.release()
    assert (real / "lineage.jsonl").read_bytes() == b"{" and (real / runfiles.CONFIG).read_bytes() == b"a: 1\n"


@pytest.mark.parametrize("name", ["lineage.jsonl", "checkpoints/1"])
def test_train_refuses_a_linked_entry_in_one_line(tmp_path, name):
    """The command line: exit 2, one error line naming the link, nothing changed in or outside."""
    run, outside = plant(tmp_path, name)
    before, out_before = tree_digest(run), tree_digest(outside)
    r = subprocess.run(cli_args(run), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and str(run / name) in errors[0] and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert tree_digest(run) == before and tree_digest(outside) == out_before


def test_a_linked_step_folder_is_named_by_every_reader(tmp_path):
    """eval, export and audit list steps through `committed_steps`: a step folder that is a
    link is named in one line there too, not reported as a missing or damaged step."""
    from async_rl.state.layout import committed_steps
    run, outside = plant(tmp_path, "checkpoints/3")
    with pytest.raises(SymlinkRefused) as e:
        committed_steps(run / runfiles.CHECKPOINTS)
    assert str(run / "checkpoints/3") in str(e.value) and "\n" not in str(e.value)
    assert (outside / "t" / "f").read_bytes() == BYTES


def test_links_wandb_makes_in_its_own_folder_are_left_alone(tmp_path):
    """W&B links `wandb/latest-run` and `wandb/debug.log` itself: a resume of a W&B run passes."""
    run = tmp_path / "run"
    (run / runfiles.WANDB / "run-1" / "logs").mkdir(parents=True)
    (run / runfiles.WANDB / "latest-run").symlink_to("run-1")
    (run / runfiles.WANDB / "debug.log").symlink_to("run-1/logs/debug.log")
    rundir.check_usable(run)
