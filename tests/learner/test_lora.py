"""LoRA: its config fields, the frozen base and adapter-only training, publication of adapters,
the checkpoint's adapters and base digest, and the PEFT export (docs/design.md, "LoRA")."""
from __future__ import annotations

import pytest

from async_rl import config as C
from async_rl.state import compat


@pytest.mark.parametrize("override, needle", [
    ("learner.lora_rank=-1", "learner.lora_rank=-1: must be >= 0"),
    ("learner.lora_alpha=0", "learner.lora_alpha=0.0: must be > 0"),
    ("learner.lora_targets=attention,conv", "learner.lora_targets='attention,conv': unknown projection 'conv'"),
    ("learner.lora_targets=", "learner.lora_targets='': unknown projection ''"),
])
def test_nonsense_lora_fields_are_refused_in_one_line(override, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load("configs/tiny.yaml", ["learner.lora_rank=4", override])
    assert str(e.value).startswith(needle) and "\n" not in str(e.value)


def test_lora_targets_name_groups_or_single_projections():
    from async_rl.model import lora
    lc = C.load("configs/tiny.yaml", ["learner.lora_rank=8", "learner.lora_targets=mlp, q"]).learner
    assert lora.projections(lc) == ("q", "gate", "up", "down")
    assert C.LearnerConfig().lora_rank == 0  # off unless asked for
    assert lora.projections(C.LearnerConfig(lora_rank=2)) == ("q", "k", "v", "o", "gate", "up", "down")


def test_lora_with_the_vllm_backend_up_to_vllms_largest_rank():
    vllm = ["engine.backend=vllm", "model.hf_path=/x", "model.learned_positions=0"]
    assert C.load("configs/tiny.yaml", ["learner.lora_rank=512", *vllm]).learner.lora_rank == 512
    with pytest.raises(C.ConfigError) as e:
        C.load("configs/tiny.yaml", ["learner.lora_rank=1024", *vllm])
    assert str(e.value) == ("learner.lora_rank=1024: must be <= 512 with engine.backend=vllm "
                            "(vLLM's largest max_lora_rank)")
    assert C.load("configs/tiny.yaml", ["learner.lora_rank=1024"]).learner.lora_rank == 1024  # built-in: any


def test_vllm_gets_the_smallest_max_lora_rank_that_holds_the_adapters():
    from async_rl.rollout import vllm_lora
    assert [vllm_lora.max_lora_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]
    args = vllm_lora.engine_args(4, slots=64, max_new_tokens=100, steps_per_call=8)
    assert args == dict(enable_lora=True, max_lora_rank=8, max_loras=15, max_cpu_loras=16)
    assert vllm_lora.engine_args(4, slots=3, max_new_tokens=100, steps_per_call=8)["max_loras"] == 3


@pytest.mark.parametrize("key, saved, now", [
    ("lora_rank", 0, 8), ("lora_rank", 8, 16), ("lora_alpha", 16.0, 32.0), ("lora_targets", "mlp", "attention")])
def test_changing_lora_on_resume_is_its_own_refused_kind(key, saved, now):
    cfg = C.load("configs/tiny.yaml", ["learner.lora_rank=8", f"learner.{key}={now}"])
    old = C.to_dict(cfg)
    old["learner"] = dict(old["learner"], **{key: saved})
    got = [c for c in compat.changes(old, cfg) if c.key == f"learner.{key}"]
    assert [c.kind for c in got] == ["lora"]


# ---- the model and the learner --------------------------------------------------------------

def _learner(*overrides):
    from test_learner import make
    return make("learner.lora_rank=4", "learner.lora_alpha=8", *overrides)


def test_a_fresh_adapter_leaves_the_base_forward_unchanged_and_its_term_is_x_a_b():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from async_rl.model import lora
    from async_rl.model.transformer import Transformer
    cfg = C.load("configs/tiny.yaml", ["learner.lora_rank=4", "learner.lora_alpha=8"])
    spec = lora.spec(cfg)
    plain = Transformer(cfg.model, 16, rngs=nnx.Rngs(0))
    with_ad = Transformer(cfg.model, 16, rngs=nnx.Rngs(0), lora=spec)
    # the adapters draw from their own key: the base is the full-weight model's, bit for bit
    base = lora.host_tree(nnx.state(with_ad, lora.BASE))
    assert base.keys() == lora.host_tree(nnx.state(plain, nnx.Param)).keys()
    assert all(np.array_equal(v, lora.host_tree(nnx.state(plain, nnx.Param))[k]) for k, v in base.items())
    ad = lora.host_tree(nnx.state(with_ad, lora.ADAPTERS))
    assert len(ad) == 2 * 7 and ad["layers.attn.q.lora_a"].shape == (2, 64, 4)
    assert ad["layers.mlp.down.lora_b"].shape == (2, 4, 64) and not ad["layers.mlp.down.lora_b"].any()
    tok = jnp.arange(1, 9, dtype=jnp.int32)[None]
    pos, valid = jnp.arange(8)[None], jnp.ones((1, 8), bool)
    np.testing.assert_array_equal(plain(tok, pos, valid), with_ad(tok, pos, valid))
    # a trained adapter adds scale * (x A) B to its projection's output
    q = with_ad.layers.attn.q
    q.lora_b.set_value(jax.random.normal(jax.random.key(1), q.lora_b.shape))
    x = jax.random.normal(jax.random.key(2), (3, 64))
    got = jax.vmap(lambda a, b, k: x @ k + spec.scale * (x @ a) @ b)(q.lora_a[...], q.lora_b[...], q.kernel[...])
    layer0 = nnx.merge(*nnx.split(with_ad.layers))  # a stacked module: call layer 0 by slicing
    gd, st = nnx.split(layer0.attn.q)
    one = nnx.merge(gd, jax.tree.map(lambda v: v[0], st))
    np.testing.assert_allclose(one(x), got[0], rtol=1e-5, atol=1e-5)


def test_lora_trains_only_the_adapters_and_the_kl_reference_is_the_base():
    import jax
    import numpy as np
    from test_learner import batch_of, random_rows

    from async_rl.model import lora
    cfg, learner = _learner("learner.kl_coef=0.1")
    base0 = lora.host_tree(learner.base_params())
    state = learner.init_state(learner.init_params())
    # optimizer moments exist for the adapters only
    opt_leaves = jax.tree.leaves(state["opt"])
    n_adapter = sum(x.size for x in jax.tree.leaves(state["params"]))
    assert n_adapter < sum(x.size for x in jax.tree.leaves(learner.base_params())) / 4
    assert sum(x.size for x in opt_leaves if x.ndim) == 2 * n_adapter
    before = lora.host_tree(state["params"])
    state, m = learner.step(state, batch_of(cfg, random_rows(cfg)))
    m = jax.device_get(m)
    after = lora.host_tree(state["params"])
    assert any(not np.array_equal(before[k], after[k]) for k in after if k.endswith("lora_b"))
    assert all(np.array_equal(v, lora.host_tree(learner.base_params())[k]) for k, v in base0.items())
    # at step 1 the adapters are zero in effect: the policy is the reference, KL is 0
    assert abs(float(m["learner/kl"])) < 1e-6
    state, m = learner.step(state, batch_of(cfg, random_rows(cfg, seed=1)))
    assert float(jax.device_get(m)["learner/kl"]) > 0


def test_lora_micro_batches_and_ppo_epochs_run_with_the_base_beside_the_state():
    import jax
    import numpy as np
    from test_learner import ONE_LAYER, batch_of, random_rows

    from async_rl.model import lora
    cfg, a = _learner(ONE_LAYER)
    _, b = _learner(ONE_LAYER, "learner.micro_batch_rows=4")
    rows = batch_of(cfg, random_rows(cfg))
    sa, _ = a.step(a.init_state(a.init_params()), rows)
    sb, _ = b.step(b.init_state(b.init_params()), rows)
    ta, tb = lora.host_tree(sa["params"]), lora.host_tree(sb["params"])
    assert max(float(np.abs(ta[k] - tb[k]).max()) for k in ta) < 1e-5
    _, c = _learner(ONE_LAYER, "learner.ppo_epochs=2", "learner.minibatches=2")
    sc, mc = c.step(c.init_state(c.init_params()), rows)
    assert np.isfinite(float(jax.device_get(mc)["learner/loss"]))


# ---- publication -------------------------------------------------------------------------

LORA = ["learner.lora_rank=4", "learner.lora_alpha=8", "learner.lr=3e-3", "learner.warmup_steps=0"]


@pytest.mark.parametrize("partial", [False, True])
def test_each_publication_moves_only_the_adapters_and_the_engine_runs_them(tmp_path, monkeypatch, partial):
    import jax
    from helpers import cfg as make_cfg
    from helpers import rollouts

    from async_rl.learner.step import Learner
    from async_rl.obs.metrics import read_jsonl
    from async_rl.rollout.pump import Pump
    from async_rl.run.train import train
    published, bases = [], []
    real, real_base = Pump.publish, Learner.base_params
    monkeypatch.setattr(Pump, "publish", lambda self, v, p: (published.append(p), real(self, v, p))[1])
    monkeypatch.setattr(Learner, "base_params", lambda self: (bases.append(real_base(self)), bases[-1])[1])
    c = make_cfg(tmp_path, *LORA, "data.num_records=16", "rollout.prompts_per_step=2", "train.max_steps=5",
                 "sampler.max_lookahead=0", f"rollout.partial={str(partial).lower()}", "log.rollouts=true")
    train(c)
    assert len(published) == 5
    leaves = [dict(jax.tree_util.tree_flatten_with_path(p)[0]) for p in published]
    adapters = {k for k in leaves[0] if "lora_" in jax.tree_util.keystr(k)}
    assert adapters and all(ls.keys() == leaves[0].keys() for ls in leaves)
    for k in leaves[0]:  # the base's buffers are the same objects in every version: never sent again
        assert all((ls[k] is leaves[0][k]) != (k in adapters) for ls in leaves[1:]), jax.tree_util.keystr(k)
    # fp32 base, fp32 engine, same devices: the engine reads the learner's own base buffers
    own = {id(x) for x in jax.tree.leaves(bases[0])}
    assert all(id(leaves[0][k]) in own for k in leaves[0] if k not in adapters)
    # synchronous steps: the engine's logprobs are the learner's, so it ran each version's adapters
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert max(r["learner/logp_diff_max"] for r in rows) < 2e-4
    assert float(jax.numpy.abs(leaves[-1][next(k for k in adapters if "lora_b" in jax.tree_util.keystr(k))]).max()) > 0
    assert all(min(r["versions"]) == max(r["versions"]) == r["step"] - 1 for r in rollouts(tmp_path))


# ---- memory and publication size -------------------------------------------------------------

def test_an_8b_lora_needs_a_frozen_base_and_adapter_moments_only_and_publishes_under_2_percent():
    from async_rl.model.flops import adapter_count, param_count
    from async_rl.plan import memory
    lcfg = C.load("configs/plan/llama3-8b-lora.yaml")
    full = C.replace(lcfg, learner={"lora_rank": 0})
    vocab = lcfg.model.vocab_size
    n, a = param_count(lcfg.model, vocab), adapter_count(lcfg, vocab)
    # rank 16 on q, k, v, o, gate, up, down of 32 layers: r (d_in + d_out) each
    assert a == 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432)
    assert a / n < 0.02  # what each publication moves, against the full weights
    got, was = memory.estimate(lcfg, vocab), memory.estimate(full, vocab)
    assert got["optimizer"] == 8 * a and was["optimizer"] == 8 * n
    assert got["engine weights"] == 2 * a  # bf16 base shared with the engine: only adapters are its own
    assert sum(got.values()) < 80 * 2**30 < sum(was.values())  # one H100's 80 GiB: LoRA fits, full does not


def test_plan_compiles_a_lora_step_whose_state_is_the_adapters():
    import jax
    import numpy as np

    from async_rl.learner.step import Learner
    from async_rl.model import sharding
    from async_rl.plan import compile as PL
    base = ["model.vocab_size=64", "model.learned_positions=0", "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4", "engine.max_prompt_len=8", "rollout.max_new_tokens=8", "mesh.fsdp=4",
            "engine.steps_per_call=2"]  # its memory, not its steps: a call of 2 steps (each a copy of the layers) compiles faster than 8
    full = C.load("configs/tiny.yaml", base)
    cfg = C.load("configs/tiny.yaml", [*base, "learner.lora_rank=4"])
    lp, fp = (PL.plan(c, "cpu:4", cost=False, engine=False).parts["learner"] for c in (cfg, full))
    learner = Learner(cfg, 64, sharding.learner_mesh(jax.devices()[:4], cfg.mesh))
    n_adapters = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(learner.abstract_params))
    # the compiled step's state: adapters (split over fsdp where they divide) and their moments
    assert lp.fits and lp.params_bytes <= n_adapters * 4 < fp.params_bytes
    assert lp.opt_bytes == pytest.approx(2 * lp.params_bytes, rel=0.01) and lp.opt_bytes < fp.opt_bytes / 2
    # the engine's part runs the base with the adapters beside it
    eng_cpu = PL.engine_part(cfg, 64, jax.devices()[:1], PL.topology("cpu:1")[1], cost=False)
    eng_full = PL.engine_part(full, 64, jax.devices()[:1], PL.topology("cpu:1")[1], cost=False)
    assert eng_cpu.fits and eng_cpu.params_bytes - eng_full.params_bytes == n_adapters * 4
