"""The default job (`make train`) over several seeds: held-out accuracy and time to the reward target.

Trains `--config` (configs/tiny.yaml) once per seed (`run.seed`), each in a run directory
of its own, then prints per seed: the final held-out accuracy, the training seconds and
step at which mean reward first reached `train.reward_target`, and the held-out accuracy
and mean completion length of the final weights per answer length (a policy that has not
learned to stop after some prompt lengths shows there as 0 with the full token budget).

    .venv/bin/python bench/heldout.py                  # seeds 0-4, one run at a time
    .venv/bin/python bench/heldout.py --seeds 0,1 --parallel 2 learner.lr=2e-3

Exit status 1 when a seed ends below `--min-accuracy` or never reaches the reward target
within `--max-seconds`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUIET, fmt, forced_devices_env, print_table, read_jsonl, run_child, train_argv, with_elapsed  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="config overrides group.field=value for every run")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated run.seed values")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time (each uses every core it gets)")
    ap.add_argument("--out", default="", help="parent of the run directories (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--min-accuracy", type=float, default=0.9)
    ap.add_argument("--max-seconds", type=float, default=60.0, help="training seconds allowed to the reward target")
    return ap.parse_args()


def train_one(args, seed: int, parent: Path) -> dict:
    run_dir = parent / f"seed{seed}"
    argv = train_argv(args.config, [*QUIET, f"run.seed={seed}", f"run.dir={run_dir}", *args.overrides])
    child = run_child(argv, forced_devices_env(1), timeout=args.timeout)
    rows = with_elapsed(read_jsonl(run_dir / "metrics.jsonl"))
    done = child.first("done:")
    out = {"seed": seed, "dir": run_dir, "rc": child.rc, "done": done[1] if done else child.tail(5)}
    evals = [r for r in rows if "eval/accuracy" in r]
    out["accuracy"] = evals[-1]["eval/accuracy"] if evals else None
    out["eval_step"] = evals[-1]["step"] if evals else None
    target = target_of(args)
    hit = next((r for r in rows if r.get("rollout/reward_mean", 0) >= target), None)
    out["target_step"], out["target_s"] = (hit["step"], hit["_elapsed"]) if hit else (None, None)
    out["train_s"] = rows[-1]["_elapsed"] if rows else None
    print(f"seed {seed}: {out['done']}", flush=True)
    return out


def target_of(args) -> float:
    from async_rl import config as C
    return C.load(args.config, args.overrides).train.reward_target


def by_length(run_dir: Path) -> dict[int, tuple[int, float, float]]:
    """Answer length -> (prompts, accuracy, mean completion tokens) of the run's newest step."""
    from async_rl.run.evaluate import open_eval
    # the run this script trained: its config's code is the caller's own
    _, ev, params = open_eval(run_dir, warn=lambda msg: print(msg, file=sys.stderr), trust_code=True)
    scores, n_tokens = ev.score(params)
    rows = defaultdict(list)
    for i, ans in enumerate(ev.set.answers):
        rows[len(ans)].append(i)
    out = {}
    for n, idx in sorted(rows.items()):
        m = ev.summarise(scores[idx], n_tokens[idx])
        out[n] = (len(idx), m["eval/accuracy"], m["eval/completion_tokens"])
    return out


def main() -> int:
    args = parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="heldout-")
    parent = Path(args.out or tmp.name).absolute()
    parent.mkdir(parents=True, exist_ok=True)
    try:
        with ThreadPoolExecutor(max(1, args.parallel)) as pool:
            results = list(pool.map(lambda s: train_one(args, s, parent), seeds))
        lengths = sorted({n for r in results if r["accuracy"] is not None for n in r.setdefault(
            "lengths", by_length(r["dir"]))})
        target = target_of(args)
        print(f"\n{args.config} {' '.join(args.overrides)}: held-out accuracy of the last eval; "
              f"training seconds and step where mean reward first reached {target}; per answer length: "
              "accuracy / mean completion tokens of the last step")
        headers = ["seed", "held-out acc", "step", f"s to {target}", f"step to {target}", "train s"] + [
            f"len {n}" for n in lengths]
        table = []
        for r in results:
            per = r.get("lengths", {})
            table.append([r["seed"], fmt(r["accuracy"], ".3f"), fmt(r["eval_step"], "d"), fmt(r["target_s"], ".0f"),
                          fmt(r["target_step"], "d"), fmt(r["train_s"], ".0f")]
                         + [f"{per[n][1]:.2f} / {per[n][2]:.1f}" if n in per else "-" for n in lengths])
        print_table(headers, table)
        accs = [r["accuracy"] for r in results]
        ok = all(a is not None and a >= args.min_accuracy for a in accs) and all(
            r["target_s"] is not None and r["target_s"] <= args.max_seconds for r in results)
        if all(a is not None for a in accs):
            print(f"held-out accuracy: min {min(accs):.3f}, mean {np.mean(accs):.3f} over seeds {args.seeds}")
        print(("ok" if ok else "FAIL") + f": every seed >= {args.min_accuracy} held-out accuracy and mean reward "
              f"{target} within {args.max_seconds:.0f} s of training")
        return 0 if ok else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
