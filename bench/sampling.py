"""The engine's top-p set without a sort against the sort it replaced, per decode step.

Baseline: sorting each row's logits and cutting at the cumulative mass (what the engine did
before, and what a user writes first). Both keep the same set (checked here on every row);
the table gives milliseconds per call of each compiled path on this host, for a batch of rows
over a real vocabulary. A CPU time is a check that the new path does not waste, not a target.
(XLA's cost model counts a loop body once, so its byte counts are not compared: the halving
reads the row's order keys and probabilities 32 times, 8 bytes x V each.)

    .venv/bin/python bench/sampling.py
    .venv/bin/python bench/sampling.py --rows 256 --vocab 151936 --top-p 0.95
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from async_rl.rollout.sampling import nucleus_V  # noqa: E402


def sorted_nucleus_V(x_V, top_p: float):
    """The definition, by a full sort: keep while the mass before a token is < top_p."""
    s_V = jnp.sort(x_V)[::-1]
    p_V = jax.nn.softmax(s_V)
    cutoff = jnp.min(jnp.where((jnp.cumsum(p_V) - p_V) < top_p, s_V, jnp.inf))
    return x_V >= cutoff


def measure(fn, x_BxV, top_p: float, repeats: int) -> tuple[float, np.ndarray]:
    """(ms per call, the kept sets)."""
    compiled = jax.jit(jax.vmap(lambda x: fn(x, top_p))).lower(x_BxV).compile()
    kept = np.asarray(compiled(x_BxV))
    t0 = time.perf_counter()
    for _ in range(repeats):
        compiled(x_BxV).block_until_ready()
    return (time.perf_counter() - t0) / repeats * 1e3, kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="rows (decode slots) per call")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen's by default)")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    # logits with a realistic spread: a few strong candidates over a long flat tail
    x = rng.standard_normal((args.rows, args.vocab)).astype(np.float32) * 2.0
    x[:, :16] += rng.uniform(4, 10, (args.rows, 16)).astype(np.float32)
    x_BxV = jnp.asarray(x)
    rows = []
    results = {name: measure(fn, x_BxV, args.top_p, args.repeats)
               for name, fn in (("sort (baseline)", sorted_nucleus_V), ("threshold halving", nucleus_V))}
    same = np.array_equal(results["sort (baseline)"][1], results["threshold halving"][1])
    base_ms = results["sort (baseline)"][0]
    for name, (ms, kept) in results.items():
        rows.append([name, f"{ms:.1f}", f"{base_ms / ms:.1f}x", f"{kept.sum(1).mean():.0f}"])
    print(f"top-p {args.top_p}, {args.rows} rows x {args.vocab} vocabulary, {jax.devices()[0].platform}; "
          f"kept sets identical: {same}")
    print_table(["top-p set", "ms per call", "speed-up over the sort", "tokens kept per row"], rows)
    if not same:
        sys.exit("the two paths kept different sets")


if __name__ == "__main__":
    main()
