"""The run lock: one holder of a run directory per process of a job.

Owns: taking, checking and releasing it (`run_lock` picks the kind): on a local (or shared
POSIX) directory an flock (`RunLock`), on an object store a lease object (lease.LeaseLock).
A second `train` on a directory in use exits 2 naming the holder; the kernel drops an flock
whose process died, so a SIGKILLed run never blocks its restart. Does not own: what the
directory holds (rundir), or what stops when the lock is lost (train).

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

from async_rl.store import runfiles, storage
from async_rl.store.lease import LeaseLock
from async_rl.store.rundir import LockLostError, RunDirError, storage_error


class RunLock:
    """An exclusive flock on the run directory itself (process 0; a directory in use cannot be
    unlinked, so deleting `.lock` does not free it) and on `run.dir/.lock` (process i > 0 of a
    job: `.lock.p<i>`, the file only: the processes of a job share the directory).

    The file holds the holder's pid, host and start time; a holder whose file was deleted or
    replaced writes it again at its next step boundary (`check`), and stops (LockLostError)
    where another process took the new file. flock belongs to the open file: the kernel
    releases it when the process exits, however it exits."""

    def __init__(self, run_dir: Path, process_index: int = 0):
        self.run_dir = Path(run_dir)
        self.path = runfiles.lock(self.run_dir, process_index)
        self.on_dir = process_index == 0
        self._fd: int | None = None
        self._dir_fd: int | None = None
        self._info = b""

    def holder(self) -> str | None:
        """Who holds the lock now (read-only probe), or None when it is free."""
        targets = ([self.run_dir] if self.on_dir and self.run_dir.is_dir() else []) + \
            ([self.path] if self.path.is_file() else [])
        for target in targets:
            try:
                fd = os.open(target, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return self._describe_holder()
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        return None

    def _describe_holder(self) -> str:
        try:
            info = json.loads(self.path.read_text() or "{}")
        except FileNotFoundError:
            return f"another process (its {self.path.name} was deleted; it writes it again at its next step)"
        except (OSError, ValueError):
            info = {}
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"])) if "started" in info else "?"
        return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (since {since})"

    def _refusal(self, run_dir: Path) -> RunDirError:
        return RunDirError(f"run.dir={str(run_dir)!r} is in use by {self._describe_holder()}; wait for that run "
                           "to end or stop it (nothing was changed)")

    def ensure_free(self, run_dir: Path) -> None:
        if self.holder():
            raise self._refusal(run_dir)

    def acquire(self, run_dir: Path) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.on_dir:
            dfd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(dfd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise self._refusal(run_dir) from None
                # a filesystem that cannot lock a directory (NFS emulates flock with write
                # locks): the file lock and the per-step check below remain
            else:
                self._dir_fd = dfd
        try:
            self._take_file(run_dir)
        except BaseException:
            self.release()
            raise

    def _take_file(self, run_dir: Path) -> None:
        existed = self.path.exists()
        try:
            fd = storage.open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise storage_error(self.path, e, "taking the run lock") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._refusal(run_dir) from None
            raise
        self._info = self._info or json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                               "started": time.time()}).encode()
        try:
            os.ftruncate(fd, 0)
            os.write(fd, self._info)
        except OSError as e:
            os.close(fd)
            if not existed:
                self.path.unlink(missing_ok=True)  # no empty lock file left behind
            raise storage_error(self.path, e, "taking the run lock") from None
        self._fd = fd

    def check(self, run_dir: Path, log=None) -> None:
        """At a step boundary: is `.lock` still the file this process holds? If it was deleted or
        replaced, take the new one (LockLostError where another process holds it)."""
        if self._fd is None:
            return
        try:
            st = os.stat(self.path)
            mine = os.fstat(self._fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                return
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
        tries = 3 if self.on_dir else 1  # a holder() probe may hold the new file for an instant
        for attempt in range(tries):
            try:
                self._take_file(run_dir)
                break
            except RunDirError:
                if attempt + 1 == tries:
                    raise LockLostError(f"{self.path}: the run lock file was replaced and is held by "
                                        f"{self._describe_holder()}; stopped before writing anything more (the "
                                        "last committed checkpoint step is intact)") from None
                time.sleep(0.05)
        if log is not None:
            log(f"warning: {self.path} was deleted or replaced while the run held it; written again")

    def release(self) -> None:
        for name in ("_fd", "_dir_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)  # closing drops the flock
                setattr(self, name, None)


def run_lock(run_dir, process_index: int = 0, lease_s: float = 60.0):
    """The run lock for `run_dir`: an flock where it is a local (or shared POSIX) directory,
    a lease object on an object store."""
    if storage.is_remote(run_dir):
        return LeaseLock(run_dir, process_index, lease_s)
    return RunLock(run_dir, process_index)
