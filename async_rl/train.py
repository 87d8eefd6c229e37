"""`train(cfg)`: wires data, ledger, pump, learner and checkpoints into one run.

Owns: the run directory's layout, the resume decision, the step loop (take a step's
groups, dispatch the step, publish weights, commit the groups to the lineage log, fetch
the previous step's metrics), the consistent cut for each checkpoint, signal handling
(SIGTERM: save at the next step boundary and exit 0; a second signal exits at once), the
per-step agreement between processes of a multi-host job (stop, end of data, empty
steps), and the end-of-run report. Does not own: any of the parts it wires.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from . import config as C
from . import data as data_mod
from . import faults, hf, rewards, sharding
from .checkpoint import Checkpointer, check_data_stream
from .config import Config, ConfigError
from .engine import Engine
from .ledger import Ledger
from .learner import Learner, Row, build_batch, params_fingerprint
from .lineage import RunLogs
from .metrics import MetricsSink, StepClock, plot_rewards
from .pump import Pump
from .sampler import Hooks, Stopped, make_sampler
from .tokenizer import build_tokenizer


@dataclass
class RunResult:
    step: int  # learner steps in the model's history
    exit_code: int  # 0 finished or stopped cleanly; 130 interrupted (saved)
    reason: str  # max_steps | data_exhausted | signal
    fingerprint: str
    reward_first: float | None = None
    reward_last: float | None = None
    history: list = field(default_factory=list)


class _Signals:
    """First SIGTERM/SIGINT: stop at the next step boundary after a save. Second: exit now."""

    def __init__(self, log):
        self.received: str | None = None
        self.log = log
        self._old = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            self.log(f"{name} again: exiting now; the last committed checkpoint is intact")
            os._exit(128 + signum)
        self.received = name
        self.log(f"{name}: saving at the next step boundary, then exiting")

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def setup_compilation_cache(path: str) -> None:
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def train(cfg: Config, log=None) -> RunResult:
    """Runs (or resumes) the job described by `cfg`; returns when it ends or is stopped."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cfg = hf.resolve(cfg)  # model.hf_path: architecture fields and tokenizer from the HF directory
    pi, pc = jax.process_index(), jax.process_count()
    primary = pi == 0
    if pc > 1:
        log = _prefixed(log, f"[process {pi}/{pc}] ")
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_compilation_cache(cfg.run.compilation_cache)
    devices = sharding.make_devices(cfg.mesh)
    pps, G = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    if pps % pc:
        raise ConfigError(f"rollout.prompts_per_step={pps}: must divide over the {pc} processes (each "
                          "process generates its share of every step from its own shard of the data)")
    local_pps = pps // pc
    shards = sharding.batch_shards(devices.learner)
    if (pps * G) % shards:
        raise ConfigError(f"rollout.prompts_per_step={pps}: prompts_per_step x samples_per_prompt "
                          f"({pps * G}) must divide evenly over the {shards} data-parallel shards")
    tok = build_tokenizer(cfg.tokenizer, synthetic=cfg.data.source == "synthetic")
    pd = data_mod.build_dataset(cfg, tok, process_index=pi, process_count=pc)
    for line, reason in pd.bad_records[:20]:
        log(f"data: skipped bad record at {line}: {reason}")
    if pd.bad_records:
        log(f"data: skipped {len(pd.bad_records)} bad records (data.on_bad_record=skip)")
    _, reward_fn = rewards.reward_for_config(cfg)
    vocab = cfg.model.vocab_size or tok.vocab_size
    if vocab < tok.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab}: smaller than the tokenizer's {tok.vocab_size}")

    learner = Learner(cfg, vocab, devices.learner, shared_devices=devices.shared)
    engine = Engine(cfg.model, learner.graphdef, vocab_size=vocab, slots=cfg.engine.max_concurrent_decodes,
                    max_prompt_len=cfg.engine.max_prompt_len, max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.engine.temperature, top_k=cfg.engine.top_k, top_p=cfg.engine.top_p,
                    seed=cfg.run.seed, devices=devices.engine, steps_per_call=cfg.engine.steps_per_call)

    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_)
    steps = ckpt.steps()
    if cfg.run.resume == "never" and steps:
        raise ConfigError(f"run.resume=never: {run_dir} already holds checkpoints {steps}; "
                          "use a new run.dir (nothing was changed)")
    if cfg.run.resume == "must" and not steps:
        raise ConfigError(f"run.resume=must: no checkpoint in {run_dir / 'checkpoints'}")
    restored = ckpt.restore_latest(learner.abstract_state(), warn=lambda m: log(f"warning: {m}")) \
        if steps and cfg.run.resume != "never" else None
    if restored is not None:
        check_data_stream(restored.meta, C.data_stream(cfg), str(run_dir))

    final_path = run_dir / "final.json"
    if primary:
        (run_dir / "config.yaml").write_text(C.to_yaml(cfg))
        (run_dir / "data.json").write_text(json.dumps({
            "prompt_ids": [int(i) for i in pd.prompt_ids], "num_epochs": cfg.data.num_epochs,
            "records_per_epoch": int(pd.records_per_epoch), "bad_records": len(pd.bad_records)}))
        final_path.unlink(missing_ok=True)
        _announce_drops(cfg, pd, log)
    logs = RunLogs(run_dir, rollouts=cfg.log.rollouts, tokenizer=tok, suffix=f".p{pi}" if pi else "")
    iterator = data_mod.make_iterator(pd)
    saved_logs = restored.ledger.header.get("logs") if restored else None
    cut = logs.cut_to(saved_logs, warn=lambda m: log(f"warning: {m}"))
    if restored is not None:
        iterator.set_state(restored.iterator_state)
        ledger = Ledger.from_snapshot(restored.ledger)
        state, step = restored.state, restored.step
        log(_resume_line(restored, ledger, cut))
    else:
        ledger = Ledger(G)
        state, step = learner.init_state(learner.init_params()), 0
    ref_params = learner.init_params() if learner.use_ref else None

    sink = MetricsSink(run_dir, tensorboard=cfg.log.tensorboard and primary,
                       progress=cfg.log.progress and primary and sys.stderr.isatty(), every=cfg.log.every_steps,
                       total_steps=_total_steps(cfg, pd), start_step=step, console=log,
                       name="metrics.jsonl" if primary else f"metrics.p{pi}.jsonl")
    sink.jsonl.truncate(int(saved_logs.get("metrics_bytes", 0)) if saved_logs else 0)

    def on_filtered(groups, s):  # sampler, main thread, under the ledger lock
        ledger.drop(groups, "zero_variance")
        logs.filtered(s, groups)

    sampler = make_sampler(cfg, ledger, Hooks(on_filtered=on_filtered, on_regenerated=lambda g, s: logs.regenerated(s, g)),
                           groups_per_step=local_pps)
    params_e = engine.load_params(learner.publishable(state["params"]))
    engine.update_params(params_e, step)
    pump = Pump(ledger=ledger, sampler=sampler, engine=engine, iterator=iterator, tokenizer=tok,
                reward_fn=reward_fn, max_new_tokens=cfg.rollout.max_new_tokens, params=params_e, version=step,
                partial=cfg.rollout.partial, deterministic=cfg.run.determinism, log=log)
    signals = _Signals(log)
    signals.install()
    # The pump thread is mostly Python between engine calls; a shorter GIL switch interval
    # keeps it from starving Orbax's commit thread (measured: commit 5.4 s -> 2.1 s).
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    history: list[dict] = []
    t_start = time.perf_counter()
    wait_s, tokens0, t_prev, last_saved = 0.0, 0, t_start, (restored.step if restored else -1)
    wait0, pump_idle0 = 0.0, 0.0
    clock = StepClock()
    pending = None  # (step, device metrics, host metrics) of the step before the one in flight
    reason = "max_steps"

    def flush_metrics():
        nonlocal pending
        if pending is None:
            return
        s, dev, host = pending
        row = {k: float(v) for k, v in jax.device_get(dev).items()}
        row.update(host)
        history.append({"step": s, **row})
        sink.write(s, row)
        pending = None

    def save(s: int):
        nonlocal last_saved
        flush_metrics()
        if cfg.run.determinism:
            pump.pause_for_cut(s, should_stop=lambda: pump.error is not None)
        with ledger.lock:  # I2: iterator state, ledger and log sizes at one instant
            it_state = pump.iterator_state()
            cut = ledger.capture()
            cut.counters["logs"] = {**logs.sizes(), "metrics_bytes": sink.jsonl.tell()}
        if pump.error is not None:
            raise pump.error
        meta = {"step": s, "version": s, "data_stream": C.data_stream(cfg), "config": C.to_dict(cfg),
                "processes": pc, "seed": cfg.run.seed, "time": time.time()}
        ckpt.save(s, state, it_state, cut, meta)
        if cfg.run.determinism:
            pump.resume()
        last_saved = s
        return ckpt.last_blocking_s

    local_stop = lambda: signals.received is not None or pump.error is not None
    # one process cannot leave a step the others enter: with several, stop only at step boundaries
    should_stop = local_stop if pc == 1 else (lambda: pump.error is not None)
    pump.start()
    try:
        while cfg.train.max_steps == 0 or step < cfg.train.max_steps:
            flags = sharding.agree([local_stop(), sampler.finished(step)])
            if flags[:, 0].any():
                break
            if flags[:, 1].all():
                reason = "data_exhausted"
                break
            t0 = time.perf_counter()
            try:
                groups = sampler.next_batch(step + 1, should_stop=should_stop)
            except Stopped:
                break
            wait_s += time.perf_counter() - t0
            if groups is None:
                if pc == 1:
                    reason = "data_exhausted"
                    break
                groups = []  # this shard is done; the others still train, this process joins with no rows
            rows = [Row(g.prompt_tokens, s.tokens, s.logprobs, s.versions, s.reward)
                    for g in groups for s in g.samples]
            batch = build_batch(rows, n_rows=local_pps * G, prompt_len=cfg.engine.max_prompt_len,
                                max_new=cfg.rollout.max_new_tokens, pad_id=tok.pad_id,
                                bucket_min=cfg.learner.bucket_min)
            if sharding.agree([len(groups)]).sum() > 0:
                state, dev_metrics = learner.step(state, batch, ref_params)
                clock.dispatched(step + 1, dev_metrics)
            else:  # every group of the step was filtered: the weights stay as they are
                dev_metrics = {}
            step += 1
            # publish before the groups leave the ledger: a gate that counts buffered groups
            # (fifo) must not let the pump start new work on the old weights in between
            pump.publish(step, engine.load_params(learner.publishable(state["params"])))
            with ledger.lock:
                ledger.commit(groups)
                logs.trained(step, groups)
            faults.point("step", step)
            faults.delay("step")
            flush_metrics()
            now = time.perf_counter()
            host = _host_metrics(batch, step, groups, ledger, now - t_prev)
            host.update({"perf/tokens_per_s": (pump.stats.tokens - tokens0) / max(now - t_prev, 1e-9),
                         "perf/learner_wait_s": wait_s - wait0,
                         "perf/pump_idle_frac": (pump.stats.idle_s - pump_idle0) / max(now - t_prev, 1e-9)})
            idle = clock.idle_fraction(step)
            if idle is not None:
                host["perf/learner_idle_frac"] = idle
            tokens0, t_prev, wait0, pump_idle0 = pump.stats.tokens, now, wait_s, pump.stats.idle_s
            pending = (step, dev_metrics, host)
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                host["ckpt/save_blocking_s"] = save(step)
        if reason != "data_exhausted" and sharding.agree([sampler.finished(step)]).all():
            reason = "data_exhausted"
        if pump.error is not None:
            raise pump.error
        if signals.received:
            reason = "signal"
        flush_metrics()
        if last_saved != step:
            save(step)
        ckpt.wait()
    finally:
        pump.stop()
        clock.close()
        signals.restore()
        sys.setswitchinterval(switch)
        sink.close()
        ckpt.close()
        logs.close()

    fp = params_fingerprint(learner.publishable(state["params"]) if pc > 1 else state["params"])
    with ledger.lock:
        open_epochs = {g.epoch for g in ledger.groups.values()}
        next_epoch = ledger.next_ordinal // max(pd.records_per_epoch, 1)
        local_done = [e not in open_epochs and (ledger.exhausted or e < next_epoch) for e in range(cfg.data.num_epochs)]
    complete = [e for e, ok in enumerate(sharding.agree(local_done).all(axis=0)) if ok]
    exhausted = bool(sharding.agree([ledger.exhausted]).all())
    rewards_seen = [h["rollout/reward_mean"] for h in history if "rollout/reward_mean" in h]
    res = RunResult(step=step, exit_code=130 if signals.received == "SIGINT" else 0, reason=reason, fingerprint=fp,
                    reward_first=rewards_seen[0] if rewards_seen else None,
                    reward_last=float(np.mean(rewards_seen[-5:])) if rewards_seen else None, history=history)
    if primary:
        final_path.write_text(json.dumps({"step": step, "fingerprint": fp, "reason": reason, "exhausted": exhausted,
                                          "complete_epochs": complete}))
        log(f"params fingerprint: {fp}")
        if cfg.log.plot and plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png"):
            log(f"reward curve: {run_dir / 'reward.png'}")
        _report(cfg, res, history, time.perf_counter() - t_start, log)
    return res


def _prefixed(log, prefix: str):
    return lambda msg: log(prefix + msg)


def _host_metrics(batch, step: int, groups, ledger: Ledger, dt: float) -> dict:
    lag = (step - 1) - batch.versions_BxN[batch.mask_BxN & batch.row_valid_B[:, None]]
    counts = ledger.counts()
    m = {"perf/step_time_s": dt,
         "rollout/staleness_mean": float(lag.mean()) if lag.size else 0.0,
         "rollout/staleness_max": int(lag.max()) if lag.size else 0,
         "rollout/staleness_hist": np.bincount(lag).tolist() if lag.size else [],
         "data/groups": len(groups), "data/drawn": ledger.next_ordinal,
         "data/ledger_ready": counts["ready"], "data/ledger_generating": counts["generating"],
         "data/ledger_pending": counts["pending"],
         "data/regenerated": ledger.regenerated_groups,
         "perf/regen_tokens_per_1k": 1000.0 * ledger.regenerated_tokens / max(ledger.trained_tokens, 1)}
    if groups:
        m["data/epoch"] = max(g.epoch for g in groups)
    m.update({f"data/dropped/{k}": v for k, v in ledger.dropped.items()})
    return m


def _resume_line(restored, ledger: Ledger, cut: int) -> str:
    summ = restored.ledger.summary()
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
    if cfg.sampler.name != "in_order":
        log(f"note: sampler.name={cfg.sampler.name}: READY groups older than sampler.max_staleness="
            f"{cfg.sampler.max_staleness} are regenerated (their rollouts discarded, logged in drops.jsonl); "
            "no prompt is dropped")


def _total_steps(cfg: Config, pd) -> int:
    per_epoch = len(pd.prompt_ids)
    data_steps = math.ceil(per_epoch * cfg.data.num_epochs / cfg.rollout.prompts_per_step)
    return min(cfg.train.max_steps, data_steps) if cfg.train.max_steps else data_steps


def _report(cfg: Config, res: RunResult, history: list[dict], wall: float, log) -> None:
    if not history:
        log(f"stopped at step {res.step} ({res.reason}); no step trained in this process")
        return
    target = cfg.train.reward_target
    hit = next((h for h in history if h.get("rollout/reward_mean", 0) >= target), None)
    msg = (f"done: step {res.step} ({res.reason}) in {wall:.0f}s; mean reward {res.reward_first:.3f} -> "
           f"{res.reward_last:.3f} (last 5 steps)")
    if hit is not None:
        msg += f"; reached {target} at step {hit['step']}"
    else:
        msg += f"; did not reach {target}"
    log(msg)
