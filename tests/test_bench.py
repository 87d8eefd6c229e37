"""The benchmark scripts still run against the package (nothing here is timed: the numbers
they print are not checked, only that every part runs to its verdict lines)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.soak  # compiles every part's decoder; the engine itself is tested in tests/rollout
def test_engine_bench_runs_every_part():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    r = subprocess.run([sys.executable, "bench/engine.py", "--config", "configs/tiny.yaml", "--new-tokens", "16",
                        "--waves", "1", "--naive-steps", "1", "--repeats", "1", "--sequences", "8", "--samples", "2",
                        "--hbm-gbps", "20", "--ahead", "1,0"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for line in ("equal lengths: engine (default, ahead 1) vs static batch",
                 "varied lengths: default, ahead 0 vs default, ahead 1: ",
                 "speedup (engine decode vs naive full recompute)", "engine decode vs HBM roofline (--hbm-gbps 20"):
        assert line in r.stdout, r.stdout[-3000:]


@pytest.mark.parametrize("script", ["bench/engine.py", "bench/async.py"])
def test_a_bench_without_vllm_names_the_extra(script):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, script, "--backend", "builtin,vllm"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout[-2000:])
    assert len(r.stderr.strip().splitlines()) == 1 and "[vllm] extra" in r.stderr, r.stderr[-2000:]


@pytest.mark.soak  # a full training run per row; CI trains from an HF checkpoint in test_export.py
def test_the_async_bench_trains_on_its_hugging_face_checkpoint():
    """hf_tiny (built-in rows; `--backend builtin,vllm` adds vLLM's in .venv-vllm): the script
    writes the tiny-shaped checkpoint, a real training run loads it and the table has its row."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "bench/async.py", "--scenarios", "hf_tiny", "--lookaheads", "1",
                        "--steps", "9", "--warmup", "4", "--repeats", "1"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "model.hf_path=" in r.stdout and "failed" not in r.stdout, r.stdout[-3000:]
    row = next(line for line in r.stdout.splitlines() if line.startswith("| in_order | L=1"))
    assert float(row.split("|")[3]) > 0  # steps/s


def test_disjoint_hardware_simulation_runs_the_real_pump():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import pipeline_sim
    finally:
        sys.path.remove(str(REPO / "bench"))
    step_s = 0.01
    out = pipeline_sim.run(1, step_s=step_s, steps=6, warmup=2)
    # every step's samples came through the pump: 4 prompts x 8 samples x 8 tokens per step, at
    # least six steps' worth and at most the 6 + 4 steps of records the run feeds it
    assert 6 * 4 * 8 * 8 <= out["tokens"] <= 10 * 4 * 8 * 8 and out["calls"] >= 6
    # the simulated learner device runs one step_s step after another: no faster than 1 / step_s
    assert 0 < out["steps_per_s"] <= (1 / step_s) * (1 + 1e-6), out


@pytest.mark.soak  # two learners compiled; LoRA's publication is tested in tests/learner/test_lora.py
def test_the_lora_bench_prints_both_rows_and_the_ratio():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "bench/lora.py", "--config", "configs/tiny.yaml", "--rank", "4", "--prompts",
                        "2", "--repeats", "1", "--steps", "1"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| full " in r.stdout and "| lora r=4 " in r.stdout and "LoRA / full = " in r.stdout, r.stdout


@pytest.mark.soak  # four training runs and six servers: 1.5-2.5 minutes on 2 shared cores
def test_the_fleet_bench_prints_every_table():
    """bench/fleet.py --quick: in-process vs a fleet of 1 and 2 `async-rl serve` servers, the
    publication figures, and a server SIGKILLed mid-run with its lost tokens counted."""
    for mod in ("httpx", "starlette", "uvicorn"):
        pytest.importorskip(mod)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "bench/fleet.py", "--quick"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert "FAILED" not in r.stdout, r.stdout[-3000:]
    for line in ("| in-process (baseline) | builtin |", "| fleet of 1 ", "| fleet of 2 ", "| tiny model ",
                 "| synthetic ", "tiny: fleet of 2 = ", "server kill: ", "tokens lost (bound "):
        assert line in r.stdout, r.stdout[-3000:]


def test_the_moe_bench_prints_both_tables():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "bench/moe.py", "--d-model", "64", "--experts", "4", "--d-ff-expert", "32",
                        "--tokens", "256", "--repeats", "1", "--prompts", "8"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for line in ("| dense SwiGLU, width k x F", "| MoE, E experts top-k", "| dense  ", "| MoE, routing replay off ",
                 "| MoE, routing replay on "):
        assert line in r.stdout, r.stdout[-3000:]


def test_the_sampling_bench_keeps_one_set_by_both_paths():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "bench/sampling.py", "--rows", "4", "--vocab", "2048", "--repeats", "1"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kept sets identical: True" in r.stdout and "| threshold halving " in r.stdout, r.stdout[-3000:]
