"""`train(cfg)`: one run, as a few named phases.

1. check the run directory (usable, not held by another process) — nothing written (on an
   object store the lease is taken here: no other holder commits after the start is chosen);
2. build the parts (tokenizer, data, rewards, learner, engine, checkpointer);
3. choose where to start: the newest verified checkpoint step (refusing a config that does
   not fit it), or a fresh start (refused where run.dir has history it would bury) — still
   nothing written, so a refusal or an early signal leaves run.dir byte-identical;
4. take the run: lock, set damaged steps aside, write the manifests, cut the logs back;
5. the step loop (`Session`): take a step's groups, dispatch the step, publish weights,
   commit the groups to the lineage log, fetch the previous step's metrics, save;
6. report.

Owns: that order, the consistent cut for each checkpoint, the per-step agreement between
processes of a multi-host job (stop, end of data, empty steps), stopping on signals and
on non-finite values (never saved over good steps) or a failing object store (abandoned, so
closing waits on nothing it would have to answer), and the end-of-run report. Does not
own: any of the parts it wires. See docs/design.md.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from . import chat_template, faults, hf, memory, remote_io, reshard, rewards, rundir, runfiles, sharding, storage
from . import config as C
from . import data as data_mod
from . import journal as journal_mod
from . import signals as sig
from .checkpoint import Checkpointer, CheckpointError, CheckpointWriteError, DamagedStep, NonFiniteError, Restored
from .ckpt_layout import last_committed
from .config import Config, ConfigError
from .engine import Engine
from .evaluate import build_eval_set, eval_slots, make_evaluator
from .learner import Learner, Row, build_batch, params_fingerprint
from .ledger import Ledger
from .lineage import RunLogs
from .metrics import MetricsSink, Rates, StepClock, host_metrics, plot_rewards, read_jsonl
from .pump import Pump
from .sampler import Hooks, Stopped, make_sampler
from .tbwriter import cut_events
from .tokenizer import build_tokenizer

# Evaluation on the pump's vLLM engine waits at most this long for it to load a step's weights
# (at its next chunk; without rollout.partial, once its slots drain), seconds.
EVAL_WAIT_S = 600.0


@dataclass
class RunResult:
    step: int  # learner steps in the model's history
    exit_code: int  # 0 finished or stopped cleanly; 130 interrupted (saved)
    reason: str  # max_steps | data_exhausted | signal
    fingerprint: str
    reward_first: float | None = None
    reward_last: float | None = None
    history: list = field(default_factory=list)


@dataclass
class Parts:
    """Everything a run is built from; building them writes nothing in run.dir."""
    cfg: Config
    run_dir: Path
    tok: Any
    pd: data_mod.PromptDataset
    iterator: data_mod.PromptIterator
    reward_fn: Callable
    learner: Learner
    engine: Engine
    ckpt: Checkpointer
    local_pps: int  # this process's groups per step
    eval_set: Any = None  # held-out prompts (eval.every_steps > 0, process 0), encoded
    generations: list = field(default_factory=list)  # re-partitions onto other process counts (reshard)


@dataclass
class Start:
    """Where the run begins: a restored step, or step 0."""
    step: int
    ledger: Ledger
    state: Any
    restored: Restored | None = None
    damaged: list[DamagedStep] = field(default_factory=list)
    restart: bool = False  # move the old history to previous/ first (run.resume=restart)


def setup_compilation_cache(path: str) -> None:
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", str(Path(path).expanduser()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def train(cfg: Config, log=None) -> RunResult:
    """Runs (or resumes) the job described by `cfg`; returns when it ends or is stopped."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if jax.process_count() > 1:
        log = _prefixed(log, f"[process {jax.process_index()}/{jax.process_count()}] ")
    signals = sig.install(log)
    try:
        return _train(cfg, log, signals)
    finally:
        sig.release(signals)


def _train(cfg: Config, log, signals: sig.Signals) -> RunResult:
    cfg = hf.resolve(cfg)  # model.hf_path: architecture fields and tokenizer from the HF directory
    if not cfg.run.dir:
        raise ConfigError("run.dir: required (no default): the directory this run writes and resumes from")
    remote = storage.is_remote(cfg.run.dir)
    if remote:
        remote_io.configure(cfg.run.storage_timeout_s)
    run_dir = storage.run_path(cfg.run.dir)
    rundir.check_usable(run_dir)
    if remote:
        cfg = _object_store_config(cfg, log)
    if cfg.log.wandb:
        from .wandb_log import check_installed
        check_installed()
    lock = rundir.run_lock(run_dir, jax.process_index(), cfg.run.lease_s)
    lock.ensure_free(run_dir)
    if remote:  # a lease is held before the run is read: no other holder commits after the choice
        lock.acquire(run_dir)
    stop_watch = remote_io.watch_stop(run_dir, log) if remote else None
    try:
        # one process may stop inside a template's render; several stop together at the agreement below
        stoppable = chat_template.stoppable(lambda: signals.received is not None) if jax.process_count() == 1 \
            else contextlib.nullcontext()
        try:
            with stoppable:
                parts = build(cfg, run_dir, log)
            if remote:
                lock.settle(log, should_stop=lambda: signals.received is not None)
            start = choose_start(parts, log)
            if start.state is None or parts.learner.use_ref:  # `take` or the session reads the pretrained weights
                parts.learner.check_init_params()
        except sig.Stopped:
            start = None
        if start is None or sharding.agree([signals.received is not None]).any():  # every process stops together
            log(f"{signals.received or 'a signal'} during start-up: stopped before changing anything in {run_dir}"
                + (" (its lease was taken and released)" if remote else ""))
            return RunResult(step=start.step if start else 0, exit_code=0, reason="signal", fingerprint="")
        if not remote:
            lock.acquire(run_dir)
        take(parts, start, log)
        session = Session(parts, start, log, signals, lock=lock)
        try:
            session.run()
        except BaseException as e:
            if remote and _store_failed(e):  # closing waits on nothing the store would have to answer
                remote_io.abandon("not tried: the run is stopping on a storage failure")
                # nor does the exit: a library's thread may still be inside its own retries (tensorstore's)
                sig.left_running("storage calls of the clients")
            session.close(failing=True)
            raise
        session.close()
        return report(parts, session, log)
    finally:
        if stop_watch is not None:
            stop_watch.set()
        lock.release()


def _store_failed(e: BaseException) -> bool:
    """Did the run stop because its object store failed to answer? (A lost lease is not that:
    the store answers, and the write guard refuses what the run would still write.)"""
    return isinstance(e, remote_io.StorageError) or getattr(e, "store_failed", False) or remote_io.cause(e) is not None


def _object_store_config(cfg: Config, log) -> Config:
    """What a run on an object store writes: everything but TensorBoard's event file (its
    writer appends to one file), turned off with one line."""
    if cfg.log.tensorboard:
        log(f"warning: run.dir={cfg.run.dir}: log.tensorboard turned off (its event file is appended to; an object "
            "store has no append): metrics.jsonl has every metric")
    return C.replace(cfg, log={"tensorboard": False})


# ---- 2. build ---------------------------------------------------------------------------


def build(cfg: Config, run_dir: Path, log) -> Parts:
    pi, pc = jax.process_index(), jax.process_count()
    setup_compilation_cache(cfg.run.compilation_cache)
    devices = sharding.make_devices(cfg.mesh)
    pps, G = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    if pps % pc:
        raise ConfigError(f"rollout.prompts_per_step={pps}: must divide over the {pc} processes (each "
                          "process generates its share of every step from its own shard of the data)"
                          + reshard.count_note(run_dir))
    shards = sharding.batch_shards(devices.learner)
    if (pps * G) % shards:
        raise ConfigError(f"rollout.prompts_per_step={pps}: prompts_per_step x samples_per_prompt "
                          f"({pps * G}) must divide evenly over the {shards} data-parallel shards")
    memory.check_host(cfg, pc)  # sizes the host could never hold, before anything is read
    tok = build_tokenizer(cfg.tokenizer, synthetic=cfg.data.char_vocab)
    pd = data_mod.build_dataset(cfg, tok, process_index=pi, process_count=pc)
    for line, reason in pd.bad_records[:20]:
        log(f"data: skipped bad record at {line}: {reason}")
    if pd.bad_records:
        log(f"data: skipped {len(pd.bad_records)} bad records (data.on_bad_record=skip)")
    _, reward_fn = rewards.reward_for_config(cfg)
    vocab = cfg.model.vocab_size or tok.vocab_size
    if vocab < tok.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab}: smaller than the tokenizer's {tok.vocab_size}")
    memory.check(cfg, vocab)  # before anything large is allocated
    learner = Learner(cfg, vocab, devices.learner, shared_devices=devices.shared, n_tokens=tok.vocab_size)
    eval_set = build_eval_set(cfg, tok) if cfg.eval.every_steps and pi == 0 else None
    engine = Engine(cfg.model, learner.graphdef, vocab_size=vocab, slots=cfg.engine.max_concurrent_decodes,
                    max_prompt_len=cfg.engine.max_prompt_len, max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.engine.temperature, top_k=cfg.engine.top_k, top_p=cfg.engine.top_p,
                    seed=cfg.run.seed, devices=devices.engine, steps_per_call=cfg.engine.steps_per_call,
                    tensor=cfg.engine.tensor, windows=not cfg.run.determinism, all_devices=devices.engine_all)
    ckpt = Checkpointer(run_dir / runfiles.CHECKPOINTS, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_)
    return Parts(cfg=cfg, run_dir=run_dir, tok=tok, pd=pd, iterator=data_mod.make_iterator(pd),
                 reward_fn=reward_fn, learner=learner, engine=engine, ckpt=ckpt, local_pps=pps // pc,
                 eval_set=eval_set)


# ---- 3. choose where to start (reads only) ----------------------------------------------


def choose_start(parts: Parts, log) -> Start:
    cfg, run_dir, ckpt = parts.cfg, parts.run_dir, parts.ckpt
    steps = ckpt.steps()
    if cfg.run.resume == "never" and (steps or rundir.history(run_dir)):
        raise ConfigError(f"run.resume=never: {run_dir} already holds a run "
                          f"({rundir.describe(rundir.history(run_dir))}); use a new run.dir (nothing was changed)")
    half = rundir.interrupted_restart(run_dir)
    if half is not None and cfg.run.resume != "restart":
        left = rundir.describe(rundir.history(run_dir)) or "no history"
        raise CheckpointError(
            f"{run_dir}: a run.resume=restart was interrupted while moving the history to {half} (left here: "
            f"{left}); pass run.resume=restart again to finish moving it and start over (nothing was changed)")
    if half is not None:
        return Start(step=0, ledger=Ledger(cfg.rollout.samples_per_prompt), state=None, restart=True)
    damaged: list[DamagedStep] = []
    if steps:
        choice = ckpt.restore_latest(parts.learner.abstract_state(), cfg=cfg, warn=lambda m: log(f"warning: {m}"))
        damaged = choice.damaged
        if choice.restored is not None:
            return _resumed(parts, choice.restored, damaged, log)
    if cfg.run.resume == "must":
        raise ConfigError(f"run.resume=must: no restorable checkpoint in {run_dir / runfiles.CHECKPOINTS} "
                          "(nothing was changed)")
    hist = rundir.history(run_dir)
    fresh = Start(step=0, ledger=Ledger(cfg.rollout.samples_per_prompt), state=None, damaged=damaged)
    if rundir.durable(run_dir) and cfg.run.resume != "restart":
        bad = f"; damaged steps: {', '.join(str(d.step) for d in damaged)}" if damaged else ""
        raise CheckpointError(
            f"{run_dir} holds a run's history ({rundir.describe(hist) or 'the mark that a checkpoint covered it'}) "
            "but no checkpoint step to resume "
            f"from{bad}; refusing to start over and bury it. Resume it with its original config, use a new "
            "run.dir, or pass run.resume=restart to move that history to run.dir/previous/ and start over "
            "(nothing was changed)")
    fresh.restart = bool(hist) and cfg.run.resume == "restart"
    return fresh


def _resumed(parts: Parts, restored: Restored, damaged: list[DamagedStep], log) -> Start:
    reshard.restore_data(parts, restored, log)  # another process count: re-partitioned; sets the iterator
    ledger = Ledger.from_snapshot(restored.ledger)
    if ledger.exhausted and not parts.iterator.exhausted:
        ledger.exhausted = False  # more epochs than before: the stream continues
        log(f"data.num_epochs={parts.cfg.data.num_epochs}: the data stream continues past the end it had reached")
    if restored.changes:
        log(f"resume: changed since step {restored.step}: " + "; ".join(map(str, restored.changes)))
    state = restored.state
    if restored.reset_optimizer:
        log(f"run.reset_optimizer=true: resuming step {restored.step} with its parameters and a fresh optimizer "
            "state (moments and the schedule's step count start from zero)")
        state = parts.learner.init_state(state["params"])
    return Start(step=restored.step, ledger=ledger, state=state, restored=restored, damaged=damaged)


# ---- 4. take the run (writes) -------------------------------------------------------------


def take(parts: Parts, start: Start, log) -> None:
    cfg, run_dir, primary = parts.cfg, parts.run_dir, jax.process_index() == 0
    if start.restart and primary:
        dest = rundir.archive_history(run_dir)
        log(f"run.resume=restart: moved the previous history of {run_dir} to {dest}; starting over")
    for d in start.damaged if not start.restart else []:
        dest = runfiles.damaged_step(run_dir, d.step, int(time.time()))
        if primary and storage.is_remote(run_dir):
            faults.point("set_aside", d.step)
            storage.move(runfiles.step(run_dir, d.step), dest)
        elif primary:
            dest.parent.mkdir(parents=True, exist_ok=True)
            faults.point("set_aside", d.step)
            shutil.move(str(runfiles.step(run_dir, d.step)), dest)
        log(f"warning: checkpoint step {d.step} set aside in {dest} ({d.why})")
    sharding.agree([1])  # every process sees the moves before opening the manager
    parts.ckpt.open()
    if primary:
        cut = reshard.cut_inactive_logs(run_dir, parts.generations, jax.process_count())
        if cut:
            log(f"cut {cut} bytes of the logs of processes this run no longer has (written after its checkpoint)")
        rundir.write_if_changed(run_dir / runfiles.CONFIG, C.to_yaml(cfg))
        rundir.write_if_changed(run_dir / runfiles.DATA, json.dumps({
            "prompt_ids": [int(i) for i in parts.pd.prompt_ids], "num_epochs": cfg.data.num_epochs,
            "records_per_epoch": int(parts.pd.records_per_epoch), "bad_records": len(parts.pd.bad_records)}))
        _announce_drops(cfg, parts.pd, log)
    if start.state is None:
        start.state = parts.learner.init_state(parts.learner.init_params())


# ---- 5. the step loop ---------------------------------------------------------------------


class Session:
    """The step loop and what it keeps between steps."""

    def __init__(self, parts: Parts, start: Start, log, signals: sig.Signals, lock: rundir.RunLock | None = None):
        cfg, pi = parts.cfg, jax.process_index()
        self.parts, self.cfg, self.log, self.signals, self.lock = parts, cfg, log, signals, lock
        self.pc, self.primary = jax.process_count(), pi == 0
        self.learner, self.engine, self.ckpt = parts.learner, parts.engine, parts.ckpt
        self.logs = RunLogs(parts.run_dir, rollouts=cfg.log.rollouts, tokenizer=parts.tok,
                            process=pi, generation=len(parts.generations))
        saved_logs = start.restored.ledger.header.get("logs") if start.restored else None
        cut = self.logs.cut_to(saved_logs, warn=lambda m: log(f"warning: {m}"))
        self.ledger, self.state, self.step = start.ledger, start.state, start.step
        if start.restored is not None:
            log(_resume_line(start.restored, self.ledger, cut))
        elif cut:
            log(f"starting at step 0: cut {cut} bytes of lineage written by an earlier start that committed no "
                "checkpoint (its groups are drawn again)")
        self.checkpointed = rundir.durable(parts.run_dir)
        self.last_saved = start.step if start.restored else -1
        self.ref_params = self.learner.init_params() if self.learner.use_ref else None
        if self.primary and not storage.is_remote(parts.run_dir):
            dropped = cut_events(parts.run_dir / runfiles.TB, start.step)
            if dropped:
                log(f"cut {dropped} TensorBoard events logged after step {start.step} (not covered by its checkpoint)")
        self.last_step = _total_steps(cfg, parts.pd)  # where max_steps or the data ends the run
        self.sink = MetricsSink(parts.run_dir, tensorboard=cfg.log.tensorboard and self.primary,
                                progress=cfg.log.progress and self.primary and sys.stderr.isatty(),
                                every=cfg.log.every_steps, total_steps=self.last_step,
                                start_step=start.step, console=log,
                                process=pi,
                                wandb=self._wandb(cfg, parts.run_dir, log) if cfg.log.wandb and self.primary else None)
        self.sink.cut(int(saved_logs.get("metrics_bytes", 0)) if saved_logs else 0)
        self.sampler = make_sampler(cfg, self.ledger, Hooks(on_filtered=self._on_filtered,
                                                            on_regenerated=lambda g, s: self.logs.regenerated(s, g)),
                                    groups_per_step=parts.local_pps)
        self.stop_ids = frozenset(getattr(parts.tok, "stop_ids", (parts.tok.eos_id,)))
        self.journal = journal_mod.open_journal(
            cfg, parts.run_dir, step=self.step, process_index=pi, process_count=self.pc,
            stop_ids=getattr(parts.tok, "stop_ids", (parts.tok.eos_id,)), log=log, drop=self.logs.drops.append,
            generation=len(parts.generations))
        self.journal_compacted = self.step  # newest committed checkpoint the journal was compacted to
        self.pruned = self.step  # newest save after which old checkpoint steps were deleted
        if self.journal is not None and (line := self.journal.restore(self.ledger, self.sampler, self.step)):
            log(line)
        params_e = self.engine_params()
        self.engine.update_params(params_e, self.step)
        rollout = self.engine
        if cfg.engine.backend == "vllm":  # the built-in engine stays for weight placement (casts, layout)
            from .vllm_rollout import from_config
            rollout = from_config(cfg, self.stop_ids, parts.tok.vocab_size, params_e, self.step,
                                  spare_slots=eval_slots(cfg) if self.primary else 0)
        self.pump = Pump(ledger=self.ledger, sampler=self.sampler, engine=rollout, iterator=parts.iterator,
                         tokenizer=parts.tok, reward_fn=parts.reward_fn, max_new_tokens=cfg.rollout.max_new_tokens,
                         params=params_e, version=self.step, partial=cfg.rollout.partial,
                         deterministic=cfg.run.determinism, log=log, journal=self.journal,
                         prefill_rows=cfg.engine.prefill_rows, reward_timeout_s=cfg.rollout.reward_timeout_s)
        self.evaluator = make_evaluator(cfg, self.learner.graphdef, self.engine.vocab_size, parts.tok,
                                        devices=list(self.engine.mesh.devices.flat), eval_set=parts.eval_set,
                                        rollout=rollout if rollout is not self.engine else None
                                        ) if self.primary else None
        if self.evaluator is not None:
            log(f"eval: every {cfg.eval.every_steps} steps and at the end, {self.evaluator.describe()}")
        self.evaluated = start.step  # evals live in metrics rows: a resumed run does not repeat one it kept
        self.params_e = params_e
        self.clock = StepClock()
        self.rates = Rates()
        self.t_start = time.perf_counter()
        self.history: list[dict] = []
        self.pending = None  # (step, device metrics, host metrics) of the step before the one in flight
        self.reason = "max_steps"
        self.job_signalled = False  # some process of the job was signalled (agreed at a step boundary)
        self.trained = 0  # steps trained by this process in this session
        self.failed: BaseException | None = None  # this process's failure, kept for the next agreement
        self.save_blocking_s: float | None = None
        # The pump thread is mostly Python between engine calls; a shorter GIL switch interval
        # keeps it from starving Orbax's commit thread (measured: commit 5.4 s -> 2.1 s).
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(0.001)
        # What start-up built (JAX, compiled programs, the restored ledger) lives as long as
        # the run: frozen, the cyclic collector stops rescanning it. A full collection of
        # that heap stalled the pump and the learner loop for 80-100 ms each, once per ~40 steps.
        gc.collect()
        gc.freeze()

    def _on_filtered(self, groups, s):  # sampler, main thread, under the ledger lock
        self.ledger.drop(groups, "zero_variance")
        self.logs.filtered(s, groups)

    def local_stop(self) -> bool:
        return self.signals.received is not None or self.local_error() is not None

    def should_stop(self) -> bool:
        # one process cannot leave a step the others enter: with several, stop only at step boundaries
        return self.local_stop() if self.pc == 1 else self.local_error() is not None

    def local_error(self) -> BaseException | None:
        """This process's failure not yet raised: of its main thread's own work, or of its pump
        or reward threads."""
        return self.failed or self.pump.error

    @contextlib.contextmanager
    def local_work(self):
        """Work of this process alone (its files, its checks). With several processes a failure
        in it is kept for the next agreement, which stops every process there (`agree`): raised
        here, it would leave the others waiting in a collective this one never joins."""
        try:
            yield
        except Exception as e:
            if self.pc == 1:
                raise
            self.failed = self.failed or e

    def agree(self, values) -> np.ndarray:
        """Every process's `values`; where a process has failed, every process stops here:
        that one with its error, the others naming it (nothing saved after the last committed step)."""
        try:
            return sharding.agree_or_fail(values, self.local_error())
        except sharding.PeerFailedError as e:
            steps = self.ckpt.steps()
            raise sharding.PeerFailedError(
                f"{e}; every process stopped after step {self.step}, nothing saved after the last committed "
                f"checkpoint (step {steps[-1]})" if steps else
                f"{e}; every process stopped after step {self.step}, no checkpoint was committed") from None

    def eval_at_start(self) -> None:
        """`eval.at_start`: the starting weights' scores as a step-0 metrics row. A resume from a
        step-0 checkpoint reuses the row its cut of metrics.jsonl kept; a resume from a later
        step trains on and keeps the row; one with no checkpoint starts over and scores again."""
        if self.evaluator is None or not self.cfg.eval.at_start or self.step != 0:
            return
        kept = [r for r in read_jsonl(runfiles.metrics(self.parts.run_dir))
                if r.get("step") == 0 and r.get("eval/accuracy") is not None]
        row = {k: v for k, v in kept[-1].items() if k not in ("step", "time")} if kept else self.evaluate()
        if not kept:
            self.sink.write(0, row)
        self.history.append({"step": 0, **row})

    def run(self) -> None:
        self.eval_at_start()
        self.pump.start()
        while self.cfg.train.max_steps == 0 or self.step < self.cfg.train.max_steps:
            groups = self.next_groups()
            if groups is None:
                break
            self.train_step(groups)
            if self.cfg.checkpoint.every_steps and self.step % self.cfg.checkpoint.every_steps == 0:
                self.save()
        self.finish()

    def next_groups(self) -> list | None:
        """This process's groups of the next step; None when the run stops here."""
        if self.lock is not None:
            with self.local_work():  # a deleted or replaced .lock: stop before writing
                self.lock.check(self.parts.run_dir, log=self.log)
        flags = self.agree([self.local_stop(), self.sampler.finished(self.step), self.signals.received is not None])
        if flags[:, 2].any():
            self.job_signalled = True  # every process saves (or not) alike, whichever was signalled
        if flags[:, 0].any():
            return None
        if flags[:, 1].all():
            self.reason = "data_exhausted"
            return None
        t0 = time.perf_counter()
        try:
            groups = self.sampler.next_batch(self.step + 1, should_stop=self.should_stop)
        except Stopped:  # with several processes: a failure, which the step's agreement stops every one on
            return None if self.pc == 1 else []
        self.rates.wait_s += time.perf_counter() - t0
        if groups is None:
            if self.pc == 1:
                self.reason = "data_exhausted"
                return None
            groups = []  # this shard is done; the others still train, this process joins with no rows
        return groups

    def train_step(self, groups: list) -> None:
        cfg, ledger = self.cfg, self.ledger
        cap, stops = cfg.rollout.max_new_tokens, self.stop_ids
        cut = [[len(s.tokens) >= cap and (not s.tokens or s.tokens[-1] not in stops) for s in g.samples]
               for g in groups]
        rows = [Row(g.prompt_tokens, s.tokens, s.logprobs, s.versions, s.reward, t)
                for g, ts in zip(groups, cut) for s, t in zip(g.samples, ts)]
        batch = build_batch(rows, n_rows=self.parts.local_pps * cfg.rollout.samples_per_prompt,
                            prompt_len=cfg.engine.max_prompt_len, max_new=cfg.rollout.max_new_tokens,
                            pad_id=self.parts.tok.pad_id, bucket_min=cfg.learner.bucket_min)
        if self.agree([len(groups)]).sum() > 0:
            self.state, dev_metrics = self.learner.step(self.state, batch, self.ref_params)
            self.clock.dispatched(self.step + 1, dev_metrics)
        else:  # every group of the step was filtered: the weights stay as they are
            dev_metrics = {}
        self.step += 1
        # publish before the groups leave the ledger: a gate that counts buffered groups
        # (fifo) must not let the pump start new work on the old weights in between
        t_publish = time.perf_counter()
        self.params_e = self.engine_params()
        self.pump.publish(self.step, self.params_e)
        publish_s = time.perf_counter() - t_publish
        self.trained += 1
        with self.local_work():
            self._commit(groups, cut)
            faults.point("step", self.step)
            faults.delay("step")
            self.flush_metrics()
            self.ckpt.check_for_errors()
            self._mark_checkpointed()
            self._compact_journal()
            self._prune()
        host = host_metrics(batch, self.step, groups, ledger)
        host["perf/publish_s"] = publish_s  # host time to dispatch the cast/reshard and hand it over
        host.update(self.rates.take(self.pump.stats, self.clock.idle_fraction(self.step)))
        if self.journal is not None:
            host.update(self.journal.metrics(self.pump.stats.busy_s))
        if self.save_blocking_s is not None:
            host["ckpt/save_blocking_s"] = self.save_blocking_s  # the save after the previous step
            self.save_blocking_s = None
        # the last step is scored here too: a checkpoint at it flushes its row before finish() could
        if self.evaluator is not None and (self.step % cfg.eval.every_steps == 0 or self.step == self.last_step):
            host.update(self.evaluate())
        self.pending = (self.step, dev_metrics, host)

    def _commit(self, groups: list, cut: list) -> None:
        """The step's groups leave the ledger and enter the lineage log (this process's share)."""
        if self.trained == 1 and self.primary:
            storage.remove(self.parts.run_dir / runfiles.FINAL)  # the run goes on past its end
        with self.ledger.lock:
            self.ledger.commit(groups)
            self.logs.trained(self.step, groups)
            if self.cfg.learner.overlong == "filter":  # I4: samples left out of the loss are logged
                for g, ts in zip(groups, cut):
                    if any(ts):
                        self.logs.overlong(self.step, g, [i for i, t in enumerate(ts) if t])

    def engine_params(self):
        """The weights as the engine reads them: `Engine.load_params` casts and reshards the
        learner's layout into fresh buffers (safe from the donating step). With several
        processes it does so for every process's engine in one program where the engine
        shares the learner's devices; otherwise each first gathers its copy (`publishable`)."""
        p = self.state["params"]
        return self.engine.load_params(self.learner.publishable(p) if self.pc > 1 and not self.engine.gathers(p) else p)

    def evaluate(self) -> dict:
        """Held-out scores of the weights after this step (in this step's metrics row)."""
        t0 = time.perf_counter()
        if self.evaluator.on_run_engine:  # it scores the weights the pump's vLLM engine runs
            if self.pump.alive:  # loaded at the pump's next swap point (published: the step's weights)
                self.pump.wait_for_weights(self.step, EVAL_WAIT_S)
            elif self.pump.rollout.version != self.step:
                self.pump.rollout.swap(self.params_e, self.step)
        out = self.evaluator(self.params_e)
        out["perf/eval_s"] = time.perf_counter() - t0
        self.evaluated = self.step
        return out

    @staticmethod
    def _wandb(cfg: Config, run_dir, log):
        from .wandb_log import WandbLog
        lc = cfg.log
        return WandbLog(run_dir, C.to_dict(cfg), project=lc.wandb_project, entity=lc.wandb_entity, name=lc.wandb_name,
                        tags=tuple(t.strip() for t in lc.wandb_tags.split(",") if t.strip()), log=log)

    def flush_metrics(self) -> None:
        if self.pending is None:
            return
        s, dev, host = self.pending
        row = {k: float(v) for k, v in jax.device_get(dev).items()}
        bad = {k: v for k, v in row.items() if k in ("learner/loss", "learner/grad_norm") and not math.isfinite(v)}
        if bad:
            # step 1's loss is computed with the starting weights, before any update
            start = "; the starting weights already give it (model.hf_path may hold NaN or inf)" if s == 1 else ""
            raise NonFiniteError(
                f"step {s}: {', '.join(f'{k}={v}' for k, v in bad.items())}: training diverged{start}; stopped "
                f"without saving it ({last_committed(self.ckpt.directory)}). Lower learner.lr or change the data, "
                "then run the same command to resume")
        row.update(host)
        self.history.append({"step": s, **row})
        self.sink.write(s, row)
        self.pending = None

    def save(self) -> None:
        s = self.step
        pump = self.pump
        with self.local_work():
            if self.lock is not None:
                self.lock.check(self.parts.run_dir, log=self.log)
            self.flush_metrics()
            if self.cfg.run.determinism:
                pump.pause_for_cut(s, should_stop=lambda: self.local_error() is not None)
            with self.ledger.lock:  # I2: iterator state, ledger and log sizes at one instant
                it_state = pump.iterator_state()
                cut = self.ledger.capture()
                cut.counters["logs"] = {**self.logs.sizes(), "metrics_bytes": self.sink.jsonl.tell()}
                if self.journal is not None:
                    self.journal.rotate(s)  # records after the cut go to a segment this checkpoint does not cover
        self.agree([])  # no process enters the save's collectives where one has failed
        meta = {"step": s, "version": s, "data_stream": C.data_stream(self.cfg), "config": C.to_dict(self.cfg),
                "processes": self.pc, "seed": self.cfg.run.seed, "time": time.time(), **reshard.meta_doc(self.parts)}
        self.ckpt.save(s, self.state, it_state, cut, meta)
        if self.cfg.run.determinism:
            pump.resume()
        self.last_saved = s
        self.save_blocking_s = self.ckpt.last_blocking_s

    def _compact_journal(self) -> None:
        """Deletes the journal segments that a checkpoint of this session, once committed, made obsolete."""
        if self.journal is None or self.last_saved <= self.journal_compacted:
            return
        done = [s for s in self.ckpt.steps() if self.journal_compacted < s <= self.last_saved]
        if done:
            self.journal.compact(done[-1])
            self.journal_compacted = done[-1]

    def _prune(self) -> None:
        """Old checkpoint steps on an object store go once a newer one committed (Orbax's keep-N
        there is ours: each deletion passes the lease check)."""
        if self.primary and self.last_saved > self.pruned and self.last_saved in self.ckpt.prune():
            self.pruned = self.last_saved

    def _mark_checkpointed(self) -> None:
        if not self.checkpointed and self.primary and self.last_saved >= 0 and self.ckpt.steps():
            rundir.mark_checkpointed(self.parts.run_dir, self.ckpt.steps()[0])
            self.checkpointed = True

    def finish(self) -> None:
        flags = self.agree([self.sampler.finished(self.step), self.signals.received is not None])
        if self.reason != "data_exhausted" and flags[:, 0].all():
            self.reason = "data_exhausted"
        self.job_signalled = self.job_signalled or bool(flags[:, 1].any())
        if self.job_signalled:
            self.reason = "signal"
            if not self.trained and self.signals.received:
                self.log(f"{self.signals.received} during start-up: stopped before training "
                         f"({'at checkpoint step ' + str(self.step) if self.last_saved >= 0 else 'nothing trained'})")
        with self.local_work():
            if self.evaluator is not None and self.evaluated != self.step and self.pending is not None:
                self.pending[2].update(self.evaluate())  # the end of the run: score its final weights
            self.flush_metrics()
        if self.last_saved != self.step and (self.trained or not self.job_signalled):
            self.save()
        else:
            self.agree([])
        self.ckpt.wait()
        self._mark_checkpointed()
        self._compact_journal()
        self._prune()

    def close(self, failing: bool = False) -> None:
        """Stops the threads and closes the files; with `failing`, an error of the checkpointer is
        reported as a warning so it does not hide the one that stopped the run."""
        self.pump.stop()
        if self.journal is not None:
            self.journal.close()
            if self.journal.usage.samples or self.journal.usage.unused:
                self.log(self.journal.summary())
        self.clock.close()
        sys.setswitchinterval(self._switch)
        gc.unfreeze()
        self.sink.close()
        self.logs.close()
        try:
            self.ckpt.close()
        except (CheckpointWriteError, rundir.LockLostError) as e:
            if not failing:
                raise
            if isinstance(e, CheckpointWriteError) and not remote_io.abandoned():  # else the error raised names it
                self.log(f"warning: {e}")


# ---- 6. report ----------------------------------------------------------------------------


def report(parts: Parts, s: Session, log) -> RunResult:
    cfg, learner, ledger = parts.cfg, parts.learner, s.ledger
    fp = params_fingerprint(learner.publishable(s.state["params"]) if s.pc > 1 else s.state["params"])
    with ledger.lock:
        open_epochs = {g.epoch for g in ledger.groups.values()}
        next_epoch = parts.pd.epoch_at(parts.iterator.next_index)  # every epoch before it is drawn here
        local_done = [e not in open_epochs and (ledger.exhausted or e < next_epoch) for e in range(cfg.data.num_epochs)]
    complete = [e for e, ok in enumerate(sharding.agree(local_done).all(axis=0)) if ok]
    exhausted = bool(sharding.agree([ledger.exhausted]).all())
    rewards_seen = [h["rollout/reward_mean"] for h in s.history if "rollout/reward_mean" in h]
    res = RunResult(step=s.step, exit_code=130 if s.signals.received == "SIGINT" else 0, reason=s.reason,
                    fingerprint=fp, reward_first=rewards_seen[0] if rewards_seen else None,
                    reward_last=float(np.mean(rewards_seen[-5:])) if rewards_seen else None, history=s.history)
    if s.primary:
        rundir.write_atomic(parts.run_dir / runfiles.FINAL, json.dumps({
            "step": s.step, "fingerprint": fp, "reason": s.reason, "exhausted": exhausted,
            "complete_epochs": complete}))
        log(f"params fingerprint: {fp}")
        try:  # the run's kept rows: a resumed session's "before" is the run's first eval, not its own
            all_rows = read_jsonl(runfiles.metrics(parts.run_dir))
        except (OSError, ValueError):
            all_rows = s.history
        try:
            if cfg.log.plot and plot_rewards(all_rows, parts.run_dir / runfiles.REWARD_PLOT):
                log(f"reward curve: {parts.run_dir / runfiles.REWARD_PLOT}")
        except Exception as e:  # noqa: BLE001 - the run is saved; only the picture is missing
            log(f"warning: {parts.run_dir / runfiles.REWARD_PLOT} not written ({getattr(e, 'strerror', None) or e})")
        run_rows = [r for r in all_rows if r.get("step", 0) <= s.step]
        _report(cfg, res, run_rows or s.history, time.perf_counter() - s.t_start, log)
    return res


def _prefixed(log, prefix: str):
    return lambda msg: log(prefix + msg)


def _resume_line(restored, ledger: Ledger, cut: int) -> str:
    summ = restored.ledger.summary()
    with ledger.lock:
        ready_steps = sorted({g.target_step for g in ledger.groups.values()
                              if g.state.name == "READY" and g.target_step is not None})
    return (f"resumed step {restored.step}: {summ['ready']} ready groups"
            + (f" (step {', '.join(map(str, ready_steps))})" if ready_steps else "")
            + f", {summ['generating']} generating ({summ['kept_tokens']} tokens kept), {summ['pending']} pending; "
            f"iterator at ordinal {ledger.next_ordinal}" + (" (exhausted)" if ledger.exhausted else "")
            + (f"; cut {cut} bytes of lineage written after it" if cut else ""))


def _announce_drops(cfg: Config, pd, log) -> None:
    """I4: a config that consumes data without training it says so, with how much it may."""
    n = len(pd.prompt_ids) * cfg.data.num_epochs
    if cfg.rollout.filter_zero_variance:
        log(f"note: rollout.filter_zero_variance=true: groups whose {cfg.rollout.samples_per_prompt} rewards are "
            f"all equal are consumed without training (up to all {n} prompt-epochs; each is logged in "
            "drops.jsonl and counted in data/dropped/zero_variance)")
    if cfg.learner.overlong == "filter":
        log(f"note: learner.overlong=filter: completions cut at rollout.max_new_tokens={cfg.rollout.max_new_tokens} "
            "without a stop token are left out of the loss (each group's are logged in drops.jsonl, reason "
            "overlong, and counted in rollout/overlong_filtered)")
    if cfg.sampler.name != "in_order":
        log(f"note: sampler.name={cfg.sampler.name}: READY groups older than sampler.max_staleness="
            f"{cfg.sampler.max_staleness} are regenerated (their rollouts discarded, logged in drops.jsonl); "
            "no prompt is dropped")


def _total_steps(cfg: Config, pd) -> int:
    per_epoch = len(pd.prompt_ids)
    data_steps = math.ceil(per_epoch * cfg.data.num_epochs / cfg.rollout.prompts_per_step)
    return min(cfg.train.max_steps, data_steps) if cfg.train.max_steps else data_steps


def _report(cfg: Config, res: RunResult, history: list[dict], wall: float, log) -> None:
    """The end-of-run line; `history` is every metrics row the run kept (all sessions)."""
    if res.reward_first is None:
        log(f"stopped at step {res.step} ({res.reason}); no step trained in this process")
        return
    target = cfg.train.reward_target
    hit = next((h for h in history if (h.get("rollout/reward_mean") or 0) >= target), None)
    rewards = [h["rollout/reward_mean"] for h in history if h.get("rollout/reward_mean") is not None]
    first, last = (rewards[0], float(np.mean(rewards[-5:]))) if rewards else (res.reward_first, res.reward_last)
    msg = (f"done: step {res.step} ({res.reason}) in {wall:.0f}s; mean reward {first:.3f} -> {last:.3f} "
           "(last 5 steps)")
    msg += f"; reached {target} at step {hit['step']}" if hit is not None else f"; did not reach {target}"
    evals = [h for h in history if "eval/accuracy" in h]
    if evals:
        msg += (f"; held-out accuracy {evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f} "
                f"(step {evals[-1]['step']})")
    log(msg + f"; peak host RSS {peak_rss_gib():.2f} GiB")


def peak_rss_gib() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 30) if sys.platform == "darwin" else peak / (1 << 20)
