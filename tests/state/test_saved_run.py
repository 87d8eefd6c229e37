"""Reading a saved run (eval, export): only verified steps are read, nothing in the run is
changed, an export replaces the previous one whole or not at all, and a live run's keep-N
cleanup does not break a reader."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from helpers import cfg, checkpoint_steps, kill9, spawn, wait_for_step

from async_rl.run import cli
from async_rl.run.train import train

BASE = ["data.num_records=40", "model.learned_positions=0", "rollout.prompts_per_step=4", "checkpoint.every_steps=2", "checkpoint.keep=3"]
EVAL = ["eval.num_records=4"]


def _tree_digest(root):
    """sha256 of every file's path and bytes under `root`: what 'nothing was changed' means."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _flip_state(run, step, n=64):
    """`n` bytes flipped, spread over the array-data files of step `step`'s model state."""
    files = [p for p in (run / "checkpoints" / str(step) / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    per = max(1, n // len(files))
    for f in files:
        b = bytearray(f.read_bytes())
        for k in range(per):
            b[(k + 1) * len(b) // (per + 1)] ^= 0x5A
        f.write_bytes(bytes(b))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    train(cfg(root / "run", *BASE, "train.max_steps=4"))
    assert checkpoint_steps(root / "run") == [2, 4]
    return root / "run"


@pytest.mark.slow
def test_a_damaged_latest_step_is_never_read(run, tmp_path, capsys):
    run = shutil.copytree(run, tmp_path / "run")
    # step 2's export, before any damage, is what a fall-back must reproduce byte for byte
    assert cli.main(["export", str(run), "--step", "2", "--out", str(tmp_path / "good")]) == 0
    _flip_state(run, 4)
    before = _tree_digest(run)
    assert cli.main(["eval", str(run), "--json", *EVAL]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out.strip().splitlines()[-1])["step"] == 2  # not the damaged step 4
    warn = [x for x in cap.err.splitlines() if "warning" in x]
    assert len(warn) == 1 and "checkpoint step 4" in warn[0] and "(state:" in warn[0], cap.err
    assert cli.main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    cap = capsys.readouterr()
    assert "exported step 2" in cap.out and "checkpoint step 4" in cap.err and "(state:" in cap.err
    for f in (tmp_path / "good").iterdir():
        assert (tmp_path / "hf" / f.name).read_bytes() == f.read_bytes(), f.name
    # a damaged step asked for by name: exit 2, one line
    for cmd in (["eval", str(run), "--step", "4", *EVAL], ["export", str(run), "--step", "4", "--out",
                                                           str(tmp_path / "x")]):
        assert cli.main(cmd) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "step 4" in err and "damaged (state:" in err, err
    assert not (tmp_path / "x").exists()
    assert _tree_digest(run) == before  # read-only: nothing set aside, nothing written
    assert not list(tmp_path.glob(".async-rl-hold-*"))  # the held copies are gone


def test_export_refuses_a_file_and_foreign_directory(run, tmp_path, capsys):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"keep me")
    assert cli.main(["export", str(run), "--step", "2", "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "an existing file" in err and f.read_bytes() == b"keep me"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    assert cli.main(["export", str(run), "--step", "2", "--out", str(tmp_path / "mine")]) == 2
    assert "notes.txt" in capsys.readouterr().err and (tmp_path / "mine" / "notes.txt").read_text() == "x"


def _export_proc(run, out, step, kill_at=""):
    env = dict(os.environ, ASYNC_RL_KILL_AT=kill_at, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "async_rl", "export", str(run), "--step", str(step),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _files(d):
    return {p.name: p.read_bytes() for p in d.iterdir()}


@pytest.mark.soak
def test_a_killed_export_leaves_the_previous_one_whole(run, tmp_path):
    """SIGKILL while the new export is written, before and after it is swapped in: `--out`
    always holds one whole export, the previous one until the swap."""
    out = tmp_path / "hf"
    p = _export_proc(run, out, 2)
    assert p.wait(timeout=120) == 0, p.stderr.read()[-2000:]
    old = _files(out)
    p = _export_proc(run, tmp_path / "new", 4)
    assert p.wait(timeout=120) == 0, p.stderr.read()[-2000:]
    new = _files(tmp_path / "new")
    assert new != old
    kills = 0
    for point, want in (("export:1", old), ("export:2", new)):
        p = _export_proc(run, out, 4, kill_at=point)
        p.wait(timeout=120)
        kills += p.returncode == -9
        assert _files(out) == want, point
        old = want
    assert kills == 2
    # and at an arbitrary moment of the write (the process's own time to export, then half of it)
    t0 = time.monotonic()
    p = _export_proc(run, tmp_path / "timing", 2)
    assert p.wait(timeout=120) == 0
    took = time.monotonic() - t0
    p = _export_proc(run, out, 2)
    time.sleep(took * 0.9)
    killed = kill9(p)
    assert _files(out) in (new, _files(tmp_path / "timing")), killed
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".hf.export-")] or killed
    p = _export_proc(run, out, 2)  # the next export clears what the killed one left
    assert p.wait(timeout=120) == 0
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".hf.export-")]


@pytest.mark.soak
def test_eval_and_export_on_a_live_run_with_keep_1(tmp_path, xla_cache, capsys):
    """checkpoint.keep=1, every_steps=1: each step deletes the one before; readers hold the
    step they read (or move on to the next one) and never fail."""
    run = tmp_path / "run"
    proc = spawn(run, "data.num_records=400", "model.learned_positions=0", "rollout.prompts_per_step=4", "checkpoint.every_steps=1",
                 "checkpoint.keep=1", cache=xla_cache)
    try:
        assert wait_for_step(run, 3, proc)
        got = []
        for i in range(3):
            assert cli.main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0, capsys.readouterr().err
            assert cli.main(["eval", str(run), "--json", *EVAL]) == 0, capsys.readouterr().err
            got.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"])
        assert proc.poll() is None, "the run ended while read"
    finally:
        kill9(proc)
    assert got == sorted(got) and got[-1] > got[0], got  # it moved on as the run did
    assert "warning" not in capsys.readouterr().err
