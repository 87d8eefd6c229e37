"""Crash tests: a real training subprocess is SIGKILLed at chosen and random moments
(also inside a checkpoint save and right after one), restarted each time, and run to the
end; the audit must pass, and in deterministic mode the parameters must be bit-identical
to an uninterrupted run (docs/design.md I1, I5, I6)."""
import json
import random
import signal
import time

import numpy as np
import pytest
from helpers import checkpoint_steps, kill9, lineage, run_cli, run_jsonl, run_text, spawn, wait_for_step, wait_until

from async_rl.state.audit import audit

BASE = ["data.num_records=32", "rollout.prompts_per_step=2", "data.num_epochs=1",
        "checkpoint.every_steps=1", "checkpoint.keep=2"]


def _schedule(seed: int, short: bool = False) -> list[tuple]:
    """At least 8 kills (6 when short, each kind once): inside saves, right after saves, after
    a step's log line, during start-up, at random moments after a step."""
    rng = random.Random(seed)
    if short:
        return [("at", "ckpt_write:2"), ("random", 3, rng.uniform(0, 0.4)), ("at", "ckpt_saved:4"),
                ("startup", rng.uniform(0.5, 2.5)), ("at", "step:6"), ("random", 7, rng.uniform(0, 0.4))]
    return [("at", "ckpt_write:2"), ("random", 3, rng.uniform(0, 0.4)), ("at", "ckpt_saved:4"),
            ("at", "step:5"), ("random", 6, rng.uniform(0, 0.4)), ("startup", rng.uniform(0.5, 2.5)),
            ("at", "ckpt_write:8"), ("random", 9, rng.uniform(0, 0.4)), ("at", "ckpt_saved:10"),
            ("random", 11, rng.uniform(0, 0.4))]


def crash_and_finish(run_dir, overrides, cache, seed=0, short=False, schedule=None, timeout=300.0) -> dict:
    """Runs the kill schedule (`_schedule`'s unless given), then the run to its end; counts
    only the kills that landed (a process that had already ended on its own is not a kill):
    final.json's fields and `delivered`. `timeout`: seconds a process may take to reach a
    kill point or a step."""
    delivered, own = 0, schedule is None
    schedule = _schedule(seed, short) if own else schedule
    for kind, *args in schedule:
        if kind == "at":
            r = run_cli(run_dir, *overrides, cache=cache, kill_at=args[0], timeout=timeout)
            assert r.returncode == -signal.SIGKILL, (args, r.returncode, r.stderr[-2000:])
            delivered += 1
        else:
            p = spawn(run_dir, *overrides, cache=cache)
            if kind == "random":
                if not wait_for_step(run_dir, args[0], p, timeout=timeout):
                    pytest.fail(f"process ended before step {args[0]}: {p.stderr.read()[-2000:]}")
                time.sleep(args[1])  # a random moment after that step, not an ordering wait
            else:
                time.sleep(args[0])
            landed = kill9(p)
            assert p.returncode in (-signal.SIGKILL, 0)
            delivered += landed
    r = run_cli(run_dir, *overrides, cache=cache, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"crash schedule: {delivered} of {len(schedule)} SIGKILLs delivered")
    assert not own or delivered >= (6 if short else 8), f"only {delivered} kills landed"
    return {**json.loads(run_text(run_dir, "final.json")), "delivered": delivered}


def _check_run(run_dir, staleness_bound=None):
    rep = audit(run_dir)
    assert rep["ok"], rep
    rows = lineage(run_dir)
    assert sorted(r["prompt_id"] for r in rows) == list(range(32))
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)  # the log is one history
    if staleness_bound is not None:
        assert all((r["step"] - 1) - min(r["versions"]) <= staleness_bound for r in rows)


# CI: the short schedule (every kind of kill once); the 10-kill schedule runs for every sampler
# in the soak matrix (test_soak_crash_matrix, in_order-1-whole is this run)
@pytest.mark.parametrize("lookahead", [1])
@pytest.mark.slow
def test_crash_matrix_in_order(tmp_path, xla_cache, lookahead):
    final = crash_and_finish(tmp_path, [*BASE, f"sampler.max_lookahead={lookahead}"], xla_cache, short=True)
    assert final["reason"] == "data_exhausted"
    _check_run(tmp_path, staleness_bound=lookahead)


@pytest.mark.soak  # CI time; fifo and windowed crashes also run in the soak matrix
@pytest.mark.parametrize("name", ["fifo", "windowed"])
def test_crash_staleness_samplers(tmp_path, xla_cache, name):
    ov = [*BASE, f"sampler.name={name}", "sampler.max_staleness=1", "rollout.partial=true"]
    final = crash_and_finish(tmp_path, ov, xla_cache, seed=3, short=True)
    assert final["reason"] == "data_exhausted"
    _check_run(tmp_path, staleness_bound=1)


@pytest.mark.soak  # CI time; tests/rollout/test_paged_engine.py evicts in CI
def test_crash_matrix_with_a_paged_pool_too_small_for_its_slots(tmp_path, xla_cache):
    """The paged engine evicting (its pool holds a quarter of the tokens its slots may take):
    evicted samples continue from their recorded tokens and every prompt trains exactly once."""
    ov = [*BASE, "engine.kv_layout=paged", "engine.page_size=4", "engine.kv_pool_tokens=80"]
    final = crash_and_finish(tmp_path, ov, xla_cache, seed=5, short=True)
    assert final["reason"] == "data_exhausted"
    _check_run(tmp_path, staleness_bound=1)
    assert max(r.get("rollout/evictions", 0) for r in run_jsonl(tmp_path, "metrics.jsonl")) > 0


SOAK = [(s, k, p) for s in ("in_order", "fifo", "windowed") for k in (0, 1, 3) for p in (False, True)]


@pytest.mark.soak
@pytest.mark.parametrize("name, k, partial", SOAK, ids=[f"{s}-{k}-{'partial' if p else 'whole'}" for s, k, p in SOAK])
def test_soak_crash_matrix(tmp_path, xla_cache, name, k, partial):
    knob = f"sampler.max_lookahead={k}" if name == "in_order" else f"sampler.max_staleness={k}"
    ov = [*BASE, f"sampler.name={name}", knob, f"rollout.partial={str(partial).lower()}"]
    final = crash_and_finish(tmp_path, ov, xla_cache, seed=k * 2 + partial)
    assert final["reason"] == "data_exhausted"
    _check_run(tmp_path, staleness_bound=k)


@pytest.mark.soak  # CI time; test_journal checks a deterministic resume bit for bit
def test_crash_matrix_deterministic_is_bit_identical(tmp_path, xla_cache):
    det = [*BASE, "run.determinism=true", "sampler.max_lookahead=2"]
    r = run_cli(tmp_path / "clean", *det, cache=xla_cache)
    assert r.returncode == 0, r.stderr
    clean = json.loads((tmp_path / "clean" / "final.json").read_text())
    final = crash_and_finish(tmp_path / "crashed", det, xla_cache, seed=1)
    assert final["step"] == clean["step"] == 16
    assert final["fingerprint"] == clean["fingerprint"]
    assert audit(tmp_path / "crashed")["ok"]


def test_sigterm_saves_and_exits_zero(tmp_path, xla_cache):
    ov = [*BASE, "checkpoint.every_steps=0"]
    p = spawn(tmp_path, *ov, cache=xla_cache, delay="step:0.2")
    assert wait_for_step(tmp_path, 3, p)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0, p.stderr.read()[-2000:]
    stopped = max(r["step"] for r in lineage(tmp_path))
    assert (tmp_path / "checkpoints" / str(stopped)).exists()  # saved at the step boundary it stopped on
    r = run_cli(tmp_path, *ov, cache=xla_cache)
    assert r.returncode == 0 and f"resumed step {stopped}" in r.stderr, r.stderr[-2000:]
    assert audit(tmp_path)["ok"]
    assert sorted(r["prompt_id"] for r in lineage(tmp_path)) == list(range(32))


def test_second_signal_exits_at_once_and_keeps_the_last_checkpoint(tmp_path, xla_cache):
    ov = [*BASE, "checkpoint.every_steps=2"]
    p = spawn(tmp_path, *ov, cache=xla_cache, delay="step:0.5")
    assert wait_for_step(tmp_path, 3, p)
    wait_until(lambda: checkpoint_steps(tmp_path), 120, "step 2's checkpoint commit")
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=120)
    assert rc != 0  # it did not wait to save
    r = run_cli(tmp_path, *ov, cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed step 2" in r.stderr or "resumed step 4" in r.stderr
    assert audit(tmp_path)["ok"]


def test_a_signal_while_a_finished_run_exits_changes_nothing(tmp_path, xla_cache):
    """The run has ended and saved; the process is on its way out (held there by a delay point):
    a SIGTERM then exits with the run's code, 0, not -15; a second one exits at once with it."""
    from helpers import read_stderr, spawn_job
    (p,) = spawn_job(tmp_path, *BASE, "train.max_steps=2", f"run.compilation_cache={xla_cache}", delay="exit:30")
    try:
        wait_until(lambda: "fault: delay at exit" in read_stderr(p) or p.poll() is not None, 400, "the run's exit")
        assert p.poll() is None, read_stderr(p)[-3000:]
        assert json.loads((tmp_path / "final.json").read_text())["step"] == 2
        p.send_signal(signal.SIGTERM)
        wait_until(lambda: "SIGTERM while exiting" in read_stderr(p), 10, "the signal's note")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0, read_stderr(p)[-3000:]  # the second at once, long before the delay ends
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=60)
    assert "SIGTERM while exiting: the run has ended; exiting with code 0" in read_stderr(p)
    assert checkpoint_steps(tmp_path) == [1, 2] and audit(tmp_path)["ok"]


def test_a_run_stopped_while_its_pump_compiles_exits_cleanly(tmp_path):
    """SIGTERM at start-up while the pump thread generates the first groups (compiles, device
    calls; no compilation cache) and stopping waits only 0.1 s for it: exit 0 with a warning,
    not an abort of Python's finalization ("exception not rethrown") on the thread left in C++."""
    from helpers import read_stderr, spawn_job

    def generating(run):
        return any(f.stat().st_size for f in (run / "journal").rglob("*.jrn"))
    for attempt in range(3):  # until the signal finds the pump thread busy
        run = tmp_path / str(attempt)
        (p,) = spawn_job(run, *BASE, "run.compilation_cache=", fault={0: "wait:pump_stop:0.1"})
        try:
            wait_until(lambda: generating(run) or p.poll() is not None, 300, "the first finished samples")
            p.send_signal(signal.SIGTERM)
            rc = p.wait(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
        err = read_stderr(p)
        assert rc == 0 and "Traceback" not in err, err[-3000:]
        if "the pump thread did not stop within 0.1 s" in err:
            assert not lineage(run) and not checkpoint_steps(run)
            return
    pytest.fail("the signal never found the pump thread inside a compile or device call")


@pytest.mark.slow
def test_a_distilled_run_killed_4_times_ends_with_an_uninterrupted_run_s_weights(tmp_path, xla_cache):
    """learner.distill: a sample does not carry its teacher logprobs; the step that trains it
    computes them again from the frozen teacher, so 4 SIGKILLs (inside and after a save, after a
    step) leave the trained stream, and the weights, as an uninterrupted run's."""
    t = run_cli(tmp_path / "teacher", "data.num_records=8", "rollout.prompts_per_step=2", "model.n_layers=1",
                cache=xla_cache)
    assert t.returncode == 0, t.stderr[-2000:]
    det = [*BASE, "run.determinism=true", "learner.distill=reverse_kl", f"learner.teacher={tmp_path / 'teacher'}",
           "rollout.reward=none"]
    r = run_cli(tmp_path / "clean", *det, cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    clean = json.loads((tmp_path / "clean" / "final.json").read_text())
    kills = [("at", "ckpt_write:2"), ("at", "ckpt_saved:4"), ("at", "step:6"), ("at", "ckpt_write:9")]
    final = crash_and_finish(tmp_path / "crashed", det, xla_cache, schedule=kills)
    assert final["delivered"] == 4 and final["step"] == clean["step"] == 16
    assert final["fingerprint"] == clean["fingerprint"]
    _check_run(tmp_path / "crashed")
    kl = [r["learner/distill_reverse_kl"] for r in run_jsonl(tmp_path / "crashed", "metrics.jsonl")]
    assert len(kl) >= 16 and all(np.isfinite(kl))
