"""Decode throughput: the engine vs. a static-batch KV-cache decoder, and vs. full recompute.

Owns: timing, the static-batch baseline and the printed tables. Does not own: any model
or engine logic.

Fair baseline (first table): the same sequences (prompts x samples, each with a length)
through (a) a static-batch decoder in the shape of flax's gemma sampler: one jitted call
prefills a batch of rows at width P and decodes them in one `lax.while_loop` with a KV
cache until every row reached its length (a finished row idles; nothing refills it), and
(b) each rollout backend of `--backend` (builtin: the engine; vllm: vLLM in-process, on the
same weights written as a Hugging Face Qwen2 directory) driven as the pump drives it:
chunks of `engine.steps_per_call` tokens, freed slots refilled. Equal batch (rows = slots),
the same sampling settings (temperature 1, no top-k/top-p); all include prefill and count
only the tokens up to each row's length. `equal lengths`: every
row runs N tokens (target: engine >= 1.0x); `varied lengths`: each row's length is drawn
uniformly from [1, N], standing in for EOS at random points as in RL (the engine learns of
an end when it reads the chunk, as with EOS; target: engine >= 1.5x). With both backends a
line per lengths gives vllm vs builtin (measured side by side, alternating).

Full recompute (second table): recomputes the whole fixed-width row (P + N columns, as
in the shared layout, so it compiles once) for every new token, batched over the same
sequences. Its step cost does not depend on how many tokens exist yet, so timing a few
steps and multiplying is exact up to timer noise; the table says when it was extrapolated.
The engine's rows: one sequence per slot, N tokens each, through the slot scheduler as the
pump runs it (chunks of `engine.steps_per_call`, each dispatched before the previous one's
tokens are recorded); decode counts the chunks after the first (which holds the prefill).

Decode vs the HBM roofline (third table): every slot holds a prompt of P tokens and
decodes, `engine.steps_per_call` tokens per chunk, through the slot scheduler; the first
chunk (with the prefill) is not timed. The roofline is the bytes a decode step must read,
the weights (in the compute dtype) plus the KV cache of the tokens each slot holds, over
the chip's published HBM bandwidth (`--hbm-gbps` where none is known, e.g. on CPU), summed
over the timed steps. Target on an accelerator: >= 50% of it.

    python bench/engine.py                      # small preset, 32 slots, up to 128 tokens
    python bench/engine.py --config configs/tiny.yaml --new-tokens 64 --waves 8
    python bench/engine.py --naive-steps 2 --dtype bfloat16
    .venv-vllm/bin/python bench/engine.py --parts fair --backend builtin,vllm   # needs the [vllm] extra
    python bench/engine.py --parts roofline --config configs/plan/qwen2.5-0.5b.yaml --vocab 151936 \
        --dtype bfloat16 --sequences 256 --prompt-len 512 --new-tokens 1536   # 0.5B shape, accelerator
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import backends  # noqa: E402  (bench/backends.py, beside this file)
import common  # noqa: E402

from async_rl import config as cfg_lib
from async_rl.model.transformer import Transformer, layout
from async_rl.plan import chips
from async_rl.rollout.decoding import Requests, generate_all
from async_rl.rollout.engine import Engine
from async_rl.rollout.interface import BuiltinRollout
from async_rl.rollout.paged_engine import PagedEngine
from async_rl.rollout.sampling import sample_token, token_key


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/small.yaml", help="preset whose model section is used")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary size (the preset leaves it to the tokenizer)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="compute and parameter dtype (float32: CPUs are slow at bf16 matmuls)")
    ap.add_argument("--sequences", type=int, default=32, help="concurrent sequences (= engine slots)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence, no EOS stop")
    ap.add_argument("--prompt-len", type=int, default=0, help="max prompt length P; 0 = the preset's")
    ap.add_argument("--naive-steps", type=int, default=3,
                    help="full-recompute steps actually timed (0 = all --new-tokens)")
    ap.add_argument("--samples", type=int, default=8,
                    help="fair baseline: samples per prompt (the GRPO group; the engine prefills a prompt once)")
    ap.add_argument("--waves", type=int, default=4, help="fair baseline: sequences = waves x --sequences")
    ap.add_argument("--repeats", type=int, default=2, help="fair baseline: runs of each decoder; the fastest counts")
    ap.add_argument("--steps-per-call", type=int, default=0, help="engine K; 0 = the config default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default="fair,recompute,roofline",
                    help="comma list: fair (static-batch baseline), recompute (full recompute), roofline (HBM)")
    ap.add_argument("--backend", default="builtin",
                    help="fair: comma list of rollout backends, builtin and/or vllm (the [vllm] extra; the model "
                         "gets Qwen2's q/k/v biases and is written as a Hugging Face directory vLLM reads)")
    ap.add_argument("--layouts", default="",
                    help="fair: the builtin engine once per KV-cache layout, side by side (comma list of "
                         f"{', '.join(LAYOUTS)}); default: the layout the engine picks on this platform")
    ap.add_argument("--ahead", default="1",
                    help="fair: comma list of 1 (chunk k+1 dispatched before chunk k is fetched: what the engine "
                         "does) and/or 0 (fetched first, the loop before), the builtin engine once per value, side by side")
    ap.add_argument("--hbm-gbps", type=float, default=0.0,
                    help="roofline: HBM bandwidth in GB/s; 0 = the chip's published figure (none on CPU)")
    args = ap.parse_args()
    bad = set(args.parts.split(",")) - {"fair", "recompute", "roofline"}
    if bad or not args.parts:
        ap.error(f"--parts: unknown {sorted(bad)} (known: fair, recompute, roofline)")
    args.backends = backends.parse(args.backend)
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.ahead = [int(x) for x in args.ahead.split(",") if x]
    if not args.ahead or set(args.ahead) - {0, 1}:
        ap.error(f"--ahead: {args.ahead} (a comma list of 0 and 1)")
    if set(args.layouts) - set(LAYOUTS):
        ap.error(f"--layouts: unknown {sorted(set(args.layouts) - set(LAYOUTS))} (known: {', '.join(LAYOUTS)})")
    return args


# the engine's KV-cache layouts: one [L, S, Hkv, T, hd] buffer written in place each step (GPU,
# CPU), or read-only during a K-step call with its new columns in a block beside it (TPU), or
# a pool of 16-token pages shared by every sequence (`engine.kv_layout=paged`, sized to hold every slot)
LAYOUTS = {"stacked": (Engine, dict(recent=False)), "recent": (Engine, dict(recent=True)),
           "paged": (PagedEngine, dict(page_size=16))}


class Timed(Requests):
    """`generate_all`'s source for one sample per prompt, `tokens` each, noting when each
    chunk reaches the host (`at`; the first one holds the prefill)."""

    def __init__(self, prompts, tokens: int):
        super().__init__(prompts, samples=1, limits=[[tokens]] * len(prompts))
        self.at: list[float] = []

    def collected(self, calls: int) -> None:
        self.at.append(time.perf_counter())


def run_engine(eng: Engine, params, prompts, new_tokens: int, prefill_rows: int = 32):
    """Every prompt into a slot, `new_tokens` each, through the slot scheduler; returns
    (seconds to the first chunk on the host, seconds from it to the last, chunks)."""
    req = Timed(prompts, new_tokens)
    t0 = time.perf_counter()
    req.run(BuiltinRollout(eng, params, 0, prefill_rows=prefill_rows), ())
    return req.at[0] - t0, req.at[-1] - req.at[0], len(req.at)


def naive_step_fn(graphdef, seed: int):
    sample = jax.vmap(functools.partial(sample_token, temperature=1.0, top_k=0, top_p=1.0))

    @jax.jit
    def step(params, tokens_BxT, positions_BxT, valid_BxT, n, p, ordinals_B):
        """Token n of every row: logits at column p + n - 1 of a full recompute."""
        logits_BxTxV = nnx.merge(graphdef, params)(tokens_BxT, positions_BxT, valid_BxT)
        keys = jax.vmap(lambda o: token_key(seed, o, 0, n))(ordinals_B)
        return sample(logits_BxTxV[:, p + n - 1], keys)
    return step


def run_naive(graphdef, params, prompts, p: int, new_tokens: int, steps: int, seed: int):
    b, t = len(prompts), p + new_tokens
    tokens = np.zeros((b, t), np.int32)
    lens = np.array([len(x) for x in prompts])
    for i, x in enumerate(prompts):
        tokens[i, p - len(x):p] = x
    step = naive_step_fn(graphdef, seed)
    ordinals = np.arange(b, dtype=np.int32)

    def one(n):
        rows = [layout(int(L), p, t, n_filled=int(L) + n) for L in lens]
        pos = np.stack([r[1] for r in rows])
        valid = np.stack([r[2] for r in rows])
        toks, _ = step(params, tokens, pos, valid, np.int32(n), np.int32(p), ordinals)
        tokens[:, p + n] = np.asarray(toks)

    t0 = time.perf_counter()
    one(0)  # compile + first step
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for n in range(1, steps + 1):
        one(n)
    per_step = (time.perf_counter() - t0) / steps
    return compile_s, per_step, step._cache_size()


def static_decoder(graphdef, seed: int, p: int, n_new: int):
    """The static-batch baseline (the shape of flax's gemma sampler): one jitted call that
    prefills a batch of prompts at width P, then decodes every row in one `lax.while_loop`
    with a KV cache until all rows ended (per-row length) or N tokens. A row that ends
    early idles until the batch's longest row is done; nothing can take its place."""
    sample = jax.vmap(functools.partial(sample_token, temperature=1.0, top_k=0, top_p=1.0))

    @jax.jit
    def run(params, tokens_BxP, positions_BxP, valid_BxP, starts_B, ordinals_B, samples_B, limits_B):
        model = nnx.merge(graphdef, params)
        b = tokens_BxP.shape[0]
        logits_BxV, cache = model.prefill_at(tokens_BxP, positions_BxP, valid_BxP, jnp.full((b,), p - 1))
        cache = jax.tree.map(lambda c: jnp.pad(c, ((0, 0), (0, 0), (0, 0), (0, n_new), (0, 0))), cache)  # [L, B, Hkv, T, hd]

        def cond(c):
            n, _, _, _, _, done_B = c
            return (n < n_new) & ~jnp.all(done_B)

        def body(c):
            n, cache, logits_BxV, toks_BxN, lps_BxN, done_B = c
            keys = jax.vmap(lambda o, s: token_key(seed, o, s, n))(ordinals_B, samples_B)
            tok_B, lp_B = sample(logits_BxV, keys)
            toks_BxN, lps_BxN = toks_BxN.at[:, n].set(tok_B), lps_BxN.at[:, n].set(lp_B)
            done_B = done_B | (n + 1 >= limits_B)
            cols_B = jnp.full((b,), p + n, jnp.int32)
            logits_BxV, cache = model.decode(tok_B, cols_B - starts_B, cols_B, starts_B, cache)
            return n + 1, cache, logits_BxV, toks_BxN, lps_BxN, done_B

        init = (jnp.int32(0), cache, logits_BxV, jnp.zeros((b, n_new), jnp.int32), jnp.zeros((b, n_new), jnp.float32),
                jnp.zeros((b,), bool))
        n, _, _, toks_BxN, lps_BxN, _ = jax.lax.while_loop(cond, body, init)
        return toks_BxN, lps_BxN, n
    return run


def run_static(run, params, rows, p: int, batch: int):
    """rows: (prompt, ordinal, sample, limit) per sequence, decoded in batches of `batch` rows.
    Returns (seconds, decode steps summed over batches, useful tokens)."""
    t0 = time.perf_counter()
    steps = useful = 0
    for b0 in range(0, len(rows), batch):
        part = rows[b0:b0 + batch]
        part = part + [part[-1]] * (batch - len(part))  # a short last batch keeps the compiled shape
        tokens = np.zeros((batch, p), np.int32)
        pos, valid, starts = [], [], []
        for r, (x, _, _, _) in enumerate(part):
            tokens[r, p - len(x):] = x
            st, ps, vl = layout(len(x), p, p)
            pos.append(ps), valid.append(vl), starts.append(st)
        toks, _, n = run(params, tokens, np.stack(pos), np.stack(valid), np.asarray(starts, np.int32),
                         np.asarray([r[1] for r in part], np.int32), np.asarray([r[2] for r in part], np.int32),
                         np.asarray([r[3] for r in part], np.int32))
        toks = np.asarray(toks)  # the host holds the batch's tokens before the next one starts
        steps += int(n)
        useful += sum(r[3] for r in rows[b0:b0 + batch])
    return time.perf_counter() - t0, steps, useful


def _ahead(r: BuiltinRollout, ahead: int) -> BuiltinRollout:
    out = BuiltinRollout(r.engine, r.params, 0)
    out.ahead = ahead
    return out


def run_continuous(r, prompts, samples: int, limits):
    t0 = time.perf_counter()
    out = generate_all(r, None, prompts, samples=samples, eos_id=None, max_tokens=limits,
                       max_new_tokens=max(map(max, limits)))
    useful = sum(len(c.tokens) for per in out for c in per)
    assert useful == sum(map(sum, limits)), (useful, sum(map(sum, limits)))
    return time.perf_counter() - t0, useful


def compare(name: str, rollouts: dict, ep, run, prompts, samples: int, limits, p: int, batch: int, repeats: int):
    """The static decoder and every backend on the same rows (prompt x sample, ordinal =
    prompt index, its length limit), alternating, `repeats` times each; the fastest run of
    each counts (the others were slowed by whatever else ran on the machine)."""
    rows = [(x, i, s, limits[i][s]) for i, x in enumerate(prompts) for s in range(samples)]
    st, en = [], {b: [] for b in rollouts}
    for _ in range(repeats):
        st.append(run_static(run, ep, rows, p, batch))
        for b, r in rollouts.items():
            en[b].append(run_continuous(r, prompts, samples, limits))
    st_s, st_steps, st_useful = min(st)
    secs = {b: min(runs)[0] for b, runs in en.items()}
    return {"name": name, "static_tps": st_useful / st_s, "static_s": st_s, "static_steps": st_steps,
            "tokens": st_useful, "secs": secs, "tps": {b: st_useful / t for b, t in secs.items()}}


def fair(args, st: backends.Setup, graphdef, rs, p: int, n_new: int, s: int, k: int, layouts: dict) -> None:
    """The first table: the same rows through the static-batch decoder and each backend
    (the builtin one once per layout of `layouts`, where given)."""
    g, ep = args.samples, st.params
    n_prompts = args.waves * s // g
    base_prompts = [rs.randint(0, args.vocab, rs.randint(p // 2, p + 1)).astype(np.int32) for _ in range(n_prompts)]
    run = static_decoder(graphdef, args.seed, p, n_new)
    t0 = time.perf_counter()
    run_static(run, ep, [(base_prompts[0], 0, 0, 1)], p, s)
    print(f"compile: static batch {time.perf_counter() - t0:.1f} s")
    equal = [[n_new] * g for _ in range(n_prompts)]
    varied = rs.randint(1, n_new + 1, (n_prompts, g)).tolist()  # per sequence, like an EOS drawn at random
    rollouts, start_s, labels = {}, {}, {"builtin": f"builtin engine, continuous batching (K={k})"}
    for b in args.backends:
        if b == "builtin" and layouts:  # the builtin engine once per layout, built by main
            for name, r in layouts.items():
                rollouts[f"builtin/{name}"], start_s[f"builtin/{name}"] = r, 0.0
                labels[f"builtin/{name}"] = f"builtin engine ({name}), continuous batching (K={k})"
        else:
            rollouts[b], start_s[b] = backends.make(b, st)
    for key, r in rollouts.items():
        t0 = time.perf_counter()
        run_continuous(r, base_prompts, g, varied)  # compiles what the timed runs meet
        print(f"warm-up: {key} start {start_s[key]:.1f} s, one untimed pass {time.perf_counter() - t0:.1f} s")
    if "vllm" in rollouts:
        import vllm
        labels["vllm"] = f"vLLM {vllm.__version__} in-process, continuous batching (chunks of K={k})"
    comps = [compare(name, rollouts, ep, run, base_prompts, g, lim, p, s, args.repeats)
             for name, lim in (("equal lengths", equal), ("varied lengths", varied))]
    print(f"\nfair baseline: {n_prompts} prompts x {g} samples = {n_prompts * g} sequences, batch = slots = {s}, "
          f"prompt width P={p}, up to N={n_new} tokens, temperature 1; all end a sequence at its length, "
          f"count only those tokens, and include prefill; fastest of {args.repeats} alternating runs each")
    rows = []
    for c in comps:
        rows.append([c["name"], "baseline: static batch, KV cache, lax.while_loop", f"{c['static_tps']:,.0f}",
                     f"{c['static_s']:.2f} s", f"{c['static_steps']} decode steps"])
        rows += [[c["name"], labels[b], f"{c['tps'][b]:,.0f}", f"{c['secs'][b]:.2f} s", f"{c['tokens']} useful tokens"]
                 for b in rollouts]
    common.print_table(["lengths", "decoder", "useful tok/s", "time", "work"], rows, align="<<>><")
    for c, thr in zip(comps, (1.0, 1.5)):
        for b in (b for b in rollouts if b.split("/")[0] == "builtin"):
            r = c["tps"][b] / c["static_tps"]
            lay = f" ({b.split('/')[1]})" if "/" in b else ""
            print(f"{c['name']}: engine{lay} vs static batch {r:.2f}x   target >= {thr:.1f}x: "
                  f"{'met' if r >= thr else 'NOT met'}")
        if "vllm" in rollouts:
            print(f"{c['name']}: vllm vs static batch {c['tps']['vllm'] / c['static_tps']:.2f}x")
        if "vllm" in rollouts and "builtin" in rollouts:
            print(f"{c['name']}: vllm vs builtin: {c['tps']['vllm'] / c['tps']['builtin']:.2f}x")
        first = next((b for b in rollouts if b.startswith("builtin/")), None)
        for b in (b for b in rollouts if b.startswith("builtin/") and b != first):
            print(f"{c['name']}: {b.split('/')[1]} vs {first.split('/')[1]}: "
                  f"{c['tps'][b] / c['tps'][first]:.2f}x")
    for r in rollouts.values():
        getattr(r, "close", lambda: None)()


def recompute(args, eng: Engine, ep, graphdef, prompts, p: int, n_new: int, s: int) -> None:
    """The second table: engine decode vs recomputing the whole row per token."""
    k = eng.steps_per_call
    if n_new <= k:
        print(f"\nvs full recompute: skipped (--new-tokens {n_new} fits in one chunk of K={k}: no decode to time)")
        return
    run_engine(eng, ep, prompts, n_new)  # compiles the batched prefills these prompts meet
    first_s, decode_s, _ = min((run_engine(eng, ep, prompts, n_new) for _ in range(args.repeats)),
                              key=lambda r: r[0] + r[1])
    eng_counts = eng.compile_counts()
    steps = min(args.naive_steps or n_new, n_new - 1)
    naive_compile, naive_step, naive_count = run_naive(graphdef, ep, prompts, p, n_new, steps, args.seed)
    tokens = s * n_new
    eng_tps, eng_e2e_tps, naive_tps = s * (n_new - k) / decode_s, tokens / (decode_s + first_s), s / naive_step
    extrap = "measured" if steps >= n_new - 1 else f"{steps} steps timed, x{n_new} extrapolated"
    print(f"\nvs full recompute: {s} sequences x {n_new} new tokens (no EOS stop), row width {p + n_new}; "
          f"naive compile {naive_compile:.1f} s (incl. first step)")
    rows = [
        (f"engine (KV cache), decode chunks of K={k} after the first", f"{eng_tps:,.0f}", f"{decode_s:.2f} s",
         "measured", f"{eng_counts['generate']}"),
        ("engine incl. prefill+insert", f"{eng_e2e_tps:,.0f}", f"{decode_s + first_s:.2f} s", "measured",
         f"prefill {eng_counts['prefill']}, insert {eng_counts['insert']}"),
        ("naive full recompute, batched", f"{naive_tps:,.1f}", f"{naive_step * n_new:.1f} s", extrap,
         f"{naive_count}"),
    ]
    head = ("path", "tokens/s", "time", "timing", "compilations")
    common.print_table(list(head), [list(r) for r in rows], align="<" * len(head))
    print(f"speedup (engine decode vs naive full recompute): {eng_tps / naive_tps:,.1f}x   "
          f"(incl. prefill: {eng_e2e_tps / naive_tps:,.1f}x)   target >= 10x")


def decode_wave(eng: Engine, ep, prompts, calls: int) -> float:
    """Every slot's sample through the slot scheduler (batched prefill) for `calls` + 1
    chunks; seconds from the first chunk on the host (the prefill's) to the last."""
    k = eng.steps_per_call
    _, secs, chunks = run_engine(eng, ep, prompts, min((calls + 1) * k, eng.max_new_tokens), prefill_rows=16)
    assert chunks == calls + 1, (chunks, calls)
    return secs


def roofline(args, eng: Engine, ep, model_cfg, rs, p: int, n_new: int, s: int, k: int) -> None:
    """The third table: decode tokens/s against (weights + live KV bytes) / HBM bandwidth."""
    calls = max(1, (n_new - 1) // k - 1)  # timed chunks after the first; the last column stays inside the cache
    prompts = [rs.randint(0, args.vocab, p).astype(np.int32) for _ in range(s)]
    decode_wave(eng, ep, prompts[:1] * s, calls)  # compiles every decode window the wave crosses
    secs = min(decode_wave(eng, ep, prompts, calls) for _ in range(args.repeats))
    steps = calls * k
    weights = sum(x.nbytes for x in jax.tree.leaves(ep))
    per_col = s * model_cfg.n_layers * 2 * model_cfg.n_kv_heads * model_cfg.resolved_head_dim * jnp.dtype(
        model_cfg.dtype).itemsize  # k and v of one column in every slot and layer
    kv = sum(per_col * (p + n + 1) for n in range(k, k + steps))  # columns held, plus the new one
    total = steps * weights + kv
    chip = chips.for_device(jax.devices()[0])
    bw = args.hbm_gbps * 1e9 or (chip.hbm_bandwidth if chip else 0.0)
    tps = s * steps / secs
    print(f"\ndecode vs HBM roofline: {s} slots x (prompt {p} + {steps} tokens), K={k}, {model_cfg.dtype}; "
          f"fastest of {args.repeats} waves, the first chunk (with the prefill) not timed")
    roof = s * steps / (total / bw) if bw else None
    rows = [["engine decode", f"{tps:,.0f}", f"{secs:.2f} s", f"{total / steps / 1e9:.3f}",
             f"{total / secs / 1e9:,.0f}" if secs else "-"],
            ["HBM roofline (weights + live KV)", common.fmt(roof, ",.0f"),
             f"{total / bw:.2f} s" if bw else "-", f"{total / steps / 1e9:.3f}", f"{bw / 1e9:,.0f}" if bw else "-"]]
    common.print_table(["path", "tokens/s", "time", "GB read per step", "GB/s"], rows, align="<>>>>")
    print(f"per step: weights {weights / 1e9:.3f} GB, KV {kv / steps / 1e9:.3f} GB on average")
    if roof:
        src = "--hbm-gbps" if args.hbm_gbps else f"{chip.name} published"
        print(f"engine decode vs HBM roofline ({src} {bw / 1e9:,.0f} GB/s): {tps / roof:.1%}   target >= 50%: "
              f"{'met' if tps / roof >= 0.5 else 'NOT met'}")
    else:
        print(f"no published HBM bandwidth for {jax.devices()[0].device_kind!r}: pass --hbm-gbps for the ratio")


def main():
    args = parse_args()
    parts = args.parts.split(",")
    cfg = cfg_lib.load(args.config)
    model_cfg = dataclasses.replace(cfg.model, dtype=args.dtype, param_dtype=args.dtype)
    if "vllm" in args.backends:  # a Qwen2 checkpoint vLLM can read
        model_cfg = dataclasses.replace(model_cfg, qkv_bias=True, learned_positions=0)
    p = args.prompt_len or cfg.engine.max_prompt_len
    n_new, s = args.new_tokens, args.sequences
    graphdef, params = nnx.split(Transformer(model_cfg, args.vocab, rngs=nnx.Rngs(args.seed)))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rs = np.random.RandomState(args.seed)
    prompts = [rs.randint(0, args.vocab, rs.randint(p // 2, p + 1)).astype(np.int32) for _ in range(s)]
    dev = jax.devices()[:1]
    k = args.steps_per_call or cfg_lib.EngineConfig().steps_per_call

    sampling = dict(temperature=1.0, top_k=0, top_p=1.0)
    eng = Engine(model_cfg, graphdef, vocab_size=args.vocab, slots=s, max_prompt_len=p, max_new_tokens=n_new,
                 seed=args.seed, devices=dev, steps_per_call=k, **sampling)
    ep = eng.load_params(params)
    ckpt = backends.write_checkpoint(params, model_cfg, args.vocab, args.dtype) if "vllm" in args.backends else None
    st = backends.Setup(eng, sampling, ep, model_cfg, args.vocab, args.dtype, args.seed, ckpt and ckpt.name)
    print(f"model: {args.config} model section, {n_params / 1e6:.1f}M params, vocab {args.vocab}, "
          f"{args.dtype} on {jax.default_backend()} ({dev[0].device_kind}), "
          f"{model_cfg.n_layers} layers d={model_cfg.d_model} H={model_cfg.n_heads} "
          f"Hkv={model_cfg.n_kv_heads} F={model_cfg.d_ff}")
    if "fair" in parts or "recompute" in parts:
        t0 = time.perf_counter()
        for n in (1 << i for i in range(args.samples.bit_length())):  # prefill, the K-step call, free, batched inserts
            generate_all(eng, ep, prompts[:1], samples=n, eos_id=None, max_tokens=[[1] * n])
        generate_all(eng, ep, prompts[:1], eos_id=None)  # every decode window
        print(f"compile: engine {time.perf_counter() - t0:.1f} s (prefill+insert+generate, K={k})")
    if "fair" in parts:
        layouts = {}
        for name in args.layouts:
            cls, kw = LAYOUTS[name]
            e = cls(model_cfg, graphdef, vocab_size=args.vocab, slots=s, max_prompt_len=p, max_new_tokens=n_new,
                    seed=args.seed, devices=dev, steps_per_call=k, **sampling, **kw)
            layouts[name] = BuiltinRollout(e, e.load_params(params), 0)
        if args.ahead != [1]:  # each layout (or the platform's) once per value, each with its own slots
            layouts = {f"{name}, ahead {a}": _ahead(r, a) for name, r in (layouts or {"default": BuiltinRollout(eng, ep, 0)}).items()
                       for a in args.ahead}
        fair(args, st, graphdef, rs, p, n_new, s, k, layouts)
    if "recompute" in parts:
        recompute(args, eng, ep, graphdef, prompts, p, n_new, s)
    if "roofline" in parts:
        roofline(args, eng, ep, model_cfg, rs, p, n_new, s, k)


if __name__ == "__main__":
    main()
