"""Learner MFU: model FLOP utilisation of the jitted GRPO train step vs. a measured matmul peak.

Owns: a synthetic batch, timing, the FLOP count and the printed table. Does not own: any
model, loss or optimizer logic (it drives the real `Learner`).

What is timed: `Learner.step(state, batch)` (forward, GRPO loss, backward, grad-norm clip,
AdamW update, metrics) on a fixed synthetic batch, blocking on every step's result, after
a compile step and warm-up steps. The batch goes through `build_batch` from per-row
records, as in training, so shapes, dtypes and shardings are the trainer's.

What the FLOPs count: `async_rl.model.flops.step_flops`, the count `async-rl plan` uses (model
FLOPs, not hardware FLOPs; recomputation or wasted work counts for nothing). Per pass over
the B rows of T = P + N columns:
  matmuls   2 * N_matmul * B*T  +  2 * d * V * B*N
            N_matmul = the blocks' matmul kernels (q, k, v, o, gate, up, down), read off the
            model's parameter tree; every column runs through the trunk, because prompt
            keys/values feed the completion. The output projection (d x V) is only needed at
            the N columns whose logits enter the loss. The input embedding is a gather: 0 FLOPs.
  attention 4 * L * H * hd * T per token (QK^T and PV) over the full T x T square when the
            plain path computes it (rows no wider than one attention block), half of it (the
            causal triangle) when a blockwise, cuDNN or splash kernel skips the masked blocks.
A forward+backward pass counts 3 of these; a forward-only pass 1 (the reference model, run
only with --kl-coef > 0; the proximal policy, with several updates per step).

The peak (--peak measured, the default) is the fastest square fp32 (or --dtype) `jnp.dot`
of a few sizes (up to --peak-n) on the same devices in the same process, timed after
warm-up (best of several), sharded by rows over the learner mesh so every device works.
It is measured before and after the steps and the better is used, so a burst of load
from other processes during one of the two does not inflate the MFU. --peak spec uses
the chip's published dense bf16 FLOP/s instead (TPUs and H100/H200/A100/B200; see
async_rl.plan.chips), the figure MFU is usually quoted against.

    python bench/learner.py                   # small preset, fp32, 4 prompts x 4 samples x 96 columns
    python bench/learner.py --prompts 2 --samples 8 --prompt-len 64 --new-tokens 128   # preset row width
    python bench/learner.py --devices 2 --data 2   # 2 forced CPU devices, data parallel
    python bench/learner.py --kl-coef 0.05         # with the reference-model forward
    python bench/learner.py --config configs/plan/qwen2.5-0.5b.yaml --vocab 151936 --dtype preset \
        --prompts 8 --samples 8 --prompt-len 512 --new-tokens 1536 --peak spec   # 0.5B shape, accelerator
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/small.yaml", help="preset whose model section is used")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary size (the preset leaves it to the tokenizer)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "preset"),
                    help="compute and parameter dtype; the peak dot uses the same one (float32 by default, "
                         "where the preset says bfloat16, so CPUs without bf16 units are not penalised); "
                         "preset: the preset's model.dtype and model.param_dtype")
    ap.add_argument("--peak", default="measured", choices=("measured", "spec"),
                    help="MFU against a matmul measured here, or the chip's published bf16 peak")
    ap.add_argument("--prompts", type=int, default=4, help="groups per step (rollout.prompts_per_step)")
    ap.add_argument("--samples", type=int, default=4, help="completions per group (rollout.samples_per_prompt)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt width P (engine.max_prompt_len)")
    ap.add_argument("--new-tokens", type=int, default=64, help="completion width N (rollout.max_new_tokens)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the compile step")
    ap.add_argument("--kl-coef", type=float, default=0.0, help="learner.kl_coef; > 0 runs the reference forward")
    ap.add_argument("--devices", type=int, default=1,
                    help="forced CPU device count (XLA_FLAGS); ignored on accelerators")
    ap.add_argument("--data", type=int, default=-1, help="mesh.data (-1 = devices left over)")
    ap.add_argument("--fsdp", type=int, default=1, help="mesh.fsdp")
    ap.add_argument("--tensor", type=int, default=1, help="mesh.tensor")
    ap.add_argument("--peak-n", type=int, default=4096,
                    help="largest side of the square matmuls that set the peak (n/4 and n/2 are tried too)")
    ap.add_argument("--target", type=float, default=0.30, help="MFU target printed with the result")
    ap.add_argument("--plan", action="store_true",
                    help="also print `async-rl plan`'s estimated step time for this shape on this chip")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="further config overrides, group.field=value")
    return ap.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.devices > 1:
    # Must be set before jax initialises its backends.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={ARGS.devices}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (bench/common.py, beside this file)

from async_rl import config as cfg_lib  # noqa: E402
from async_rl.learner.step import Learner, Row, build_batch  # noqa: E402
from async_rl.model import (  # noqa: E402
    attention,
    flops,
    sharding,  # noqa: E402
)
from async_rl.plan import chips  # noqa: E402


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def block(x):
    return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def synthetic_rows(n_groups: int, samples: int, prompt_len: int, new_tokens: int, vocab: int, seed: int):
    """Full-width prompts and completions: every column is a real token, none is padding,
    so the FLOPs counted are all useful work (padding would be computed but not counted)."""
    rs = np.random.RandomState(seed)
    rows = []
    for _ in range(n_groups):
        completions = []
        for _ in range(samples):
            toks = rs.randint(0, vocab, new_tokens).astype(np.int32)
            # Plausible behaviour logprobs near a uniform policy's, so importance weights
            # and clipping take both branches as in training.
            lp = (np.log(1.0 / vocab) + 0.05 * rs.randn(new_tokens)).astype(np.float32)
            completions.append((toks, lp, float(rs.rand() < 0.5)))
        prompt = rs.randint(0, vocab, prompt_len).astype(np.int32)
        rows += [Row(prompt, toks, lp, np.zeros(new_tokens, np.int32), r) for toks, lp, r in completions]
    return rows


def matmul_peak(mesh, sizes, dtype, reps: int = 5) -> tuple[float, int]:
    """(FLOP/s, n) of the fastest square dot over `sizes`, best of `reps` each.

    Several sizes because the fastest one depends on caches and threading (on 2 CPU
    cores 1024^3 beat 4096^3 by ~10%); taking the best keeps the MFU conservative."""
    return max(_dot_flops(mesh, n, dtype, reps) for n in sizes)


def _dot_flops(mesh, n: int, dtype, reps: int) -> tuple[float, int]:
    """Rows sharded over the mesh so every device works."""
    rows = NamedSharding(mesh, P(mesh.axis_names))
    rep = NamedSharding(mesh, P())
    n_dev = mesh.devices.size
    n = (n // n_dev) * n_dev
    a = jax.device_put(np.random.RandomState(1).randn(n, n).astype(np.float32), rows).astype(dtype)
    b = jax.device_put(np.random.RandomState(2).randn(n, n).astype(np.float32), rep).astype(dtype)
    f = jax.jit(jnp.dot, out_shardings=rows)
    f(a, b).block_until_ready()  # compile + warm
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best, n


def main(args):
    dtypes = [] if args.dtype == "preset" else [f"model.dtype={args.dtype}", f"model.param_dtype={args.dtype}"]
    overrides = [*dtypes, f"rollout.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}",
                 f"engine.max_prompt_len={args.prompt_len}", f"rollout.max_new_tokens={args.new_tokens}",
                 f"learner.kl_coef={args.kl_coef}", f"mesh.data={args.data}", f"mesh.fsdp={args.fsdp}",
                 f"mesh.tensor={args.tensor}", f"run.seed={args.seed}",
                 "train.max_steps=1000",  # a horizon for the preset's cosine schedule; no effect on cost
                 *args.overrides]
    cfg = cfg_lib.load(args.config, overrides)
    dtype = jnp.dtype(cfg.model.dtype)
    mc = cfg.model
    mesh = sharding.make_devices(cfg.mesh).learner
    P_, N_ = args.prompt_len, args.new_tokens
    B, T = args.prompts * args.samples, P_ + N_

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    learner = Learner(cfg, args.vocab, mesh)
    params = learner.init_params()
    ref = learner.publishable(params) if learner.use_ref else None
    state = block(learner.init_state(params))
    rows = synthetic_rows(args.prompts, args.samples, P_, N_, args.vocab, args.seed)
    batch = build_batch(rows, n_rows=B, prompt_len=P_, max_new=N_, pad_id=0)
    init_s = time.perf_counter() - t0

    sizes = sorted({max(args.peak_n // 4, 256), max(args.peak_n // 2, 256), args.peak_n})
    chip = chips.for_device(mesh.devices.flat[0])
    if args.peak == "spec" and chip is None:
        sys.exit(f"--peak spec: no published figures for {mesh.devices.flat[0].device_kind!r}; use --peak measured")
    peak_before, n_before = matmul_peak(mesh, sizes, dtype)

    t0 = time.perf_counter()
    state, metrics = block(learner.step(state, batch, ref))
    compile_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        state, metrics = block(learner.step(state, batch, ref))
    times = []
    c0 = cpu_seconds()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = block(learner.step(state, batch, ref))
        times.append(time.perf_counter() - t0)
    # CPU time per step vs. cores x wall time: well below 1 means other processes took
    # the cores (the timings are then pessimistic), or the step leaves cores idle.
    busy = (cpu_seconds() - c0) / (sum(times) * (os.cpu_count() or 1))
    loss = float(metrics["learner/loss"])
    if not np.isfinite(loss):
        sys.exit(f"non-finite loss {loss}: the timed steps did not compute a real step")

    peak_after, n_after = matmul_peak(mesh, sizes, dtype)
    peak, peak_n = max((peak_before, n_before), (peak_after, n_after))
    measured = peak
    if args.peak == "spec":
        peak = chip.peak_flops * mesh.devices.size
    load_after = os.getloadavg()[0]

    causal = learner.attn.impl != "xla" and not (learner.attn.impl == "blockwise" and T <= attention.BLOCK)
    fl = flops.step_flops(cfg, args.vocab, causal)
    total = sum(fl.values())
    counts, (fb, fwd) = flops.param_counts(mc, args.vocab), flops.passes(cfg)
    med, best = float(np.median(times)), min(times)

    dev = mesh.devices.flat[0]
    print(f"model: {args.config} model section, {counts.total / 1e6:.1f}M params "
          f"(trunk {counts.trunk / 1e6:.2f}M, embed {counts.embed / 1e6:.2f}M, "
          f"head {counts.head / 1e6:.2f}M), vocab {args.vocab}, {mc.n_layers} layers d={mc.d_model} "
          f"H={mc.n_heads} Hkv={mc.n_kv_heads} hd={mc.resolved_head_dim} F={mc.d_ff}, "
          f"tie_embeddings={mc.tie_embeddings}")
    preset_dtype = cfg_lib.load(args.config).model.dtype
    print(f"compute: {mc.dtype} activations, {mc.param_dtype} params (preset: {preset_dtype}) on "
          f"{jax.default_backend()} ({dev.device_kind}), mesh {dict(mesh.shape)}, {os.cpu_count()} host CPUs; "
          f"attention {learner.attn.impl}, remat {cfg.learner.remat}")
    print(f"batch: {args.prompts} prompts x {args.samples} samples = B {B} rows, "
          f"T = P {P_} + N {N_} = {T} columns, {B * T} tokens/step ({B * N_} completion tokens), "
          f"no padding")
    print(f"flops/step = {3 * fb + fwd} x (2*N_matmul*B*T + 2*d*V*B*N + {'2' if causal else '4'}*L*H*hd*T*B*T)"
          f" = {' + '.join(f'{k} {v / 1e9:.1f}' for k, v in fl.items())} = {total / 1e9:.1f} GFLOP "
          f"(N_matmul {counts.matmul / 1e6:.2f}M; {fb} forward+backward pass(es) count 3 each, {fwd} forward-only "
          f"1 each; reference model {'included' if learner.use_ref else 'not run (kl_coef=0)'})")
    print(f"timing: init {init_s:.1f} s, compile+first step {compile_s:.1f} s, {args.warmup} warm-up, "
          f"{args.steps} timed steps blocking on each; peak = fastest of 5 square dots each of "
          f"n = {', '.join(map(str, sizes))}, before ({peak_before / 1e9:.1f}) and after "
          f"({peak_after / 1e9:.1f} GFLOP/s), best at n = {peak_n}; "
          f"host 1-min load average {load_before:.1f} -> {load_after:.1f}, this process kept "
          f"{busy:.0%} of the {os.cpu_count()} CPUs busy during the timed steps")
    head = ("", "step time", "tokens/s", "GFLOP/s", "MFU")
    rows = [
        ("train step, median", f"{med * 1e3:,.0f} ms", f"{B * T / med:,.0f}", f"{total / med / 1e9:,.1f}",
         f"{total / med / peak:.1%}"),
        ("train step, best", f"{best * 1e3:,.0f} ms", f"{B * T / best:,.0f}", f"{total / best / 1e9:,.1f}",
         f"{total / best / peak:.1%}"),
        (f"matmul peak ({dtype.name} dot, measured)", "", "", f"{measured / 1e9:,.1f}", f"{measured / peak:.0%}"),
    ]
    if args.peak == "spec":
        rows.append((f"{chip.name} published bf16 peak x {mesh.devices.size}", "", "", f"{peak / 1e9:,.1f}", "100%"))
    common.print_table(list(head), [list(r) for r in rows], align="<" * len(head))
    mfu = total / med / peak
    print(f"MFU (median step, vs the {'published' if args.peak == 'spec' else 'measured'} peak) {mfu:.1%}   "
          f"target >= {args.target:.0%}: "
          f"{'met' if mfu >= args.target else 'NOT met'}   (loss {loss:.4f})")
    if args.plan:
        print(plan_line(cfg, args.vocab, mesh, chip, med))


def plan_line(cfg, vocab: int, mesh, chip, measured_s: float) -> str:
    """The plan's roofline for the step just timed (same config, mesh and chip figures)."""
    from async_rl.plan import compile as PL
    chip = chip or chips.NOMINAL_CPU  # no published figures (a CPU): the code path, not a prediction
    part = PL.learner_part(cfg, vocab, mesh, chip)
    est = PL.Report("", "", chip, mesh.devices.size, dict(mesh.shape), parts={"learner": part}).estimates()
    if not est["est_step_s"]:
        return f"plan estimate: none ({part.error or 'no cost model'})"
    return (f"plan estimate for this shape at {chip.name}: {est['est_step_s'] * 1e3:,.0f} ms ({est['bound']}-bound, attention "
            f"{part.attention}); measured median {measured_s * 1e3:,.0f} ms = {measured_s / est['est_step_s']:.2f}x "
            f"the estimate")


if __name__ == "__main__":
    main(ARGS)
