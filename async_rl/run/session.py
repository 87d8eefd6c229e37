"""What a run keeps between steps (`Session`): the collaborators the train loop drives (ledger,
sampler, pump, journal, learner, checkpointer, logs, metrics, evaluator), wired once from the built
parts and the chosen start; the per-step agreement between processes; the consistent cut each
checkpoint saves (I2); and closing it all in order. The loop itself is `train`.

See docs/design.md, "The step loop".
"""

from __future__ import annotations

import contextlib
import gc
import math
import secrets
import sys
import time

import jax
import numpy as np
from flax import nnx

from async_rl import config as C
from async_rl import signals as sig
from async_rl.buffer import journal as journal_mod
from async_rl.buffer.sampler import Hooks, make_sampler
from async_rl.config import Config
from async_rl.learner.step import updates_per_step
from async_rl.model import sharding
from async_rl.obs.metrics import MetricsSink, Rates, StepClock
from async_rl.obs.tensorboard import cut_events
from async_rl.rollout import backends
from async_rl.rollout.pump import Pump
from async_rl.run.build import Parts, Start, resume_line, total_steps
from async_rl.run.evaluate import eval_slots, make_evaluator
from async_rl.state import compat, reshard
from async_rl.state.checkpoint import CheckpointWriteError, NonFiniteError
from async_rl.state.layout import last_committed
from async_rl.state.lineage import RunLogs
from async_rl.store import remote_io, rundir, runfiles, runlock, storage

# Evaluation on the pump's vLLM engine waits at most this long for it to load a step's weights
# (at its next chunk; without rollout.partial, once its slots drain), seconds.
EVAL_WAIT_S = 600.0


class Session:
    """The step loop and what it keeps between steps."""

    def __init__(self, parts: Parts, start: Start, log, signals: sig.Signals, lock: runlock.RunLock | None = None):
        cfg = parts.cfg
        self.parts, self.cfg, self.log, self.signals, self.lock = parts, cfg, log, signals, lock
        self.pc, self.primary = jax.process_count(), jax.process_index() == 0
        self.learner, self.engine, self.ckpt = parts.learner, parts.engine, parts.ckpt
        self.ledger, self.state, self.step = start.ledger, start.state, start.step
        saved_logs = self._open_logs(start)
        self.checkpointed = rundir.durable(parts.run_dir)
        self.last_saved = start.step if start.restored else -1
        # LoRA: the learner passes its frozen base, which is the reference, itself
        self.ref_params = self.learner.init_params() if self.learner.use_ref and self.learner.lora is None else None
        self.engine_base = None  # LoRA: the base as the engine reads it, published once
        self._open_metrics(start, saved_logs)
        self._open_buffer()
        self._start_rollout()
        self.evaluated = start.step  # evals live in metrics rows: a resumed run does not repeat one it kept
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
        self._settle_runtime()

    def _open_logs(self, start: Start) -> dict | None:
        """This process's logs, cut back to the restored checkpoint's lengths (what they held
        past it was not covered by it); the lengths the checkpoint saved, None on a fresh start."""
        parts, log = self.parts, self.log
        self.logs = RunLogs(parts.run_dir, rollouts=self.cfg.log.rollouts, tokenizer=parts.tok,
                            process=jax.process_index(), generation=len(parts.generations))
        saved_logs = start.restored.ledger.header.get("logs") if start.restored else None
        cut = self.logs.cut_to(saved_logs, warn=lambda m: log(f"warning: {m}"))
        if start.restored is not None:
            log(resume_line(start.restored, self.ledger, cut))
        elif cut:
            log(f"starting at step 0: cut {cut} bytes of lineage written by an earlier start that committed no "
                "checkpoint (its groups are drawn again)")
        return saved_logs

    def _open_metrics(self, start: Start, saved_logs: dict | None) -> None:
        """The metrics sink (rows, TensorBoard, progress bar, W&B), cut back to the checkpoint's
        step like the logs."""
        cfg, parts, log = self.cfg, self.parts, self.log
        if self.primary and not storage.is_remote(parts.run_dir):
            dropped = cut_events(parts.run_dir / runfiles.TB, start.step)
            if dropped:
                log(f"cut {dropped} TensorBoard events logged after step {start.step} (not covered by its checkpoint)")
        self.last_step = total_steps(cfg, parts.pd)  # where max_steps or the data ends the run
        self.sink = MetricsSink(parts.run_dir, tensorboard=cfg.log.tensorboard and self.primary,
                                progress=cfg.log.progress and self.primary and sys.stderr.isatty(),
                                every=cfg.log.every_steps, total_steps=self.last_step,
                                start_step=start.step, console=log,
                                process=jax.process_index(),
                                wandb=self._wandb(cfg, parts.run_dir, log) if cfg.log.wandb and self.primary else None)
        self.sink.cut(int(saved_logs.get("metrics_bytes", 0)) if saved_logs else 0)

    def _open_buffer(self) -> None:
        """The sampler over the ledger and the rollout journal, with the groups it restores."""
        cfg, parts = self.cfg, self.parts
        self.sampler = make_sampler(cfg, self.ledger, Hooks(on_filtered=self._on_filtered,
                                                            on_regenerated=lambda g, s: self.logs.regenerated(s, g)),
                                    groups_per_step=parts.local_pps)
        self.stop_ids = frozenset(getattr(parts.tok, "stop_ids", (parts.tok.eos_id,)))
        self.journal = journal_mod.open_journal(
            cfg, parts.run_dir, step=self.step, process_index=jax.process_index(), process_count=self.pc,
            stop_ids=getattr(parts.tok, "stop_ids", (parts.tok.eos_id,)), log=self.log, drop=self.logs.drops.append,
            generation=len(parts.generations))
        self.journal_compacted = self.step  # newest committed checkpoint the journal was compacted to
        self.pruned = self.step  # newest save after which old checkpoint steps were deleted
        if self.journal is not None and (line := self.journal.restore(self.ledger, self.sampler, self.step)):
            self.log(line)

    def _start_rollout(self) -> None:
        """The engine with this step's weights, the rollout backend over it, the pump that feeds
        the ledger, and the evaluator (process 0)."""
        cfg, parts, log = self.cfg, self.parts, self.log
        params_e = self.engine_params()
        self.engine.update_params(params_e, self.step)
        # the built-in engine places the weights for every backend (casts, layout)
        rollout = backends.for_training(cfg, backends.RunSide(
            engine=self.engine, params=params_e, version=self.step, stop_ids=self.stop_ids,
            n_tokens=parts.tok.vocab_size, spare_slots=eval_slots(cfg) if self.primary else 0,
            lora=self.learner.lora, tok=parts.tok, run_dir=parts.run_dir,
            run_tag=self._run_tag(cfg, parts), log=log))
        episodes, env_runner = self._episodes(cfg, parts)
        self.pump = Pump(ledger=self.ledger, sampler=self.sampler, rollout=rollout, iterator=parts.iterator,
                         tokenizer=parts.tok, reward_fn=parts.reward_fn, max_new_tokens=cfg.rollout.max_new_tokens,
                         params=params_e, version=self.step, partial=cfg.rollout.partial,
                         deterministic=cfg.run.determinism, log=log, journal=self.journal,
                         reward_timeout_s=cfg.rollout.reward_timeout_s,
                         episodes=episodes, env=env_runner, on_env_request=self.logs.env_requested,
                         reward_max_abs=cfg.rollout.reward_max_abs)
        self.evaluator = make_evaluator(cfg, self.learner.graphdef, self.engine.vocab_size, parts.tok,
                                        devices=list(self.engine.mesh.devices.flat), eval_set=parts.eval_set,
                                        rollout=rollout if backends.shares_engine(rollout) else None,
                                        run_dir=parts.run_dir, env=parts.env) if self.primary else None
        if self.evaluator is not None:
            log(f"eval: every {cfg.eval.every_steps} steps and at the end, {self.evaluator.describe()}")
        self.params_e = params_e

    @staticmethod
    def _run_tag(cfg, parts) -> str:
        """A fleet's request tag: the run's identity and this session (only a fleet makes run_id)."""
        if cfg.engine.backend != "remote":
            return ""
        return f"{rundir.run_identity(parts.run_dir)}.{secrets.token_hex(4)}"

    def _settle_runtime(self) -> None:
        """The interpreter settings the loop runs under (`close` puts the switch interval back)."""
        # The pump thread is mostly Python between engine calls; a shorter GIL switch interval
        # keeps it from starving Orbax's commit thread (figures: docs/benchmarks.md).
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(0.001)
        # What start-up built (JAX, compiled programs, the restored ledger) lives as long as
        # the run: frozen, the cyclic collector stops rescanning it. A full collection of
        # that heap stalled the pump and the learner loop for 80-100 ms each, once per ~40 steps.
        gc.collect()
        gc.freeze()

    def _episodes(self, cfg, parts):
        """Multi-turn episodes (rollout.env): their rules and the env's runner; (None, None) without."""
        if parts.env is None:
            return None, None
        from async_rl.env.guards import state_limits, traceback_keeper
        from async_rl.env.interface import EnvRunner
        from async_rl.rollout.episode import Episodes
        episodes = Episodes.of(cfg.rollout, run=rundir.run_identity(parts.run_dir), tokenizer=parts.tok,
                               max_turns=parts.env.max_turns)

        def wake():
            with self.ledger.changed:
                self.ledger.changed.notify_all()
        runner = EnvRunner(parts.env, max_concurrent=cfg.rollout.env_max_concurrent,
                           timeout_s=cfg.rollout.env_timeout_s, on_done=wake,
                           limits=state_limits(cfg.rollout), keep_traceback=traceback_keeper(parts.run_dir))
        return episodes, runner

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






    def engine_params(self):
        """The weights as the engine reads them: `Engine.load_params` casts and reshards the
        learner's layout into fresh buffers (safe from the donating step). With several
        processes it does so for every process's engine in one program where the engine
        shares the learner's devices; otherwise each first gathers its copy (`publishable`)."""
        if self.learner.lora is None:
            return self._to_engine(self.state["params"])
        # LoRA: the base crosses once; each version after moves its adapters only, beside
        # the same base buffers (an engine's tree is the base's leaves and the adapters')
        if self.engine_base is None:
            base = self.learner.base_params()
            self.engine_base = self.engine.adopt(base) if self.pc == 1 else self._to_engine(base)
        return nnx.merge_state(self.engine_base, self._to_engine(self.state["params"]))

    def _to_engine(self, p):
        return self.engine.load_params(self.learner.publishable(p) if self.pc > 1 and not self.engine.gathers(p) else p)

    def evaluate(self) -> dict:
        """Held-out scores of the weights after this step (in this step's metrics row)."""
        t0 = time.perf_counter()
        # it scores the weights the pump's vLLM engine runs (with LoRA: its requests start on the
        # newest adapters, this step's)
        if self.evaluator.on_run_engine:
            if self.pump.alive:  # loaded at the pump's next swap point (published: the step's weights)
                self.pump.wait_for_weights(self.step, EVAL_WAIT_S)
            elif self.pump.rollout.version != self.step:
                self.pump.rollout.swap(self.params_e, self.step)
        out = self.evaluator(self.params_e, self.step)
        out["perf/eval_s"] = time.perf_counter() - t0
        self.evaluated = self.step
        return out

    @staticmethod
    def _wandb(cfg: Config, run_dir, log):
        from async_rl.obs.wandb_log import WandbLog
        lc = cfg.log
        return WandbLog(run_dir, C.to_dict(cfg), project=lc.wandb_project, entity=lc.wandb_entity, name=lc.wandb_name,
                        tags=tuple(t.strip() for t in lc.wandb_tags.split(",") if t.strip()), log=log)

    def flush_metrics(self) -> None:
        if self.pending is None:
            return
        s, dev, host, groups = self.pending
        row = {k: float(v) for k, v in jax.device_get(dev).items()}
        bad = {k: v for k, v in row.items() if k in ("learner/loss", "learner/grad_norm") and not math.isfinite(v)}
        skipped = int(row.get("learner/skipped_updates", 0))
        if (bad or skipped) and self.cfg.learner.nonfinite == "fail":
            # step 1's loss is computed with the starting weights, before any update
            start = "; the starting weights already give it (model.hf_path may hold NaN or inf)" \
                if s == 1 and bad else ""
            what = ", ".join(f"{k}={v}" for k, v in bad.items()) or f"{skipped} updates with non-finite values"
            raise NonFiniteError(
                f"step {s}: {what}: training diverged{start}; its update was not applied and the step not saved "
                f"({last_committed(self.ckpt.directory)}). Lower learner.lr or change the data (or set "
                "learner.nonfinite=skip to go on without such updates), then run the same command to resume")
        if skipped:
            self._skipped(s, skipped, bad, groups)
        row.update(host)
        self.history.append({"step": s, **row})
        self.sink.write(s, row)
        self.pending = None

    def _skipped(self, s: int, skipped: int, bad: dict, groups: list) -> None:
        """learner.nonfinite=skip: a step with updates not applied. Its groups stay consumed (in
        the lineage, trained at `s`); drops.jsonl says their update was skipped."""
        what = ", ".join(f"{k}={v}" for k, v in bad.items()) or "updates with non-finite values"
        self.log(f"warning: step {s}: {what}: {skipped} of its {updates_per_step(self.cfg)} updates not applied "
                 f"(learner.nonfinite=skip); its {len(groups)} groups are consumed (drops.jsonl: nonfinite)")
        with self.ledger.lock:
            self.logs.nonfinite(s, groups, skipped)

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
        meta = {"step": s, "version": s, "data_stream": compat.data_stream(self.cfg), "config": C.to_dict(self.cfg),
                "processes": self.pc, "seed": self.cfg.run.seed, "time": time.time(), **reshard.meta_doc(self.parts)}
        if self.learner.lora is not None:  # the adapters are saved; the base is named and digested
            meta["lora_base"] = self.learner.base_reference()
        if self.learner.teacher is not None:  # a resume reads this teacher again (state.teacher, I1)
            meta["teacher"] = self.learner.teacher.reference(self.log)
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


    def close(self, failing: bool = False) -> None:
        """Stops the threads and closes the files; with `failing`, an error of the checkpointer is
        reported as a warning so it does not hide the one that stopped the run."""
        self.pump.stop()
        if not self.pump.alive and hasattr(self.pump.rollout, "close"):  # vLLM: its LoRA adapters' folder goes
            try:
                self.pump.rollout.close()
            except Exception as e:  # failing: the error that stopped the run is the one to report
                if not failing:
                    raise
                self.log(f"warning: closing the rollout backend: {e}")
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
