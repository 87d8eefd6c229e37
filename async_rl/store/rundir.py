"""The run directory as a whole: is it usable, who holds it, what history it has.

Owns: checking `run.dir` before anything is written (a file, a path under a file, no write
permission: one-line errors, exit 2), the error a run lock raises once it is lost
(`LockLostError`; the locks themselves are runlock's and lease's), asking an object store whether it can be used at all (`probe_store`: no
credentials, no answer, no bucket), recognising history (lineage, metrics, damaged
steps, checkpoints) so that a directory with history but no restorable step is never
started over silently, moving that history aside when the user asks for a restart
(`run.resume=restart`), and writing the small manifests (`config.yaml`, `data.json`,
`final.json`) atomically. Does not own: checkpoints (checkpoint), the logs' contents
(lineage, metrics), or deciding to resume (train).

See docs/design.md, "Run directory safety".
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import time
from pathlib import Path

from async_rl.config import ConfigError
from async_rl.errors import RunFailure
from async_rl.store import applog, remote_io, runfiles, storage
from async_rl.store.remote_io import StorageError

# runfiles.MARKER is written once a checkpoint of the run is seen committed: from then on its
# logs are history that a checkpoint covered, and a directory that has lost every step is
# never started over. runfiles.RESTARTING is written before a restart moves anything and
# removed after: it names the folder it moves into, so that a restart killed half-way is
# recognised and finished, never resumed from.


class RunDirError(ConfigError):
    """run.dir cannot be used as asked (exit 2); nothing in it was changed."""


def check_usable(path: Path) -> None:
    """Raises RunDirError unless `path` is (or can be created as) a writable directory."""
    if storage.is_remote(path):
        return _check_bucket(path)
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
    storage.refuse_links(p, opaque=(runfiles.WANDB,))  # before anything in it is read for a resume, cut or moved


# A start-up probe of the store gets this long: nothing is at stake yet, so a store that does
# not answer is named at once rather than after run.storage_timeout_s, seconds.
PROBE_S = 10.0


def probe_store(path) -> None:
    """An object-store path: the store answers (within PROBE_S) and its bucket exists;
    RunDirError naming the cause otherwise (no credentials, no answer, no such bucket)."""
    fs, where = storage.filesystem(path), str(path)
    scheme, rest = where.split("://", 1)
    bucket = rest.split("/", 1)[0]
    try:
        with remote_io.limit(PROBE_S):
            fs.info(f"{scheme}://{bucket}")
    except FileNotFoundError:
        raise RunDirError(f"{where}: bucket {bucket!r} does not exist") from None
    except StorageError as e:
        raise RunDirError(f"{where}: the store cannot be used ({e.why}); nothing was changed") from None


def _check_bucket(path) -> None:
    """An object-store run.dir: the store answers, its bucket exists, it is not an object
    itself, and this process may write there (a probe object is written and deleted)."""
    where = str(path)
    try:
        probe_store(path)
    except RunDirError as e:
        raise RunDirError(f"run.dir={e}") from None
    try:
        with remote_io.limit(PROBE_S):
            if storage.filesystem(path).isfile(where):
                raise RunDirError(f"run.dir={where!r}: is an object, not a prefix")
            probe = runfiles.probe(storage.run_path(where), socket.gethostname(), os.getpid())
            storage.write_atomic(probe, b"")
            storage.remove(probe)
    except RunDirError:
        raise
    except StorageError as e:
        raise RunDirError(f"run.dir={where}: the store cannot be used ({e.why}); nothing was changed") from None
    except (OSError, ValueError) as e:
        raise RunDirError(f"run.dir={where!r}: cannot be written ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
            from None


def _nonempty(p) -> int:
    """How many entries folder `p` has."""
    return len(storage.listdir(p)) if storage.is_dir(p) else 0


def history(path: Path) -> dict[str, int]:
    """What a run directory already holds: {kind: count} for non-empty history items."""
    p, out = path, {}
    if not storage.is_dir(p):
        return out
    names = storage.listdir(p)
    for pattern in runfiles.HISTORY:
        n = sum(1 for f in storage.glob(p, pattern) if applog.has_bytes(f))
        if n:
            out[pattern.split("*")[0]] = n
    for name in runfiles.HISTORY_DIRS:
        n = _nonempty(p / name) if name in names else 0
        if n:
            out[name] = n
    return out


def durable(path: Path) -> bool:
    """Did a checkpoint ever cover this run's logs? (marker written, or damaged steps set aside)"""
    return storage.is_file(path / runfiles.MARKER) or _nonempty(path / runfiles.DAMAGED) > 0


def mark_checkpointed(path: Path, step: int) -> None:
    p = path / runfiles.MARKER
    if not storage.is_file(p):
        write_atomic(p, json.dumps({"first_committed_step": step, "time": time.time()}))


def describe(hist: dict[str, int]) -> str:
    return ", ".join(f"{k} ({v})" for k, v in sorted(hist.items()))


def interrupted_restart(path: Path) -> Path | None:
    """The folder an interrupted run.resume=restart was moving the history into, or None."""
    try:
        dest = json.loads(storage.read_text(path / runfiles.RESTARTING))["dest"]
        return storage.run_path(dest) if storage.is_remote(path) else Path(dest)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return path / runfiles.PREVIOUS  # torn: still a restart that did not finish


def archive_history(path: Path) -> Path:
    """Moves the run's history and manifests into `previous/<time>/` (run.resume=restart);
    an interrupted restart is finished into the folder it had begun."""
    from async_rl import faults

    p = path
    dest = interrupted_restart(p)
    if dest is None or not storage.is_dir(dest) or str(dest.parent) != str(p / runfiles.PREVIOUS):
        dest = p / runfiles.PREVIOUS / time.strftime("%Y%m%d-%H%M%S")
        n = 0
        while storage.exists(dest):
            n += 1
            dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
        storage.mkdirs(dest)
        write_atomic(p / runfiles.RESTARTING, json.dumps({"dest": str(dest), "time": time.time()}))
    names = [f.name for g in runfiles.HISTORY for f in storage.glob(p, g)] + list(runfiles.HISTORY_DIRS) \
        + list(runfiles.MANIFESTS)
    moved = 0
    for name in names:
        if storage.exists(p / name):
            storage.move(p / name, dest / name)
            moved += 1
            faults.point("restart", moved)
    storage.remove(p / runfiles.RESTARTING)
    return dest


def run_identity(path, create: bool = True) -> str:
    """The run's identity: made once (random) by whichever process gets there first, read by
    every later one and every resume; a restart (run.resume=restart) moves it aside with the
    history, so the new run gets a new one. `create=False` (read-only commands): "unnamed"
    where the run has none."""
    p = path / runfiles.RUN_ID
    new = secrets.token_hex(8).encode()
    if not create and not storage.exists(p):
        return "unnamed"
    if create:
        storage.create(p, new)  # the first process to get there wins; the rest read its identity
    ident = storage.read_bytes(p).decode("utf-8", "replace").strip()
    if not ident.isalnum():
        kind = RunFailure if create else ConfigError  # a reader's input, not a run that failed
        raise kind(f"{p}: not a run identity ({ident[:40]!r}); it names this run's env steps, restore it")
    return ident


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a torn write."""
    try:
        storage.write_atomic(path, text)
    except OSError as e:
        raise storage_error(path, e) from None


def write_if_changed(path: Path, text: str) -> None:
    if not storage.is_file(path) or storage.read_text(path) != text:
        write_atomic(path, text)


DISK_HINT = "free space (or fix the disk)"


def storage_error(path, err: OSError, what: str = "write") -> OSError | StorageError:
    """`err` as a StorageError where it is the disk's fault (ENOSPC, EIO, EDQUOT, EROFS, EFBIG)
    or the store's (no answer, no credentials: `remote_io.cause`)."""
    if err.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EROFS, errno.EFBIG):
        return StorageError(path, err.strerror or str(err), what, hint=DISK_HINT)
    why = remote_io.cause(err)
    return StorageError(path, why, what) if why else err


class LockLostError(RunFailure):
    """The run lock of this process was taken by another one (exit 1); nothing was written after."""
