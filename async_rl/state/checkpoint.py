"""One atomic Orbax step per checkpoint: train state, Grain iterator, ledger and meta, verified.

Owns: the CheckpointManager (async writes, keep-N, temporary directory + commit), the
ledger's on-disk form (a small Orbax handler writing its ragged arrays into one file and a
JSON header per process), the iterator-state item (a frozen copy taken at the cut, written
by Grain's own handler), the digests that make every item verifiable (per state leaf in
`meta`, a blake2b digest per ledger array, sha256 of the iterator state and of each JSON document), and
choosing the step to resume from: a step whose files are unreadable or fail their digest is
*damaged* and skipped (the caller sets it aside); a step that does not fit this config (its
state's structure, its data stream, a changed process count in deterministic mode) is
*refused*: the run stops with exit 2 naming each difference, touching nothing. A step
written by another number of processes is read whole (every process's ledger shard and
iterator state) for `reshard` to deal out. Does not own: when to save or what the cut
contains (train), the ledger's in-memory form (ledger), the field classification
(config), re-partitioning (reshard), or moving files (train, through rundir).

See docs/design.md, "The checkpoint" and "Run directory safety".
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import grain
import jax
import orbax.checkpoint as ocp

from async_rl import config as C
from async_rl import faults
from async_rl.buffer.ledger import Capture, LedgerSnapshot
from async_rl.errors import RunFailure, UsageError
from async_rl.model import lora, sharding
from async_rl.state import compat, orbax_patch
from async_rl.state.items import (
    Damaged,
    IteratorState,
    LedgerSave,
    json_digest,
    process_prefix_here,
    quiet_damaged_reads,
    read_ledger,
    read_signed_json,
    saved_arrays,
    sha256,
    state_digests,
    structure_diff,
    target_arrays,
    unreadable,
)
from async_rl.state.layout import (
    COMMIT_FILE,
    committed_steps,
    iterator_file,
    last_committed,
    meta_file,
    step_dir,
    temporary_path_class,
)
from async_rl.store import remote_io, storage


class CheckpointError(UsageError):
    """A checkpoint that cannot be used as asked (exit 2); nothing was changed."""


class CheckpointWriteError(RunFailure):
    """A save that did not commit (disk full, I/O error); the last committed step is intact."""


class NonFiniteError(RunFailure):
    """Non-finite parameters must never be saved over good steps."""


def _lost_lease(e: BaseException | None):
    """The LockLostError `e` was raised from (the commit refused by the write guard), or None."""
    from async_rl.store.rundir import LockLostError
    for _ in range(10):
        if e is None or isinstance(e, LockLostError):
            return e
        e = e.__cause__ or e.__context__
    return None


# A wait for Orbax's background commit gives up after this long, seconds: every storage call
# in it is bounded, so a commit still running is stuck (a stalled store gives up sooner).
COMMIT_WAIT_S = 3600.0


# ---- choosing and restoring a step ----------------------------------------------------------


@dataclasses.dataclass
class Restored:
    step: int
    state: Any  # {"params", "opt"}; opt is None when run.reset_optimizer applies
    iterator_state: dict
    ledger: LedgerSnapshot
    meta: dict
    changes: list = dataclasses.field(default_factory=list)  # free config changes since the save
    reset_optimizer: bool = False
    # written by another process count: every old process's (ledger shard, iterator state), in
    # process order; `ledger` and `iterator_state` are then None until reshard deals them out
    shards: list | None = None


@dataclasses.dataclass
class DamagedStep:
    step: int
    why: str


@dataclasses.dataclass
class Choice:
    restored: Restored | None
    damaged: list[DamagedStep]


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int, async_save: bool):
        orbax_patch.install()
        self.directory = storage.run_path(directory) if storage.is_remote(directory) else Path(directory).absolute()
        self.keep, self.async_save = keep, async_save
        self.mngr: ocp.CheckpointManager | None = None  # opened by `open()`: reading needs none
        self.last_blocking_s = 0.0  # time save() held the caller, for ckpt/ metrics
        self._inflight: int | None = None  # the step of the last save started
        self._stuck = False  # a wait gave up on Orbax's commit thread: it is left running

    def open(self) -> None:
        """Starts writing (creates the directory, clears uncommitted temporaries). On an object
        store old steps are deleted by `prune` instead of Orbax, under the run's lease check."""
        orbax_patch.quiet_closed_loops()  # a commit given up leaves tensorstore callbacks for its closed loop
        remote = storage.is_remote(self.directory)
        opts = ocp.CheckpointManagerOptions(max_to_keep=None if remote else self.keep,
                                            enable_async_checkpointing=self.async_save,
                                            cleanup_tmp_directories=True, create=True)
        # an object store's commit record, or (crash tests) a commit that fails as a full disk would
        commit = temporary_path_class(self.directory) or faults.commit_class()
        if commit is not None:
            opts = dataclasses.replace(opts, temporary_path_class=commit)
        self.mngr = ocp.CheckpointManager(self.directory, options=opts)

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return committed_steps(self.directory)

    # ---- saving --------------------------------------------------------------------------

    def save(self, step: int, state, iterator_state: dict, ledger: Capture, meta: dict) -> None:
        """Starts an async save; raises NonFiniteError before writing anything if the state is."""
        t0 = time.perf_counter()
        digests, finite = state_digests(state)
        if not finite:
            raise NonFiniteError(f"step {step}: the parameters or optimizer state hold NaN or inf: training "
                                 f"diverged; not saved ({last_committed(self.directory)}). Lower learner.lr or "
                                 "change the data, then run the same command to resume")
        meta = dict(meta, digests={"state": digests})
        meta["meta_sha256"] = json_digest(meta)
        it_sha = sha256(IteratorState(iterator_state).get_state())
        self.wait()  # Orbax's save waits for the previous one anyway; this names it if it failed
        self._inflight = step
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=grain.checkpoint.CheckpointSave(IteratorState(iterator_state)),
                                  ledger=LedgerSave(ledger, step, it_sha), meta=ocp.args.JsonSave(meta))
        try:  # on an object store Orbax's own part of the save may wait on the store too
            if storage.is_remote(self.directory):
                remote_io.wait_bounded(lambda: self.mngr.save(step, args=args, force=True), "checkpoint save",
                                       COMMIT_WAIT_S)
            else:
                self.mngr.save(step, args=args, force=True)
        except remote_io.GaveUp as e:
            self._stuck = True
            raise self._write_error(step, f"it was given up: {e}") from None
        except OSError as e:
            raise self._write_error(step, e) from None
        self.last_blocking_s = time.perf_counter() - t0
        faults.point("ckpt_saved", step)

    def _write_error(self, step: int | None, e: BaseException | str) -> Exception:
        """CheckpointWriteError naming the step and the cause (LockLostError where the run lost
        its lease: that, not the save, is what stopped it)."""
        lost = None if isinstance(e, str) else _lost_lease(e)
        if lost is not None:
            return lost
        why = e if isinstance(e, str) else remote_io.cause(e)
        if why is None:
            while isinstance(e, Exception) and e.__cause__ is not None and not isinstance(e, OSError):
                e = e.__cause__
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        try:
            steps = self.steps() if not remote_io.stalled() else None
        except Exception:  # noqa: BLE001 - only for the message
            steps = None
        kept = ("the last committed step is intact" if steps is None else
                f"the last committed step ({steps[-1]}) is intact" if steps else "no step was committed before it")
        err = CheckpointWriteError(
            f"checkpoint {'step ' + str(step) if step is not None else 'save'} in {self.directory} did not "
            f"commit ({why}); {kept}: fix the cause and run the same command to resume")
        err.store_failed = isinstance(e, str) or remote_io.cause(e) is not None
        return err

    def check_for_errors(self) -> None:
        """Raises CheckpointWriteError if a background save failed (those that fail in Orbax's
        final commit surface at the next save or at the end, through `wait`)."""
        if self.mngr is None:
            return
        try:
            self.mngr.check_for_errors()
        except Exception as e:
            raise self._write_error(self._inflight, e) from None

    def wait(self) -> None:
        """Waits for the background commit (`remote_io.wait_bounded`: given up on a store that
        stopped answering, within seconds of a stop request while it stalls, after
        COMMIT_WAIT_S in any case; the commit thread is then left running)."""
        if self.mngr is None or self._stuck:
            return
        try:
            remote_io.wait_bounded(self.mngr.wait_until_finished, "checkpoint commit", COMMIT_WAIT_S)
        except remote_io.GaveUp as e:
            self._stuck = True
            raise self._write_error(self._inflight, f"its commit was given up: {e}") from None
        except Exception as e:
            raise self._write_error(self._inflight, e) from None

    def prune(self) -> list[int]:
        """On an object store: deletes the committed steps older than the newest `keep` (returns
        the steps kept; [] elsewhere, where Orbax deletes them itself), each
        write passing the run's lease check. A step's commit record goes first, so a deletion
        cut short leaves an uncommitted step, which is never read."""
        if self.mngr is None or not storage.is_remote(self.directory):
            return []
        steps = self.steps()
        for s in steps[:-self.keep]:
            d = step_dir(self.directory, s)
            storage.remove(d / COMMIT_FILE)
            storage.remove_tree(d)
        return steps[-self.keep:]

    def close(self) -> None:
        if self.mngr is not None:
            try:
                self.wait()
            finally:
                try:
                    if not self._stuck:
                        self.mngr.close()
                except Exception:  # a failed save was reported by wait()
                    pass
                self.mngr = None

    # ---- restoring -----------------------------------------------------------------------

    def restore_latest(self, abstract_state, *, cfg: C.Config | None = None, warn: Callable = print,
                       base: Callable[[], dict] | None = None) -> Choice:
        """The newest step that restores whole and verified on every process. A damaged step
        is skipped with a warning (the caller sets it aside once it holds the run); a step that
        does not fit `cfg` (or, LoRA, whose adapters were trained on another base than `base()`
        describes) raises CheckpointError/ConfigError (nothing is touched)."""
        damaged: list[DamagedStep] = []
        for step in reversed(self.steps()):
            try:
                got, err = self.restore(step, abstract_state, cfg=cfg, base=base), None
            except Damaged as e:
                got, err = None, e
            if sharding.agree([got is not None]).all():
                return Choice(got, damaged)
            why = str(err) if err else "damaged on another process"
            warn(f"checkpoint step {step} in {self.directory} is damaged ({why}); trying the previous step")
            damaged.append(DamagedStep(step, why))
        return Choice(None, damaged)

    def restore(self, step: int, abstract_state, *, cfg: C.Config | None = None,
                base: Callable[[], dict] | None = None) -> Restored:
        """Restores and verifies step `step`; raises Damaged, or ConfigError for a config that
        does not fit it (or adapters trained on another base than `base()`, LoRA)."""
        orbax_patch.quiet_closed_loops()
        d = step_dir(self.directory, step)
        meta = self.read_meta(step)
        changes = _check_config(meta, cfg, d) if cfg is not None else []
        if base is not None and "lora_base" in meta:
            lora.check_base(meta["lora_base"], base(), f"{d.parent} (step {step})")
        reset = _check_structure(d / "state", abstract_state, cfg, changes)
        saved_pc, pc = int(meta.get("processes", 1)), jax.process_count()
        shards = [self._read_shard(d, p, saved_pc) for p in range(saved_pc)] \
            if saved_pc != pc else [self._read_shard(d, jax.process_index(), pc)]
        target = {"params": abstract_state["params"]} if reset else abstract_state
        state = self._read_state(step, target, meta)
        if reset:
            state = {"params": state["params"], "opt": None}
        for ledger, _ in shards:
            try:
                ledger.validate(max_version=int(meta.get("version", step)))
            except ValueError as e:
                raise Damaged("ledger", d / "ledger", f"invalid ({e})") from None
        one = shards[0] if saved_pc == pc else (None, None)
        return Restored(step=step, state=state, iterator_state=one[1], ledger=one[0], meta=meta,
                        changes=[c for c in changes if c.kind == "free"], reset_optimizer=reset,
                        shards=shards if saved_pc != pc else None)

    def read_meta(self, step: int) -> dict:
        """Step `step`'s meta document, checked against its digest; raises Damaged."""
        return read_signed_json("meta", meta_file(step_dir(self.directory, step)), "meta_sha256")

    def read_params(self, step: int, abstract_params):
        """The `params` half of step `step`'s state, checked against the digests the save
        recorded (the optimizer is not read); raises Damaged. Reads only: a damaged step is
        left where it is."""
        orbax_patch.quiet_closed_loops()
        return self._read_state(step, {"params": abstract_params}, self.read_meta(step))["params"]

    def read_ledgers(self, step: int) -> tuple[dict, list[LedgerSnapshot]]:
        """(meta, every process's ledger shard) of step `step`, verified; raises Damaged."""
        meta = self.read_meta(step)
        n = int(meta.get("processes", 1))
        return meta, [read_ledger(step_dir(self.directory, step) / "ledger", process_prefix_here(i, n))
                      for i in range(n)]

    def _read_shard(self, d: Path, index: int, count: int) -> tuple[LedgerSnapshot, dict]:
        ledger = read_ledger(d / "ledger", process_prefix_here(index, count))
        return ledger, self._read_iterator(iterator_file(d, index, count), ledger.header.get("iterator_sha256"))

    def _read_iterator(self, path: Path, want: str | None) -> dict:
        try:
            raw = path.read_bytes()
            state = json.loads(raw)
        except (OSError, ValueError) as e:
            raise unreadable("data", path, e) from None
        if want is not None and sha256(raw) != want:
            raise Damaged("data", path, "sha256 mismatch with the ledger's record of it")
        if not isinstance(state, dict):
            raise Damaged("data", path, "not a JSON object")
        return state

    def _read_state(self, step: int, target, meta: dict):
        d = step_dir(self.directory, step) / "state"
        reader = ocp.PyTreeCheckpointer()  # reads one item; a manager would want to own the directory
        try:
            state = reader.restore(d, args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True))
        except (MemoryError, KeyboardInterrupt):
            raise
        except remote_io.StorageError:
            raise
        except Exception as e:  # orbax and tensorstore raise many types for unreadable files
            raise unreadable("state", d, e) from None
        finally:
            reader.close()
        saved = (meta.get("digests") or {}).get("state")
        if saved:
            got, _ = state_digests(state)
            bad = [k for k, v in got.items() if saved.get(k) != v]
            if bad:
                raise Damaged("state", d, f"digest mismatch in {', '.join(bad[:3])}"
                                          + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))
        return state


def _check_config(meta: dict, cfg: C.Config, where: Path) -> list:
    """Refuses (ConfigError) a resume whose config changes the data stream or the state's
    structure; returns every change with its kind."""
    step = meta.get("step", where.name)
    saved_pc, pc = meta.get("processes", 1), jax.process_count()
    if saved_pc != pc and cfg.run.determinism:
        raise C.ConfigError(f"run.determinism=true: the checkpoint in {where.parent} (step {step}) was written by "
                            f"{saved_pc} process(es), this job has {pc}; another process count re-partitions the "
                            "remaining prompts, so the run cannot stay bit-identical to an unchanged one. Resume "
                            f"with {saved_pc} process(es), or set run.determinism=false to resize it "
                            "(nothing was changed)")
    saved = meta.get("config") or {}
    changes = compat.changes(saved, cfg)
    # the first change of a kind a saved step cannot take: why, and what to do instead
    refused = {"stream": lambda c: "changing it would change which prompts the saved iterator and ledger mean. "
                                   "Revert it",
               "lora": lambda c: "its adapters (and their optimizer state) exist only in that form. Revert it",
               "lowered": lambda c: f"{compat.NO_LOWER_FIELDS[c.key]}. Keep it >= {c.saved!r}"}
    for kind, why in refused.items():
        c = next((c for c in changes if c.kind == kind), None)
        if c is not None:
            raise C.ConfigError(f"{c.key}={c.now!r}: the checkpoint in {where.parent} (step {step}) was written with "
                                f"{c.key}={c.saved!r}; {why(c)} or use a new run.dir (nothing was changed)")
    return changes


def saved_processes(directory: Path) -> tuple[int, int] | None:
    """(step, process count) of the newest committed step in `directory` whose meta reads, or None."""
    for step in reversed(committed_steps(directory)):
        try:
            return step, int(json.loads(meta_file(step_dir(directory, step)).read_text()).get("processes", 1))
        except (OSError, ValueError, AttributeError):
            continue
    return None


def _check_structure(state_dir: Path, abstract_state, cfg: C.Config | None, changes: list) -> bool:
    """Refuses a state whose structure differs from this config's, unless only the optimizer's
    differs and run.reset_optimizer=true; returns whether to reset the optimizer."""
    try:
        saved = saved_arrays(state_dir)
    except (MemoryError, KeyboardInterrupt):
        raise
    except remote_io.StorageError:
        raise
    except Exception as e:
        quiet_damaged_reads()
        if remote_io.cause(e):
            raise unreadable("state", state_dir, e) from None
        raise Damaged("state", state_dir, f"metadata unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    target = target_arrays(abstract_state)
    if saved == target:
        return False
    params_only = {k: v for k, v in saved.items() if k.startswith("params.")}
    params_fit = params_only == {k: v for k, v in target.items() if k.startswith("params.")}
    fields = [c for c in changes if c.kind == "state"]
    if params_fit and cfg is not None and cfg.run.reset_optimizer:
        return True
    how = ("; ".join(map(str, fields)) if fields else
           "; ".join(structure_diff(saved, target)))
    ways = "revert it, or use a new run.dir"
    if params_fit:
        ways += ", or set run.reset_optimizer=true to keep the parameters and start a fresh optimizer state"
    raise C.ConfigError(f"the checkpoint in {state_dir.parent.parent} (step {state_dir.parent.name}) does not fit "
                        f"this config's model/optimizer state: {how}. Ways out: {ways} (nothing was changed)")
