"""Generation wasted by SIGKILLs, with and without the rollout journal.

Owns: running one job three ways and the printed table. Does not own: any trainer logic
(it drives `python -m async_rl train` and reads what the runs write).

The job: the tiny preset (GRPO on digit reversal, 16384 prompts, 512 steps) with
`checkpoint.every_steps=20`. Runs:
  1. uninterrupted (journal on, the default);
  2. K SIGKILLs at random moments, journal on; the run is restarted after each and finishes;
  3. the same kills with `journal.enabled=false`.
Each kill is a real SIGKILL the training process sends itself after its n-th engine call
(`ASYNC_RL_KILL_AT=generate:<n>`, n drawn at random per session, the same draws for 2 and
3): a random moment in the generation stream, wherever the learner and the checkpoint
writer are. Before dying the process prints how many tokens it generated and how many its
ledger holds in unfinished samples ("in flight": what no journal keeps); the next session
restores the last committed checkpoint, whose ledger keeps the unfinished samples of its cut.

Counts: tokens generated = the sum over sessions (a killed one from that line, the last one
from `rollout/generated_tokens`); tokens trained = the final checkpoint's `trained_tokens`;
tokens generated again = generated - trained (in_order trains every generated token of an
uninterrupted run, so that row reads 0: a check of the accounting); in flight = the tokens
of unfinished samples in the ledger at each kill (counted in "generated" already, part of what
is generated again); kept = the unfinished samples' tokens in the checkpoint each resumed
session restores (continued, not generated again). Wall = the sum of every
session's wall time, restarts included (a short warm-up run fills the compilation cache
first, so no run pays compilation). Journal cost = `perf/journal_write_frac` of the
uninterrupted run: time the pump thread spends encoding and queueing records over its time
in engine calls (the write and fdatasync run on the journal's own threads).

    python bench/crash_waste.py                  # K=3 kills, seed 0
    python bench/crash_waste.py --kills 4 --seed 1 --records 8192
    python bench/crash_waste.py --records 1024 --every 5 --kills 2 --steps-per-call 2   # minutes
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from async_rl import config as C  # noqa: E402
from async_rl.state.layout import committed_steps  # noqa: E402

FAULT = re.compile(r"fault: SIGKILL at generate:(\d+) generated_tokens=(\d+) in_flight_tokens=(\d+)")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--records", type=int, default=16384, help="data.num_records (steps = records / 32)")
    ap.add_argument("--kills", type=int, default=3, help="SIGKILLs per killed run")
    ap.add_argument("--every", type=int, default=20, help="checkpoint.every_steps")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    ap.add_argument("--min-frac", type=float, default=0.08, help="a session is killed after at least this "
                                                                 "fraction of the job's engine calls")
    ap.add_argument("--max-frac", type=float, default=0.25, help="... and at most this fraction")
    ap.add_argument("--steps-per-call", type=int, default=C.EngineConfig().steps_per_call,
                    help="engine.steps_per_call; below rollout.max_new_tokens (the tiny preset's 8) samples span "
                         "engine calls, so a kill finds unfinished ones in the ledger")
    ap.add_argument("--devices", type=int, default=1, help="forced CPU devices per run")
    ap.add_argument("--timeout", type=float, default=1800, help="per session, seconds")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    return ap.parse_args()


class Job:
    def __init__(self, args, root: Path):
        self.args, self.root = args, root
        self.cache = root / "xla"  # one compilation cache: restarts pay restore, not compilation
        self.env = common.forced_devices_env(args.devices)

    def argv(self, run_dir: Path, *extra: str) -> list[str]:
        return common.train_argv(self.args.config, [
            f"run.dir={run_dir}", f"run.compilation_cache={self.cache}", *common.QUIET,
            f"data.num_records={self.args.records}", f"checkpoint.every_steps={self.args.every}",
            f"engine.steps_per_call={self.args.steps_per_call}", *extra])

    def session(self, run_dir: Path, extra: list[str], kill_at: int | None) -> common.ChildRun:
        env = dict(self.env, ASYNC_RL_KILL_AT=f"generate:{kill_at}" if kill_at else "")
        run = common.run_child(self.argv(run_dir, *extra), env, timeout=self.args.timeout)
        if run.rc not in (0, -9):
            sys.exit(f"{run_dir.name}: exit {run.rc}\n{run.tail()}")
        return run

    def run(self, name: str, extra: list[str], kills: list[int]) -> dict:
        d = self.root / name
        out = {"name": name, "wall": 0.0, "generated": 0, "kills": 0, "in_flight": 0, "kept": 0, "sessions": 0,
               "start": []}
        for n in kills + [None]:
            r = self.session(d, extra, n)
            out["wall"] += r.wall_s
            out["sessions"] += 1
            first = r.first("step ")
            if first is not None:  # start-up: process start, imports, restore, cached compilation, first step
                out["start"].append(first[0] - r.t_spawn)
            hit = next((FAULT.search(l) for _, l in r.lines if FAULT.search(l)), None)
            if r.rc == -9 and hit:
                out["kills"] += 1
                out["generated"] += int(hit.group(2))
                out["in_flight"] += int(hit.group(3))
                kept = kept_tokens(d)
                out["kept"] += kept
                print(f"  {name}: killed after engine call {n} ({int(hit.group(2))} tokens generated, "
                      f"{int(hit.group(3))} in flight in the ledger, {kept} kept by the checkpoint the resume "
                      f"restores), {r.wall_s:.1f}s", flush=True)
                continue
            if r.rc == -9:
                sys.exit(f"{name}: killed without the fault line\n{r.tail()}")
            rows = common.read_jsonl(d / "metrics.jsonl")
            out["generated"] += int(rows[-1]["rollout/generated_tokens"])
            out["last"] = rows[-1]
            out["resumes"] = [l for _, l in r.lines if l.startswith(("resumed", "journal:"))]
            print(f"  {name}: finished at step {rows[-1]['step']}, {r.wall_s:.1f}s", flush=True)
            break
        from async_rl.state.checkpoint import Checkpointer
        _, shards = Checkpointer(d / "checkpoints", keep=1, async_save=False).read_ledgers(
            committed_steps(d / "checkpoints")[-1])
        out["trained"] = sum(int(sh.header["trained_tokens"]) for sh in shards)
        out["ledger_twice"] = out["generated"] - out["trained"]
        out["twice"] = out["ledger_twice"]
        audit = common.run_child([sys.executable, "-m", "async_rl", "audit", str(d)], self.env, timeout=300)
        out["audit"] = "ok" if audit.rc == 0 else f"FAIL ({audit.rc})"
        return out


def kept_tokens(run_dir: Path) -> int:
    """Tokens of unfinished samples in the ledger of the newest committed checkpoint: what the
    next session restores and continues instead of generating again."""
    from async_rl.state.checkpoint import Checkpointer
    steps = committed_steps(run_dir / "checkpoints")
    if not steps:
        return 0
    _, shards = Checkpointer(run_dir / "checkpoints", keep=1, async_save=False).read_ledgers(steps[-1])
    return sum(sh.summary()["kept_tokens"] for sh in shards)


def main() -> None:
    args = parse_args()
    root = Path(tempfile.mkdtemp(prefix="crash_waste_"))
    job = Job(args, root)
    print(f"job: {args.config}, data.num_records={args.records}, checkpoint.every_steps={args.every}; "
          f"{args.kills} SIGKILLs per killed run (seed {args.seed}); {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    # compile once first: every run then finds its programs in the persistent cache
    job.session(root / "warmup", [f"data.num_records={2 * 32}"], None)
    base = job.run("uninterrupted", [], [])
    steps = base["last"]["step"]
    slots = 64  # the preset's engine.max_concurrent_decodes
    k = args.steps_per_call  # tokens per slot per engine call
    calls = base["generated"] / (slots * k)  # roughly: the slots stay full
    rng = random.Random(args.seed)
    kills = [int(rng.uniform(args.min_frac, args.max_frac) * calls) for _ in range(args.kills)]
    print(f"  kill after engine calls {kills} of each session (~{calls / steps:.0f} calls per step)", flush=True)
    on = job.run("kills, journal on", [], kills)
    off = job.run("kills, journal off", ["journal.enabled=false"], kills)

    rows = []
    for r in (base, on, off):
        k = max(r["kills"], 1)
        extra_s = f"{(r['wall'] - base['wall']) / k:.1f}" if r["kills"] else "-"
        rows.append([r["name"], str(r["kills"]), f"{r['wall']:.1f}", f"{r['wall'] / base['wall']:.2f}x", extra_s,
                     f"{sum(r['start']) / max(len(r['start']), 1):.1f}",
                     str(r["generated"]), str(r["trained"]), str(r["twice"]), str(r["in_flight"]), str(r["kept"]),
                     f"{r['twice'] / k:.0f}" if r["kills"] else "-",
                     f"{r['in_flight'] / k:.0f}" if r["kills"] else "-",
                     str(r["last"].get("rollout/journal_samples", "-")), r["audit"]])
    common.print_table(["run", "kills", "wall s", "vs uninterrupted", "s per kill", "to 1st step s",
                        "tokens generated", "tokens trained",
                        "generated again", "in flight at kills", "kept by checkpoints",
                        "again per kill", "in flight per kill", "journal samples (last)",
                        "audit"], rows)
    frac = base["last"].get("perf/journal_write_frac")
    print(f"journal writes: {100 * frac:.2f}% of generation time (uninterrupted run, journal.fsync_every_s=1.0: "
          "reward-thread time encoding and queueing records / the pump's time in engine calls)")
    for r in (on, off):
        for line in r.get("resumes", []):
            print(f"  {r['name']}, last session: {line}")
    per_on, per_off = on["twice"] / max(on["kills"], 1), off["twice"] / max(off["kills"], 1)
    ratio = per_off / per_on if per_on > 0 else float("inf")
    print(f"redone per kill: {per_on:.0f} vs {per_off:.0f} tokens ({ratio:.1f}x fewer)")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"run directories: {root}")


if __name__ == "__main__":
    main()
