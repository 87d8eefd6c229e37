"""Memory of a long multi-turn run: the process's resident memory should level off once every
program shape has compiled, not keep rising with the steps."""

import os
import subprocess
import sys
import time

import pytest

STEPS = int(os.environ.get("ASYNC_RL_SOAK_MEMORY_STEPS", "300"))


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (FileNotFoundError, ProcessLookupError):
        return None


@pytest.mark.soak  # several minutes of training on 2 cores
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_long_multi_turn_runs_memory_stops_growing(tmp_path, xla_cache):
    """configs/tiny-tools.yaml (an env turn per episode) for STEPS steps over two epochs, with
    checkpoints, held-out evaluations and TensorBoard as a user runs it: the median resident
    memory of the last quarter of the run is within 64 MB of the second quarter's (warm-up,
    compilation and the first checkpoints are in the first)."""
    args = [sys.executable, "-m", "async_rl", "train", "--config", "configs/tiny-tools.yaml", f"run.dir={tmp_path / 'run'}",
            f"train.max_steps={STEPS}", "data.num_epochs=2", "eval.every_steps=50", "checkpoint.every_steps=25",
            "log.progress=false", "log.tensorboard=true", "log.plot=false", f"run.compilation_cache={xla_cache}"]
    log = open(tmp_path / "train.log", "w+")  # a file, not a pipe: 300 step lines would fill one
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, text=True)
    samples = []
    end = time.monotonic() + 1800
    try:
        while p.poll() is None and time.monotonic() < end:
            if (mb := _rss_mb(p.pid)) is not None:
                samples.append(mb)
            time.sleep(1.0)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=60)
        log.seek(0)
        err = log.read()
        log.close()
    assert p.returncode == 0, err[-2000:]
    assert f"done: step {STEPS} (max_steps)" in err, err[-2000:]
    q = len(samples) // 4
    assert q >= 10, f"too few samples ({len(samples)})"
    second, last = sorted(samples[q:2 * q]), sorted(samples[3 * q:])
    growth = last[len(last) // 2] - second[len(second) // 2]
    assert growth < 64, f"RSS rose {growth:.0f} MB from the second quarter to the last ({samples[::q]})"
