"""Helpers shared by the bench scripts: training subprocesses, run outputs, tables.

Owns: launching `python -m async_rl train` (or a bench child mode) with a forced host
device count, timestamping its stderr lines as they arrive, reading metrics.jsonl,
turning the trainer's cumulative per-step fractions into per-interval (steady-state)
values, and printing plain-text tables. Does not own: any trainer logic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Quiet, file-light runs: no progress bar, TensorBoard or plot; nothing that a bench
# would time by accident.
QUIET = ["log.progress=false", "log.tensorboard=false", "log.plot=false"]


def forced_devices_env(n: int, base: dict | None = None) -> dict:
    """Environment for a child process that sees `n` CPU devices (XLA_FLAGS is read once,
    when jax initialises its backends, so it has to be set before the child starts)."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if n > 1:
        flags.append(f"--xla_force_host_platform_device_count={n}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class ChildRun:
    argv: list[str]
    rc: int
    t_spawn: float  # time.time() just before the child was started
    wall_s: float
    lines: list[tuple[float, str]] = field(default_factory=list)  # (time.time() when read, stderr line)
    stdout: str = ""

    def first(self, prefix: str) -> tuple[float, str] | None:
        return next(((t, l) for t, l in self.lines if l.startswith(prefix)), None)

    def tail(self, n: int = 15) -> str:
        return "\n".join(l for _, l in self.lines[-n:])


def run_child(argv: list[str], env: dict, timeout: float, echo: bool = False) -> ChildRun:
    """Runs argv; each stderr line is stamped with the wall clock when it arrives (the
    child flushes every line), so the parent can time 'resumed ...' and 'step N: ...'."""
    lines: list[tuple[float, str]] = []
    t_spawn = time.time()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1)
    out: list[str] = []
    t_out = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    t_out.start()

    def pump_err():
        for line in proc.stderr:
            lines.append((time.time(), line.rstrip("\n")))
            if echo:
                print("    | " + line.rstrip("\n"), file=sys.stderr, flush=True)

    t_err = threading.Thread(target=pump_err, daemon=True)
    t_err.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    t_err.join(5)
    t_out.join(5)
    return ChildRun(argv=argv, rc=rc, t_spawn=t_spawn, wall_s=time.time() - t_spawn, lines=lines,
                    stdout="".join(out))


def train_argv(config: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "async_rl", "train", "--config", config, *overrides]


def read_jsonl(path: Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()]


def with_elapsed(rows: list[dict]) -> list[dict]:
    """Adds `_elapsed`: seconds from the learner loop's start to the end of each step.

    The trainer sets t_prev = t_start before the loop and step_time_s = now - t_prev, so
    the running sum of perf/step_time_s is exactly `now - t_start`, the denominator of
    perf/learner_idle_frac (and, up to the few ms between building the pump and entering
    the loop, of perf/pump_idle_frac). Works for a run that started fresh in one process."""
    out, acc = [], 0.0
    for r in sorted(rows, key=lambda r: r["step"]):
        acc += float(r.get("perf/step_time_s", 0.0))  # an evaluation's own row (step 0: before any) adds none
        out.append(dict(r, _elapsed=acc))
    return out


def interval_fraction(rows: list[dict], key: str, lo: int, hi: int) -> float | None:
    """Steady-state value of a per-step fraction metric over steps (lo, hi].

    perf/learner_idle_frac and perf/pump_idle_frac are logged per step (over the interval
    since the step before); weighting each by its step's perf/step_time_s gives the
    fraction of the window's wall time."""
    num = den = 0.0
    for r in rows:
        if lo < r["step"] <= hi and r.get(key) is not None and r.get("perf/step_time_s"):
            num += r[key] * r["perf/step_time_s"]
            den += r["perf/step_time_s"]
    return num / den if den > 0 else None


def fmt(v, spec: str = ".2f", none: str = "-") -> str:
    if v is None:
        return none
    return format(v, spec)


def print_table(headers: list[str], rows: list[list[str]], align: str | None = None) -> None:
    """A plain grid; `align` is one char per column, '<' or '>' (default: first left, rest right)."""
    align = align or ("<" + ">" * (len(headers) - 1))
    w = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    line = "+" + "+".join("-" * (x + 2) for x in w) + "+"
    print(line)
    print("|" + "|".join(f" {h:<{x}} " for h, x in zip(headers, w)) + "|")
    print(line)
    for r in rows:
        print("|" + "|".join(f" {str(c):{a}{x}} " for c, a, x in zip(r, align, w)) + "|")
    print(line)
