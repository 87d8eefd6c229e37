"""A run on a fleet of `async-rl serve` processes (`engine.backend=remote`, docs/fleet.md):
servers SIGKILLed, restarted and replaced while the learner trains, the trainer SIGKILLed and
resumed; every prompt is trained exactly once, and the learner goes on while a server is down."""
import json
import random
import time

import pytest
from fleet_servers import SHARED, TRAIN, Server, stop_all, write_servers
from helpers import kill9, lineage, run_cli, spawn, wait_for_step

from async_rl.state.audit import audit

pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

@pytest.mark.slow
def test_servers_and_trainer_killed_at_random_moments_every_prompt_once(tmp_path, xla_cache):
    rng = random.Random(0)
    run_dir, servers_file = tmp_path / "run", tmp_path / "servers.txt"
    # a and b serve from the start; a2 is a restarted a (a new port), c a new server that replaces b
    a, b, a2, c = (Server() for _ in range(4))
    a, b, a2, c = (s.ready() for s in (a, b, a2, c))
    write_servers(servers_file, [a, b])
    overrides = [*SHARED, *TRAIN, "engine.backend=remote", f"engine.servers_file={servers_file}"]
    server_kills = trainer_kills = 0
    p, killed_at, said = None, [], ""

    def at_step(n: int) -> None:
        assert wait_for_step(run_dir, n, p, timeout=240), p.stderr.read()[-3000:]
        time.sleep(rng.uniform(0, 0.3))  # a random moment after that step

    try:
        p = spawn(run_dir, *overrides, cache=xla_cache)
        at_step(2)
        server_kills += a.kill()  # 1: the learner goes on with b alone
        killed_at.append(time.time())
        at_step(4)
        write_servers(servers_file, [a2, b])  # a, restarted
        at_step(6)
        trainer_kills += kill9(p)  # the servers keep running; the new trainer's requests are its own
        said += p.stderr.read()
        p = spawn(run_dir, *overrides, cache=xla_cache)
        at_step(8)
        server_kills += b.kill()  # 2: replaced by c, added to the file
        killed_at.append(time.time())
        write_servers(servers_file, [a2, c])
        at_step(10)
        server_kills += a2.kill()  # 3: c alone until the end
        killed_at.append(time.time())
        write_servers(servers_file, [c])
        at_step(12)
        trainer_kills += kill9(p)
        said += p.stderr.read()
        r = run_cli(run_dir, *overrides, cache=xla_cache, timeout=400)
        assert r.returncode == 0, r.stderr[-4000:]
        said += r.stderr
    finally:
        if p is not None and p.poll() is None:
            kill9(p)
        stop_all()
    print(f"fleet: {server_kills} server and {trainer_kills} trainer SIGKILLs delivered")
    print("".join(line for line in said.splitlines(True) if line.startswith(("fleet:", "step", "resum"))))
    assert server_kills == 3 and trainer_kills == 2
    rep = audit(run_dir)
    assert rep["ok"], rep
    rows = lineage(run_dir)
    assert sorted(r["prompt_id"] for r in rows) == list(range(32))
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("rollout/samples_moved", 0) for m in metrics) > 0, "no kill found a sample in flight"
    for t in killed_at:  # the learner went on: a step within health_timeout_s (10) and a step's time of each kill
        after = min(m["time"] for m in metrics if m["time"] > t)
        assert after - t <= 10 + 10, f"no step for {after - t:.1f} s after a server was killed"


EPISODES = ["data.task=recall", "data.min_digits=4", "data.max_digits=4", "model.learned_positions=0",
            "rollout.max_new_tokens=20", "rollout.turn_max_tokens=3", "rollout.env=recall"]
LORA = ["learner.lora_rank=4", "learner.lora_alpha=8", "learner.warmup_steps=0"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["episodes", "lora"])
def test_a_server_killed_mid_run_of_episodes_or_lora_loses_nothing(tmp_path, xla_cache, kind):
    """Multi-turn episodes (env steps stay on the trainer, exactly once) and LoRA (the engine's
    tree is the base and the adapters) on a fleet of two, one killed at a random moment."""
    extra = EPISODES if kind == "episodes" else LORA
    rng = random.Random(1)
    run_dir, servers_file = tmp_path / "run", tmp_path / "servers.txt"
    a, b = Server(*extra), Server(*extra)
    write_servers(servers_file, [a.ready(), b.ready()])
    overrides = [*SHARED, *TRAIN, *extra, "data.num_records=16", "engine.backend=remote",
                 f"engine.servers_file={servers_file}"]
    p = None
    try:
        p = spawn(run_dir, *overrides, cache=xla_cache)
        assert wait_for_step(run_dir, 2, p, timeout=240), p.stderr.read()[-3000:]
        time.sleep(rng.uniform(0, 0.3))
        assert a.kill()
        assert p.wait(timeout=300) == 0, p.stderr.read()[-3000:]
        said = p.stderr.read()
    finally:
        if p is not None and p.poll() is None:
            kill9(p)
        stop_all()
    assert f"fleet: server {a.url} is down" in said, said[-3000:]
    rep = audit(run_dir)
    assert rep["ok"], rep
    assert sorted(r["prompt_id"] for r in lineage(run_dir)) == list(range(16))
    if kind == "episodes":
        assert rep["env_steps"]["recorded"] > 0 and rep["env_steps"]["unused"] == 0, rep["env_steps"]
    else:  # only the adapters move per version: the base file was written once
        import numpy as np
        files = sorted((run_dir / "fleet_weights").glob("v*.npz"))
        assert files and (run_dir / "fleet_weights" / "base.npz").exists()
        with np.load(files[-1]) as f:
            names = [k for k in f.files if not k.startswith("__")]
        assert names and all("/lora_a/" in k or "/lora_b/" in k for k in names), names


@pytest.mark.slow
def test_a_deterministic_run_on_servers_ends_with_the_in_process_fingerprint(tmp_path, xla_cache):
    det = ["run.determinism=true", "sampler.max_lookahead=2", "data.num_records=16"]
    r = run_cli(tmp_path / "in_process", *SHARED, *det, cache=xla_cache)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = Server(*det), Server(*det)
    try:
        servers = f"engine.servers={a.ready().url},{b.ready().url}"
        r = run_cli(tmp_path / "fleet", *SHARED, *det, "engine.backend=remote", servers, cache=xla_cache)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        stop_all()
    final = [json.loads((tmp_path / d / "final.json").read_text()) for d in ("in_process", "fleet")]
    assert final[0]["step"] == final[1]["step"] == 8
    assert final[0]["fingerprint"] == final[1]["fingerprint"]
    rewards = [json.loads(x).get("rollout/reward_mean", 0) for x in (tmp_path / "fleet" / "metrics.jsonl").open()]
    assert max(rewards) > 0, "no reward: the weights never moved, the comparison would prove nothing"
