"""On-policy distillation against GRPO on the same student: steps to held-out accuracy.

Trains a teacher with `--config` (the tiny job), then a fresh student of another width
(`--student`) twice from the same start: distilled from the teacher's run directory with no
reward (`learner.distill=reverse_kl rollout.reward=none`), and by GRPO on the task's reward
(the baseline a user would otherwise run). Prints, per run, the first evaluated step whose
held-out accuracy reached `--target`, the final accuracy and the wall time. Runs one at a time.

    .venv/bin/python bench/distill.py
    .venv/bin/python bench/distill.py --student model.d_model=32,model.d_ff=128
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUIET, fmt, forced_devices_env, print_table, read_jsonl, run_child, train_argv, with_elapsed  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--student", default="model.d_model=48,model.d_ff=192", help="overrides that make the student")
    ap.add_argument("--eval-every", type=int, default=16, help="eval.every_steps of the student runs")
    ap.add_argument("--target", type=float, default=0.9, help="held-out accuracy counted as reached")
    ap.add_argument("--out", default="", help="parent of the run directories (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    return ap.parse_args()


def train(args, run_dir: Path, overrides: list[str]) -> dict:
    child = run_child(train_argv(args.config, [*QUIET, f"run.dir={run_dir}", *overrides]), forced_devices_env(1),
                      timeout=args.timeout)
    if child.rc != 0:
        sys.exit(f"{run_dir.name}: exit {child.rc}\n{child.tail(10)}")
    rows = with_elapsed(read_jsonl(run_dir / "metrics.jsonl"))
    evals = [r for r in rows if "eval/accuracy" in r]
    hit = next((r for r in evals if r["eval/accuracy"] >= args.target), None)
    kl = [r["learner/distill_reverse_kl"] for r in rows if "learner/distill_reverse_kl" in r]
    return {"name": run_dir.name, "steps": rows[-1]["step"], "hit": hit["step"] if hit else None,
            "hit_s": hit["_elapsed"] if hit else None, "acc": evals[-1]["eval/accuracy"] if evals else None,
            "wall": rows[-1]["_elapsed"], "kl": (kl[0], kl[-1]) if kl else None}


def main() -> None:
    args = parse_args()
    parent = Path(args.out or tempfile.mkdtemp(prefix="distill-bench-"))
    student = [o for o in args.student.split(",") if o] + [f"eval.every_steps={args.eval_every}"]
    teacher = train(args, parent / "teacher", [])
    runs = [train(args, parent / "distill", [*student, "learner.distill=reverse_kl",
                                             f"learner.teacher={parent / 'teacher'}", "rollout.reward=none"]),
            train(args, parent / "grpo", student)]
    print(f"\nteacher: {args.config}, held-out accuracy {fmt(teacher['acc'], '.3f')} after {teacher['steps']} steps; "
          f"student: {args.student}; runs in {parent}")
    print_table(["run", f"step at accuracy >= {args.target}", "seconds to it", "final accuracy", "wall s",
                 "reverse KL first -> last"],
                [[r["name"], fmt(r["hit"], "d"), fmt(r["hit_s"], ".0f"), fmt(r["acc"], ".3f"), fmt(r["wall"], ".0f"),
                  f"{r['kl'][0]:.2f} -> {r['kl'][1]:.3f}" if r["kl"] else "-"] for r in runs])
    d, g = runs
    if d["hit"] and g["hit"]:
        print(f"distillation reached {args.target} in {d['hit'] / g['hit']:.2f}x the steps GRPO took (baseline: GRPO "
              "on the task's reward, same student and start)")


if __name__ == "__main__":
    main()
