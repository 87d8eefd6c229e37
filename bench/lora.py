"""LoRA against full weights, side by side in one process: bytes moved per publication,
publish time, and the learner's step time and peak memory.

Owns: building both learners and one engine on the same devices from one preset (default
`small`), the timing and the printed table. Does not own: any LoRA logic (it drives the real
`Learner`, `Engine.load_params` / `Engine.adopt` and the publication path `Session.engine_params`
takes: the full weights cast and copied into the engine, or with LoRA the adapters alone beside
the base published once).

Publication: per version, the bytes the learner hands the engine (its parameters' bytes in the
learner's dtype: all weights, or the adapters) and the wall time until the engine's copy is
ready (median of --repeats). Step: one learner step on random rows (--prompts groups of the
preset's samples_per_prompt), median of --steps after a compile step; its peak memory is XLA's
compiled-memory figure (arguments + temporaries + outputs not aliased to them), as `async-rl
plan` reports it. `--shapes CONFIG` adds the bytes per publication of another config from its
shapes alone (no weights made: e.g. an 8B plan config).

    python bench/lora.py                                    # small preset, rank 16
    python bench/lora.py --config configs/tiny.yaml --rank 4 --prompts 4
    python bench/lora.py --config configs/smollm2-arith.yaml --shapes configs/plan/llama3-8b-lora.yaml
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/small.yaml")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8, help="groups per learner step")
    ap.add_argument("--shapes", default="", help="another config: its bytes per publication from shapes alone")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from flax import nnx

    from async_rl import config as C
    from async_rl.learner.batch import Row, build_batch
    from async_rl.learner.step import Learner
    from async_rl.model import hf, sharding
    from async_rl.plan.compile import peak_bytes
    from async_rl.rollout.engine import Engine
    from bench.common import print_table
    base = hf.resolve(C.load(args.config, [f"rollout.prompts_per_step={args.prompts}", "learner.warmup_steps=0",
                                           "learner.schedule=constant"]))  # a Hugging Face model's shapes
    from async_rl.data.tokenizer import build_tokenizer
    vocab = base.model.vocab_size or build_tokenizer(base.tokenizer, synthetic=base.data.char_vocab).vocab_size
    mesh = sharding.make_devices(base.mesh).learner

    def engine_for(learner):
        ec = base.engine
        return Engine(base.model, learner.graphdef, vocab_size=vocab, slots=ec.max_concurrent_decodes,
                      max_prompt_len=ec.max_prompt_len, max_new_tokens=base.rollout.max_new_tokens,
                      temperature=1.0, top_k=0, top_p=1.0, seed=0, devices=list(mesh.devices.flat))

    def timed(fn, n):
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    def rows(cfg):
        rs = np.random.RandomState(0)
        P, N, G = cfg.engine.max_prompt_len, cfg.rollout.max_new_tokens, cfg.rollout.samples_per_prompt
        out = []
        for _ in range(cfg.rollout.prompts_per_step):
            prompt = rs.randint(1, vocab, P // 2).astype(np.int32)
            for _ in range(G):
                out.append(Row(prompt, rs.randint(1, vocab, N).astype(np.int32),
                               np.full(N, -np.log(vocab), np.float32), np.zeros(N, np.int32), float(rs.rand())))
        return build_batch(out, n_rows=len(out), prompt_len=P, max_new=N, pad_id=0)

    table = []
    for name, cfg in (("full", base), (f"lora r={args.rank}", C.replace(base, learner={
            "lora_rank": args.rank, "lora_alpha": args.alpha}))):
        learner = Learner(cfg, vocab, mesh, log=lambda _: None)
        engine = engine_for(learner)
        state = learner.init_state(learner.init_params())
        params = state["params"]
        moved = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        if learner.lora is None:
            publish = lambda: engine.load_params(learner.publishable(params))  # noqa: E731
        else:
            engine_base = engine.adopt(learner.base_params())  # once per run
            publish = lambda: nnx.merge_state(engine_base, engine.load_params(learner.publishable(params)))  # noqa: E731
        publish()  # compiles the cast
        pub_s = timed(publish, args.repeats)
        batch = rows(cfg)
        second = learner.base_params() if learner.lora is not None else None
        peak = peak_bytes(learner._step.lower(state, second, sharding.global_batch(
            learner.mesh, learner.agreed(batch).device_dict())).compile().memory_analysis())
        state, _ = learner.step(state, batch)  # compiles the step
        jax.block_until_ready(state)
        step_times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, m = learner.step(state, batch)
            jax.block_until_ready((state, m))
            step_times.append(time.perf_counter() - t0)
        n_opt = sum(x.size for x in jax.tree.leaves(state["opt"]))
        table.append([name, f"{moved / 2**20:.2f}", f"{pub_s * 1e3:.1f}", f"{statistics.median(step_times):.3f}",
                      f"{peak / 2**20:.0f}", f"{n_opt * 4 / 2**20:.1f}"])
    print(f"{args.config}: {jax.devices()[0].platform}, {len(jax.devices())} device(s)")
    print_table(["weights", "MiB per publication", "publish ms", "learner step s", "step peak MiB",
                 "optimizer MiB"], table)
    full_mb, lora_mb = float(table[0][1]), float(table[1][1])
    print(f"bytes per publication: LoRA / full = {lora_mb / full_mb:.2%}")
    if args.shapes:
        from async_rl.model import flops
        other = C.replace(C.load(args.shapes, []), learner={"lora_rank": args.rank, "lora_alpha": args.alpha})
        full_b = flops.param_count(other.model, other.model.vocab_size) * np.dtype(other.model.param_dtype).itemsize
        lora_b = flops.adapter_count(other, other.model.vocab_size) * 4  # adapters are trained in fp32
        print(f"{args.shapes} (from shapes): {lora_b / 2**20:.1f} vs {full_b / 2**20:.1f} MiB per publication, "
              f"LoRA / full = {lora_b / full_b:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
