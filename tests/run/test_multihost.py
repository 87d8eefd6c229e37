"""A real multi-process job on one machine: two training processes joined through
jax.distributed (loopback), each with its own Grain shard, pump, engine and ledger shard,
one SPMD learner across both; killed and resumed, every prompt still trained once."""
import json

import pytest
from helpers import run_multi

from async_rl.state.audit import audit

# synchronous saves: the kill at step 5 must find step 4's checkpoint committed
BASE = ["data.num_records=25", "rollout.prompts_per_step=4", "checkpoint.every_steps=2", "data.shuffle=false",
        "checkpoint.async=false"]


def _rows(run_dir):
    rows = []
    for p in sorted(run_dir.glob("lineage*.jsonl")):
        rows += [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    return rows


LORA = ["learner.lora_rank=4", "learner.lora_alpha=8", "learner.lr=3e-3"]


@pytest.mark.soak  # CI time; CI keeps the two-process weight and failure tests
@pytest.mark.parametrize("weights", ["full", "lora"])
def test_two_processes_stop_kill_resume_exactly_once(tmp_path, weights):
    """With LoRA too: the adapters span both processes' learner, the base is each process's own."""
    extra = LORA if weights == "lora" else []
    r = run_multi(tmp_path, *BASE, *extra, "train.max_steps=3")
    assert all(x.returncode == 0 for x in r), r[0].stderr[-3000:] + r[1].stderr[-3000:]
    assert (tmp_path / "lineage.p1.jsonl").exists()
    assert sorted({x["step"] for x in _rows(tmp_path)}) == [1, 2, 3]
    # SIGKILL process 0 right after step 5's lineage; process 1 is stuck in a collective and killed too
    r = run_multi(tmp_path, *BASE, *extra, kill_at="step:5")
    assert r[0].returncode == -9
    r = run_multi(tmp_path, *BASE, *extra)
    assert all(x.returncode == 0 for x in r), r[0].stderr[-3000:] + r[1].stderr[-3000:]
    assert "resumed step 4" in r[0].stderr and "resumed step 4" in r[1].stderr
    rows = _rows(tmp_path)
    # 25 records over 2 shards (13 + 12): 7 steps of 2 groups per process, the last ones short
    assert sorted(x["prompt_id"] for x in rows) == list(range(25))
    assert max(x["step"] for x in rows) == 7
    rep = audit(tmp_path)
    assert rep["ok"], rep
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["reason"] == "data_exhausted" and final["complete_epochs"] == [0]


PUBLISH = r"""
import sys
import jax, numpy as np
from async_rl import config as C
from async_rl.model import sharding
from async_rl.rollout.decoding import generate_all
from async_rl.rollout.engine import Engine
from async_rl.learner.step import Learner
sharding.init_distributed()
cfg = C.load("configs/tiny.yaml", ["model.dtype=bfloat16", f"engine.tensor={sys.argv[1]}"])
dev = sharding.make_devices(cfg.mesh)
learner = Learner(cfg, 32, dev.learner, shared_devices=dev.shared)
eng = Engine(cfg.model, learner.graphdef, vocab_size=32, slots=4, max_prompt_len=8, max_new_tokens=6,
             temperature=1.0, top_k=0, top_p=1.0, seed=0, devices=dev.engine, tensor=cfg.engine.tensor,
             all_devices=dev.engine_all)
params = learner.init_params()
assert eng.gathers(params)
one = eng.load_params(params)  # one program for every process's engine
old = eng.load_params(learner.publishable(params))  # gather this process's copy, then cast and place
assert eng._placed(one)
for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(old)):
    assert a.is_fully_addressable and a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim)
    np.testing.assert_array_equal(np.asarray(a.astype(np.float32)), np.asarray(b.astype(np.float32)))
prompts = [np.array([1, 2, 3], np.int32), np.array([4, 5], np.int32)]
x, y = (generate_all(eng, p, prompts, samples=2, eos_id=None) for p in (one, old))
assert all((a.tokens == b.tokens).all() for pa, pb in zip(x, y) for a, b in zip(pa, pb))
print("published", jax.process_index(), jax.tree.leaves(one)[0].dtype)
"""


def test_weights_reach_every_process_engine_in_one_program(tmp_path):
    """Two processes: the weights reach each process's engine (cast, split over tensor) from
    one program over the learner's layout, equal to gathering a copy per process first."""
    import os
    import subprocess
    import sys

    from helpers import free_port
    for tensor in (2,):  # tensor 1: the training runs above take this path too
        port = free_port()
        procs = [subprocess.Popen([sys.executable, "-c", PUBLISH, str(tensor)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=dict(os.environ, ASYNC_RL_DISTRIBUTED="1", JAX_PLATFORMS="cpu",
                                           JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", ASYNC_RL_NUM_PROCESSES="2",
                                           ASYNC_RL_PROCESS_ID=str(i),
                                           XLA_FLAGS="--xla_force_host_platform_device_count=2"))
                 for i in range(2)]
        outs = [p.communicate(timeout=240) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0 and "published" in out, err[-3000:]


def _sigterm_one_process(run_dir, target: int):
    """A 2-process job, SIGTERM to process `target` once step 2 is trained: every process
    stops at the same step boundary, saves that step once, exits 0; the audit passes."""
    import signal

    from helpers import checkpoint_steps, finish_job, handles_sigterm, lineage, read_stderr, running_job, wait_until
    with running_job(run_dir, *BASE, "checkpoint.every_steps=0", nproc=2, devices_per_process=2,
                     delay="step:0.3") as procs:
        wait_until(lambda: any(r["step"] >= 2 for r in lineage(run_dir)) or any(p.poll() is not None for p in procs),
                   timeout=240, what="step 2")
        assert all(p.poll() is None for p in procs), read_stderr(procs[0])[-3000:]
        assert handles_sigterm(procs[target].pid)
        procs[target].send_signal(signal.SIGTERM)
        codes = finish_job(procs, timeout=120)
    errs = [read_stderr(p) for p in procs]
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert "SIGTERM: stopping at the next safe point" in errs[target]
    last = max(r["step"] for r in _rows(run_dir))
    assert last < 7  # stopped early, not at the end of the data
    # one save, of the step both stopped after; both processes trained up to it
    assert checkpoint_steps(run_dir) == [last]
    assert max(json.loads(l)["step"] for l in (run_dir / "lineage.p1.jsonl").read_text().splitlines()) == last
    final = json.loads((run_dir / "final.json").read_text())
    assert final["reason"] == "signal" and final["step"] == last
    assert audit(run_dir)["ok"]


@pytest.mark.soak  # two real processes: ~100 s here; CI keeps the handler check below
def test_sigterm_to_process_1_stops_the_whole_job_with_one_save(tmp_path):
    _sigterm_one_process(tmp_path, target=1)


@pytest.mark.soak
def test_sigterm_to_process_0_stops_the_whole_job_with_one_save(tmp_path):
    _sigterm_one_process(tmp_path, target=0)


HANDLER = r"""
import os, signal, time
from async_rl import signals
from async_rl.model import sharding
s = signals.install()
assert sharding.init_distributed()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("received", s.received)
"""


def test_the_sigterm_handler_after_joining_a_job_is_ours(tmp_path):
    """jax.distributed.initialize must not leave a SIGTERM handler of its own in place of
    the one the step loop stops on (a one-process job, on loopback)."""
    import os
    import subprocess
    import sys

    from helpers import free_port
    env = dict(os.environ, ASYNC_RL_DISTRIBUTED="1", JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
               ASYNC_RL_NUM_PROCESSES="1", ASYNC_RL_PROCESS_ID="0", TF_CPP_MIN_LOG_LEVEL="0")
    r = subprocess.run([sys.executable, "-c", HANDLER], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "received SIGTERM" in r.stdout, r.stdout + r.stderr[-3000:]


# Gloo's threads print to stdout as they connect, in pieces: each line here is one write(2), so
# a line of ours arrives whole (pipe writes under PIPE_BUF are atomic) wherever theirs fall
AGREE = r"""
import os
import jax
from async_rl.model import sharding
say = lambda *a: os.write(1, (" ".join(map(str, a)) + "\n").encode())
sharding.init_distributed()
err = RuntimeError("reward function failed on prompt_id=7: boom\nsecond line") if jax.process_index() == 1 else None
say("agreed", sharding.agree_or_fail([jax.process_index()], None).ravel().tolist())
try:
    sharding.agree_or_fail([2.5], err)
    say("went on")
except sharding.PeerFailedError as e:
    say("peer failed:", e)
except RuntimeError as e:
    say("own error:", e)
"""


def test_a_failure_on_one_process_stops_every_process_at_the_same_agreement(tmp_path):
    """Two processes on loopback: where one has failed, the agreement raises on both (the
    failed one its own error, the other naming it) instead of letting one leave the
    collectives the other waits in."""
    import os
    import subprocess
    import sys

    from helpers import free_port
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", AGREE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, ASYNC_RL_DISTRIBUTED="1", JAX_PLATFORMS="cpu",
                                                  JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                  ASYNC_RL_NUM_PROCESSES="2", ASYNC_RL_PROCESS_ID=str(i)))
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    assert all("agreed [0.0, 1.0]" in o for o in outs), outs
    assert "peer failed: process 1 of 2 failed: reward function failed on prompt_id=7: boom\n" in outs[0], outs[0]
    assert "own error: reward function failed on prompt_id=7: boom\nsecond line" in outs[1], outs[1]


@pytest.mark.soak  # two real jobs of two processes
def test_a_reward_failure_on_process_1_stops_the_whole_job_and_it_resumes(tmp_path):
    """A 2-process job whose process 1's reward thread fails after a checkpoint is committed:
    both processes stop at the same step boundary, promptly, each with one error line (process
    0's names process 1 and the cause), exit 1, save nothing more; the next start resumes."""
    import time

    from helpers import checkpoint_steps, finish_job, read_stderr, running_job, wait_until
    run_dir = tmp_path
    # one device per process: with two, this job hung twice inside XLA:CPU collectives on a
    # loaded 2-core host, before any fault fired
    # 2 groups of 4 samples per process and step: call 29 is a reward of step 4's groups or later
    with running_job(run_dir, *BASE, nproc=2, devices_per_process=1, fault={1: "fail:reward:29"}) as procs:
        wait_until(lambda: any(p.poll() is not None for p in procs), timeout=400, what="the first process's exit")
        t_first = time.monotonic()
        codes = finish_job(procs, timeout=120)
        took = time.monotonic() - t_first
    errs = [read_stderr(p) for p in procs]
    assert codes == [1, 1], errs[0][-3000:] + errs[1][-3000:]
    assert took < 60, took  # not a coordination-service timeout
    lines = [[ln for ln in e.splitlines() if ln.startswith("error:")] for e in errs]
    assert all(len(x) == 1 for x in lines) and not any("Traceback" in e for e in errs), errs[0][-3000:] + errs[1][-3000:]
    assert "reward function failed" in lines[1][0] and "injected failure (reward call 29)" in lines[1][0], lines
    assert "process 1 of 2 failed: reward function failed" in lines[0][0], lines
    assert "injected failure (reward call 29)" in lines[0][0], lines
    steps = checkpoint_steps(run_dir)
    assert steps, errs[0][-3000:]
    assert f"nothing saved after the last committed checkpoint (step {steps[-1]})" in lines[0][0], lines
    with running_job(run_dir, *BASE, nproc=2, devices_per_process=1) as procs:
        codes = finish_job(procs, timeout=400)
    errs = [read_stderr(p) for p in procs]
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert all(f"resumed step {steps[-1]}" in e for e in errs)
    assert sorted(x["prompt_id"] for x in _rows(run_dir)) == list(range(25))
    assert audit(run_dir)["ok"]
