"""What a run reports when it ends: its result, the closing summary lines, and peak memory."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from async_rl.config import Config
from async_rl.learner.step import params_fingerprint
from async_rl.model import sharding
from async_rl.obs.metrics import plot_rewards, read_jsonl
from async_rl.store import rundir, runfiles

if TYPE_CHECKING:
    from async_rl.run.build import Parts
    from async_rl.run.session import Session


@dataclass
class RunResult:
    step: int  # learner steps in the model's history
    exit_code: int  # 0 finished or stopped cleanly; 130 interrupted (saved)
    reason: str  # max_steps | data_exhausted | signal
    fingerprint: str
    reward_first: float | None = None
    reward_last: float | None = None
    history: list = field(default_factory=list)



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
