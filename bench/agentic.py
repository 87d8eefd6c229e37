"""Multi-turn episodes: is env latency hidden behind generation, and what does a SIGKILL cost?

Owns: the bench env (`slow_recall`: the recall task's tool, two tool turns per episode, each
step an `async def` that sleeps `ASYNC_RL_BENCH_ENV_MS`), the runs and the printed tables.
Does not own: any trainer logic (it drives `python -m async_rl train` and reads what the runs
write).

1. Throughput, side by side in one invocation: the same job (configs/tiny-tools.yaml's model,
   `rollout.env=agentic:slow_recall`, 64 slots) with env steps taking 0 ms and 200 ms. Figures
   are medians over the steps after the warm-up: generated policy tokens per second of the
   training loop (`perf/tokens_per_s`) and env steps per second. Baseline: the 0 ms run.
2. Kills: the 0 ms job SIGKILLed K times at random env requests (`ASYNC_RL_KILL_AT=env_submit:<n>`),
   restarted after each, run to the end. From `env_requests*.jsonl` (every request, in order,
   never cut back): steps asked again (the same key twice) per kill, against what restarting
   every unfinished episode from scratch would ask again: at each kill, every step already asked
   of an episode that had not finished.

    python bench/agentic.py                      # 200 ms vs 0 ms, 3 kills
    python bench/agentic.py --latency-ms 100 --kills 4 --records 4096
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from async_rl.data.tool_tasks import lookup_value  # noqa: E402

TURNS = 3  # two tool turns, then the answer


class SlowRecall:
    """The recall tool behind a latency: answers the first two replies with the value."""
    max_turns = TURNS

    def __init__(self):
        self.delay = float(os.environ.get("ASYNC_RL_BENCH_ENV_MS", "0")) / 1000

    async def step(self, key, messages, state):
        if self.delay:
            await asyncio.sleep(self.delay)
        if key.turn + 1 >= TURNS:
            return {"observation": None, "done": True, "state": state}
        return {"observation": f"{lookup_value(0, messages[0]['content'].rstrip('='))}=", "done": False,
                "state": {"calls": key.turn + 1}}


def slow_recall():
    return SlowRecall()


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--latency-ms", type=float, default=200, help="env step latency of the second run")
    ap.add_argument("--records", type=int, default=2048, help="data.num_records (steps = records / 32)")
    ap.add_argument("--lookahead", type=int, default=2, help="sampler.max_lookahead: steps of groups in progress")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1200, help="per session, seconds")
    return ap.parse_args()


def argv(run_dir: Path, cache: Path, records: int, lookahead: int, *extra: str) -> list[str]:
    return common.train_argv("configs/tiny-tools.yaml", [
        f"run.dir={run_dir}", f"run.compilation_cache={cache}", *common.QUIET, "eval.every_steps=0",
        f"data.num_records={records}", "train.max_steps=0", "rollout.env=agentic:slow_recall",
        "rollout.max_new_tokens=20", "rollout.turn_max_tokens=3", "model.learned_positions=28",
        "rollout.env_max_concurrent=256", "checkpoint.every_steps=10", f"sampler.max_lookahead={lookahead}", *extra])


def child_env(latency_ms: float, kill_at: str = "") -> dict:
    env = common.forced_devices_env(1)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO / "bench"), env.get("PYTHONPATH")) if p)
    env["ASYNC_RL_BENCH_ENV_MS"] = str(latency_ms)
    env["ASYNC_RL_KILL_AT"] = kill_at
    return env


def throughput(run_dir: Path) -> tuple[float, float, int]:
    rows = common.read_jsonl(run_dir / "metrics.jsonl")
    rows = rows[len(rows) // 4:]  # after the warm-up (compilation, the first steps' ramp)
    toks = statistics.median(r["perf/tokens_per_s"] for r in rows)
    steps = [(b["rollout/env_steps"] - a["rollout/env_steps"]) / b["perf/step_time_s"] for a, b in zip(rows, rows[1:])]
    return toks, statistics.median(steps), len(rows)


def requests(run_dir: Path) -> list[str]:
    return [r["key"] for p in sorted(run_dir.glob("env_requests*.jsonl")) for r in common.read_jsonl(p)]


def from_scratch(chunks: list[list[str]]) -> int:
    """Steps a restart of every unfinished episode would ask again: at the end of each killed
    session, every step asked so far of an episode without its last step."""
    asked: dict[str, set] = {}
    done: set = set()
    redo = 0
    for chunk in chunks[:-1]:
        for key in chunk:
            episode, turn = key.rsplit("/", 1)
            asked.setdefault(episode, set()).add(int(turn))
            if int(turn) == TURNS - 1:
                done.add(episode)
        redo += sum(len(t) for e, t in asked.items() if e not in done)
    return redo


def main() -> int:
    args = parse_args()
    root = Path(tempfile.mkdtemp(prefix="agentic_bench_"))
    cache = root / "xla"
    try:
        warm = common.run_child(argv(root / "warm", cache, 256, args.lookahead), child_env(0), args.timeout)
        if warm.rc != 0:
            print(warm.tail(), file=sys.stderr)
            return 1
        rows = []
        for ms in (0.0, args.latency_ms):
            run = root / f"lat{int(ms)}"
            r = common.run_child(argv(run, cache, args.records, args.lookahead), child_env(ms), args.timeout)
            if r.rc != 0:
                print(r.tail(), file=sys.stderr)
                return 1
            rows.append((ms, *throughput(run)))
        base = rows[0][1]
        print(f"env latency hidden behind generation (configs/tiny-tools.yaml model, 64 slots, {args.records} prompts "
              f"x 8 samples, {TURNS} env steps per episode, lookahead {args.lookahead}; baseline: the same job with 0 ms env steps)")
        common.print_table(["env step", "tokens/s", "env steps/s", "steps measured", "vs 0 ms"],
                           [[f"{ms:g} ms", f"{t:.0f}", f"{s:.0f}", str(n), f"{t / base:.2f}x"] for ms, t, s, n in rows])

        rng, run, chunks, delivered = random.Random(args.seed), root / "killed", [], 0
        total_steps = args.records * 8 * TURNS
        for _ in range(args.kills):
            n = rng.randint(total_steps // (4 * args.kills), total_steps // (2 * args.kills))
            before = len(requests(run)) if run.exists() else 0
            r = common.run_child(argv(run, cache, args.records, args.lookahead), child_env(0, f"env_submit:{n}"), args.timeout)
            delivered += r.rc == -9
            chunks.append(requests(run)[before:])
        before = len(requests(run))
        r = common.run_child(argv(run, cache, args.records, args.lookahead), child_env(0), args.timeout)
        if r.rc != 0:
            print(r.tail(), file=sys.stderr)
            return 1
        keys = requests(run)
        chunks.append(keys[before:])
        again = sum(Counter(keys).values()) - len(set(keys))
        scratch = from_scratch(chunks)
        print(f"\nenv steps asked again after SIGKILLs ({delivered} delivered, at random env requests; the run "
              "resumed each time and finished; baseline: restarting unfinished episodes from scratch)")
        common.print_table(["restart policy", "asked again", "per kill"],
                           [["async_rl (recorded steps kept)", str(again), f"{again / max(delivered, 1):.1f}"],
                            ["unfinished episodes from scratch", str(scratch), f"{scratch / max(delivered, 1):.1f}"]])
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
