"""Routing replay end to end: an MoE run with learner.routing_replay SIGKILLed four times (and
resumed with its experts split over an expert axis) trains every prompt exactly once, and
every sample saved half-finished (or finished) in a checkpoint before a kill is trained with
the routes recorded before the kill (docs/design.md, "Routing replay"; I1, I5)."""
import random
import shutil

import numpy as np
import pytest
from helpers import checkpoint_steps, lineage, read_ledger, rollouts, run_cli
from test_crash import crash_and_finish

from async_rl.state.audit import audit
from async_rl.state.lineage import decode_routes

MOE = ["model.qk_norm=true", "model.n_experts=4", "model.n_experts_per_token=2", "model.d_ff_expert=32",
       "learner.routing_replay=true", "log.rollouts=true"]
# a slow engine (few slots, long completions) beside a learner that rests after each step: saves
# catch samples part-way through generation (as in tests/run/test_resume.py)
RUN = ["data.num_records=16", "rollout.prompts_per_step=2", "data.num_epochs=1", "checkpoint.every_steps=1",
       "checkpoint.keep=100", "checkpoint.async=false", "sampler.max_lookahead=1", "engine.max_concurrent_decodes=4",
       "rollout.max_new_tokens=12", "data.max_digits=6", "model.learned_positions=24", *MOE]


def _inflight(run_dir, step: int) -> dict:
    """(ordinal, sample) -> (tokens, routes) of the half-finished samples checkpoint `step` holds."""
    led = read_ledger(run_dir, step)
    return {(g.ordinal, i): (list(s.tokens), s.route_rows()) for g in led.groups.values()
            for i, s in enumerate(g.samples) if s.tokens and not s.done}


@pytest.mark.slow
def test_routing_replay_crash_keeps_the_routes_recorded_before_each_kill(tmp_path, xla_cache):
    src, run = tmp_path / "src", tmp_path / "run"
    r = run_cli(src, *RUN, "train.max_steps=4", cache=xla_cache, delay="generate:0.03,step:0.3")
    assert r.returncode == 0, r.stderr[-2000:]
    caught = [s for s in checkpoint_steps(src) if _inflight(src, s)]
    assert caught, "no save caught a half-finished sample"
    step = caught[-1]
    saved = _inflight(src, step)
    assert all(rows is not None and len(rows) == len(g_prompt_of(src, step, key[0])) - 1 + len(toks)
               for key, (toks, rows) in saved.items())
    shutil.copytree(src, run)  # a run killed right after that save: its later checkpoints gone
    for s in checkpoint_steps(run):
        if s > step:
            shutil.rmtree(run / "checkpoints" / str(s))
    rng = random.Random(1)
    schedule = [("at", f"ckpt_write:{step + 1}"), ("random", step + 2, rng.uniform(0, 0.4)),
                ("at", f"ckpt_saved:{step + 3}"), ("random", step + 4, rng.uniform(0, 0.4))]
    # resumed on an expert-parallel mesh: each of the 4 devices' learner holds 2 of the 4 experts
    final = crash_and_finish(run, [*RUN, "mesh.expert=2"], xla_cache, schedule=schedule)
    assert final["delivered"] >= 4 and final["reason"] == "data_exhausted"
    rep = audit(run)
    assert rep["ok"], rep
    assert sorted(row["prompt_id"] for row in lineage(run)) == list(range(16))
    trained = {(g["ordinal"], i): (g, smp) for g in rollouts(run) for i, smp in enumerate(g["samples"])}
    for key, (toks, rows) in saved.items():
        g, smp = trained[key]
        assert smp["tokens"][:len(toks)] == toks and len(smp["tokens"]) > len(toks)  # continued, not regenerated
        got = decode_routes(smp["routes"])
        np.testing.assert_array_equal(got[:len(rows)], rows)  # the saved tokens' routes, as recorded
        assert len(got) == len(g["prompt_tokens"]) - 1 + len(smp["tokens"])
    print(f"{len(saved)} samples saved half-finished at step {step} kept their routes through "
          f"{final['delivered']} SIGKILLs")


def g_prompt_of(run_dir, step: int, ordinal: int):
    return read_ledger(run_dir, step).groups[ordinal].prompt_tokens
