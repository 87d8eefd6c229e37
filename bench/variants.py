"""Steps to mean reward 0.9 on the tiny job, one run per loss variant.

Each variant is the tiny job (configs/tiny.yaml) with a few learner.* overrides; a run
stops (SIGTERM: saves and exits) once a step's rollout/reward_mean reaches the target, or
at --max-steps. Prints one row per variant: the first step at the target (or '-'), the
best reward seen and the wall time. One run each: timing decides which weights generate
which samples, so a variant's step count varies between runs (README, tiny job range).

    python bench/variants.py [--only default,gspo] [--max-steps 256] [--target 0.9]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUIET, REPO, forced_devices_env, print_table, read_jsonl, train_argv  # noqa: E402

VARIANTS = {
    "default": [],  # GRPO: group mean/std advantages, token mean, symmetric clip, tis
    "clip_higher": ["learner.clip_eps_high=0.28"],  # DAPO clip-higher
    "seq_mean": ["learner.loss_agg=seq_mean"],
    "dr_grpo": ["learner.advantage=mean", "learner.loss_agg=token_sum_norm"],
    "gspo": ["learner.ratio_level=sequence", "learner.is_correction=seq_tis", "learner.loss_agg=seq_mean"],
    "rloo": ["learner.advantage=rloo"],
    "overlong_filter": ["learner.overlong=filter"],
    "overlong_penalty": ["learner.overlong=penalty", "learner.overlong_buffer=1"],
}


def run_variant(name: str, overrides: list[str], max_steps: int, target: float, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"variant-{name}-") as d:
        run_dir = Path(d)
        argv = train_argv("configs/tiny.yaml", [f"run.dir={run_dir}", *QUIET, "eval.every_steps=0",
                                                "checkpoint.every_steps=0", f"train.max_steps={max_steps}", *overrides])
        t0 = time.time()
        proc = subprocess.Popen(argv, cwd=REPO, env=forced_devices_env(1), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        hit = None
        try:
            while proc.poll() is None and time.time() - t0 < timeout:
                rows = read_jsonl(run_dir / "metrics.jsonl")
                hit = next((r["step"] for r in rows if (r.get("rollout/reward_mean") or 0) >= target), None)
                if hit is not None:
                    proc.send_signal(signal.SIGTERM)
                    break
                time.sleep(1.0)
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err = proc.stderr.read() if proc.stderr else ""
        rows = read_jsonl(run_dir / "metrics.jsonl")
        best = max((r.get("rollout/reward_mean") or 0 for r in rows), default=None)
        if hit is None:
            hit = next((r["step"] for r in rows if (r.get("rollout/reward_mean") or 0) >= target), None)
        return {"variant": name, "steps_to_target": hit, "steps_run": len(rows), "best_reward": best,
                "wall_s": round(time.time() - t0, 1), "rc": proc.returncode,
                "error": None if proc.returncode in (0, -signal.SIGTERM) else err[-500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--max-steps", type=int, default=256)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"--only: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        sys.exit(2)
    results = []
    for n in names:
        r = run_variant(n, VARIANTS[n], args.max_steps, args.target, args.timeout)
        print(json.dumps(r), file=sys.stderr, flush=True)
        results.append(r)
    print_table(["variant", "overrides", f"steps to {args.target}", "steps run", "best reward", "wall s"],
                [[r["variant"], " ".join(VARIANTS[r["variant"]]) or "(defaults)",
                  r["steps_to_target"] if r["steps_to_target"] is not None else "-", r["steps_run"],
                  f"{r['best_reward']:.3f}" if r["best_reward"] is not None else "-", r["wall_s"]] for r in results],
                align="<<>>>>")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if any(r["error"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
