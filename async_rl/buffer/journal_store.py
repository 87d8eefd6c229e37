"""Where the rollout journal's segments live: a local file, or part objects on an object store.

Owns: creating a segment, writing records to it, making them durable, closing, listing,
reading back, cutting and deleting segments, on either kind of run.dir. Locally a segment
is a file `<seq>.jrn`: records are written at once (the OS holds them: they survive a
SIGKILL) and fdatasync'd in batches. An object store has no append, so there a segment is
the folder `<seq>.jrn/` of part objects, read back in order as one byte stream
(`storage.read_log`); records wait in memory and each sync uploads them as the next part
(one PUT: whole or absent), so `journal.fsync_every_s` is also how much generation a kill
there can lose. Does not own: which records are written or used (`journal`), their bytes
(`journal_format`).
"""

from __future__ import annotations

import os
import threading

from async_rl.store import storage


class FileSegment:
    """A local segment file, created exclusively and appended to."""

    def __init__(self, path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self.new = True  # its directory entry is not fsynced yet
        self.dirty = True
        self.closed_at: int | None = None  # the checkpoint cut that closed it (set by the journal)

    @property
    def open(self) -> bool:
        return self.fd >= 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self.dirty = True

    def sync(self) -> None:
        os.fdatasync(self.fd)
        if self.new:
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self.new = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ObjectSegment:
    """A segment on an object store: the folder of its parts, one uploaded per sync. Writes
    may come while a sync uploads (syncs of one segment never overlap)."""

    def __init__(self, path):
        self.path = path
        self._pending: list[bytes] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._open = True
        self.dirty = True
        self.closed_at: int | None = None  # the checkpoint cut that closed it (set by the journal)

    @property
    def open(self) -> bool:
        return self._open

    def write(self, data: bytes) -> None:
        with self._lock:
            self._pending.append(data)
        self.dirty = True

    def sync(self) -> None:
        with self._lock:
            taken, self._pending = self._pending, []
        if not taken:
            return
        try:
            storage.write_atomic(self.path / storage.segment_name(self._seq + 1), b"".join(taken))
        except BaseException:
            with self._lock:  # the next sync uploads them, in order, with what came since
                self._pending[:0] = taken
            raise
        self._seq += 1

    def close(self) -> None:
        self._open = False


def create(path) -> FileSegment | ObjectSegment:
    """A new, empty segment at `path` (OSError where it cannot be made)."""
    return ObjectSegment(path) if storage.is_remote(path) else FileSegment(path)


def segment_files(directory) -> list:
    """The segments in one process's journal folder, oldest first."""
    return [directory / n for n in storage.listdir(directory) if n.endswith(".jrn") and n[:-4].isdigit()]


def delete(path) -> None:
    """Removes a segment (nothing where it is gone already)."""
    if not storage.is_remote(path):
        path.unlink(missing_ok=True)
        return
    for u, _ in reversed(storage.segments(path)):  # the last part first: never a gap
        storage.remove(u)
