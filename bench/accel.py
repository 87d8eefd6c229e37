"""Every benchmark in one command, sized for one accelerator host (`make bench-accel`).

Owns: the list of benchmark runs and their arguments per mode, running each as a child
process under a time limit, skipping the ones whose packages this host lacks (with the
reason), and writing each table to a file. Does not own: any measurement (the bench
scripts do that).

It prints the chip first. It runs with whatever JAX the host has (e.g. a GPU image's own
jax 0.11 with jax-cuda plugins): the repository goes on PYTHONPATH, nothing is installed.
Training benchmarks (async, checkpoint) need grain and tensorboardX; load needs psutil;
engine-vllm (the built-in engine vs vLLM, last) needs vllm, and up to 4 more minutes.

    python bench/accel.py                  # accelerator sizes (0.5B learner MFU vs the chip's peak, and
                                           # `async-rl plan`'s estimate for that step), < 8 min
                                           # (< 12 with vllm)
    python bench/accel.py --quick          # tiny sizes: proves every part runs (CPU)
    python bench/accel.py --out runs/bench-accel --only learner-0.5b,engine
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (name, script, accelerator args, quick args, modules needed, seconds allowed)
RUNS = [
    ("learner-0.5b", "learner.py",
     ["--config", "configs/plan/qwen2.5-0.5b.yaml", "--vocab", "151936", "--dtype", "preset", "--prompts", "8",
      "--samples", "8", "--prompt-len", "512", "--new-tokens", "1536", "--peak", "spec", "--peak-n", "8192",
      "--steps", "5", "--target", "0.40", "--plan"],
     ["--config", "configs/plan/qwen2.5-0.5b.yaml", "--vocab", "512", "--prompts", "1", "--samples", "4",
      "--prompt-len", "8", "--new-tokens", "8", "--steps", "2", "--peak-n", "512", "model.n_layers=2",
      "model.d_model=128", "model.d_ff=256", "model.n_heads=2", "model.n_kv_heads=1", "learner.micro_batch_rows=0",
      "--plan"],
     (), 300),
    ("learner-small", "learner.py", ["--dtype", "bfloat16", "--peak-n", "8192", "--prompts", "16", "--samples", "8"],
     ["--prompts", "1", "--samples", "2", "--prompt-len", "8", "--new-tokens", "8", "--steps", "2", "--peak-n", "512"],
     (), 150),
    ("engine", "engine.py", ["--parts", "fair,recompute", "--dtype", "bfloat16", "--sequences", "256",
                             "--new-tokens", "256"],
     ["--parts", "fair,recompute", "--sequences", "4", "--new-tokens", "8", "--naive-steps", "1"], (), 120),
    ("engine-0.5b-roofline", "engine.py",
     ["--parts", "roofline", "--config", "configs/plan/qwen2.5-0.5b.yaml", "--vocab", "151936", "--dtype",
      "bfloat16", "--sequences", "256", "--prompt-len", "512", "--new-tokens", "1536", "--repeats", "1"],
     ["--parts", "roofline", "--config", "configs/plan/qwen2.5-0.5b.yaml", "--vocab", "512", "--sequences", "4",
      "--prompt-len", "8", "--new-tokens", "9", "--repeats", "1", "--hbm-gbps", "50"], (), 300),
    ("load", "load.py", [], [], ("psutil",), 120),
    ("async", "async.py", ["--scenarios", "keeps_up", "--steps", "12", "--warmup", "4", "--repeats", "1"],
     ["--scenarios", "keeps_up", "--lookaheads", "1", "--steps", "4", "--warmup", "1", "--repeats", "1"],
     ("grain", "tensorboardX"), 150),
    ("checkpoint", "checkpoint.py", ["--parts", "save,ledger", "--ledger-groups", "1000,10000", "--saves", "2"],
     ["--parts", "ledger", "--ledger-groups", "100", "--reps", "1"], ("grain", "tensorboardX"), 120),
    ("engine-vllm", "engine.py", ["--parts", "fair", "--backend", "builtin,vllm", "--dtype", "bfloat16", "--sequences",
                                  "256", "--new-tokens", "256"],
     ["--parts", "fair", "--backend", "builtin,vllm", "--sequences", "4", "--new-tokens", "8", "--samples", "2",
      "--waves", "1", "--repeats", "1"], ("vllm",), 240),
]


def chip_line() -> str:
    import jax
    devs = jax.devices()
    return (f"chip: {devs[0].device_kind} x {len(devs)} ({jax.default_backend()}), jax {jax.__version__}, "
            f"python {sys.version.split()[0]}, {os.cpu_count()} host CPUs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU run that proves every part executes)")
    ap.add_argument("--out", default="runs/bench-accel", help="directory for one .txt table per benchmark")
    ap.add_argument("--only", default="", help="comma list of benchmark names (default: all)")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds for the whole run, later runs are skipped; 0 = 450, plus engine-vllm's allowance "
                         "where vllm is installed")
    args = ap.parse_args()
    has_vllm = importlib.util.find_spec("vllm") is not None
    args.budget = args.budget or 450.0 + sum(r[5] for r in RUNS if "vllm" in r[4] and has_vllm)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = chip_line()
    print(head, flush=True)
    (out / "chip.txt").write_text(head + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    only = set(filter(None, args.only.split(",")))
    t_start, summary = time.perf_counter(), []
    for name, script, accel, quick, needs, limit in RUNS:
        if only and name not in only:
            continue
        missing = [m for m in needs if importlib.util.find_spec(m) is None]
        left = args.budget - (time.perf_counter() - t_start)
        if missing:
            summary.append((name, f"skipped: needs {', '.join(missing)}"))
            continue
        if left < 30:
            summary.append((name, "skipped: time budget spent"))
            continue
        argv = [sys.executable, str(REPO / "bench" / script), *(quick if args.quick else accel)]
        print(f"\n== {name}: {' '.join(argv[1:])}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=min(limit, left))
            text, verdict = proc.stdout + proc.stderr, f"exit {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            text, verdict = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timed out"
        dt = time.perf_counter() - t0
        (out / f"{name}.txt").write_text(text)
        tail = [l for l in text.splitlines() if l.strip()][-14:]
        print("\n".join(tail), flush=True)
        summary.append((name, f"{verdict} in {dt:.0f} s"))
    print(f"\n{head}\ntotal {time.perf_counter() - t_start:.0f} s; tables in {out}/")
    for name, what in summary:
        print(f"  {name:<14} {what}")
    return 0 if all(w.startswith(("exit 0", "skipped")) for _, w in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
