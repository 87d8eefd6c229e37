"""On-policy distillation against GRPO on the same student: steps to held-out accuracy.

Trains a teacher with `--config` (the tiny job), then a fresh student of another width
(`--student`) twice from the same start: distilled from the teacher's run directory with no
reward (`learner.distill=reverse_kl rollout.reward=none`), and by GRPO on the task's reward
(the baseline a user would otherwise run). Prints, per run, the first evaluated step whose
held-out accuracy reached `--target`, the final accuracy and the wall time. Runs one at a time.

`--smollm2` (after `make real-model`): the teacher is `configs/smollm2-arith.yaml`'s RL job
(GRPO from SmolLM2-135M-Instruct), the student the same untrained model distilled with no
reward; the target is the teacher's final held-out accuracy less `--margin`, and the baseline is
the teacher's own RL run (the steps it took to reach the target). With `--out`, a teacher
that already finished there (`teacher/final.json`) is reused.

    .venv/bin/python bench/distill.py
    .venv/bin/python bench/distill.py --config configs/tiny-tools.yaml   # a multi-turn env with a tool
    .venv/bin/python bench/distill.py --smollm2
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
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M distilled from its own RL job's run")
    ap.add_argument("--margin", type=float, default=0.10, help="--smollm2: the target is the teacher's accuracy less this")
    args = ap.parse_args()
    if args.smollm2:
        args.config, args.student, args.eval_every = "configs/smollm2-arith.yaml", "", 5
    return args


def train(args, run_dir: Path, overrides: list[str]) -> dict:
    child = run_child(train_argv(args.config, [*QUIET, f"run.dir={run_dir}", *overrides]), forced_devices_env(1),
                      timeout=args.timeout)
    if child.rc != 0:
        sys.exit(f"{run_dir.name}: exit {child.rc}\n{child.tail(10)}")
    return summary(run_dir)


def summary(run_dir: Path) -> dict:
    rows = with_elapsed(read_jsonl(run_dir / "metrics.jsonl"))
    evals = [r for r in rows if "eval/accuracy" in r]
    kl = [r["learner/distill_reverse_kl"] for r in rows if "learner/distill_reverse_kl" in r]
    return {"name": run_dir.name, "steps": rows[-1]["step"], "evals": evals,
            "first": evals[0]["eval/accuracy"] if evals else None, "acc": evals[-1]["eval/accuracy"] if evals else None,
            "wall": rows[-1]["_elapsed"], "kl": (kl[0], kl[-1]) if kl else None}


def reached(run: dict, target: float) -> dict:
    """`run` with the first evaluated step (and its second) whose accuracy reached `target`."""
    hit = next((r for r in run["evals"] if r["eval/accuracy"] >= target), None)
    return {**run, "hit": hit["step"] if hit else None, "hit_s": hit["_elapsed"] if hit else None}


def main() -> None:
    args = parse_args()
    parent = Path(args.out or tempfile.mkdtemp(prefix="distill-bench-"))
    student = [o for o in args.student.split(",") if o] + [f"eval.every_steps={args.eval_every}"]
    if (parent / "teacher" / "final.json").exists():  # a teacher trained to its end there before: reused
        teacher = summary(parent / "teacher")
    else:
        teacher = train(args, parent / "teacher", [f"eval.every_steps={args.eval_every}"] if args.smollm2 else [])
    distill = train(args, parent / "distill", [*student, "learner.distill=reverse_kl",
                                               f"learner.teacher={parent / 'teacher'}", "rollout.reward=none"])
    if args.smollm2:  # the same model untrained: the teacher's own RL run is the baseline
        args.target = round(teacher["acc"] - args.margin, 3)
        runs, baseline = [distill, dict(teacher, name="GRPO (the teacher's RL run)")], "the RL job that made the teacher"
    else:
        runs, baseline = [distill, train(args, parent / "grpo", student)], "GRPO on the task's reward, same student and start"
    runs = [reached(r, args.target) for r in runs]
    print(f"\nteacher: {args.config}, held-out accuracy {fmt(teacher['first'], '.3f')} -> {fmt(teacher['acc'], '.3f')} "
          f"after {teacher['steps']} steps; student: {args.student or 'the same model, untrained'}; runs in {parent}")
    print_table(["run", f"step at accuracy >= {args.target}", "seconds to it", "accuracy first -> final", "wall s",
                 "reverse KL first -> last"],
                [[r["name"], fmt(r["hit"], "d"), fmt(r["hit_s"], ".0f"), f"{fmt(r['first'], '.3f')} -> {fmt(r['acc'], '.3f')}",
                  fmt(r["wall"], ".0f"), f"{r['kl'][0]:.2f} -> {r['kl'][1]:.3f}" if r["kl"] else "-"] for r in runs])
    d, g = runs
    if d["hit"] and g["hit"]:
        print(f"distillation reached {args.target} in {d['hit'] / g['hit']:.2f}x the steps of the baseline ({baseline})")


if __name__ == "__main__":
    main()
