"""The run lock on an object store: a lease object, and the writes it fences.

Owns: the versioned read and conditional replace of one object (GCS generation, S3 ETag),
the lease built on them (`LeaseLock`: create, renew, release, take over; an epoch per
holder), the holder's guard before each write (its clock, and the lease object read back:
registered with `storage` as the write guard of the run directory), and the hold-off that
keeps a new holder from reading where to resume while an old one may still write. Does not
own: the local flock (runlock.RunLock), or what stops when the lease is lost (train).

See docs/design.md, "Run directories on object storage".
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from async_rl.store import applog, remote_io, runfiles, storage
from async_rl.store.remote_io import StorageError
from async_rl.store.rundir import LockLostError, RunDirError, history, storage_error

# A new holder reads nothing of the run until this many leases have passed since it saw
# the lease absent or stale: an old holder stops writing one lease after its last renewal,
# and a write it began just before that has the rest to land.
HOLD_OFF = 4 / 3


class Conflict(Exception):
    """A conditional write lost: the object was created or changed by another writer."""


def read_versioned(p, timeout_s: float | None = None) -> tuple[bytes, str] | None:
    """(content, version) of object `p`, or None where there is none. The version is the
    GCS generation or the S3 ETag of exactly the content returned."""
    t = timeout_s or remote_io.per_request_s()
    if storage.scheme(p) == "gs":
        from google.api_core import exceptions as gexc
        blob = _gcs_blob(p)
        with remote_io.named(p, "read"):
            try:
                data = blob.download_as_bytes(timeout=(min(10.0, t), t), retry=_gcs_retry(t))
            except gexc.NotFound:
                return None
        return data, str(blob.generation)
    fs = storage.filesystem(p)
    bucket, key, _ = fs.split_path(storage.url(p))
    with remote_io.limit(t):
        try:
            got = fs.call_s3("get_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        body = got["Body"]
        import asyncio

        from fsspec.asyn import sync
        data = sync(fs.loop, body.read) if asyncio.iscoroutinefunction(body.read) else body.read()
    return data, got["ETag"]


def replace_if(p, data: bytes, version: str | None, timeout_s: float | None = None) -> str:
    """Writes object `p` only if it is still at `version` (None: only if it does not exist);
    returns the new version. Conflict where another writer got there first;
    FileNotFoundError (S3) where the object to replace is gone."""
    t = timeout_s or remote_io.per_request_s()
    if storage.scheme(p) == "gs":
        from google.api_core import exceptions as gexc
        blob = _gcs_blob(p)
        with remote_io.named(p, "write"):
            try:
                blob.upload_from_string(data, if_generation_match=int(version) if version is not None else 0,
                                        timeout=(min(10.0, t), t), retry=_gcs_retry(t))
            except gexc.PreconditionFailed:
                raise Conflict(storage.url(p)) from None
        return str(blob.generation)
    fs = storage.filesystem(p)
    bucket, key, _ = fs.split_path(storage.url(p))
    cond = {"IfMatch": version} if version is not None else {"IfNoneMatch": "*"}
    try:
        with remote_io.limit(t):
            return fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **cond)["ETag"]
    except FileNotFoundError:
        raise
    except (FileExistsError, OSError) as e:
        if _precondition(e):
            raise Conflict(storage.url(p)) from None
        raise


def _precondition(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, FileExistsError) or "PreconditionFailed" in str(e) or "412" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _gcs_retry(t: float):
    from google.cloud.storage.retry import DEFAULT_RETRY
    return DEFAULT_RETRY.with_timeout(t)


_gcs = {}


def _gcs_blob(p):
    if "client" not in _gcs:
        storage.filesystem("gs://x")  # the extra's check
        from google.cloud import storage as gcs
        with remote_io.named("gs://", "connect"):
            _gcs["client"] = gcs.Client()
    bucket, _, key = storage.url(p)[len("gs://"):].partition("/")
    return _gcs["client"].bucket(bucket).blob(key)


def _epoch(doc: dict) -> int:
    """A lease record's epoch (0: written before leases had one)."""
    e = doc.get("epoch", 0)
    return e if isinstance(e, int) and not isinstance(e, bool) and e >= 0 else 0


class LeaseLock:
    """The run lock on an object store, which has no flock: a lease object (`.lock`, or
    `.lock.p<i>` for process i > 0) naming its holder (pid, host, start time, a random
    token) and when it was last renewed. It is created with a conditional create (GCS
    `ifGenerationMatch=0`, S3 `If-None-Match: *`: one winner), renewed every third of
    `lease_s` by a heartbeat thread with a conditional replace of the version it last wrote,
    and released by replacing it with a released record. Each holder has an epoch, one more
    than the lease it took over (1 where it found none). A renewal that finds it changed,
    missing or unreadable loses it; the holder also stops trusting it once its last
    successful renewal is `lease_s` old by its own monotonic clock. Every write under the run
    directory checks both first (`check`), then reads the lease object itself (`fence`: still
    this holder's token and epoch), then the clock again: that is the storage write guard, so a
    holder that lost it writes nothing more, even one whose clock missed a pause. A stale
    lease is taken only once it stayed unchanged for HOLD_OFF leases (at once where its
    holder's process is gone from this host); a missing one in a directory with history is
    taken at once, but the run is read only HOLD_OFF leases later (`settle`)."""

    def __init__(self, run_dir, process_index: int = 0, lease_s: float = 60.0):
        self.run_dir = run_dir
        self.path = runfiles.lock(run_dir, process_index)
        self.lease_s = float(lease_s)
        self._version: str | None = None
        self._doc: dict = {}
        self._lost: str | None = None
        self._renewed: float | None = None  # monotonic start of the last write of the lease that held
        self._error = ""  # why the last renewal failed
        self._settle_at = 0.0
        self._stop = None
        self._thread = None

    def _io_s(self) -> float:
        """One lease request's timeout: a renewal slower than its interval is late anyway."""
        return max(2.0, min(remote_io.per_request_s(), self.lease_s / 3))

    def _read(self, timeout_s: float | None = None) -> tuple[dict, str] | None:
        got = read_versioned(self.path, timeout_s or self._io_s())
        if got is None:
            return None
        try:
            doc = json.loads(got[0] or b"{}")
        except ValueError:
            doc = {}
        return (doc if isinstance(doc, dict) else {}), got[1]

    def _stale(self, doc: dict) -> bool:
        """Released, not renewed for lease_s (by the reader's clock), or its process is gone from this host."""
        return bool(doc.get("released")) or self._gone(doc) or \
            time.time() - float(doc.get("renewed", 0)) > float(doc.get("lease_s", self.lease_s))

    @staticmethod
    def _gone(doc: dict) -> bool:
        """Its holder's process is gone from this host (certain, whatever the clocks say)."""
        if doc.get("host") == socket.gethostname() and isinstance(doc.get("pid"), int):
            try:
                os.kill(doc["pid"], 0)
            except ProcessLookupError:
                return True
            except OSError:
                pass
        return False

    def _watch(self, got: tuple[dict, str], run_dir, since: float) -> tuple[dict, str] | None:
        """A lease that looks expired: taken only if it also stays unchanged until HOLD_OFF of its
        holder's leases have passed since `since`, timed here. Hosts' clocks may disagree (a
        reader whose clock runs ahead would take a lease its holder still renews), and a holder
        trusts its lease for lease_s after its last renewal by its own clock."""
        deadline = since + HOLD_OFF * float(got[0].get("lease_s", self.lease_s))
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
            now = self._read()
            if now is None:
                return None  # deleted meanwhile: created afresh
            if now[0].get("released"):
                return now
            if now[1] != got[1]:
                raise self._refusal(run_dir, now[0])
        return got

    @staticmethod
    def _describe(doc: dict) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["started"])) if "started" in doc else "?"
        ago = f", renewed {time.time() - float(doc['renewed']):.0f} s ago" if "renewed" in doc else ""
        return f"pid {doc.get('pid', '?')} on host {doc.get('host', '?')} (since {since}{ago})"

    def holder(self) -> str | None:
        got = self._read()
        if got is None or self._stale(got[0]) or got[0].get("token") == self._doc.get("token"):
            return None
        return self._describe(got[0])

    def _refusal(self, run_dir, doc: dict) -> RunDirError:
        return RunDirError(f"run.dir={str(run_dir)!r} is in use by {self._describe(doc)}; wait for that run to end or "
                           f"stop it (its lock is taken over {self.lease_s:.0f} s after its last renewal; nothing was "
                           "changed)")

    def ensure_free(self, run_dir) -> None:
        got = self._read()
        if got is not None and not self._stale(got[0]):
            raise self._refusal(run_dir, got[0])

    def _body(self) -> bytes:
        self._doc["renewed"] = time.time()
        return json.dumps(self._doc).encode()

    def acquire(self, run_dir) -> None:
        self._doc = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                     "token": uuid.uuid4().hex, "lease_s": self.lease_s}
        seen = time.monotonic()
        got = self._read()
        if got is not None and not self._stale(got[0]):
            raise self._refusal(run_dir, got[0])
        if got is not None and not got[0].get("released") and not self._gone(got[0]):
            got = self._watch(got, run_dir, seen)
        self._doc["epoch"] = _epoch(got[0]) + 1 if got is not None else 1
        # absent from a directory with history: deleted under a live holder (a release leaves
        # a record): take it now, read the run only once that holder must have stopped
        settle = seen + HOLD_OFF * self.lease_s if got is None and self._had_holder() else 0.0
        t = time.monotonic()
        try:  # a create, or a takeover of exactly the version read
            self._version = replace_if(self.path, self._body(), None if got is None else got[1], self._io_s())
        except Conflict:
            now = self._read()
            raise self._refusal(run_dir, now[0] if now else {}) from None
        except FileNotFoundError:
            raise RunDirError(f"run.dir={str(run_dir)!r}: its lock {self.path} was deleted while being taken over; "
                              "run the same command again (nothing was changed)") from None
        except StorageError as e:
            raise RunDirError(f"run.dir={str(run_dir)!r}: cannot take the run lock {self.path} ({e.why}); nothing "
                              "was changed") from None
        except OSError as e:
            raise storage_error(self.path, e, "taking the run lock") from None
        self._renewed, self._settle_at = t, settle
        storage.guard(self.run_dir, self.guard)
        self._start_heartbeat()

    def _had_holder(self) -> bool:
        """Did a process hold this lease before? (the run has history; for process i > 0, its
        own lineage: a job grown to more processes has none, and its new leases are absent)"""
        i = runfiles.lock_process(self.path)
        return applog.has_bytes(runfiles.lineage(self.run_dir, i)) if i else bool(history(self.run_dir))

    def settle(self, log, should_stop=lambda: False) -> None:
        """Waits, where the lease was found missing, until any process that held it has stopped
        writing (it checks its lease before each batch of writes); `should_stop` ends the wait."""
        wait = self._settle_at - time.monotonic()
        if wait <= 0:
            return
        log(f"warning: {self.path} was missing although {self.run_dir} holds a run (deleted while a run held it?); "
            f"taken, and waiting {wait:.0f} s for any process that held it to stop writing before reading the run")
        while time.monotonic() < self._settle_at and not should_stop():
            time.sleep(min(0.25, max(0.0, self._settle_at - time.monotonic())))

    def _start_heartbeat(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="run-lease", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            t = time.monotonic()
            try:
                self.renew()
            except Conflict:
                now = self._safe_read()
                self._lose(f"taken by {self._describe(now[0])}" if now else "deleted")
                return
            except FileNotFoundError:
                self._lose("deleted")
                return
            except StorageError as e:  # no answer: tried again at the next beat, while the lease lasts
                self._error = e.why
                continue
            except Exception as e:  # noqa: BLE001 - an answer that is not the lease: it cannot be renewed
                self._lose(f"unreadable ({type(e).__name__}: {str(e)[:200]})")
                return
            self._renewed, self._error = t, ""

    def _safe_read(self):
        try:
            return self._read()
        except Exception:  # noqa: BLE001 - only for the message
            return None

    def _lose(self, how: str) -> None:
        self._lost = self._lost or (f"{self.path}: the run lock was {how} while this run held it; stopped before "
                                    "writing anything more (the last committed checkpoint step is intact)")

    def renew(self) -> None:
        """Extends the lease (Conflict where another writer replaced it)."""
        self._version = replace_if(self.path, self._body(), self._version, self._io_s())

    def check(self, run_dir=None, log=None) -> None:
        """Before each batch of writes: LockLostError if the lease was lost, or if its last
        successful renewal is lease_s old (another process may take it over now)."""
        if not self._lost and self._renewed is not None:
            age = time.monotonic() - self._renewed
            if age >= self.lease_s:
                why = f"last error: {self._error}" if self._error else "this process or its renewals were held up"
                self._lost = (f"{self.path}: the run lock was last renewed {age:.0f} s ago, run.lease_s="
                              f"{self.lease_s:g} ({why}); another process may take it over: stopped before writing "
                              "anything more (the last committed checkpoint step is intact)")
        if self._lost:
            raise LockLostError(self._lost)

    def fence(self) -> None:
        """LockLostError unless the lease object still names this holder (its token and epoch),
        read from the store now: a holder whose clock or heartbeat missed a takeover (its host
        suspended, say) learns of it here, before its write."""
        if self._lost:
            raise LockLostError(self._lost)
        bound, t0 = remote_io.timeout_s(), time.monotonic()
        try:  # bounded as the write it guards is, and a store that does not answer is named alike
            got = self._read(bound)
        except StorageError as e:
            if time.monotonic() - t0 < bound - 1:
                raise
            raise StorageError(self.path, f"no answer within {bound:.0f} s; last error: {e.why}", "read") from None
        if got is None:
            self._lose("deleted")
        elif got[0].get("token") != self._doc.get("token"):
            self._lose(f"taken over by {self._describe(got[0])} as epoch {_epoch(got[0])} (this run held "
                       f"epoch {_epoch(self._doc)})")
        elif got[0].get("released"):
            self._lose("released")
        if self._lost:
            raise LockLostError(self._lost)

    def guard(self) -> None:
        """The write guard of the run directory: its own clock, the lease object, its clock
        again (the read may have waited); what remains unfenced is the write's own way to the store."""
        self.check()
        self.fence()
        self.check()

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()  # a renewal in flight ends within its request's timeout; not waited for on a stalled store
            self._thread.join(timeout=1.0 if remote_io.stalled() else self._io_s() + 1)
            self._stop = None
        storage.unguard(self.run_dir)
        if self._version is not None and not self._lost and not remote_io.stalled():
            try:  # a released record (only while it is still this run's): absent means deleted
                doc = dict(self._doc, released=time.time())
                self._version = replace_if(self.path, json.dumps(doc).encode(), self._version, self._io_s())
            except (Conflict, StorageError, OSError):
                pass  # it expires by itself
        self._version = None
