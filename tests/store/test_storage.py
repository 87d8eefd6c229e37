"""A full or failing disk never hangs a run: every writer (TensorBoard, metrics.jsonl,
lineage.jsonl, drops.jsonl, the run lock, the manifests) turns ENOSPC into one error line
naming the file, exit 1, with the last committed step intact; the journal turns itself off
with one warning. Real full filesystems: small tmpfs mounts (needs root; skipped otherwise)."""
import contextlib
import os
import signal
import subprocess

import pytest
from helpers import checkpoint_steps, run_cli, spawn, wait_for_step, wait_until

from async_rl.state.audit import audit

BASE = ["data.num_records=48", "rollout.prompts_per_step=4", "checkpoint.every_steps=2"]


@contextlib.contextmanager
def tmpfs(path, size="30m"):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True, timeout=30)
    if r.returncode:
        pytest.skip(f"a small tmpfs cannot be mounted here ({r.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@contextlib.contextmanager
def bind(src, dst):
    """`src` mounted over `dst` (a file or folder), unmounted at the end."""
    r = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, text=True, timeout=30)
    if r.returncode:
        pytest.skip(f"a bind mount cannot be made here ({r.stderr.strip()})")
    try:
        yield dst
    finally:
        subprocess.run(["umount", "-l", str(dst)], capture_output=True, timeout=30)


def fill(fs) -> int:
    """Writes a filler file until the filesystem has no byte left; returns its size."""
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    n = 0
    try:
        for chunk in (1 << 20, 4096, 1):
            buf = b"\0" * chunk
            with contextlib.suppress(OSError):
                while True:
                    n += os.write(fd, buf)
    finally:
        os.close(fd)
    return n


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def test_disk_full_mid_run_is_one_error_line_and_resumes(tmp_path, xla_cache):
    """run.dir on a 30 MiB tmpfs filled while the run trains (TensorBoard on, every step)."""
    with tmpfs(tmp_path / "fs") as fs:
        run = fs / "run"
        args = (*BASE, "data.num_epochs=50", "log.tensorboard=true", "log.every_steps=1")
        p = spawn(run, *args, cache=xla_cache, delay="step:0.3")
        try:
            wait_until(lambda: checkpoint_steps(run) or p.poll() is not None, 400, "a committed checkpoint")
            assert wait_for_step(run, checkpoint_steps(run)[-1] + 1, p, timeout=300)
            fill(fs)
            p.wait(timeout=180)  # on a full disk the run ends; it never hangs
        finally:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=60)
        err = p.stderr.read()
        assert p.returncode == 1, err[-3000:]
        lines = error_lines(err)
        assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert "No space left on device" in lines[0] or "checkpoint" in lines[0], lines
        (fs / "filler").unlink()
        steps = checkpoint_steps(run)
        assert steps
        r = run_cli(run, *args, f"train.max_steps={steps[-1] + 2}", cache=xla_cache)
        assert r.returncode == 0 and f"resumed step {steps[-1]}" in r.stderr, r.stderr[-3000:]
        assert audit(run)["ok"]


def test_disk_full_at_start_is_one_error_line_and_leaves_no_lock(tmp_path, xla_cache):
    with tmpfs(tmp_path / "fs", size="4m") as fs:
        (fs / "run").mkdir()
        fill(fs)
        r = run_cli(fs / "run", *BASE, "train.max_steps=2", cache=xla_cache, timeout=300)
        assert r.returncode == 1, r.stderr[-3000:]
        lines = error_lines(r.stderr)
        assert len(lines) == 1 and ".lock" in lines[0] and "No space left" in lines[0], r.stderr[-3000:]
        assert "Traceback" not in r.stderr
        assert not (fs / "run" / ".lock").exists() and not list((fs / "run").iterdir())


# the writer -> the path in run.dir put on a full filesystem, and config to make it write
WRITERS = {"tensorboard": ("tb", ["log.tensorboard=true", "log.every_steps=1"]),
           "metrics": ("metrics.jsonl", []),
           "lineage": ("lineage.jsonl", []),
           "drops": ("drops.jsonl", ["rollout.filter_zero_variance=true"]),
           "journal": ("journal", []),
           "rollouts": ("rollouts.jsonl", ["log.rollouts=true"]),
           "checkpoint": ("checkpoints", [])}


@pytest.mark.soak
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_each_writer_on_a_full_disk(tmp_path, xla_cache, writer):
    """One writer's file (or folder) on a full tmpfs, bind-mounted in place (run.dir refuses
    symbolic links), the rest on a disk with
    room: that writer's first write fails. Exit 1 with one error line naming it (the journal:
    one warning, it turns itself off, training goes on); the next start resumes."""
    name, extra = WRITERS[writer]
    run = tmp_path / "run"
    run.mkdir()
    with tmpfs(tmp_path / "fs", size="4m") as fs, contextlib.ExitStack() as stack:
        target, spot = fs / name, run / name
        if "." not in name:
            target.mkdir()
            spot.mkdir()
        else:
            target.touch()
            spot.touch()
        stack.enter_context(bind(target, spot))
        fill(fs)
        args = (*BASE, *extra)
        r = run_cli(run, *args, cache=xla_cache, timeout=300)
        if writer == "journal":
            assert r.returncode == 0, r.stderr[-3000:]
            warn = [ln for ln in r.stderr.splitlines() if "journal write failed" in ln]
            assert len(warn) == 1 and "No space left" in warn[0] and "Traceback" not in r.stderr, r.stderr[-3000:]
            assert audit(run)["ok"]
            return
        assert r.returncode == 1, r.stderr[-3000:]
        lines = error_lines(r.stderr)
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert name in lines[0] and "No space left on device" in lines[0], lines
        (fs / "filler").unlink()
        r = run_cli(run, *args, cache=xla_cache, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert audit(run)["ok"]


def test_a_log_write_on_a_full_device_is_a_storage_error_naming_it():
    """/dev/full answers every write with ENOSPC: the append raises at once, naming the file,
    and closing afterwards raises nothing (nothing is left buffered)."""
    from async_rl.state.lineage import JsonlLog
    from async_rl.store.rundir import StorageError
    log = JsonlLog("/dev/full")
    with pytest.raises(StorageError, match=r"/dev/full: write failed \(No space left on device\)"):
        log.append([{"step": 1}])
    log.close()


def test_tensorboard_events_are_written_before_add_returns(tmp_path):
    """Our event writer's records parse back as TensorBoard reads them (CRCs, purge marker, scalars)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event, SessionLog
    from tensorboardX.record_writer import masked_crc32c

    from async_rl.obs.tensorboard import EventWriter
    w = EventWriter(tmp_path / "tb", purge_step=5)
    w.add_scalars({"rollout/reward_mean": 0.25, "learner/loss": -1.5}, 5)
    (path,) = (tmp_path / "tb").iterdir()
    b, i, events = path.read_bytes(), 0, []  # read while the writer is still open
    while i < len(b):
        (n,) = struct.unpack("Q", b[i:i + 8])
        assert struct.unpack("I", b[i + 8:i + 12])[0] == masked_crc32c(b[i:i + 8])
        data = b[i + 12:i + 12 + n]
        assert struct.unpack("I", b[i + 12 + n:i + 16 + n])[0] == masked_crc32c(data)
        events.append(Event.FromString(data))
        i += 16 + n
    w.close()
    assert events[0].file_version == "brain.Event:2"
    assert events[1].step == 5 and events[1].session_log.status == SessionLog.START
    got = {v.tag: v.simple_value or v.tensor.float_val[0] for e in events[2:] for v in e.summary.value}
    assert got == {"rollout/reward_mean": 0.25, "learner/loss": -1.5}


def test_a_local_append_log_appends_cuts_back_and_is_created_once(tmp_path):
    """applog's local log: bytes land at once, `tell` is the file's length across sessions, a
    cut keeps the first bytes, and a new log refuses a file that exists."""
    from async_rl.store import applog
    from async_rl.store.applog import AppendLog
    p = tmp_path / "x.jsonl"
    log = AppendLog(p)
    log.append(b"one\n")
    log.append(b"two\n")
    assert p.read_bytes() == b"one\ntwo\n" and log.tell() == 8 == applog.size(p)
    assert log.truncate(4) == 4 and log.tell() == 4
    log.append(b"three\n")
    log.close()
    again = AppendLog(p)  # the next session appends after what is kept
    assert again.tell() == 10 and applog.read(p) == b"one\nthree\n"
    assert applog.cut(p, 100) == 0 and applog.cut(p, 0) == 10 and applog.read(p) == b""
    again.close()
    with pytest.raises(FileExistsError):
        AppendLog(p, new=True)
    seg = AppendLog(tmp_path / "00000001.jrn", new=True)
    seg.write(b"rec")
    assert seg.dirty
    seg.sync()
    seg.close()
    assert not seg.open
    applog.delete(tmp_path / "00000001.jrn")
    applog.delete(tmp_path / "00000001.jrn")  # gone already: nothing
    assert not applog.has_bytes(tmp_path / "00000001.jrn") and applog.read(tmp_path / "none") == b""


def test_exclusive_create_is_whole_or_absent_and_first_wins(tmp_path):
    from async_rl.store import storage
    p = tmp_path / "run_id"
    assert storage.create(p, b"first") and not storage.create(p, b"second")
    assert p.read_bytes() == b"first" and [f.name for f in tmp_path.iterdir()] == ["run_id"]
