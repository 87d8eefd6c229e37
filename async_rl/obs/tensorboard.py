"""TensorBoard event files written on the caller's thread.

Owns: one event file per writer in `logdir` (`events.out.tfevents.<time>.<host>`, the
record format TensorBoard reads: length, masked CRC32C, Event proto, masked CRC32C), the
purge marker a resumed run writes first (TensorBoard hides the events of steps >= it from
earlier files), and appending scalars. tensorboardX's own writer queues events for a
background thread; when that thread dies of a full disk the caller blocks forever on the
full queue. Here each `add_scalars` is one write on the step loop's thread, so ENOSPC or
EIO surfaces at once as a StorageError naming the file. Does not own: which metrics are
logged or when (metrics).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path

from async_rl.store.rundir import storage_error


def _record(data: bytes) -> bytes:
    from tensorboardX.record_writer import masked_crc32c

    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


class EventWriter:
    """Scalars into a TensorBoard event file; thread-safe, every call written before it returns."""

    def __init__(self, logdir: Path, purge_step: int | None = None):
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        self._Event = Event
        self.dir = Path(logdir)
        self._lock = threading.Lock()
        self._fd = -1
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.path = self.dir / f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}"
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise storage_error(self.dir, e, "opening a TensorBoard event file") from None
        events = [Event(wall_time=time.time(), file_version="brain.Event:2")]
        if purge_step is not None:
            events.append(Event(step=purge_step, wall_time=time.time(),
                                session_log=SessionLog(status=SessionLog.START)))
        self._write(events)

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        from tensorboardX.summary import scalar
        now = time.time()
        self._write([self._Event(wall_time=now, step=step, summary=scalar(k, v)) for k, v in values.items()])

    def _write(self, events: list) -> None:
        data = memoryview(b"".join(_record(e.SerializeToString()) for e in events))
        with self._lock:
            if self._fd < 0:
                return
            try:
                while data:
                    data = data[os.write(self._fd, data):]
            except OSError as e:
                raise storage_error(self.path, e) from None

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def cut_events(tb_dir: Path, step: int) -> int:
    """Rewrites each TensorBoard event file of `tb_dir` without the events after `step` (those
    a killed session logged past its last checkpoint) and any torn last record; returns the
    events dropped. Each file is replaced atomically, and only when something is dropped."""
    paths = sorted(Path(tb_dir).glob("events.out.tfevents.*")) if Path(tb_dir).is_dir() else []
    if not paths:
        return 0  # tensorboardX (and the cloud clients it imports) is not loaded for nothing
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    dropped = 0
    for path in paths:
        raw, keep, pos, cut = path.read_bytes(), [], 0, False
        while pos < len(raw):
            head = raw[pos:pos + 12]
            n = struct.unpack("<Q", head[:8])[0] if len(head) == 12 else -1
            data = raw[pos + 12:pos + 12 + n] if n >= 0 else b""
            tail = raw[pos + 12 + n:pos + 16 + n] if n >= 0 else b""
            if (n < 0 or struct.unpack("<I", head[8:])[0] != masked_crc32c(head[:8]) or len(tail) != 4
                    or struct.unpack("<I", tail)[0] != masked_crc32c(data)):
                cut = True  # a torn record: nothing after it can be trusted
                break
            ev = Event.FromString(data)
            if ev.step <= step:
                keep.append(raw[pos:pos + 16 + n])
            else:
                dropped += 1
                cut = True
            pos += 16 + n
        if cut:
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                f.write(b"".join(keep))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    return dropped
