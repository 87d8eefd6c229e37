"""Decode throughput: the KV-cache engine vs. full-recompute decoding, on one model shape.

Owns: timing and the printed table. Does not own: any model or engine logic.

The naive baseline recomputes the whole fixed-width row (P + N columns, as in the shared
layout, so it compiles once) for every new token, batched over the same sequences. Its
step cost does not depend on how many tokens exist yet, so timing a few steps and
multiplying is exact up to timer noise; the table says when it was extrapolated.

    python bench/engine.py                      # small preset, 32 sequences x 128 tokens
    python bench/engine.py --naive-steps 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from async_rl import config as cfg_lib
import common  # noqa: E402  (bench/common.py, beside this file)
from async_rl.engine import Engine, sample_token, token_key
from async_rl.model import Transformer, layout


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
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def block(x):
    return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def run_engine(eng: Engine, params, prompts, new_tokens: int):
    """Prefill + insert every sequence, then `new_tokens` generate steps; returns timings."""
    state = block(eng.init_decode_state())
    t0 = time.perf_counter()
    for slot, prompt in enumerate(prompts):
        state = eng.insert(eng.prefill(params, prompt), state, slot, ordinal=slot, sample=0)
    block(state)
    t1 = time.perf_counter()
    for _ in range(new_tokens):
        state, _, _ = eng.generate(params, state)  # returns host arrays: each step is synced
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


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


def main():
    args = parse_args()
    cfg = cfg_lib.load(args.config)
    model_cfg = dataclasses.replace(cfg.model, dtype=args.dtype, param_dtype=args.dtype)
    p = args.prompt_len or cfg.engine.max_prompt_len
    n_new, s = args.new_tokens, args.sequences
    graphdef, params = nnx.split(Transformer(model_cfg, args.vocab, rngs=nnx.Rngs(args.seed)))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rs = np.random.RandomState(args.seed)
    prompts = [rs.randint(0, args.vocab, rs.randint(p // 2, p + 1)).astype(np.int32) for _ in range(s)]
    dev = jax.devices()[:1]

    eng = Engine(model_cfg, graphdef, vocab_size=args.vocab, slots=s, max_prompt_len=p, max_new_tokens=n_new,
                 temperature=1.0, top_k=0, top_p=1.0, seed=args.seed, devices=dev)
    ep = eng.load_params(params)
    t0 = time.perf_counter()
    run_engine(eng, ep, prompts[:1], 1)  # compiles prefill, insert, generate
    eng_compile = time.perf_counter() - t0
    prefill_s, decode_s = run_engine(eng, ep, prompts, n_new)
    eng_counts = eng.compile_counts()

    steps = args.naive_steps or n_new
    steps = min(steps, n_new - 1)
    naive_compile, naive_step, naive_count = run_naive(graphdef, ep, prompts, p, n_new, steps, args.seed)

    tokens = s * n_new
    eng_tps = tokens / decode_s
    eng_e2e_tps = tokens / (decode_s + prefill_s)
    naive_tps = s / naive_step
    extrap = "measured" if steps >= n_new - 1 else f"{steps} steps timed, x{n_new} extrapolated"
    rows = [
        ("engine (KV cache), decode steps", f"{eng_tps:,.0f}", f"{decode_s:.2f} s", "measured",
         f"{eng_counts['generate']}"),
        ("engine incl. prefill+insert", f"{eng_e2e_tps:,.0f}", f"{decode_s + prefill_s:.2f} s", "measured",
         f"prefill {eng_counts['prefill']}, insert {eng_counts['insert']}"),
        ("naive full recompute, batched", f"{naive_tps:,.1f}", f"{naive_step * n_new:.1f} s", extrap,
         f"{naive_count}"),
    ]
    print(f"model: {args.config} model section, {n_params / 1e6:.1f}M params, vocab {args.vocab}, "
          f"{args.dtype} on {jax.default_backend()} ({dev[0].device_kind}), "
          f"{model_cfg.n_layers} layers d={model_cfg.d_model} H={model_cfg.n_heads} "
          f"Hkv={model_cfg.n_kv_heads} F={model_cfg.d_ff}")
    print(f"work: {s} sequences x {n_new} new tokens (no EOS stop), prompt width P={p}, row width {p + n_new}, "
          f"temperature 1")
    print(f"compile: engine {eng_compile:.1f} s (prefill+insert+generate), naive {naive_compile:.1f} s "
          f"(incl. first step)")
    head = ("path", "tokens/s", f"{tokens} tok", "timing", "compilations")
    common.print_table(list(head), [list(r) for r in rows], align="<" * len(head))
    print(f"speedup (engine decode vs naive): {eng_tps / naive_tps:,.1f}x   "
          f"(incl. prefill: {eng_e2e_tps / naive_tps:,.1f}x)   target >= 10x")


if __name__ == "__main__":
    main()
