"""Learner: host batches from plain rows, length buckets, micro-batching == the unsplit
update, PPO epochs x minibatches (1 x 1 is the plain update; more make the clip act),
and split checks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from async_rl import config as C
from async_rl.learner import losses
from async_rl.learner.batch import bucket, bucket_widths, widen
from async_rl.learner.step import Learner, Row, build_batch
from async_rl.model import sharding

V = 16  # the tiny preset's char vocabulary is smaller; any V works for random tokens
# for checks of how the step splits, accumulates and counts updates (depth changes none of it):
# one layer compiles in about half the time
ONE_LAYER = "model.n_layers=1"


def make(*overrides, log=None):
    cfg = C.load("configs/tiny.yaml", ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
                                       "learner.warmup_steps=0", "learner.lr=3e-3", *overrides])
    mesh = sharding.make_devices(cfg.mesh).learner
    learner = Learner(cfg, V, mesh, log=log or (lambda m: None))
    return cfg, learner


def random_rows(cfg, seed=0, n_groups=None, max_prompt=None, max_new=None):
    rs = np.random.RandomState(seed)
    P, N, G = cfg.engine.max_prompt_len, cfg.rollout.max_new_tokens, cfg.rollout.samples_per_prompt
    rows = []
    for _ in range(n_groups or cfg.rollout.prompts_per_step):
        prompt = rs.randint(1, V, rs.randint(1, (max_prompt or P) + 1)).astype(np.int32)
        for _ in range(G):
            n = rs.randint(1, (max_new or N) + 1)
            rows.append(Row(prompt, rs.randint(1, V, n).astype(np.int32),
                            (np.log(1 / V) + 0.3 * rs.randn(n)).astype(np.float32), np.zeros(n, np.int32),
                            float(rs.rand())))
    return rows


def batch_of(cfg, rows, bucket_min=0):
    n = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    return build_batch(rows, n_rows=n, prompt_len=cfg.engine.max_prompt_len, max_new=cfg.rollout.max_new_tokens,
                       pad_id=0, bucket_min=bucket_min)


def one_step(learner, batch):
    state = learner.init_state(learner.init_params())
    state, metrics = learner.step(state, batch)
    return jax.device_get(state), jax.device_get(metrics)


def max_rel(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(float(np.abs(x - y).max() / (np.abs(y).max() + 1e-12)) for x, y in zip(la, lb))


def test_build_batch_lays_rows_in_the_engine_columns():
    cfg, _ = make()
    rows = random_rows(cfg)[:6]  # a short step: 6 of 16 rows
    b = batch_of(cfg, rows)
    P, N = cfg.engine.max_prompt_len, cfg.rollout.max_new_tokens
    assert b.tokens_BxT.shape == (16, P + N) and b.widths == (P, N)
    for r, row in enumerate(rows):
        L, n = len(row.prompt_tokens), len(row.tokens)
        assert b.tokens_BxT[r, P - L:P].tolist() == row.prompt_tokens.tolist()
        assert b.tokens_BxT[r, P:P + n].tolist() == row.tokens.tolist()
        assert b.valid_BxT[r].sum() == L + n and b.positions_BxT[r, P - L] == 0
        assert b.mask_BxN[r].sum() == n and b.rewards_B[r] == np.float32(row.reward)
    assert b.row_valid_B.tolist() == [True] * 6 + [False] * 10


def test_buckets_are_bounded_and_cover_the_longest_row():
    assert [bucket(n, 64, 1536) for n in (1, 64, 65, 700, 1100, 1536)] == [64, 64, 128, 1024, 1536, 1536]
    assert bucket(5, 0, 8) == 8 and bucket_widths(128, 512) == [128, 256, 512]
    cfg, _ = make()
    rows = random_rows(cfg, max_prompt=3, max_new=2)
    b = batch_of(cfg, rows, bucket_min=2)
    longest = max(len(r.prompt_tokens) for r in rows), max(len(r.tokens) for r in rows)
    assert b.widths == (bucket(longest[0], 2, 8), bucket(longest[1], 2, 8)) and b.widths[0] < 8


def test_bucketed_batch_gives_the_full_width_logprobs():
    # the tiny preset has a learned table indexed by absolute column: a narrower layout must
    # keep each token's column, or engine and learner logprobs would disagree
    cfg, learner = make()
    assert cfg.model.learned_positions
    rows = random_rows(cfg, seed=1, max_prompt=4, max_new=3)
    full, short = batch_of(cfg, rows), batch_of(cfg, rows, bucket_min=2)
    assert short.widths[0] == 4 and short.widths[1] <= 4
    params = learner.init_params()
    lp = jax.jit(lambda p, b: learner._model_logprobs(learner._model(p, None), b)[0])
    a = np.asarray(lp(params, full.device_dict()))[:, :short.widths[1]]
    b = np.asarray(lp(params, short.device_dict()))
    m = short.mask_BxN
    np.testing.assert_allclose(b[m], a[m], atol=1e-5, rtol=0)
    # widening back (what processes do to agree on one shape) changes nothing either
    again = widen(short, 8, 8, 0)
    for k, v in full.device_dict().items():
        got = again.device_dict()[k]
        if k == "positions_BxT":  # only valid columns' positions mean anything
            got, v = got[full.valid_BxT], v[full.valid_BxT]
        np.testing.assert_array_equal(got, v, err_msg=k)


def test_each_step_shape_is_logged_once():
    lines = []
    cfg, learner = make(ONE_LAYER, "learner.bucket_min=4", log=lines.append)
    state = learner.init_state(learner.init_params())
    for seed, (mp, mn) in enumerate([(3, 2), (4, 3), (8, 8), (2, 1)]):
        state, _ = learner.step(state, batch_of(cfg, random_rows(cfg, seed, max_prompt=mp, max_new=mn), 4))
    jax.block_until_ready(state)
    assert learner.compiled_widths == {(4, 4), (8, 8)}
    assert len(lines) == 2 and all(l.startswith("learner: compiling the step for 16 rows") for l in lines)
    assert learner._step._cache_size() == 2


def assert_update_follows_moments(cfg, state, ref_state, what, eps=1e-8):
    """The first step moves each parameter by lr * u, u = m_hat / (sqrt(v_hat) + eps) (optax's
    adamw, eps 1e-8). Where a gradient is ~0, u amplifies float noise in the moments, so the
    parameters may differ by lr * |u - u_ref|, bounded from the two runs' moments by
    |dm| / (s + eps) + |m_ref| |ds| / ((s + eps)(s_ref + eps)) and never above 2 (|u| <= 1
    on the first step), plus float32 rounding of the update and of p + update."""
    lc = cfg.learner
    lr = lc.lr  # warm-up 0, constant schedule: the first update's rate
    adam, ref_adam = state["opt"][1][0], ref_state["opt"][1][0]
    leaves = [jax.tree.leaves(t) for t in (state["params"], ref_state["params"], adam.mu, ref_adam.mu,
                                            adam.nu, ref_adam.nu)]
    assert len({len(x) for x in leaves}) == 1
    for p, p_ref, mu, mu_ref, nu, nu_ref in zip(*leaves):
        p, p_ref, mu, mu_ref, nu, nu_ref = (np.asarray(x, np.float64) for x in (p, p_ref, mu, mu_ref, nu, nu_ref))
        m, m_ref = mu / (1 - lc.b1), mu_ref / (1 - lc.b1)
        s, s_ref = np.sqrt(nu / (1 - lc.b2)), np.sqrt(nu_ref / (1 - lc.b2))
        du = np.abs(m - m_ref) / (s + eps) + np.abs(m_ref) * np.abs(s - s_ref) / ((s + eps) * (s_ref + eps))
        tol = lr * np.minimum(du, 2.0) * 1.01 + lr * 1e-6 + 4 * np.spacing(np.abs(p_ref).astype(np.float32))
        over = np.abs(p - p_ref) - tol
        assert over.max() <= 0, (what, float(over.max()), float(np.abs(p - p_ref).max()))


@pytest.mark.slow
def test_micro_batches_give_the_unsplit_update():
    cfg, plain = make(ONE_LAYER)
    batch = batch_of(cfg, random_rows(cfg, seed=2))
    ref_state, ref_m = one_step(plain, batch)
    rows = dict(jax.device_put(batch.device_dict()), adv_B=jnp.ones(16))
    ref_grads = jax.jit(lambda p: plain._grads(p, None, rows)[2])(plain.init_params())
    for micro in (4,):  # 4 micro-batches accumulated
        _, learner = make(ONE_LAYER, f"learner.micro_batch_rows={micro}")
        grads = jax.jit(lambda p: learner._grads(p, None, rows)[2])(learner.init_params())
        assert max_rel(grads, ref_grads) < 1e-5, micro
        state, m = one_step(learner, batch)
        # Adam's moments hold the (clipped) gradient linearly: equal up to summation order
        adam, ref_adam = state["opt"][1][0], ref_state["opt"][1][0]
        assert max_rel(adam.mu, ref_adam.mu) < 1e-5 and max_rel(adam.nu, ref_adam.nu) < 1e-5, micro
        assert_update_follows_moments(cfg, state, ref_state, micro)
        for k in ("learner/loss", "learner/grad_norm", "learner/clip_frac", "learner/is_weight_mean",
                  "learner/is_weight_max", "learner/entropy", "learner/logp_diff_max"):
            assert m[k] == pytest.approx(ref_m[k], rel=1e-5, abs=1e-7), (micro, k)


def test_one_epoch_one_minibatch_is_the_plain_policy_gradient_update():
    cfg, learner = make(ONE_LAYER, "learner.ppo_epochs=1", "learner.minibatches=1")
    batch = batch_of(cfg, random_rows(cfg, seed=3))
    params0 = learner.init_params()
    state = learner.init_state(params0)
    lc = cfg.learner

    # the update written out: one gradient of the token-mean surrogate at the current weights
    def loss(p):
        b = batch.device_dict()
        logp, _ = learner._model_logprobs(learner._model(p, None), b)
        mask = jnp.asarray(b["mask_BxN"] & b["row_valid_B"][:, None])
        adv = losses.grpo_advantages(jnp.asarray(b["rewards_B"]).reshape(-1, cfg.rollout.samples_per_prompt),
                                     lc.adv_eps).reshape(-1)
        return losses.policy_loss(logp, jnp.asarray(b["behav_logp_BxN"]), adv, mask, clip_eps=lc.clip_eps,
                                  correction=lc.is_correction, is_cap=lc.is_cap)[0]

    params0 = jax.device_get(params0)
    grads = jax.jit(jax.grad(loss))(params0)
    tx = learner.tx  # the reference update in one program (op by op, each op would compile its own)
    updates, want_opt = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params0)
    want = jax.jit(optax.apply_updates)(params0, updates)
    got, m = jax.device_get(learner.step(state, batch))
    # same gradient (Adam's moments are linear in it) and the same Adam step, up to the
    # float noise that m / sqrt(v) amplifies where a gradient is ~0
    assert max_rel(got["opt"][1][0].mu, want_opt[1][0].mu) < 1e-5
    assert max_rel(got["opt"][1][0].nu, want_opt[1][0].nu) < 1e-5
    assert max_rel(got["params"], want) < 1e-3
    assert float(m["learner/clip_frac"]) == 0.0  # one update: ratio pi/pi_prox is exactly 1
    assert int(got["opt"][1][0].count) == 1


def test_several_updates_per_step_make_the_clip_act():
    cfg, learner = make(ONE_LAYER, "learner.ppo_epochs=2", "learner.minibatches=2", "learner.lr=3e-2")
    batch = batch_of(cfg, random_rows(cfg, seed=4))
    state, m = one_step(learner, batch)
    assert m["learner/clip_frac"] > 0
    assert int(state["opt"][1][0].count) == 4  # optimizer updates; the learner step is still one
    # the schedule counts learner steps: after 1 step of 4 updates, warm-up is at step 1
    cfg2, l2 = make("learner.ppo_epochs=2", "learner.minibatches=2", "learner.warmup_steps=4")
    sched = l2.tx  # chain(clip, adamw(schedule)): read the lr through a zero-gradient update
    p = {"w": jnp.ones(3)}
    st = sched.init(p)
    lrs = []
    for _ in range(8):
        u, st = sched.update({"w": jnp.ones(3)}, st, p)
        lrs.append(float(-u["w"][0]))
    assert lrs[0] == lrs[3] == 0.0 and lrs[4] == pytest.approx(lrs[7], rel=1e-4) and lrs[4] > 0


@pytest.mark.parametrize("overrides, needle", [
    (["learner.minibatches=3"], "learner.minibatches"),
    (["learner.micro_batch_rows=3"], "learner.micro_batch_rows"),
    (["learner.remat=all"], "learner.remat"),
    (["learner.ppo_epochs=0"], "learner.ppo_epochs"),
    (["model.attention=flash"], "model.attention"),
])
def test_bad_splits_and_choices_are_config_errors(overrides, needle):
    with pytest.raises(C.ConfigError, match=needle.replace(".", r"\.")):
        make(*overrides)


def test_micro_batches_must_split_over_the_batch_shards():
    with pytest.raises(C.ConfigError, match=r"learner\.micro_batch_rows=2: must be a multiple of the 4 batch"):
        make("learner.micro_batch_rows=2")


@pytest.mark.parametrize("warmup, max_steps, horizon", [(0, 0, 0), (0, 1, 0), (0, 0, 10), (5, 0, 0), (5, 3, 0),
                                                        (2, 10, 0), (0, 0, 1)])
def test_the_cosine_schedule_is_valid_for_any_warmup_and_length(warmup, max_steps, horizon):
    from async_rl.learner.step import lr_schedule
    cfg = C.load("configs/tiny.yaml", ["learner.schedule=cosine", f"learner.warmup_steps={warmup}",
                                       f"train.max_steps={max_steps}", "learner.lr=1e-3",
                                       "learner.end_lr_ratio=0.1"])
    sched = lr_schedule(cfg, horizon)
    lrs = [float(sched(i)) for i in range(12)]
    assert all(np.isfinite(lrs)) and max(lrs) <= 1e-3 * (1 + 1e-6)
    # no warm-up: the first step trains at the peak rate, not at 0
    assert lrs[0] == pytest.approx(1e-3) if warmup == 0 else lrs[0] == 0.0
    total = max_steps or horizon
    if total > warmup:  # the floor is reached where the run ends
        assert lrs[total] == pytest.approx(1e-4, rel=1e-4) and lrs[total - 1] > lrs[total] * (1 - 1e-6)


def test_a_cosine_decay_shorter_than_its_warmup_is_a_config_error():
    with pytest.raises(C.ConfigError, match=r"learner\.decay_steps=5: must be 0 or more than learner\.warmup_steps"):
        C.load("configs/tiny.yaml", ["learner.schedule=cosine", "learner.warmup_steps=5", "learner.decay_steps=5"])


def test_an_update_with_a_non_finite_gradient_is_not_applied():
    updates = 2  # minibatches: the count sums over a step's updates
    cfg, learner = make(ONE_LAYER, f"learner.minibatches={updates}")
    rows = random_rows(cfg)
    good = list(rows)
    rows[1] = rows[1]._replace(reward=float("nan"))  # its group's advantages, hence every update, are NaN
    start = jax.device_get(learner.init_state(learner.init_params()))
    state, metrics = learner.step(jax.device_put(start, learner.state_sh), batch_of(cfg, rows))
    state, metrics = jax.device_get((state, metrics))
    assert int(metrics["learner/skipped_updates"]) == updates
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(start)))
    # the same batch with a finite reward is applied
    state, metrics = jax.device_get(learner.step(jax.device_put(start, learner.state_sh), batch_of(cfg, good)))
    assert int(metrics["learner/skipped_updates"]) == 0
    assert not np.array_equal(jax.tree.leaves(state["params"])[0], jax.tree.leaves(start["params"])[0])
