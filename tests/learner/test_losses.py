import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl.learner import losses


def test_grpo_advantages_match_hand_computation():
    r = jnp.array([[1.0, 0.0, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]])
    adv = np.asarray(losses.grpo_advantages(r, 1e-6))
    # group 0: mean 0.5, population std sqrt((0.25 + 0.25 + 0 + 0) / 4) = 0.353553...
    std = np.sqrt(0.125)
    np.testing.assert_allclose(adv[0], [0.5 / std, -0.5 / std, 0.0, 0.0], rtol=1e-5)
    np.testing.assert_allclose(adv[1], 0.0, atol=1e-6)  # equal rewards carry no signal


def _example():
    new = jnp.array([[-1.0, -2.0, -0.5], [-0.3, -1.2, -4.0]])
    behav = jnp.array([[-1.2, -1.5, -0.5], [-0.3, -2.0, -1.0]])
    mask = jnp.array([[True, True, True], [True, True, False]])
    adv = jnp.array([1.0, -2.0])
    return new, behav, mask, adv


def test_importance_weights_equal_exp_new_minus_behaviour():
    new, behav, mask, adv = _example()
    _, stats = losses.policy_loss(new, behav, adv, mask, clip_eps=0.2, correction="tis", is_cap=1e9)
    w = np.exp(np.asarray(new - behav))
    m = np.asarray(mask)
    assert float(stats["is_weight_mean"]) == pytest.approx(w[m].mean(), rel=1e-6)
    assert float(stats["is_weight_max"]) == pytest.approx(w[m].max(), rel=1e-6)


def test_tis_gradient_is_truncated_weight_times_advantage():
    new, behav, mask, adv = _example()
    cap = 1.5
    g = jax.grad(lambda lp: losses.policy_loss(lp, behav, adv, mask, clip_eps=0.2, correction="tis",
                                               is_cap=cap)[0])(new)
    w = np.minimum(np.exp(np.asarray(new - behav)), cap)
    expect = -(w * np.asarray(adv)[:, None] * np.asarray(mask)) / np.asarray(mask).sum()
    np.testing.assert_allclose(np.asarray(g), expect, rtol=1e-5, atol=1e-7)


def test_none_is_ppo_clip_against_behaviour():
    new, behav, mask, adv = _example()
    loss, stats = losses.policy_loss(new, behav, adv, mask, clip_eps=0.2, correction="none", is_cap=2.0)
    r = np.exp(np.asarray(new - behav))
    a = np.asarray(adv)[:, None]
    sur = np.minimum(r * a, np.clip(r, 0.8, 1.2) * a)
    m = np.asarray(mask)
    assert float(loss) == pytest.approx(-(sur * m).sum() / m.sum(), rel=1e-6)
    assert float(stats["clip_frac"]) == pytest.approx(((np.clip(r, 0.8, 1.2) * a < r * a) & m).sum() / m.sum())


def test_decoupled_equals_ppo_clip_when_behaviour_is_proximal():
    new, behav, mask, adv = _example()
    prox = new - 0.1  # the policy moved since the proximal snapshot
    dec, _ = losses.policy_loss(new, prox, adv, mask, clip_eps=0.2, correction="decoupled", is_cap=5.0,
                                prox_BxN=prox)
    ppo, _ = losses.policy_loss(new, prox, adv, mask, clip_eps=0.2, correction="none", is_cap=5.0)
    assert float(dec) == pytest.approx(float(ppo), rel=1e-6)


def test_seq_tis_uses_one_weight_per_sequence():
    new, behav, mask, adv = _example()
    _, stats = losses.policy_loss(new, behav, adv, mask, clip_eps=0.2, correction="seq_tis", is_cap=1e9)
    m = np.asarray(mask)
    seq = np.exp(((np.asarray(new - behav)) * m).sum(1))
    assert float(stats["is_weight_max"]) == pytest.approx(seq.max(), rel=1e-5)


def test_kl_k3_is_zero_at_reference_and_positive_elsewhere():
    lp = jnp.array([[-1.0, -2.0]])
    mask = jnp.ones((1, 2), bool)
    assert float(losses.kl_k3(lp, lp, mask)) == pytest.approx(0.0, abs=1e-7)
    assert float(losses.kl_k3(lp, lp - 0.5, mask)) > 0


def test_token_logprobs_use_temperature():
    logits = jnp.array([[[2.0, 0.0, -1.0]]])
    tok = jnp.array([[0]])
    for t in (1.0, 0.5):
        expect = np.asarray(jax.nn.log_softmax(logits / t))[0, 0, 0]
        assert float(losses.token_logprobs(logits, tok, t)[0, 0]) == pytest.approx(expect, rel=1e-6)


def test_chunked_completion_logprobs_match_unchunked_values_and_grads():
    rng = np.random.default_rng(0)
    W = jnp.asarray(rng.normal(size=(8, 37)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(3, 10, 8)).astype(np.float32))
    tok = jnp.asarray(rng.integers(0, 37, size=(3, 10)))
    f = lambda w, chunk: losses.completion_logprobs(lambda h: h @ w, x, tok, 0.7, chunk)
    full_lp, full_ent = f(W, 0)
    expect = jax.nn.log_softmax((x @ W) / 0.7)
    np.testing.assert_allclose(full_lp, np.take_along_axis(np.asarray(expect), np.asarray(tok)[..., None], -1)[..., 0],
                               rtol=1e-5, atol=1e-6)
    for chunk in (3, 4, 10):
        lp, ent = f(W, chunk)
        np.testing.assert_allclose(lp, full_lp, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ent, full_ent, rtol=1e-5, atol=1e-6)
        g_full = jax.grad(lambda w: f(w, 0)[0].sum())(W)
        g = jax.grad(lambda w: f(w, chunk)[0].sum())(W)
        np.testing.assert_allclose(g, g_full, rtol=1e-4, atol=1e-5)
