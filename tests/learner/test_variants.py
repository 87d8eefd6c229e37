"""Loss variants: the defaults give today's update (recorded before the variants existed),
and every variant matches a small hand-computed example."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cli
from test_learner import batch_of, make, random_rows

from async_rl import config as C
from async_rl.learner import losses
from async_rl.learner.step import params_fingerprint

# The update of three learner steps under the default loss (params after - params before): its
# L2 norm and its projection on a fixed random unit direction. Recorded from the code whose
# params hashes (taken before the loss variants were added) were still checked by this test
# on the host that took them; a hash is not kept because XLA's CPU code, and so the last bits,
# follow the host's instruction set (seen: SSE4.2 / AVX2 / AVX-512 differ by 1e-8 in the norm,
# 3e-5 in the projection). Any change to the default update moves them far more.
LEARNER_UPDATE = {"default": (2.127980756329462, -1.5018867982072426),
                  "epochs": (45.91275392738242, -0.9767971414106881)}
CLI_UPDATE = (0.2924243028934139, -2.032526994806411)  # the same for a whole deterministic run (soak)


def _stats(after, before) -> tuple[float, float]:
    """The update's L2 norm and its projection on a fixed random unit direction."""
    d = np.concatenate([(np.asarray(jax.device_get(a), np.float64) - np.asarray(jax.device_get(b), np.float64)).ravel()
                        for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))])
    norm = float(np.linalg.norm(d))
    return norm, float(d @ np.random.default_rng(0).standard_normal(d.size)) / norm


def _update(*overrides) -> tuple[float, float]:
    cfg, learner = make(*overrides)
    before = learner.init_params()
    state = learner.init_state(learner.init_params())
    ref = learner.init_params() if learner.use_ref else None
    for seed in range(3):
        state, _ = learner.step(state, batch_of(cfg, random_rows(cfg, seed=10 + seed)), ref)
    return _stats(state["params"], before)


@pytest.mark.parametrize("name, overrides", [
    ("default", ()),
    ("epochs", ("learner.ppo_epochs=2", "learner.minibatches=2", "learner.lr=3e-2", "learner.kl_coef=0.1")),
])
def test_default_loss_is_unchanged(name, overrides):
    norm, proj = _update(*overrides)
    want_norm, want_proj = LEARNER_UPDATE[name]
    assert norm == pytest.approx(want_norm, rel=1e-5)
    assert proj == pytest.approx(want_proj, abs=1e-3)


@pytest.mark.soak  # a whole deterministic run (~70 s on 2 busy cores)
def test_default_training_run_is_unchanged(tmp_path, xla_cache):
    from async_rl.learner.step import Learner
    from async_rl.model import sharding
    from async_rl.state.saved_run import open_run, read_params

    r = run_cli(tmp_path, "data.num_records=32", "rollout.prompts_per_step=4", "checkpoint.every_steps=0",
                "run.determinism=true", "eval.every_steps=0", "log.plot=false", "log.tensorboard=false",
                cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    run = open_run(tmp_path)
    step, after = read_params(run, warn=lambda m: None)
    assert step == json.loads((tmp_path / "final.json").read_text())["step"]
    learner = Learner(run.cfg, run.vocab, sharding.make_devices(run.cfg.mesh).learner, log=lambda m: None)
    norm, proj = _stats(after, learner.init_params())
    assert norm == pytest.approx(CLI_UPDATE[0], rel=1e-5)
    assert proj == pytest.approx(CLI_UPDATE[1], abs=1e-3)


# ---- hand-computed examples --------------------------------------------------------------

def test_advantage_estimators():
    r = jnp.array([[1.0, 0.0, 0.5, 0.5]])  # mean 0.5, population std sqrt(0.125)
    std = np.sqrt(0.125)
    np.testing.assert_allclose(losses.advantages(r, "grpo", 1e-6)[0], [0.5 / std, -0.5 / std, 0, 0], rtol=1e-5)
    # Dr. GRPO: r_i - mean, no std division
    np.testing.assert_allclose(losses.advantages(r, "mean", 1e-6)[0], [0.5, -0.5, 0.0, 0.0], atol=1e-7)
    # RLOO: r_0 - (0 + .5 + .5)/3 = 2/3, r_1 - (1 + .5 + .5)/3 = -2/3, r_2 - (1 + 0 + .5)/3 = 0
    np.testing.assert_allclose(losses.advantages(r, "rloo", 1e-6)[0], [2 / 3, -2 / 3, 0.0, 0.0], atol=1e-6)


def test_soft_overlong_penalty_ramps_to_minus_coef_at_the_cap():
    # DAPO: 0 for |y| <= L_max - L_buf, (L_max - L_buf - |y|) / L_buf above; L_max 8, L_buf 3, x coef 0.5
    pen = losses.overlong_penalty(jnp.array([2, 5, 6, 7, 8]), max_len=8, buffer=3, coef=0.5)
    np.testing.assert_allclose(pen, [0.0, 0.0, -0.5 / 3, -1.0 / 3, -0.5], atol=1e-6)


def _two_rows(log_r, adv, mask):
    logp = jnp.array(log_r, jnp.float32)
    return logp, jnp.zeros_like(logp), jnp.array(adv, jnp.float32), jnp.array(mask)


def test_clip_higher_clips_each_side_with_its_own_epsilon():
    # ratios [0.7, 1.3] in a row with A = +1 and in a row with A = -1; range [1 - 0.2, 1 + 0.28]
    logp, behav, adv, mask = _two_rows(np.log([[0.7, 1.3], [0.7, 1.3]]), [1.0, -1.0], [[True, True]] * 2)
    f = lambda lp, high: losses.policy_loss(lp, behav, adv, mask, clip_eps=0.2, clip_high=high, correction="none",
                                            is_cap=2.0)
    loss, st = f(logp, 0.28)
    # A=+1: min(0.7, 0.8) = 0.7, min(1.3, 1.28) = 1.28 (high clip); A=-1: min(-0.7, -0.8) = -0.8 (low clip),
    # min(-1.3, -1.28) = -1.3; token mean -(0.7 + 1.28 - 0.8 - 1.3) / 4
    assert float(loss) == pytest.approx(0.03, abs=1e-6)
    assert float(st["clip_frac_low"]) == 0.25 and float(st["clip_frac_high"]) == 0.25
    assert float(st["clip_frac"]) == 0.5
    assert float(st["ratio_max"]) == pytest.approx(1.3, rel=1e-6)
    assert float(st["ratio_mean"]) == pytest.approx(1.0, rel=1e-6)
    # only unclipped tokens carry a gradient, -A r / 4
    g = jax.grad(lambda lp: f(lp, 0.28)[0])(logp)
    np.testing.assert_allclose(g, [[-0.175, 0.0], [0.0, 0.325]], atol=1e-6)
    # the symmetric clip (today's): 1.3 -> 1.2 in the A=+1 row: -(0.7 + 1.2 - 0.8 - 1.3) / 4
    assert float(f(logp, None)[0]) == pytest.approx(0.05, abs=1e-6)


def test_loss_aggregations():
    # ratio 1 everywhere: each token's surrogate is its row's advantage; row 0 has 3 tokens, A=+1;
    # row 1 has 1 token, A=-1; L_max 4
    logp, behav, adv, mask = _two_rows([[0.0] * 3, [0.0] * 3], [1.0, -1.0],
                                       [[True, True, True], [True, False, False]])
    f = lambda lp, agg: losses.policy_loss(lp, behav, adv, mask, clip_eps=0.2, correction="none", is_cap=2.0,
                                           row_w_B=None if agg == "token_mean" else losses.row_weights(mask, agg, 4))[0]
    assert float(f(logp, "token_mean")) == pytest.approx(-(3 - 1) / 4)  # -sum / tokens
    assert float(f(logp, "seq_mean")) == pytest.approx(0.0, abs=1e-7)  # -(3/3 - 1/1) / 2 rows
    assert float(f(logp, "token_sum_norm")) == pytest.approx(-(3 - 1) / (2 * 4))  # -sum / (rows x L_max)
    # seq_mean: each token weighs -A / (rows |y_i|); Dr. GRPO: -A / (rows L_max)
    np.testing.assert_allclose(jax.grad(f)(logp, "seq_mean"), [[-1 / 6] * 3, [0.5, 0, 0]], atol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(logp, "token_sum_norm"), [[-1 / 8] * 3, [1 / 8, 0, 0]], atol=1e-6)


def test_gspo_sequence_ratio_is_length_normalised_and_clipped_per_sequence():
    # row 0: log ratios [0.3, 0.1] -> s_0 = exp(0.2) = 1.2214 > 1.2, clipped; row 1: [0.1, -0.1, 0.3] ->
    # s_1 = exp(0.1) = 1.10517; both A = +1. GSPO: J = 1/G sum_i min(s_i A_i, clip(s_i) A_i)
    logp, behav, adv, mask = _two_rows([[0.3, 0.1, 0.0], [0.1, -0.1, 0.3]], [1.0, 1.0],
                                       [[True, True, False], [True, True, True]])
    w = losses.row_weights(mask, "seq_mean", 3)
    f = lambda lp: losses.policy_loss(lp, behav, adv, mask, clip_eps=0.2, correction="none", is_cap=2.0,
                                      ratio_level="sequence", row_w_B=w)
    loss, st = f(logp)
    s1 = np.exp(0.1)
    assert float(loss) == pytest.approx(-(1.2 + s1) / 2, rel=1e-6)
    assert float(st["clip_frac_high"]) == pytest.approx(2 / 5)  # row 0's two tokens, of 5
    assert float(st["ratio_mean"]) == pytest.approx((2 * np.exp(0.2) + 3 * s1) / 5, rel=1e-6)
    # grad J = 1/G sum_i s_i A_i 1/|y_i| sum_t grad log pi(y_it); clipped row 0 has none
    g = jax.grad(lambda lp: f(lp)[0])(logp)
    np.testing.assert_allclose(g, [[0, 0, 0], [-s1 / 6] * 3], rtol=1e-5, atol=1e-7)


def test_gspo_with_sequence_tis_weights_each_sequence():
    # pi_prox = pi_theta at the step start (ratio 1); w = min(prod_t pi_prox/mu, cap): row 0 exp(0.5) = 1.6487,
    # row 1 exp(1.0) = 2.718 -> cap 2; A = [1, -1]: J = 1/2 (1.6487 - 2)
    logp = jnp.zeros((2, 2))
    behav = jnp.array([[-0.2, -0.3], [-0.5, -0.5]])
    mask = jnp.ones((2, 2), bool)
    loss, _ = losses.policy_loss(logp, behav, jnp.array([1.0, -1.0]), mask, clip_eps=0.2, correction="seq_tis",
                                 is_cap=2.0, ratio_level="sequence", row_w_B=losses.row_weights(mask, "seq_mean", 2))
    assert float(loss) == pytest.approx(-(np.exp(0.5) - 2.0) / 2, rel=1e-5)


def test_approx_kl_to_the_behaviour_policy():
    # k3 = r - 1 - log r per token: log r 0.1 -> 0.0051709, -0.2 -> 0.0187308
    logp, behav, _, mask = _two_rows([[0.1, -0.2]], [0.0], [[True, True]])
    assert float(losses.approx_kl(logp, behav, mask)) == pytest.approx((0.0051709 + 0.0187308) / 2, rel=1e-4)


@pytest.mark.parametrize("overrides, needle", [
    (["learner.ratio_level=sequence"], "learner.ratio_level"),  # with the default tis
    (["learner.ratio_level=sequence", "learner.is_correction=decoupled"], "learner.ratio_level"),
    (["learner.advantage=rloo", "rollout.samples_per_prompt=1"], "rollout.samples_per_prompt"),  # every estimator
    (["learner.overlong=penalty", "learner.overlong_buffer=9"], "learner.overlong_buffer"),
    (["learner.loss_agg=sum"], "learner.loss_agg"),
])
def test_undefined_combinations_are_config_errors(overrides, needle):
    with pytest.raises(C.ConfigError, match=needle.replace(".", r"\.")):
        C.load("configs/tiny.yaml", overrides)
    C.load("configs/tiny.yaml", ["learner.ratio_level=sequence", "learner.is_correction=seq_tis"])


def _marked(cfg, seed, trunc_tokens):
    """Rows whose first sample of each group is truncated (full length), its tokens `trunc_tokens`."""
    N = cfg.rollout.max_new_tokens
    rows = random_rows(cfg, seed=seed)
    out = []
    for i, r in enumerate(rows):
        if i % cfg.rollout.samples_per_prompt == 0:
            r = r._replace(tokens=np.full(N, trunc_tokens, np.int32), logprobs=np.full(N, -2.0, np.float32),
                           versions=np.zeros(N, np.int32), truncated=True)
        out.append(r)
    g = cfg.rollout.samples_per_prompt
    out[g:2 * g] = [r._replace(reward=0.5) for r in out[g:2 * g]]  # group 1: equal rewards
    return out


def test_overlong_filter_leaves_truncated_rows_out_and_the_rollout_metrics():
    cfg, learner = make("learner.overlong=filter")
    got = []
    for tok in (3, 5):  # the truncated rows' tokens differ; nothing else does
        state = learner.init_state(learner.init_params())
        state, m = learner.step(state, batch_of(cfg, _marked(cfg, 7, tok)))
        got.append(params_fingerprint(state["params"]))
    m = jax.device_get(m)
    assert got[0] == got[1]
    rows = _marked(cfg, 7, 5)
    n = len(rows)
    assert float(m["rollout/truncated_frac"]) == pytest.approx(cfg.rollout.prompts_per_step / n)
    assert int(m["rollout/overlong_filtered"]) == cfg.rollout.prompts_per_step
    assert float(m["rollout/response_len_mean"]) == pytest.approx(np.mean([len(r.tokens) for r in rows]))
    assert int(m["rollout/response_len_max"]) == cfg.rollout.max_new_tokens
    assert float(m["rollout/zero_adv_group_frac"]) == pytest.approx(1 / cfg.rollout.prompts_per_step)
    for k in ("clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean", "ratio_max"):
        assert f"learner/{k}" in m
    # a kept row's tokens do reach the weights
    rows[1] = rows[1]._replace(tokens=(rows[1].tokens % 15) + 1)
    state, _ = learner.step(learner.init_state(learner.init_params()), batch_of(cfg, rows))
    assert params_fingerprint(state["params"]) != got[0]


def test_overlong_filter_logs_every_left_out_sample_as_a_drop(tmp_path, xla_cache):
    # an untrained policy rarely stops within 8 tokens: most samples are cut at the cap
    r = run_cli(tmp_path, "data.num_records=8", "rollout.prompts_per_step=4", "checkpoint.every_steps=0",
                "eval.every_steps=0", "learner.overlong=filter", cache=xla_cache, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "learner.overlong=filter" in r.stderr  # said at start (I4)
    drops = [json.loads(l) for l in (tmp_path / "drops.jsonl").read_text().splitlines()]
    metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert drops and all(d["reason"] == "overlong" and d["what"] == "samples" for d in drops)
    for m in metrics:
        assert m["rollout/overlong_filtered"] == sum(len(d["samples"]) for d in drops if d["step"] == m["step"])
        assert m["rollout/truncated_frac"] == pytest.approx(m["rollout/overlong_filtered"] / 16)  # 4 prompts x 4 samples
