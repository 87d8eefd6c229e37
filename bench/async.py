"""Asynchronous pipelining: steady-state learner steps/s vs how far generation may run ahead.

Owns: the scenarios, one training subprocess per (scenario, sampler, lookahead or
staleness) row, the steady-state arithmetic and the printed tables. Does not own: any
trainer logic. Each row is `python -m async_rl train` with the printed overrides, started
through this script's `--child` mode, which only observes: it records when each learner
step is dispatched and when its outputs are ready (a watcher thread blocks on them), so
the learner device's busy time can be measured; it changes nothing in the run.

Per row, over the steps after --warmup (compile and the first batches excluded) up to
the last step of the run:
  steps/s       (last - first) / (elapsed at last - elapsed at first); elapsed is the
                running sum of perf/step_time_s (the learner loop's perf_counter clock)
  idle_frac     the trainer's own perf/learner_idle_frac (per step: the gap between a
                step's completion and the next dispatch, over the dispatch interval),
                averaged over the window; a cross-check of the column before.
  learner idle  device idleness: 1 - (time the learner device spends on steps) / wall, where
                step t occupies [max(dispatch t, ready t-1), ready t] (from the child's
                watcher). This is the column the 'learner idle' target is judged on.
  step ms       mean of those per-step busy intervals (learner compute in the pipeline)
  pump idle     perf/pump_idle_frac over the window (no slot in use and nothing allowed to
                start; time blocked inside an engine call counts as busy)
  staleness     rollout/staleness_mean averaged, rollout/staleness_max maxed over the window
  regen/1k      regenerated tokens per 1k trained tokens over the window (from the cumulative
                perf/regen_tokens_per_1k and the per-step trained token counts; '-' when
                the run logs no such metric)

Scenarios (the exact command of every run is printed; hf_tiny only when asked, or with --backend vllm):
  balanced   the tiny preset with 32 engine slots (8 decode waves per step) on 2 forced
             CPU devices, engine on one and learner on the other (mesh.engine_devices=1):
             generating a step costs about as much as training one, so overlapping them is
             where speed comes from. Target: lookahead 1 >= 1.3x lookahead 0.
  keeps_up   a 2x wider, 2x deeper model than tiny with all 256 samples of a step decoded at
             once (256 slots, one wave): generation takes a small share of a learner step.
             Target: learner idle <= 10% at lookahead >= 1. The pump's generated tokens
             per second not idle ('gen tok/s', from rollout/generated_tokens and
             perf/pump_idle_frac) at L=1 against the trainer before the engine work
             (--baseline-rev c8fad11: its pump and engine, at its defaults, same run):
             target >= 2x. One more row at L=1 runs this tree at engine.steps_per_call=1
             (a host sync per token), an ablation: what multi-step decode alone adds.
  tiny       the tiny preset as it is, engine and learner on one forced CPU device each, at
             L=1 with the default engine.steps_per_call and with 1: the same pump
             tokens/s ratios as in keeps_up, where per-token host work weighs more.
  hf_tiny    the tiny shape as a Hugging Face checkpoint this script writes (2 heads of 32; no
             learned positions), loaded by every row: built-in rows at each lookahead and, with
             --backend builtin,vllm, vLLM rows (engine.backend=vllm) at the same lookaheads on
             the same checkpoint, prompts and settings; prints vllm vs builtin steps/s and pump
             generation tokens/s. No target: the comparison users would make.
  disjoint_sim  a SIMULATION of disjoint hardware (bench/pipeline_sim.py): engine and
             learner are simulated remote devices whose work is a wait that releases the
             GIL, around the real pump, ledger, sampler and publishing, in one process; they
             cannot contend for cores, so what is left is what the software serialises.
             Generating a step costs as much as a learner step (--sim-step-ms). Target:
             lookahead 1 >= 1.8x lookahead 0 (the limit is 2x).

    python bench/async.py                                   # every scenario, in_order 0,1,2
    python bench/async.py --scenarios disjoint_sim          # the simulation alone (about a minute)
    python bench/async.py --scenarios balanced --steps 60 --repeats 3
    python bench/async.py --samplers in_order,fifo --staleness 1,2
    python bench/async.py --scenarios keeps_up,tiny --lookaheads 1 --baseline-rev c8fad11  # vs an older trainer
    .venv-vllm/bin/python bench/async.py --backend builtin,vllm --lookaheads 0,1   # hf_tiny on both backends
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import backends  # noqa: E402
import common  # noqa: E402

SCENARIOS = {
    "balanced": {
        "devices": 2,
        "overrides": ["mesh.engine_devices=1", "engine.max_concurrent_decodes=32"],
        "about": "tiny preset, 32 engine slots; engine on 1 forced CPU device, learner on the other",
        "target": ("ratio", 1, 1.3),  # in_order lookahead 1 vs 0: steps/s ratio >= 1.3
    },
    "keeps_up": {
        "devices": 2,
        "overrides": ["mesh.engine_devices=1", "model.d_model=128", "model.n_layers=4", "model.d_ff=512",
                      "engine.max_concurrent_decodes=256"],
        "about": "model 2x wider and 2x deeper than tiny (d 128, 4 layers, ff 512), 256 engine slots; "
                 "engine on 1 forced CPU device, learner on the other",
        "target": ("learner_idle", 1, 0.10),  # learner device idle <= 10% at lookahead >= 1
        # the previous default, one token per engine call, beside the default at L=1: pump tokens/s ratio
        "variants": {"steps_per_call=1": (1, ["engine.steps_per_call=1"])},
    },
    "tiny": {
        "devices": 2,
        "overrides": ["mesh.engine_devices=1"],
        "about": "the tiny preset as it is (d 64, 2 layers, 64 engine slots); engine on 1 forced CPU device, "
                 "learner on the other",
        "target": None,  # only the steps_per_call comparison below
        "variants": {"steps_per_call=1": (1, ["engine.steps_per_call=1"])},
    },
    "hf_tiny": {
        "devices": 2,
        "overrides": ["mesh.engine_devices=1", "tokenizer.kind=char", "eval.every_steps=0"],
        "about": "a random model of the tiny shape (d 64, 2 layers, ff 256; 2 heads of 32, as vLLM's CPU attention "
                 "has no kernel for 16; no learned positions) written as a Hugging Face directory that every row "
                 "loads (model.hf_path); engine on 1 forced CPU device, learner on the other; with --backend "
                 "builtin,vllm the vLLM rows (engine.backend=vllm) run beside the built-in ones",
        "target": None,
        "hf": True,  # the rows load the checkpoint main() writes (write_hf_tiny)
    },
}
# Row knob per sampler: in_order bounds run-ahead in steps, the others staleness in versions.
KNOB = {"in_order": "sampler.max_lookahead", "fifo": "sampler.max_staleness", "windowed": "sampler.max_staleness"}
REGEN_KEY = "perf/regen_tokens_per_1k"  # cumulative: 1000 * regenerated / trained tokens since start
TRAINED_KEY = "rollout/completion_tokens"  # tokens trained in the step (0 or absent: all filtered)
TRACE = "bench_learner_trace.jsonl"
GEN_SPEEDUP_TARGET = 2.0  # keeps_up: pump tokens/s, this tree vs --baseline-rev (the trainer before the engine work)
SIM_TARGET = 1.8  # disjoint_sim: lookahead 1 vs 0 steps/s (the limit is 2x)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--config", default="configs/tiny.yaml", help="preset every scenario starts from")
    ap.add_argument("--scenarios", default="",
                    help=f"comma list of {', '.join(SCENARIOS)}, disjoint_sim (default: all but hf_tiny; with "
                         "--backend naming vllm: hf_tiny)")
    ap.add_argument("--backend", default="builtin",
                    help="hf_tiny: comma list of builtin, vllm (vllm needs the [vllm] extra: run this script "
                         "with .venv-vllm/bin/python)")
    ap.add_argument("--samplers", default="in_order", help="comma list of in_order, fifo, windowed")
    ap.add_argument("--lookaheads", default="0,1,2", help="in_order: sampler.max_lookahead values")
    ap.add_argument("--staleness", default="1,2", help="fifo/windowed: sampler.max_staleness values")
    ap.add_argument("--steps", type=int, default=30, help="learner steps per run (train.max_steps)")
    ap.add_argument("--warmup", type=int, default=6,
                    help="steps excluded from the steady-state window (compile, first batches)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per row, interleaved across rows; the table shows their mean (and the steps/s range)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override for every run (repeatable), e.g. --set rollout.max_new_tokens=16")
    ap.add_argument("--cache", default="",
                    help="persistent compilation cache shared by the runs (default: a fresh temp dir, so only the "
                         "first run of a shape compiles cold; compile is outside the window either way)")
    ap.add_argument("--keep", default="", help="keep run directories under this path (default: temp, deleted)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per training run before it is killed")
    ap.add_argument("--verbose", action="store_true", help="echo each run's stderr")
    ap.add_argument("--sim-step-ms", type=float, default=200.0,
                    help="disjoint_sim: simulated cost of a learner step, and of generating a step's samples")
    ap.add_argument("--sim-steps", type=int, default=20, help="disjoint_sim: steps per run")
    ap.add_argument("--baseline-rev", default="",
                    help="keeps_up and tiny: one more L=1 row running the trainer of this git revision (its "
                         "async_rl package, its defaults), e.g. the engine before multi-step decode: c8fad11")
    return ap.parse_args()


# ---- child: one observed training run --------------------------------------------------


def child(argv: list[str]) -> int:
    """`--child TRACE -- <async-rl CLI args>`: runs the CLI in this
    process with a watcher on learner steps; writes one line per step to TRACE."""
    sep = argv.index("--")
    opts, cli_args = argv[:sep], argv[sep + 1:]
    trace_path = Path(opts[0])
    import jax

    from async_rl.learner import step as learner
    from async_rl.run import cli

    todo: queue.Queue = queue.Queue()
    trace: list[tuple[int, float, float]] = []

    def watch():
        # Blocks (outside the GIL) until each step's metrics exist: that is when the jitted
        # step finished on the learner's devices. Steps run in dispatch order.
        while (item := todo.get()) is not None:
            i, t_disp, metrics = item
            jax.block_until_ready(metrics)
            trace.append((i, t_disp, time.perf_counter()))

    watcher = threading.Thread(target=watch, name="bench-watch", daemon=True)
    watcher.start()
    orig_step = learner.Learner.step
    count = [0]

    def step(self, *a, **k):
        out = orig_step(self, *a, **k)
        count[0] += 1
        todo.put((count[0], time.perf_counter(), out[1]))
        return out

    learner.Learner.step = step
    print(f"bench child: async_rl from {Path(cli.__file__).parent}", file=sys.stderr, flush=True)

    rc = cli.main(cli_args)
    todo.put(None)
    watcher.join(60)
    trace_path.write_text("".join(json.dumps({"step": i, "dispatch": d, "ready": r}) + "\n" for i, d, r in trace))
    return rc


# ---- parent ----------------------------------------------------------------------------


_CEILING = """
import threading, time, jax, jax.numpy as jnp
d0, d1 = jax.devices()[:2]
f = jax.jit(lambda x: jnp.tanh(x @ x) @ x)
xs = [jax.device_put(jnp.ones((384, 384)), d) for d in (d0, d1)]
loop = lambda x: [f(x).block_until_ready() for _ in range(150)]
[loop(x) for x in xs]
t = time.perf_counter(); [loop(x) for x in xs]; serial = time.perf_counter() - t
t = time.perf_counter(); th = [threading.Thread(target=loop, args=(x,)) for x in xs]
[a.start() for a in th]; [a.join() for a in th]
print(serial / (time.perf_counter() - t))
"""


def parallel_ceiling() -> float | None:
    """How much two forced CPU devices overlap pure compute on this machine."""
    env = common.forced_devices_env(2)
    r = subprocess.run([sys.executable, "-c", _CEILING], capture_output=True, text=True, env=env, timeout=300)
    try:
        return float(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def row_overrides(sampler: str, knob: int) -> list[str]:
    return [f"sampler.name={sampler}", f"{KNOB[sampler]}={knob}"]


def device_busy(trace: list[dict], lo: int, hi: int) -> tuple[float | None, float | None]:
    """(busy share of [ready lo, ready hi], mean busy seconds per step) of the learner device."""
    by = {r["step"]: r for r in trace}
    if lo not in by or hi not in by:
        return None, None
    busy = [by[t]["ready"] - max(by[t]["dispatch"], by[t - 1]["ready"]) for t in range(lo + 1, hi + 1)]
    wall = by[hi]["ready"] - by[lo]["ready"]
    return (sum(busy) / wall if wall > 0 else None), statistics.fmean(busy)


def regen_per_1k(rows: list[dict], lo: int, hi: int) -> float | None:
    """Regenerated tokens per 1k trained tokens over steps (lo, hi]. The trainer logs the
    ratio cumulative since start; with the trained tokens summed per step, the
    regenerated count at each step follows, and so does the ratio for the window."""
    if not any(r.get(REGEN_KEY) is not None for r in rows):
        return None
    trained, acc = {}, 0.0
    for r in rows:
        acc += r.get(TRAINED_KEY) or 0.0
        trained[r["step"]] = acc
    by = {r["step"]: r for r in rows}
    regen = lambda s: (by[s].get(REGEN_KEY) or 0.0) * max(trained[s], 1) / 1000.0
    dt = trained[hi] - trained[lo]
    return 1000.0 * (regen(hi) - regen(lo)) / dt if dt > 0 else None


def generation_rate(rows: list[dict], lo: int, hi: int) -> float | None:
    """Tokens the pump generated per second it was not idle, over steps (lo, hi]."""
    by = {r["step"]: r for r in rows}
    if any(by.get(s, {}).get("rollout/generated_tokens") is None for s in (lo, hi)):
        return None
    active = sum(r["perf/step_time_s"] * (1.0 - (r.get("perf/pump_idle_frac") or 0.0))
                 for r in rows if lo < r["step"] <= hi)
    tokens = by[hi]["rollout/generated_tokens"] - by[lo]["rollout/generated_tokens"]
    return tokens / active if active > 0 else None


def analyse(rows: list[dict], trace: list[dict], warmup: int) -> dict:
    rows = common.with_elapsed(rows)
    last = rows[-1]["step"]
    lo = min(warmup, last - 2)  # keep at least two steps in the window on very short runs
    win = [r for r in rows if lo < r["step"] <= last]
    by = {r["step"]: r for r in rows}
    span = by[last]["_elapsed"] - by[lo]["_elapsed"]
    busy, step_s = device_busy(trace, max(lo, 1), last)
    out = {"steps": last, "window": (lo, last), "steps_per_s": (last - lo) / span if span > 0 else None,
           "learner_wait": common.interval_fraction(rows, "perf/learner_idle_frac", lo, last),
           "learner_idle": None if busy is None else max(0.0, 1.0 - busy), "step_s": step_s,
           "pump_idle": common.interval_fraction(rows, "perf/pump_idle_frac", lo, last),
           "first_step_s": rows[0]["perf/step_time_s"]}
    st_mean = [r["rollout/staleness_mean"] for r in win if r.get("rollout/staleness_mean") is not None]
    st_max = [r["rollout/staleness_max"] for r in win if r.get("rollout/staleness_max") is not None]
    out["stale_mean"] = statistics.fmean(st_mean) if st_mean else None
    out["stale_max"] = max(st_max) if st_max else None
    out["regen_per_1k"] = regen_per_1k(rows, lo, last)
    out["reward_last"] = win[-1].get("rollout/reward_mean")
    out["gen_tps"] = generation_rate(rows, lo, last)
    return out


def mean_run(runs: list[dict]) -> dict:
    """Field-wise mean of repeated runs of one row (max for maxima)."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
        if isinstance(v, (int, float)) and len(vals) == len(runs):
            out[k] = max(vals) if k == "stale_max" else statistics.fmean(vals)
    return out


def export_rev(rev: str, root: Path) -> Path:
    """The async_rl package of a git revision, unpacked under root (imported via PYTHONPATH)."""
    dest = root / f"rev_{rev}"
    if not (dest / "async_rl").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(common.REPO), "archive", rev, "async_rl"], capture_output=True,
                                 timeout=120)
        if archive.returncode != 0:
            sys.exit(f"--baseline-rev {rev}: git archive failed: {archive.stderr.decode().strip()[:200]}")
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True, timeout=120)
    return dest


def run_row(args, scen: dict, sampler: str, knob: int, run_dir: Path, cache: str,
            extra: list[str] = (), source: Path | None = None) -> tuple[dict | None, str, str]:
    """One run; `source`: a directory whose async_rl package runs instead of this tree's."""
    hf_path = [f"model.hf_path={args.hf_dir}"] if scen.get("hf") else []
    overrides = [f"run.dir={run_dir}", "run.resume=never", f"run.compilation_cache={cache}",
                 f"train.max_steps={args.steps}", "checkpoint.every_steps=0", *common.QUIET,
                 *scen["overrides"], *hf_path, *row_overrides(sampler, knob), *extra, *args.set]
    cli_argv = common.train_argv(args.config, overrides)[1:]  # -m async_rl train ...
    trace = run_dir / TRACE
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, os.path.abspath(__file__), "--child", str(trace),
            "--", *cli_argv[2:]]
    env = common.forced_devices_env(scen["devices"])
    cmd = (f"XLA_FLAGS={env['XLA_FLAGS']} " if env["XLA_FLAGS"] else "") + " ".join(["python", *cli_argv])
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), env.get("PYTHONPATH", "")]))
        cmd = f"PYTHONPATH={source} {cmd}"
    res = common.run_child(argv, env, timeout=args.timeout, echo=args.verbose)
    rows = common.read_jsonl(run_dir / "metrics.jsonl")
    if res.rc != 0 or len(rows) < 3:
        why = next((l for _, l in reversed(res.lines) if "Error" in l or l.startswith("error")), "") or res.tail(3)
        return None, cmd, f"rc={res.rc}: {why.strip()[:200]}"
    m = analyse(rows, common.read_jsonl(trace), args.warmup)
    m["wall_s"] = res.wall_s
    return m, cmd, ""


def run_scenario(args, sname: str, samplers: list[str], knobs: dict, root: Path, cache: str) -> list[str]:
    """Every row of one real-training scenario, interleaved over repeats; prints the table, returns verdicts."""
    scen = SCENARIOS[sname]
    print(f"\n== {sname}: {scen['about']}", flush=True)
    variants = dict(scen.get("variants", {}))  # label -> (lookahead, overrides): extra in_order rows
    if scen.get("hf") and "vllm" in args.backends:
        variants.update({f"vllm L={k}": (k, ["engine.backend=vllm"]) for k in knobs.get("in_order", [])})
    source = None
    if args.baseline_rev and variants:
        source = export_rev(args.baseline_rev, root)
        variants[f"rev {args.baseline_rev}"] = (1, [])
    cells = [(sampler, knob, "") for sampler in samplers for knob in knobs[sampler]]
    cells += [("in_order", knob, label) for label, (knob, _) in variants.items() if "in_order" in samplers]
    runs: dict = {c: [] for c in cells}
    notes: dict = {}
    for rep in range(args.repeats):  # interleaved, so slow drift in machine load hits every row alike
        for c in cells:
            if c in notes:
                continue
            sampler, knob, label = c
            extra = variants[label][1] if label else []
            src = source if label.startswith("rev ") else None
            m, cmd, note = run_row(args, scen, sampler, knob,
                                   root / f"{sname}_{sampler}_{knob}{label.replace(' ', '_')}_{rep}",
                                   cache, extra, src)
            if rep == 0:
                print(f"  $ {cmd}", flush=True)
            if m is None:
                notes[c] = note
                print(f"    failed: {note}", flush=True)
                continue
            runs[c].append(m)
            print(f"    run {rep + 1}: wall {m['wall_s']:.0f} s, first step {m['first_step_s']:.1f} s, "
                  f"window steps {m['window'][0] + 1}..{m['window'][1]}: {m['steps_per_s']:.2f} steps/s, "
                  f"pump generates {common.fmt(m['gen_tps'], ',.0f')} tokens/s", flush=True)
    results = []
    for c in cells:
        rs = sorted(runs[c], key=lambda r: r["steps_per_s"])
        results.append((c, mean_run(rs) if rs else None, rs))
    print_results(results)
    return verdicts_of(sname, variants, scen, results)


def print_results(results: list) -> None:
    base = next((m for c, m, _ in results if c == ("in_order", 0, "") and m), None)
    table = []
    for (sampler, knob, label), m, rs in results:
        shown = "vllm" if label.startswith("vllm") else label  # its lookahead is the row's
        name = (f"L={knob}" if sampler == "in_order" else f"S={knob}") + (f" {shown}" if shown else "")
        if m is None:
            table.append([sampler, name, "failed"] + ["-"] * 11)
            continue
        ratio = m["steps_per_s"] / base["steps_per_s"] if base and base["steps_per_s"] else None
        spread = (f"{rs[0]['steps_per_s']:.2f}-{rs[-1]['steps_per_s']:.2f}" if len(rs) > 1 else "")
        table.append([sampler, name, common.fmt(m["steps_per_s"], ".2f"), spread,
                      (common.fmt(ratio, ".2f") + "x") if ratio else "-",
                      common.fmt(m["learner_idle"], ".1%"), common.fmt(m["learner_wait"], ".1%"),
                      common.fmt(None if m["step_s"] is None else m["step_s"] * 1e3, ".0f"),
                      common.fmt(m["pump_idle"], ".1%"), common.fmt(m["gen_tps"], ",.0f"),
                      common.fmt(m["stale_mean"], ".2f"), common.fmt(m["stale_max"], ".0f"),
                      common.fmt(m["regen_per_1k"], ".1f"), common.fmt(m["reward_last"], ".2f")])
    print()
    common.print_table(["sampler", "lookahead/staleness", "steps/s", "range", "vs in_order L0", "learner idle",
                        "idle_frac", "step ms", "pump idle", "gen tok/s", "stale mean", "stale max", "regen/1k",
                        "reward"], table, align="<<>>>>>>>>>>>>")


def verdicts_of(sname: str, variants: dict, scen: dict, results: list) -> list[str]:
    out = []
    get = lambda knob, label="": next((m for c, m, _ in results if c == ("in_order", knob, label) and m), None)
    base = get(0)
    kind, knob, thr = scen["target"] or (None, 0, 0)
    row = get(knob)
    if kind is None:
        pass
    elif kind == "ratio":
        val = row["steps_per_s"] / base["steps_per_s"] if row and base else None
        ok = val is not None and val >= thr
        out.append(f"{sname}: in_order L={knob} vs L=0 = {common.fmt(val, '.2f')}x; target >= {thr}x: "
                   f"{'met' if ok else 'NOT met'}")
    else:
        rows_k = [(c[1], m) for c, m, _ in results if c[0] == "in_order" and not c[2] and c[1] >= knob and m]
        vals = ", ".join(f"L={k} {common.fmt(m['learner_idle'], '.1%')}" for k, m in rows_k)
        ok = bool(rows_k) and all(m["learner_idle"] is not None and m["learner_idle"] <= thr for _, m in rows_k)
        out.append(f"{sname}: steady-state learner idle {vals}; target <= {thr:.0%}: {'met' if ok else 'NOT met'}")
    for label, (k, _) in variants.items():
        new, old = get(k), get(k, label)
        val = new["gen_tps"] / old["gen_tps"] if new and old and new["gen_tps"] and old["gen_tps"] else None
        line = (f"{sname}: pump generation tokens/s at L={k}, this tree at the default engine.steps_per_call "
                f"vs ")
        if label.startswith("vllm"):  # the same checkpoint, prompts and settings on the other backend
            ratio = lambda key: old[key] / new[key] if new and old and new[key] and old[key] else None
            out.append(f"{sname}: engine.backend=vllm vs builtin at in_order L={k}: steps/s "
                       f"{common.fmt(ratio('steps_per_s'), '.2f')}x, pump generation tokens/s "
                       f"{common.fmt(ratio('gen_tps'), '.2f')}x (no target)")
        elif label.startswith("rev "):  # the target: against the trainer as it was
            ok = val is not None and val >= GEN_SPEEDUP_TARGET
            out.append(f"{line}the trainer of revision {label[4:]} (its pump and engine, at its defaults) = "
                       f"{common.fmt(val, '.2f')}x; target >= {GEN_SPEEDUP_TARGET:.1f}x: {'met' if ok else 'NOT met'}")
        else:  # an ablation of this tree: what multi-step decode alone adds
            out.append(f"{line}{label} = {common.fmt(val, '.2f')}x (this tree with one token per engine call; "
                       f"no target)")
    return out


def run_simulation(args) -> list[str]:
    """The disjoint-hardware simulation (bench/pipeline_sim.py): lookahead 0 vs 1, interleaved repeats."""
    import pipeline_sim
    cost = args.sim_step_ms / 1e3
    print(f"\n== disjoint_sim: SIMULATION of disjoint hardware: the engine and the learner are simulated remote "
          f"devices whose work is a GIL-releasing wait ({args.sim_step_ms:.0f} ms to generate a step's samples, "
          f"{args.sim_step_ms:.0f} ms per learner step), around the real pump, ledger, in_order sampler and "
          f"publishing; {args.sim_steps} steps per run, window ({args.warmup}, last]", flush=True)
    got: dict = {0: [], 1: []}
    for _ in range(args.repeats):
        for la in got:
            got[la].append(pipeline_sim.run(la, step_s=cost, steps=args.sim_steps, warmup=args.warmup)["steps_per_s"])
    ideal = {0: 1 / (2 * cost), 1: 1 / cost}
    mean = {la: statistics.fmean(v) for la, v in got.items()}
    common.print_table(["sampler", "lookahead", "steps/s", "range", "ideal steps/s", "vs L0"],
                       [["in_order", f"L={la}", f"{mean[la]:.2f}", f"{min(v):.2f}-{max(v):.2f}", f"{ideal[la]:.2f}",
                         f"{mean[la] / mean[0]:.2f}x"] for la, v in got.items()], align="<<>>>>")
    ratio = mean[1] / mean[0]
    return [f"disjoint_sim (simulation of disjoint hardware): in_order L=1 vs L=0 = {ratio:.2f}x (limit 2x); "
            f"target >= {SIM_TARGET}x: {'met' if ratio >= SIM_TARGET else 'NOT met'}"]


def write_hf_tiny(root: Path, config: str) -> Path:
    """hf_tiny's checkpoint: a random model of the preset's shape with 2 heads of 32 and the
    char tokenizer's vocabulary, as a Hugging Face directory (config.json + safetensors)."""
    from flax import nnx

    from async_rl import config as C
    from async_rl.data.tokenizer import build_tokenizer
    from async_rl.model import hf
    from async_rl.model.transformer import Transformer

    cfg = C.load(config, ["model.n_heads=2", "model.n_kv_heads=2", "model.learned_positions=0"])
    vocab = build_tokenizer(cfg.tokenizer, synthetic=True).vocab_size
    params = nnx.state(Transformer(cfg.model, vocab, rngs=nnx.Rngs(cfg.run.seed)), nnx.Param)
    return hf.save_hf(params, cfg.model, vocab, root / "hf_tiny")


def main():
    args = parse_args()
    t_all = time.perf_counter()
    load0 = os.getloadavg()
    args.backends = backends.parse(args.backend)  # one line and exit 2 when unknown or not installed
    default = ["hf_tiny"] if "vllm" in args.backends else [s for s in SCENARIOS if s != "hf_tiny"] + ["disjoint_sim"]
    scen_names = [s for s in args.scenarios.split(",") if s] or default
    samplers = [s for s in args.samplers.split(",") if s]
    for s in scen_names:
        if s not in SCENARIOS and s != "disjoint_sim":
            sys.exit(f"--scenarios: unknown {s!r} (known: {', '.join(SCENARIOS)}, disjoint_sim)")
    for s in samplers:
        if s not in KNOB:
            sys.exit(f"--samplers: unknown {s!r} (known: {', '.join(KNOB)})")
    if args.steps <= args.warmup + 2 or args.sim_steps <= args.warmup + 2:
        sys.exit(f"--steps={args.steps}, --sim-steps={args.sim_steps}: must exceed --warmup + 2 ({args.warmup + 2})")
    knobs = {s: [int(x) for x in (args.lookaheads if s == "in_order" else args.staleness).split(",") if x]
             for s in samplers}
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_async_"))
    root.mkdir(parents=True, exist_ok=True)
    cache = args.cache or str(root / "xla_cache")
    args.hf_dir = write_hf_tiny(root, args.config) if any(SCENARIOS.get(s, {}).get("hf") for s in scen_names) else None

    print(f"bench/async.py: {os.cpu_count()} host CPUs, load average {load0[0]:.1f} at start; preset "
          f"{args.config}; {args.steps} steps per run, steady-state window = steps ({args.warmup}, last]; "
          f"{args.repeats} run(s) per row"
          + (f"; extra overrides {args.set}" if args.set else ""))
    if any(s in SCENARIOS for s in scen_names):
        ceiling = parallel_ceiling()
        print(f"device-parallel ceiling on this machine: the same jitted matmul loop on 2 forced CPU devices from 2 "
              f"threads runs {common.fmt(ceiling, '.2f')}x faster than one device after the other (what disjoint "
              "engine/learner devices can overlap at most here)")
    verdicts = []
    for sname in scen_names:
        if sname == "disjoint_sim":
            verdicts += run_simulation(args)
        else:
            verdicts += run_scenario(args, sname, samplers, knobs, root, cache)
    print()
    for v in verdicts:
        print(v)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(f"total wall {time.perf_counter() - t_all:.0f} s; load average {os.getloadavg()[0]:.1f} at end "
          f"(other processes on these {os.cpu_count()} CPUs slow every row)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2:]))
    main()
