"""Mixture of experts: an MoE block's cost against a dense block of equal active parameters, and
how far the engine's behaviour logprobs sit from the learner's on an MoE policy in bf16.

Cost: one block's MLP, forward and backward over `--tokens` tokens, the MoE one (E experts of
width F, top-k) against a dense SwiGLU of width k x F (the same matmul work per token): wall
time on this host (XLA:CPU computes `ragged_dot` as a dense product masked per expert, so here
the MoE block does E / k times the work it would on a TPU) and, with `--topology` (needs
libtpu), XLA's FLOPs and bytes of the same step compiled for that TPU (megablox's gmm states its
cost to XLA; its tgmm's, the weights' gradient, is added by formula).

Mismatch: a random Qwen3-MoE-shaped policy in bf16 generates with the built-in engine; the
learner's full-row forward recomputes the sampled tokens' logprobs; max |delta logprob| and
the mean k1 KL(engine || learner), with and without routing replay (the learner's forward
taking the experts the engine chose), beside a dense policy of the same width.

    .venv/bin/python bench/moe.py
    .venv/bin/python bench/moe.py --topology v5p:2x2x1    # needs libtpu
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from async_rl.config import ModelConfig  # noqa: E402
from async_rl.model import attention, flops, moe, sharding  # noqa: E402
from async_rl.model.transformer import MLP, Transformer, layout  # noqa: E402
from async_rl.rollout.decoding import generate_all  # noqa: E402
from async_rl.rollout.engine import Engine  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-ff-expert", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=64, help="mismatch: prompts, 4 samples of 32 tokens each")
    ap.add_argument("--topology", default="", help="also compile the cost step for this TPU topology (libtpu)")
    return ap.parse_args()


def blocks(a, dtype="float32"):
    base = dict(d_model=a.d_model, n_layers=1, n_heads=8, n_kv_heads=8, d_ff=a.top_k * a.d_ff_expert, qk_norm=True,
                dtype=dtype, param_dtype="float32")
    return ModelConfig(**base), ModelConfig(**base, n_experts=a.experts, n_experts_per_token=a.top_k,
                                            d_ff_expert=a.d_ff_expert)


def step_fn(block, spec):
    graphdef, params = nnx.split(block)

    def loss(p, x):
        m = nnx.merge(graphdef, p)
        y = m(x, valid=None, spec=spec) if isinstance(m, moe.MoE) else m(x)
        return (y.astype(jnp.float32) ** 2).mean()
    return jax.jit(jax.value_and_grad(loss)), params


def cost_rows(a):
    dense_cfg, moe_cfg = blocks(a, dtype="bfloat16")
    x = jax.random.normal(jax.random.key(0), (a.tokens, a.d_model), jnp.bfloat16)
    out = []
    for name, block in (("dense SwiGLU, width k x F", MLP(dense_cfg, rngs=nnx.Rngs(0))),
                        ("MoE, E experts top-k", moe.MoE(moe_cfg, rngs=nnx.Rngs(0)))):
        fn, params = step_fn(block, None)
        jax.block_until_ready(fn(params, x))
        t0 = time.perf_counter()
        for _ in range(a.repeats):
            jax.block_until_ready(fn(params, x))
        ms = (time.perf_counter() - t0) / a.repeats * 1e3
        tpu = tpu_cost(a, block) if a.topology else ("", "")
        out.append([name, f"{ms:.1f}", *tpu])
    return out


def tpu_cost(a, block):
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    dev = topologies.get_topology_desc(platform="tpu", topology_name=a.topology).devices[:1]
    mesh = sharding.build_mesh(list(dev), (1, 1, 1, 1), sharding.AXES)
    spec = attention.resolve("auto", "tpu", "bfloat16", mesh, sharding.BATCH_AXES, "tensor")
    fn, params = step_fn(block, spec)
    put = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    c = fn.lower(jax.tree.map(put, params), put(jnp.zeros((a.tokens, a.d_model), jnp.bfloat16))).compile()
    ca = c.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    extra = 6.0 * a.top_k * a.d_model * a.d_ff_expert * a.tokens if isinstance(block, moe.MoE) else 0.0  # tgmm
    return f"{(ca.get('flops', 0.0) + extra) / 1e9:.1f}", f"{ca.get('bytes accessed', 0.0) / 1e6:.0f}"


def mismatch_rows(a):
    """Per policy (dense; MoE with the learner routing by itself; MoE replaying the engine's
    routes): max |delta logprob| and mean k1 KL of the engine's sampled tokens, one generation each."""
    V, P, N = 256, 16, 32
    out = []
    for name, cfg in zip(("dense", "MoE"), blocks(a, dtype="bfloat16")):
        cfg = dataclasses.replace(cfg, n_layers=2, d_model=128, n_heads=4, n_kv_heads=4, d_ff=cfg.d_ff // 2,
                                  d_ff_expert=cfg.d_ff_expert // 2 if cfg.moe else 0)
        graphdef, params = nnx.split(Transformer(cfg, V, rngs=nnx.Rngs(0)))
        params = jax.tree.map(lambda x: x * 3.0, params)  # peaked outputs, as trained policies are
        eng = Engine(cfg, graphdef, vocab_size=V, slots=16, max_prompt_len=P, max_new_tokens=N, temperature=1.0,
                     top_k=0, top_p=1.0, seed=0, devices=jax.devices()[:1], routes=cfg.moe)
        rs = np.random.RandomState(0)
        prompts = [rs.randint(4, V, rs.randint(4, P + 1)).astype(np.int32) for _ in range(a.prompts)]
        rows = generate_all(eng, eng.load_params(params), prompts, samples=4, eos_id=-1)

        @jax.jit
        def fwd(p, t, pos, v, routes):
            model = nnx.merge(graphdef, p)
            return model.logits(model.hidden(t, pos, v, routes_BxTxLxK=routes))

        for replay in (False, True) if cfg.moe else (False,):
            deltas, kls = [], []
            for prompt, group in zip(prompts, rows):
                for c in group:
                    start, positions, valid = layout(len(prompt), P, P + N, len(prompt) + len(c.tokens))
                    tokens = np.zeros(P + N, np.int32)
                    tokens[start:P] = prompt
                    tokens[P:P + len(c.tokens)] = c.tokens
                    routes = None
                    if replay:
                        routes = np.full((P + N, cfg.n_layers, cfg.n_experts_per_token), -1, np.int32)
                        routes[start:start + len(c.routes)] = c.routes
                        routes = routes[None]
                    logits = fwd(params, tokens[None], positions[None], valid[None], routes)[0]
                    lp = jax.nn.log_softmax(logits[P - 1:P - 1 + len(c.tokens)].astype(jnp.float32), -1)
                    learner = np.asarray(jnp.take_along_axis(lp, jnp.asarray(c.tokens)[:, None], 1)[:, 0])
                    deltas.append(np.abs(learner - c.logprobs).max())
                    kls.append(np.mean(c.logprobs - learner))
            label = name if not cfg.moe else f"{name}, routing replay {'on' if replay else 'off'}"
            out.append([label, f"{max(deltas):.3g}", f"{np.mean(kls):.2e}"])
    return out


def main():
    a = parse_args()
    print(f"MoE block: D={a.d_model}, E={a.experts}, top-{a.top_k}, F={a.d_ff_expert}; dense block: width "
          f"{a.top_k * a.d_ff_expert}; {a.tokens} tokens, forward + backward, {jax.default_backend()} wall time"
          + (f"; XLA cost compiled for {a.topology} (megablox's tgmm by formula)" if a.topology else ""))
    heads = ["block (same matmul work per token)", "ms on this host"] + (
        [f"GFLOP on {a.topology}", f"MB accessed on {a.topology}"] if a.topology else [])
    rows = cost_rows(a)
    print_table(heads, [r[:len(heads)] for r in rows])
    m = flops.param_counts(blocks(a)[1], 256)
    print(f"(MoE block parameters: {m.trunk:,}, of which a token runs through {m.matmul:,})")
    print("\nengine (built-in, bf16) vs learner (full-row forward, bf16) on the sampled tokens")
    print_table(["policy", "max |delta logprob|", "mean k1 KL(engine || learner)"], mismatch_rows(a))


if __name__ == "__main__":
    main()
