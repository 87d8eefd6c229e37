"""What async_rl changes in Orbax (orbax-checkpoint 0.12.8 only), installed by `install()` when a
checkpoint is opened, never at import, and removed by `uninstall()`:

- the tensorstore kvstore spec Orbax builds (`build_kvstore_tspec`): s3:// directories routed to
  tensorstore's s3 driver, gs:// retries bounded by run.storage_timeout_s;
- the absl log records of a failed background save dropped (Orbax logs it from each thread it
  passes through; the run reports it once itself);
- `quiet_closed_loops`: Python's unraisable hook skips tensorstore callbacks landing on an event
  loop Orbax already closed (installed by the reads that cause them).
"""

from __future__ import annotations

import logging
import sys
from importlib import metadata

from orbax.checkpoint._src.serialization import tensorstore_utils as _ts_utils

from async_rl.errors import UsageError
from async_rl.store import remote_io, storage

VERSION = "0.12.8"  # the orbax-checkpoint these patches were written against
_installed: dict = {}


class OrbaxVersionError(UsageError):
    """The installed Orbax is not the one the patches were written for."""


def install() -> None:
    """Installs the patches (idempotent); refuses, with one line, an Orbax of another version."""
    if "build" in _installed:
        return
    found = metadata.version("orbax-checkpoint")
    if found != VERSION:
        raise OrbaxVersionError(f"orbax-checkpoint {found} is installed; async_rl's checkpoint patches are "
                                f"written for {VERSION} (pip install -c constraints.txt -e .)")
    _installed["build"] = _ts_utils.build_kvstore_tspec
    _route_arrays()
    _installed["filter"] = _FailedSaveLog()
    logging.getLogger("absl").addFilter(_installed["filter"])


def uninstall() -> None:
    """Puts back what `install` and `quiet_closed_loops` changed."""
    if "build" in _installed:
        _ts_utils.build_kvstore_tspec = _installed.pop("build")
    if "filter" in _installed:
        logging.getLogger("absl").removeFilter(_installed.pop("filter"))
    if "unraisable" in _installed:
        sys.unraisablehook = _installed.pop("unraisable")


def _route_arrays() -> None:
    """Orbax 0.12.8 opens tensorstore kvstores for gs:// and absolute local paths only (an s3://
    directory is refused as relative). Every kvstore spec it builds comes from
    `build_kvstore_tspec`; for an s3:// directory that now returns the spec Orbax builds for the
    same key under gs:// (its object-store layout: OCDBT, no file locking) with each `gcs`
    kvstore replaced by tensorstore's `s3` one. A gs:// spec gets the retry policy bounded by
    run.storage_timeout_s (`remote_io.tensorstore_retries`). Local paths pass through untouched."""
    build = _ts_utils.build_kvstore_tspec
    if getattr(build, "routes_s3", False):
        return

    def build_kvstore_tspec(directory, name=None, **kwargs):
        d = str(directory)
        if d.startswith("gs://"):
            return _gcs_to(build(directory, name, **kwargs), s3=False)
        if not d.startswith("s3://"):
            return build(directory, name, **kwargs)
        return _gcs_to(build("gs://" + d[len("s3://"):], name, **kwargs), s3=True)

    build_kvstore_tspec.routes_s3 = True
    _ts_utils.build_kvstore_tspec = build_kvstore_tspec


def _gcs_to(spec, s3: bool):
    """`spec` with each gcs kvstore made an s3 one (`s3`) or given the bounded retry policy."""
    if isinstance(spec, list):
        return [_gcs_to(x, s3) for x in spec]
    if isinstance(spec, str) and spec.startswith("gs://") and s3:
        return storage.tensorstore_kvstore("s3://" + spec[len("gs://"):])
    if not isinstance(spec, dict):
        return spec
    if spec.get("driver") in ("gcs", "gcs_grpc"):
        if not s3:
            context = {**spec.get("context", {}), "gcs_request_retries": remote_io.tensorstore_retries()}
            return {**spec, "context": context}
        rest = {k: v for k, v in spec.items() if k not in ("driver", "bucket", "path")}
        return {**rest, **storage.tensorstore_kvstore(f"s3://{spec['bucket']}/{spec.get('path', '')}")}
    return {k: _gcs_to(v, s3) for k, v in spec.items()}


def quiet_closed_loops() -> None:
    """Orbax runs each read on a fresh event loop; when one read fails, tensorstore callbacks
    still in flight land on the closed loop and Python prints each as an unraisable exception
    (dozens of tracebacks around one clear warning). Only exactly those are dropped."""
    prev = sys.unraisablehook
    if getattr(prev, "quiet_closed_loops", False):
        return
    _installed.setdefault("unraisable", prev)

    def hook(u):
        if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
            prev(u)
    hook.quiet_closed_loops = True
    sys.unraisablehook = hook


class _FailedSaveLog(logging.Filter):
    """Orbax logs a failed background save with tracebacks, once from each thread it passes
    through, before raising it to us; we report it once, naming the step and what is intact.
    Likewise an object-store call that the run's storage bound gave up on (a `StorageError`,
    which the run names in its one line) that Orbax logs on its way. Only those records are
    dropped: every other Orbax error is logged as Orbax logs it."""

    MESSAGES = ("in background save thread",  # AsyncCheckpointer's commit thread
                "_SignalingThread.run() raised an exception",  # the thread running a commit future
                "Save Finalize thread",  # CheckpointManager.wait_until_finished
                "Checkpointer failed: one or more items may not be finalized",  # CheckpointManager._finalize
                "Failed to write metadata=",  # the step's metadata store, whose failure the save then raises
                "Failed to update metadata=")  # the same store when the step's metadata is amended

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or "orbax" not in record.pathname:
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        gave_up = any(isinstance(a, remote_io.StorageError) for a in args) or (
            record.exc_info is not None and isinstance(record.exc_info[1], remote_io.StorageError))
        return not (gave_up or any(m in str(record.msg) for m in self.MESSAGES))
