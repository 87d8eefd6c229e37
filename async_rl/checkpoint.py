"""One atomic Orbax step per checkpoint: train state, Grain iterator, ledger and meta.

Owns: the CheckpointManager (async writes, keep-N, temporary directory + commit), the
ledger's on-disk form (a small Orbax handler writing its ragged arrays into one file and a JSON
header per process), the iterator-state item (a frozen copy taken at the cut, written
by Grain's own handler), choosing the step to resume from (falling back past a damaged
step, which is moved aside with a warning), and refusing a resume whose config changes
what the data stream means. Does not own: when to save or what the cut contains
(train), nor the ledger's in-memory form (ledger).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future

from . import faults, sharding
from .config import ConfigError, DATA_STREAM_FIELDS
from .ledger import Capture, LedgerSnapshot

# ---- the ledger item ---------------------------------------------------------------------


def _process_prefix() -> str:
    return f"process_{jax.process_index()}-of-{jax.process_count()}"


class LedgerHandler(ocp.AsyncCheckpointHandler):
    """Writes each process's ledger shard as `<prefix>.bin` (every ragged array back to back)
    and `<prefix>.json` (the header and where each array lies in the .bin).

    One file of raw bytes costs what one np.save of them costs, and a file shorter than the
    header says is caught on restore. Asynchronous: the arrays are built from the cut and
    written from Orbax's background commit, so a save holds the learner only for the cut."""

    def _write(self, directory: epath.Path, args: "LedgerSave") -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        pre, snap = _process_prefix(), args.cut.build()
        index, offset = {}, 0
        with open(directory / f"{pre}.bin", "wb") as f:
            for i, (name, arr) in enumerate(snap.arrays.items()):
                arr = np.ascontiguousarray(arr)
                index[name] = {"dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset}
                arr.tofile(f)
                offset += arr.nbytes
                if i == 1:
                    f.flush()
                    faults.point("ckpt_write", args.step)
        (directory / f"{pre}.json").write_text(json.dumps(dict(snap.header, arrays=index, bytes=offset)))

    async def async_save(self, directory: epath.Path, args: "LedgerSave"):
        async def write():
            await asyncio.to_thread(self._write, directory, args)
        return [future.CommitFutureAwaitingContractedSignals(write(), name="ledger_save")]

    def save(self, directory: epath.Path, args: "LedgerSave") -> None:
        self._write(directory, args)

    def restore(self, directory: epath.Path, args: "LedgerRestore" = None) -> LedgerSnapshot:
        directory, pre = Path(directory), _process_prefix()
        header = json.loads((directory / f"{pre}.json").read_text())
        index, size = header.pop("arrays"), header.pop("bytes")
        raw = (directory / f"{pre}.bin").read_bytes()
        if len(raw) != size:
            raise ValueError(f"{directory / f'{pre}.bin'}: {len(raw)} bytes, the header says {size} (truncated?)")
        arrays = {}
        for name, a in index.items():
            dt, shape = np.dtype(a["dtype"]), tuple(a["shape"])
            arrays[name] = np.frombuffer(raw, dt, count=int(np.prod(shape)), offset=a["offset"]).reshape(shape)
        return LedgerSnapshot(header=header, arrays=arrays)

    def metadata(self, directory: epath.Path) -> Any:
        return None

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(LedgerHandler, for_save=True)
@dataclasses.dataclass
class LedgerSave(ocp.args.CheckpointArgs):
    cut: Capture  # the ledger at the cut (a LedgerSnapshot works too: it has build())
    step: int = -1


@ocp.args.register_with_handler(LedgerHandler, for_restore=True)
@dataclasses.dataclass
class LedgerRestore(ocp.args.CheckpointArgs):
    pass


class IteratorState:
    """The iterator state captured at the cut; Grain's handler saves/restores it as JSON."""

    def __init__(self, state: dict | None = None):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()

    def set_state(self, raw: bytes) -> None:
        self.state = json.loads(raw)

    def start_prefetch(self) -> None:  # called by Grain's handler after restore
        pass


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    iterator_state: dict
    ledger: LedgerSnapshot
    meta: dict


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int, async_save: bool):
        self.directory = Path(directory).absolute()
        self.async_save = async_save
        self.mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 cleanup_tmp_directories=True, create=True))
        self.last_blocking_s = 0.0  # time save() held the caller, for ckpt/ metrics

    def steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def save(self, step: int, state, iterator_state: dict, ledger: Capture, meta: dict) -> None:
        t0 = time.perf_counter()
        self.mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(IteratorState(iterator_state)),
            ledger=LedgerSave(ledger, step),
            meta=ocp.args.JsonSave(meta)), force=True)
        self.last_blocking_s = time.perf_counter() - t0
        faults.point("ckpt_saved", step)

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()

    def read_meta(self, step: int) -> dict:
        return self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore(self, step: int, abstract_state) -> Restored:
        r = self.mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=grain.checkpoint.CheckpointRestore(IteratorState()),
            ledger=LedgerRestore(),
            meta=ocp.args.JsonRestore()))
        return Restored(step=step, state=r.state, iterator_state=r.data.state, ledger=r.ledger, meta=r.meta)

    def restore_latest(self, abstract_state, warn) -> Restored | None:
        """Newest step that restores whole on every process; a damaged one is moved to
        `damaged/` (by process 0) with a warning naming it."""
        steps = self.steps()
        for step in reversed(steps):
            try:
                got, err = self.restore(step, abstract_state), None
            except Exception as e:  # any unreadable part makes the whole step unusable
                got, err = None, e
            if sharding.agree([got is not None]).all():
                return got
            dest = self.directory.parent / "damaged" / f"step_{step}_{int(time.time())}"
            why = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}" if err else "damaged on another process"
            warn(f"checkpoint step {step} in {self.directory} is damaged ({why}); moved to {dest}; "
                 "trying the previous step")
            if jax.process_index() == 0:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(self.directory / str(step)), dest)
            sharding.agree([1])  # every process sees the move before reloading
            self.mngr.reload()
        if steps:
            raise CheckpointError(f"every checkpoint step in {self.directory} is damaged ({steps}); "
                                  "refusing to start over silently")
        return None


class CheckpointError(RuntimeError):
    pass


def check_data_stream(meta: dict, current: dict, where: str) -> None:
    """Refuses a resume whose config changes the meaning of the saved stream position."""
    saved = meta.get("data_stream", {})
    for key in DATA_STREAM_FIELDS:
        if key in saved and saved[key] != current[key]:
            raise ConfigError(f"{key}={current[key]!r}: the checkpoint in {where} was written with "
                              f"{key}={saved[key]!r}; changing it would change which prompts the saved "
                              "iterator and ledger mean (use a new run.dir, or run.resume=never)")
