"""Where a checkpoint step's files lie: the one place that knows the on-disk layout.

Owns: listing committed steps as Orbax's CheckpointManager lists them (its standard step-name
format and its own record of a finished step: on a local filesystem the rename of the
temporary directory to the step's name; on an object store, where Orbax writes the step's
directory in place, its `commit_success.txt`: a half-written step is never listed), the
commit protocol each backend uses (`temporary_path_class`),
the items of a step, the meta document's file, each process's file-name prefix (the ledger
item's `<prefix>.json`/`.bin` are checkpoint's own format), and the data item's per-process
file (Grain's handler writes one JSON per process). Where Orbax's arrays go on s3:// is
`orbax_patch`'s. Does not own: writing, reading or verifying those files
(checkpoint, saved_run).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.metadata import checkpoint as _ckpt_metadata
from orbax.checkpoint._src.path import async_path as _async_path

from async_rl.store import storage

ITEMS = ("state", "data", "ledger", "meta")  # the Composite items of every step
COMMIT_FILE = ocp.path.atomicity.COMMIT_SUCCESS_FILE  # the object that makes a step committed on an object store
_NAMES = ocp.path.step.standard_name_format()  # the CheckpointManager's default, which train uses


class _LeasedCommit(ocp.path.atomicity.CommitFileTemporaryPath):
    """Object stores have no rename: Orbax writes the step in place and records its commit in a
    file (its default on gs://; on s3:// its default rename would be a copy). Its `finalize`,
    with the lease checked (`storage.check_write`: the holder's clock and the lease object read
    back, `lease.LeaseLock.guard`) right before the commit record is written,
    after the metadata update that may wait on the store: a run that lost its lease never
    commits a step after another holder chose where to resume."""

    async def finalize(self):
        storage.check_write(self.get_final())
        store = self._checkpoint_metadata_store
        if store:
            await asyncio.to_thread(store.wait_until_finished)
            await asyncio.to_thread(store.update, file_path=_ckpt_metadata.step_metadata_file_path(self._tmp_path),
                                    commit_timestamp_nsecs=time.time_ns())
            await asyncio.to_thread(store.wait_until_finished)
        storage.check_write(self.get_final())
        await _async_path.write_text(self._final_path / COMMIT_FILE,
                                     f"Checkpoint commit was successful to {self._final_path}")


_COMMIT_FILE = _LeasedCommit
_REMOTE_NAMES = ocp.path.step.standard_name_format(temporary_path_cls=_COMMIT_FILE)


def temporary_path_class(ckpt_dir) -> type | None:
    """The commit protocol for a CheckpointManager writing `ckpt_dir` (None: Orbax's default)."""
    return _COMMIT_FILE if storage.is_remote(ckpt_dir) else None


def committed_steps(ckpt_dir: str | Path) -> list[int]:
    """Committed steps in `ckpt_dir`, oldest first (temporaries, half-written steps and stray
    names left out)."""
    if storage.is_remote(ckpt_dir):
        d, names = epath.Path(str(ckpt_dir)), _REMOTE_NAMES
        if not storage.is_dir(d):
            return []
    else:
        d, names = Path(ckpt_dir), _NAMES
        if not d.is_dir():
            return []
        storage.refuse_links(d, depth=2)  # a linked step folder (or item) is named, not followed
        d = epath.Path(d.absolute())
    try:
        return sorted(m.step for m in names.find_all(d))
    except FileNotFoundError:  # removed while listed
        return []


def is_step_name(name: str) -> bool:
    """Whether `name` is a step directory's final name (not one of its items)."""
    return name.isascii() and name.isdecimal() and _NAMES.build_name(int(name)) == name


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return storage.run_path(ckpt_dir) / _NAMES.build_name(step)


def item_dir(ckpt_dir: str | Path, step: int, item: str) -> Path:
    assert item in ITEMS, item
    return step_dir(ckpt_dir, step) / item


def meta_file(step_path: Path) -> Path:
    """The JSON meta document (Orbax's JsonSave writes its item as `metadata`)."""
    return storage.run_path(step_path) / "meta" / "metadata"


def process_prefix(index: int, count: int) -> str:
    return f"process_{index}-of-{count}"


def iterator_file(step_path: Path, index: int, count: int) -> Path:
    """One process's iterator state, as Grain's checkpoint handler names it."""
    return storage.run_path(step_path) / "data" / f"{process_prefix(index, count)}.json"


def last_committed(ckpt_dir: str | Path) -> str:
    """For messages: "the last committed checkpoint is step N", or that none was committed."""
    steps = committed_steps(ckpt_dir)
    return f"the last committed checkpoint is step {steps[-1]}" if steps else "no checkpoint was committed"
