"""`train(cfg)`: one run, as a few named phases.

1. check the run directory (usable, not held by another process) — nothing written (on an
   object store the lease is taken here: no other holder commits after the start is chosen);
2. build the parts (tokenizer, data, rewards, learner, engine, checkpointer): `build`;
3. choose where to start (`build.choose_start`): the newest verified checkpoint step (refusing a config that does
   not fit it), or a fresh start (refused where run.dir has history it would bury) — still
   nothing written, so a refusal or an early signal leaves run.dir byte-identical;
4. take the run (`build.take`): lock, set damaged steps aside, write the manifests, cut the logs back;
5. the step loop over a `session.Session` (what the run keeps between steps): take a step's groups, dispatch the step, publish weights,
   commit the groups to the lineage log, fetch the previous step's metrics, save;
6. report (`report`).

Owns: that order, the step loop (stop, end of data, empty steps agreed between the processes
of a multi-host job), stopping on signals and
on non-finite values (never saved over good steps) or a failing object store (abandoned, so
closing waits on nothing it would have to answer). Does not own: the parts (`build`),
the cut each checkpoint saves (`session`), the end-of-run report (`report`). See docs/design.md.
"""

from __future__ import annotations

import contextlib
import sys
import time

import jax

from async_rl import faults
from async_rl import signals as sig
from async_rl.buffer.sampler import Stopped
from async_rl.config import Config, ConfigError
from async_rl.data import chat_template
from async_rl.learner.step import Row, build_batch
from async_rl.model import hf, sharding
from async_rl.obs.metrics import host_metrics, read_jsonl
from async_rl.run.build import build, choose_start, compilation_cache, object_store_config, store_failed, take
from async_rl.run.report import RunResult, report
from async_rl.run.session import Session
from async_rl.store import remote_io, rundir, runfiles, runlock, storage

# Evaluation on the pump's vLLM engine waits at most this long for it to load a step's weights
# (at its next chunk; without rollout.partial, once its slots drain), seconds.
EVAL_WAIT_S = 600.0


def train(cfg: Config, log=None) -> RunResult:
    """Runs (or resumes) the job described by `cfg`; returns when it ends or is stopped."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if jax.process_count() > 1:
        log = _prefixed(log, f"[process {jax.process_index()}/{jax.process_count()}] ")
    signals = sig.install(log)
    try:
        with compilation_cache(cfg.run.compilation_cache, cfg.run.compilation_cache_max_gb):
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
        cfg = object_store_config(cfg, log)
    if cfg.log.wandb:
        from async_rl.obs.wandb_log import check_installed
        check_installed()
    lock = runlock.run_lock(run_dir, jax.process_index(), cfg.run.lease_s)
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
            run(session)
        except BaseException as e:
            if remote and store_failed(e):  # closing waits on nothing the store would have to answer
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


# ---- 2. build ---------------------------------------------------------------------------


# ---- 3. choose where to start (reads only) ----------------------------------------------


# ---- 4. take the run (writes) -------------------------------------------------------------





def eval_at_start(s: Session) -> None:
    """`eval.at_start`: the starting weights' scores as a step-0 metrics row. A resume from a
    step-0 checkpoint reuses the row its cut of metrics.jsonl kept; a resume from a later
    step trains on and keeps the row; one with no checkpoint starts over and scores again."""
    if s.evaluator is None or not s.cfg.eval.at_start or s.step != 0:
        return
    kept = [r for r in read_jsonl(runfiles.metrics(s.parts.run_dir))
            if r.get("step") == 0 and r.get("eval/accuracy") is not None]
    row = {k: v for k, v in kept[-1].items() if k not in ("step", "time")} if kept else s.evaluate()
    if not kept:
        s.sink.write(0, row)
    s.history.append({"step": 0, **row})

def run(s: Session) -> None:
    eval_at_start(s)
    s.pump.start()
    while s.cfg.train.max_steps == 0 or s.step < s.cfg.train.max_steps:
        groups = next_groups(s)
        if groups is None:
            break
        train_step(s, groups)
        if s.cfg.checkpoint.every_steps and s.step % s.cfg.checkpoint.every_steps == 0:
            s.save()
    finish(s)

def next_groups(s: Session) -> list | None:
    """This process's groups of the next step; None when the run stops here."""
    if s.lock is not None:
        with s.local_work():  # a deleted or replaced .lock: stop before writing
            s.lock.check(s.parts.run_dir, log=s.log)
    flags = s.agree([s.local_stop(), s.sampler.finished(s.step), s.signals.received is not None])
    if flags[:, 2].any():
        s.job_signalled = True  # every process saves (or not) alike, whichever was signalled
    if flags[:, 0].any():
        return None
    if flags[:, 1].all():
        s.reason = "data_exhausted"
        return None
    t0 = time.perf_counter()
    try:
        groups = s.sampler.next_batch(s.step + 1, should_stop=s.should_stop)
    except Stopped:  # with several processes: a failure, which the step's agreement stops every one on
        return None if s.pc == 1 else []
    s.rates.wait_s += time.perf_counter() - t0
    if groups is None:
        if s.pc == 1:
            s.reason = "data_exhausted"
            return None
        groups = []  # this shard is done; the others still train, this process joins with no rows
    return groups

def train_step(s: Session, groups: list) -> None:
    cfg, ledger = s.cfg, s.ledger
    cap, stops = cfg.rollout.max_new_tokens, s.stop_ids
    cut = [[len(s.tokens) >= cap and (not s.tokens or s.tokens[-1] not in stops) for s in g.samples]
           for g in groups]
    replay = cfg.learner.routing_replay
    rows = [Row(g.prompt_tokens, s.tokens, s.logprobs, s.versions, s.reward, t, s.route_rows() if replay else None)
            for g, ts in zip(groups, cut) for s, t in zip(g.samples, ts)]
    batch = build_batch(rows, n_rows=s.parts.local_pps * cfg.rollout.samples_per_prompt,
                        prompt_len=cfg.engine.max_prompt_len, max_new=cfg.rollout.max_new_tokens,
                        pad_id=s.parts.tok.pad_id, bucket_min=cfg.learner.bucket_min,
                        routes=(cfg.model.n_layers, cfg.model.n_experts_per_token) if replay else None)
    if s.agree([len(groups)]).sum() > 0:
        s.state, dev_metrics = s.learner.step(s.state, batch, s.ref_params)
        s.clock.dispatched(s.step + 1, dev_metrics)
    else:  # every group of the step was filtered: the weights stay as they are
        dev_metrics = {}
    s.step += 1
    # publish before the groups leave the ledger: a gate that counts buffered groups
    # (fifo) must not let the pump start new work on the old weights in between
    t_publish = time.perf_counter()
    s.params_e = s.engine_params()
    s.pump.publish(s.step, s.params_e)
    publish_s = time.perf_counter() - t_publish
    s.trained += 1
    with s.local_work():
        commit(s, groups, cut)
        faults.point("step", s.step)
        faults.delay("step")
        s.flush_metrics()
        s.ckpt.check_for_errors()
        s._mark_checkpointed()
        s._compact_journal()
        s._prune()
    host = host_metrics(batch, s.step, groups, ledger)
    host["perf/publish_s"] = publish_s  # host time to dispatch the cast/reshard and hand it over
    host.update(s.rates.take(s.pump.stats, s.clock.idle_fraction(s.step)))
    if s.journal is not None:
        host.update(s.journal.metrics(s.pump.stats.busy_s))
    if s.save_blocking_s is not None:
        host["ckpt/save_blocking_s"] = s.save_blocking_s  # the save after the previous step
        s.save_blocking_s = None
    # the last step is scored here too: a checkpoint at it flushes its row before finish() could
    if s.evaluator is not None and (s.step % cfg.eval.every_steps == 0 or s.step == s.last_step):
        host.update(s.evaluate())
    s.pending = (s.step, dev_metrics, host, groups)

def commit(s: Session, groups: list, cut: list) -> None:
    """The step's groups leave the ledger and enter the lineage log (this process's share)."""
    if s.trained == 1 and s.primary:
        storage.remove(s.parts.run_dir / runfiles.FINAL)  # the run goes on past its end
    with s.ledger.lock:
        s.ledger.commit(groups)
        s.logs.trained(s.step, groups)
        if s.cfg.learner.overlong == "filter":  # I4: samples left out of the loss are logged
            for g, ts in zip(groups, cut):
                if any(ts):
                    s.logs.overlong(s.step, g, [i for i, t in enumerate(ts) if t])

def finish(s: Session) -> None:
    flags = s.agree([s.sampler.finished(s.step), s.signals.received is not None])
    if s.reason != "data_exhausted" and flags[:, 0].all():
        s.reason = "data_exhausted"
    s.job_signalled = s.job_signalled or bool(flags[:, 1].any())
    if s.job_signalled:
        s.reason = "signal"
        if not s.trained and s.signals.received:
            s.log(f"{s.signals.received} during start-up: stopped before training "
                     f"({'at checkpoint step ' + str(s.step) if s.last_saved >= 0 else 'nothing trained'})")
    with s.local_work():
        if s.evaluator is not None and s.evaluated != s.step and s.pending is not None:
            s.pending[2].update(s.evaluate())  # the end of the run: score its final weights
        s.flush_metrics()
    if s.last_saved != s.step and (s.trained or not s.job_signalled):
        s.save()
    else:
        s.agree([])
    s.ckpt.wait()
    s._mark_checkpointed()
    s._compact_journal()
    s._prune()


# ---- 6. report ----------------------------------------------------------------------------


def _prefixed(log, prefix: str):
    return lambda msg: log(prefix + msg)


