"""The run directory as a whole: is it usable, who holds it, what history it has.

Owns: checking `run.dir` before anything is written (a file, a path under a file, no write
permission: one-line errors, exit 2), the per-process run lock (a second `train` on a
directory in use exits 2 naming the holder; the kernel drops a lock whose process died, so
a SIGKILLed run never blocks its restart), recognising history (lineage, metrics, damaged
steps, checkpoints) so that a directory with history but no restorable step is never
started over silently, moving that history aside when the user asks for a restart
(`run.resume=restart`), and writing the small manifests (`config.yaml`, `data.json`,
`final.json`) atomically. Does not own: checkpoints (checkpoint), the logs' contents
(lineage, metrics), or deciding to resume (train).

See docs/design.md, "Run directory safety".
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from .config import ConfigError

# Files and folders that hold a run's history; a fresh start never truncates them.
HISTORY_GLOBS = ("lineage*.jsonl", "metrics*.jsonl", "drops*.jsonl", "rollouts*.jsonl")
HISTORY_DIRS = ("checkpoints", "damaged", "tb", "journal", "wandb")
MANIFESTS = ("config.yaml", "data.json", "final.json", "reward.png", ".checkpointed", "wandb.json")
# Written once a checkpoint of the run is seen committed: from then on its logs are history
# that a checkpoint covered, and a directory that has lost every step is never started over.
MARKER = ".checkpointed"
# Written before a restart moves anything, removed after: names the folder it moves into,
# so that a restart killed half-way is recognised and finished, never resumed from.
RESTARTING = ".restarting"


class RunDirError(ConfigError):
    """run.dir cannot be used as asked (exit 2); nothing in it was changed."""


def check_usable(path: Path) -> None:
    """Raises RunDirError unless `path` is (or can be created as) a writable directory."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise RunDirError(f"run.dir={str(path)!r}: is a file, not a directory")
    probe = p
    while not probe.exists():
        parent = probe.parent
        if parent == probe:
            break
        probe = parent
    if probe.exists() and not probe.is_dir():
        raise RunDirError(f"run.dir={str(path)!r}: cannot be created, {str(probe)!r} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == p else f"cannot be created, {str(probe)!r} is not writable"
        raise RunDirError(f"run.dir={str(path)!r}: {what}")


def history(path: Path) -> dict[str, int]:
    """What a run directory already holds: {kind: count} for non-empty history items."""
    p, out = Path(path), {}
    if not p.is_dir():
        return out
    for pattern in HISTORY_GLOBS:
        n = sum(1 for f in p.glob(pattern) if f.is_file() and f.stat().st_size > 0)
        if n:
            out[pattern.split("*")[0]] = n
    for name in HISTORY_DIRS:
        d = p / name
        if d.is_dir() and any(d.iterdir()):
            out[name] = sum(1 for _ in d.iterdir())
    return out


def durable(path: Path) -> bool:
    """Did a checkpoint ever cover this run's logs? (marker written, or damaged steps set aside)"""
    p = Path(path)
    return (p / MARKER).is_file() or ((p / "damaged").is_dir() and any((p / "damaged").iterdir()))


def mark_checkpointed(path: Path, step: int) -> None:
    p = Path(path) / MARKER
    if not p.is_file():
        write_atomic(p, json.dumps({"first_committed_step": step, "time": time.time()}))


def describe(hist: dict[str, int]) -> str:
    return ", ".join(f"{k} ({v})" for k, v in sorted(hist.items()))


def interrupted_restart(path: Path) -> Path | None:
    """The folder an interrupted run.resume=restart was moving the history into, or None."""
    try:
        return Path(json.loads((Path(path) / RESTARTING).read_text())["dest"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return Path(path) / "previous"  # torn: still a restart that did not finish


def archive_history(path: Path) -> Path:
    """Moves the run's history and manifests into `previous/<time>/` (run.resume=restart);
    an interrupted restart is finished into the folder it had begun."""
    from . import faults

    p = Path(path)
    dest = interrupted_restart(p)
    if dest is None or not dest.is_dir() or dest.parent != p / "previous":
        dest = p / "previous" / time.strftime("%Y%m%d-%H%M%S")
        n = 0
        while dest.exists():
            n += 1
            dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
        dest.mkdir(parents=True)
        write_atomic(p / RESTARTING, json.dumps({"dest": str(dest), "time": time.time()}))
    names = [f.name for g in HISTORY_GLOBS for f in p.glob(g)] + list(HISTORY_DIRS) + list(MANIFESTS)
    moved = 0
    for name in names:
        if (p / name).exists():
            os.replace(p / name, dest / name)
            moved += 1
            faults.point("restart", moved)
    (p / RESTARTING).unlink(missing_ok=True)
    return dest


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a torn write."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        write_atomic(path, text)


class RunLock:
    """An exclusive flock on `run.dir/.lock` (process i > 0 of a job: `.lock.p<i>`).

    The file holds the holder's pid, host and start time. flock belongs to the open file:
    the kernel releases it when the process exits, however it exits."""

    def __init__(self, run_dir: Path, process_index: int = 0):
        self.path = Path(run_dir) / (".lock" if process_index == 0 else f".lock.p{process_index}")
        self._fd: int | None = None

    def holder(self) -> str | None:
        """Who holds the lock now (read-only probe), or None when it is free."""
        if not self.path.is_file():
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            return self._describe_holder()
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def _describe_holder(self) -> str:
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            info = {}
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"])) if "started" in info else "?"
        return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (since {since})"

    def ensure_free(self, run_dir: Path) -> None:
        held = self.holder()
        if held:
            raise RunDirError(f"run.dir={str(run_dir)!r} is in use by {held}; wait for that run to end or "
                              "stop it (nothing was changed)")

    def acquire(self, run_dir: Path) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirError(f"run.dir={str(run_dir)!r} is in use by {self._describe_holder()}; wait for "
                                  "that run to end or stop it (nothing was changed)") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.time()}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
