"""Shared test helpers: small configs and reading run outputs."""
from __future__ import annotations

import json
from pathlib import Path

from async_rl import config as C

FAST = ["log.progress=false", "log.tensorboard=false", "log.plot=false", "run.compilation_cache=",
        "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_kv_heads=2",
        "engine.max_concurrent_decodes=16", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6",
        "data.max_digits=4", "checkpoint.every_steps=0"]


def cfg(run_dir: Path, *overrides: str) -> C.Config:
    return C.load("configs/tiny.yaml", [f"run.dir={run_dir}", *FAST, *overrides])


def lineage(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "lineage.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []


def steps_of(run_dir: Path) -> dict[int, list[int]]:
    """step -> prompt_ids trained in it, in ordinal order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for r in lineage(run_dir):
        out.setdefault(r["step"], []).append((r["ordinal"], r["prompt_id"]))
    return {s: [p for _, p in sorted(v)] for s, v in sorted(out.items())}
