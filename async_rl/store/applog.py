"""The append-only log: the one type behind lineage, drops, rollouts, metrics and the journal.

Owns: where a log's bytes live and how they are appended, made durable, read back, measured,
cut back (to a byte length a checkpoint recorded) and deleted. Locally a log is one file,
opened for append: bytes are written at once (the OS holds them: they survive a SIGKILL of
the process) and `sync` fdatasyncs them. An object store has no append, so there the log
`name` is the folder `name/` of numbered segment objects, read back in order as one byte
stream: bytes wait in memory until `sync` uploads them as the next segment (one PUT: whole or
absent), and `append` uploads at once. A cut deletes segments from the last one backwards, so
a cut stopped half-way leaves a shorter log with no gap, and the next cut finishes it.
Does not own: what the bytes are (JSON lines: lineage; journal records: journal_format),
which logs a run has (runfiles), or the write guard and bound every storage call goes
through (storage, remote_io).

See docs/design.md, "The run directory".
"""

from __future__ import annotations

import os
import threading

from async_rl.store import storage

SEGMENT_DIGITS = 10  # a segment object's name: its sequence number, zero-padded


def segment_name(seq: int) -> str:
    return f"{seq:0{SEGMENT_DIGITS}d}"


def segments(p) -> list[tuple[str, int]]:
    """(url, bytes) of each segment of log `p` on an object store, in order."""
    fs = storage.filesystem(p)
    try:
        entries = fs.ls(storage.url(p), detail=True)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        if e.get("type") == "file" and len(name) == SEGMENT_DIGITS and name.isdigit():
            out.append((f"{storage.scheme(p)}://{e['name']}", int(e["size"])))
    return sorted(out)


def read(p) -> bytes:
    """The whole content of log `p` (b"" where there is none)."""
    if not storage.is_remote(p):
        try:
            return storage.read_bytes(p)
        except FileNotFoundError:
            return b""
    fs = storage.filesystem(p)
    out = []
    for u, _ in segments(p):
        try:
            out.append(fs.cat_file(u))
        except FileNotFoundError:  # cut by a resume while read: a cut deletes from the end
            break
    return b"".join(out)


def size(p) -> int:
    """Bytes in log `p` (0 where there is none)."""
    if not storage.is_remote(p):
        return storage.size(p) if storage.is_file(p) else 0
    return sum(n for _, n in segments(p))


def has_bytes(p) -> bool:
    """Whether log `p` exists with at least one byte."""
    return size(p) > 0


def cut(p, nbytes: int) -> int:
    """Cuts log `p` back to its first `nbytes`; returns the bytes cut."""
    if not storage.is_remote(p):
        storage.no_link(p)  # never cut a file elsewhere through a link
        before = size(p)
        if before > nbytes:
            os.truncate(p, nbytes)  # fsspec has no truncate: the file is cut in place
        return max(0, before - nbytes)
    segs, fs = segments(p), storage.filesystem(p)
    if segs:
        storage.check_write(p)
    pos, spans = 0, []
    for u, n in segs:
        spans.append((u, pos, n))
        pos += n
    for u, start, n in reversed(spans):
        if start >= nbytes:
            fs.rm_file(u)
        elif start + n > nbytes:
            fs.pipe_file(u, fs.cat_file(u)[:nbytes - start])
    return max(0, pos - nbytes)


def delete(p) -> None:
    """Removes log `p` (nothing where it is gone already); on an object store the last segment
    first, so a delete stopped half-way never leaves a gap."""
    if not storage.is_remote(p):
        storage.remove(p)
        return
    for u, _ in reversed(segments(p)):
        storage.remove(u)


class AppendLog:
    """One log open for appending (OSError as raised where it cannot be opened or written).

    `new`: the log must not exist yet (a local file is created exclusively, and its directory
    entry is made durable by the first `sync`). `dirty` says bytes were written since the last
    `sync`; a caller that syncs from another thread may clear it before syncing (a write landing
    meanwhile sets it again). On an object store, writes may come while a sync uploads (syncs of
    one log never overlap)."""

    def __init__(self, path, *, new: bool = False):
        self.path = storage.run_path(path)
        self.remote = storage.is_remote(path)
        self.dirty = new
        self._open = True
        if self.remote:
            self._pending: list[bytes] = []
            self._lock = threading.Lock()
            segs = [] if new else segments(path)
            self._size = sum(n for _, n in segs)
            self._seq = int(segs[-1][0].rsplit("/", 1)[-1]) if segs else 0
        else:
            # appends, exclusive create and fdatasync are POSIX file semantics fsspec does not
            # offer: a local log stays a plain file descriptor
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_EXCL if new else 0)
            self._fd = storage.open_no_follow(self.path, flags)
            self._new_entry = new

    @property
    def open(self) -> bool:
        return self._open

    def write(self, data: bytes) -> None:
        """Locally written at once; on an object store held until the next `sync`."""
        if self.remote:
            with self._lock:
                self._pending.append(data)
        else:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        self.dirty = True

    def append(self, data: bytes) -> None:
        """Written at once on either kind of store (an object store: as one new segment)."""
        if data:
            self.write(data)
            if self.remote:
                self.sync()

    def sync(self) -> None:
        """Makes what was written durable: fdatasync, or the upload of the next segment. A failed
        upload keeps its bytes for the next sync, in order, with what came since."""
        if not self.remote:
            os.fdatasync(self._fd)
            if self._new_entry:
                dfd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
                self._new_entry = False
            return
        with self._lock:
            taken, self._pending = self._pending, []
        if not taken:
            return
        data = b"".join(taken)
        try:
            storage.write_atomic(self.path / segment_name(self._seq + 1), data)
        except BaseException:
            with self._lock:
                self._pending[:0] = taken
            raise
        self._seq += 1
        self._size += len(data)

    def tell(self) -> int:
        """Bytes in the log: written (a file) or uploaded (an object store)."""
        return self._size if self.remote else os.fstat(self._fd).st_size

    def truncate(self, nbytes: int) -> int:
        """Cuts the log back to `nbytes`; returns the bytes cut."""
        got = cut(self.path, nbytes)
        if self.remote:
            self._size = size(self.path)
        return got

    def close(self) -> None:
        if self._open and not self.remote:
            os.close(self._fd)
        self._open = False
