"""Run outputs for people: per-step metrics, TensorBoard, W&B, progress, the reward curve.

Owns: the per-step metrics sink (metrics.jsonl + TensorBoard + the rich progress bar +
console lines), the device-side step clock behind `perf/learner_idle_frac`, the host-side
per-step figures (throughput and idle from counters, ledger counts, staleness), and the
reward curve PNG. Does not own: the learner's device metrics, or the logs that prove
exactly-once (`lineage`, whose `JsonlLog` metrics.jsonl also uses so it follows the
checkpoint the same way).
"""

from __future__ import annotations

import io
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from async_rl.state.lineage import JsonlLog, read_jsonl
from async_rl.store import runfiles, storage


class StepClock:
    """When each dispatched learner step finished on its devices.

    Steps are dispatched asynchronously, so the host's wait for a batch says little about
    the devices; a thread blocks on each step's outputs and stamps their completion. The
    learner was idle before step t for max(0, dispatch(t) - done(t - 1))."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._done: dict[int, float] = {}
        self._dispatch: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name="step-clock", daemon=True)
        self._thread.start()

    def dispatched(self, step: int, outputs) -> None:
        self._dispatch[step] = time.perf_counter()
        self._q.put((step, outputs))

    def _run(self) -> None:
        import jax
        while (item := self._q.get()) is not None:
            step, outputs = item
            jax.block_until_ready(outputs)
            self._done[step] = time.perf_counter()

    def idle_fraction(self, step: int) -> float | None:
        """Idle share of the interval between the dispatches of steps step-1 and step."""
        t, prev = self._dispatch.get(step), self._dispatch.get(step - 1)
        if t is None or prev is None or t <= prev:
            return None
        done = self._done.get(step - 1)
        return 0.0 if done is None else max(0.0, t - done) / (t - prev)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=60)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)



@dataclass
class Rates:
    """Per-step throughput and idle figures, from counters read at each step."""
    wait_s: float = 0.0  # the learner's total wait for batches
    _t: float = field(default_factory=time.perf_counter)
    _tokens: int = 0
    _wait: float = 0.0
    _idle: float = 0.0
    _swap: float = 0.0

    def take(self, stats, learner_idle: float | None) -> dict:
        now = time.perf_counter()
        dt = max(now - self._t, 1e-9)
        out = {"perf/step_time_s": dt, "perf/tokens_per_s": (stats.tokens - self._tokens) / dt,
               "perf/learner_wait_s": self.wait_s - self._wait, "perf/pump_idle_frac": (stats.idle_s - self._idle) / dt,
               "rollout/generated_tokens": stats.tokens, "perf/swap_s": stats.swap_s - self._swap}
        if learner_idle is not None:
            out["perf/learner_idle_frac"] = learner_idle
        if stats.env_submitted:  # multi-turn episodes: env steps asked for and recorded (cumulative)
            out["rollout/env_steps"], out["rollout/env_requested"] = stats.env_steps, stats.env_submitted
            out["rollout/env_observations_cut"] = stats.env_cut
        if getattr(stats, "dropped", 0):  # slot-chunks spent on samples that had ended in the chunk in flight (cumulative)
            out["rollout/dropped_slot_chunks"] = stats.dropped
        if getattr(stats, "evictions", 0):  # a paged engine: samples evicted or not admitted (cumulative)
            out["rollout/evictions"] = stats.evictions
        if getattr(stats, "moved", 0):  # a fleet or a paged engine: samples continued later or elsewhere (cumulative)
            out["rollout/samples_moved"] = stats.moved
        if getattr(stats, "prefix_cached", 0):  # vLLM: prompt tokens read from its prefix cache (cumulative)
            out["rollout/prefix_cached_tokens"] = stats.prefix_cached
        self._t, self._tokens, self._wait, self._idle = now, stats.tokens, self.wait_s, stats.idle_s
        self._swap = stats.swap_s
        return out


def host_metrics(batch, step: int, groups, ledger) -> dict:
    """The step's data/ and staleness figures from the batch and the ledger (under its lock)."""
    lag = (step - 1) - batch.versions_BxN[batch.mask_BxN & batch.row_valid_B[:, None]]
    with ledger.lock:  # the pump thread adds, resets and removes groups meanwhile
        counts = ledger.counts()
        m = {"data/groups": len(groups), "data/drawn": ledger.next_ordinal,
             "data/ledger_ready": counts["ready"], "data/ledger_generating": counts["generating"],
             "data/ledger_pending": counts["pending"], "data/regenerated": ledger.regenerated_groups,
             "perf/regen_tokens_per_1k": 1000.0 * ledger.regenerated_tokens / max(ledger.trained_tokens, 1)}
        m.update({f"data/dropped/{k}": v for k, v in ledger.dropped.items()})
    m.update({"rollout/staleness_mean": float(lag.mean()) if lag.size else 0.0,
              "rollout/staleness_max": int(lag.max()) if lag.size else 0,
              "rollout/staleness_hist": np.bincount(lag).tolist() if lag.size else []})
    if groups:
        m["data/epoch"] = max(g.epoch for g in groups)
    return m


class MetricsSink:
    """metrics.jsonl every step; TensorBoard and the console every `every` steps."""

    CONSOLE = ("rollout/reward_mean", "eval/accuracy", "learner/loss", "learner/entropy", "perf/tokens_per_s",
               "perf/learner_idle_frac", "rollout/staleness_mean", "learner/distill_reverse_kl")

    def __init__(self, run_dir: Path, *, tensorboard: bool, progress: bool, every: int, total_steps: int | None,
                 start_step: int, console=print, process: int = 0, wandb=None):
        self.jsonl = JsonlLog(runfiles.metrics(run_dir, process))
        self.wandb = wandb  # a wandb_log.WandbLog: every step W&B does not have yet
        self.every, self.console = every, console
        self.tb = None
        if tensorboard:
            from async_rl.obs.tensorboard import EventWriter  # written on this thread: a full disk raises, never hangs
            self.tb = EventWriter(run_dir / runfiles.TB, purge_step=start_step + 1)
        self.progress = None
        if progress:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TextColumn("reward {task.fields[reward]}"), TextColumn("{task.fields[tps]} tok/s"),
                                     TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                     transient=False, refresh_per_second=4, console=Console(stderr=True))
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, reward="-", tps="-")
            self.progress.start()

    def cut(self, nbytes: int) -> None:
        """Cuts metrics.jsonl back to the checkpoint's length; W&B gets the kept rows it lacks."""
        self.jsonl.truncate(nbytes)
        if self.wandb is not None:
            self.wandb.catch_up(read_jsonl(self.jsonl.path))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "time": round(time.time(), 3)}
        row.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()})
        self.jsonl.append([row])
        if self.wandb is not None:
            self.wandb.log(step, metrics)
        if self.progress is not None:
            self.progress.update(self.task, completed=step, reward=_fmt(metrics.get("rollout/reward_mean", "-")),
                                 tps=f"{metrics.get('perf/tokens_per_s', 0):.0f}")
        if step % self.every == 0:
            if self.tb is not None:
                self.tb.add_scalars({k: v for k, v in metrics.items()
                                     if isinstance(v, (int, float)) and math.isfinite(v)}, step)
            if self.progress is None:
                self.console(f"step {step}: " + " ".join(f"{k.split('/')[-1]}={_fmt(metrics[k])}"
                                                         for k in self.CONSOLE if k in metrics))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
        self.jsonl.close()


def plot_rewards(all_rows: list[dict], out: Path) -> bool:
    """reward.png: mean reward per step (with a moving average) from metrics.jsonl's rows, and
    the held-out accuracy where the run evaluated; beside it, with learner.distill, the reverse KL
    to the teacher per step."""
    rows = [r for r in all_rows if r.get("rollout/reward_mean") is not None]
    evals = [r for r in all_rows if r.get("eval/accuracy") is not None]
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in rows]
    rew = [r["rollout/reward_mean"] for r in rows]
    k = max(1, len(rew) // 20)
    smooth = [sum(rew[max(0, i - k + 1):i + 1]) / len(rew[max(0, i - k + 1):i + 1]) for i in range(len(rew))]
    kl = [(r["step"], r["learner/distill_reverse_kl"]) for r in rows if "learner/distill_reverse_kl" in r]
    fig, axes = plt.subplots(1, 1 + bool(kl), figsize=(6 + 5 * bool(kl), 3.5), dpi=100, squeeze=False)
    ax = axes[0, 0]
    if kl:
        axes[0, 1].plot(*zip(*kl), color="tab:red")
        axes[0, 1].set(xlabel="learner step", ylabel="reverse KL to the teacher (nats/token)")
        axes[0, 1].grid(alpha=0.3)
    ax.plot(steps, rew, alpha=0.35, label="mean reward")
    ax.plot(steps, smooth, label=f"moving average ({k})")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", markersize=3,
                label="held-out accuracy")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward / accuracy" if evals else "reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    storage.write_atomic(out, buf.getvalue())  # a local file or an object: whole or absent
    return True
