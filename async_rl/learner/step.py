"""The learner: parameter init, optimizer and the jitted GRPO/PPO train step.

Owns: the train state {params, opt}, its shardings on the learner mesh, the optax
optimizer (AdamW, warm-up + constant/cosine, grad-norm clip; an update with a non-finite
loss or gradient is not applied, `learner/skipped_updates` counts them), and the pure
`train_step(state, batch) -> (state, metrics)` jitted with explicit shardings and donated
state: PPO epochs x minibatches of optimizer updates against the step's proximal
logprobs, each update accumulating gradients over micro-batches. Does not own: which
rows form a step (sampler, train), their host layout and length buckets (`batch`), the
loss formulas (losses), files (checkpoint), or the engine (weights leave through
`publishable`).

LoRA (`learner.lora_rank` > 0): the state's params are the adapters alone and the optimizer
holds their moments only; the frozen base is loaded once (`base_params`) and passed to the
step beside the state, not donated and not differentiated. The KL reference is that base
with the adapters left out (a graphdef without them): no second copy of the weights.

Updates. With `ppo_epochs` E and `minibatches` M a step makes E x M optimizer updates;
update u trains the rows r with r % M == u % M. The proximal logprobs pi_prox are those
of the weights at the step's start (one extra forward pass when E x M > 1; with one
update they are the current logprobs under stop-gradient). The learning-rate
schedule still counts learner steps. Micro-batch j of an update holds its rows r with
r % K == j (K micro-batches): strided, so every micro-batch spans every device.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from async_rl.config import Config, ConfigError
from async_rl.learner import losses
from async_rl.learner.batch import Batch, Row, build_batch, widen  # noqa: F401  (Row, build_batch: the learner's input)
from async_rl.model import attention, moe, sharding
from async_rl.model import lora as lora_mod
from async_rl.model.transformer import Transformer


def updates_per_step(cfg: Config) -> int:
    return cfg.learner.ppo_epochs * cfg.learner.minibatches


def lr_schedule(cfg: Config, horizon: int = 0) -> optax.Schedule:
    """The learning rate by learner step: a linear warm-up over `learner.warmup_steps` (none at
    0), then constant or a cosine that reaches lr * end_lr_ratio at step `learner.decay_steps`,
    else train.max_steps, else `horizon` (where the data ends the run). Without any of them
    (a learner built outside a run: plan, benches) the cosine holds the peak."""
    lc = cfg.learner
    after = optax.constant_schedule(lc.lr)
    total = lc.decay_steps or cfg.train.max_steps or horizon
    if lc.schedule == "cosine" and total:
        # a run no longer than its warm-up never reaches the cosine: any positive length is valid
        after = optax.cosine_decay_schedule(lc.lr, max(total - lc.warmup_steps, 1), alpha=lc.end_lr_ratio)
    if not lc.warmup_steps:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lc.lr, lc.warmup_steps), after], [lc.warmup_steps])


def make_optimizer(cfg: Config, horizon: int = 0) -> optax.GradientTransformation:
    lc = cfg.learner
    sched = lr_schedule(cfg, horizon)
    u = updates_per_step(cfg)
    if u > 1:  # optax counts updates; the schedule is in learner steps
        base = sched
        sched = lambda count: base(count // u)  # noqa: E731
    chain = [optax.clip_by_global_norm(lc.grad_clip)] if lc.grad_clip else []
    chain.append(optax.adamw(sched, b1=lc.b1, b2=lc.b2, weight_decay=lc.weight_decay))
    return optax.chain(*chain)


def _new_model(cfg: Config, vocab_size: int, n_tokens: int = 0, lora: lora_mod.LoraSpec | None = None) -> Transformer:
    return Transformer(cfg.model, vocab_size, rngs=nnx.Rngs(cfg.run.seed), n_tokens=n_tokens, lora=lora)


def split_model(cfg: Config, vocab_size: int, n_tokens: int = 0) -> tuple:
    """(graphdef, trained parameters, frozen base), abstract: the model as the learner trains it
    and the engine runs it (the engine's tree is the base's leaves and the trained ones; without
    LoRA both are the one parameter tree)."""
    lora = lora_mod.spec(cfg)
    abstract_model = nnx.eval_shape(lambda: _new_model(cfg, vocab_size, n_tokens, lora))
    if lora is None:
        graphdef, params = nnx.split(abstract_model, nnx.Param)
        return graphdef, params, params
    return nnx.split(abstract_model, lora_mod.ADAPTERS, lora_mod.BASE)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Learner:
    """Holds the compiled functions; the state itself is passed in and out (pure steps)."""

    def __init__(self, cfg: Config, vocab_size: int, mesh, shared_devices: bool = True, *,
                 log: Callable[[str], None] = _log, unroll: bool = False, n_tokens: int = 0, horizon: int = 0,
                 teacher=None):
        """`unroll`: every loop in the step unrolled (layers, updates, micro-batches, logit
        chunks): slow to compile, but XLA's cost model then counts every iteration (`plan`).
        `n_tokens`: the tokenizer's vocabulary size; ids at or above it get no probability
        (`Transformer`), here and in the engine, which shares this graphdef. `horizon`: the
        run's length in steps where the data ends it (the cosine schedule's, `lr_schedule`).
        `teacher`: learner.distill's frozen teacher on this mesh (`state.teacher.Teacher`: its
        graphdef, shardings and `params()`), passed to every step."""
        self.cfg, self.mesh, self.vocab_size = cfg, mesh, vocab_size
        self.P, self.N = cfg.engine.max_prompt_len, cfg.rollout.max_new_tokens
        self.G = cfg.rollout.samples_per_prompt
        self.log, self.unroll = log, unroll
        self.compiled_widths: set[tuple[int, int]] = set()  # (Pb, Nb) of every step shape seen
        platform = mesh.devices.flat[0].platform
        self.attn = attention.resolve(cfg.model.attention, platform, cfg.model.dtype, mesh, sharding.BATCH_AXES,
                                      "tensor")
        self._layer_unroll = self.layer_unroll(platform, cfg.model.n_layers)
        self.gather = sharding.layer_gatherer(mesh, cfg.model.dtype, keep=("experts",) if moe.in_shard_map(self.attn) else ())
        self._check_splits(cfg, mesh)
        self.tx = make_optimizer(cfg, horizon)
        self.lora = lora_mod.spec(cfg)
        self.graphdef, abstract_params, self.abstract_base = split_model(cfg, vocab_size, n_tokens)
        if self.lora is None:
            self.base_graphdef = self.graphdef
        else:  # trained: the adapters; the base is frozen beside them
            self.base_graphdef = nnx.split(nnx.eval_shape(lambda: _new_model(cfg, vocab_size, n_tokens)),
                                           nnx.Param)[0]
        self.param_sh = sharding.param_shardings(abstract_params, mesh)
        self.base_sh = sharding.param_shardings(self.abstract_base, mesh)
        self.opt_sh = sharding.opt_shardings(self.tx, abstract_params, self.param_sh, mesh)
        self.state_sh = {"params": self.param_sh, "opt": self.opt_sh}
        self.abstract_params = abstract_params
        trained = nnx.Param if self.lora is None else lora_mod.ADAPTERS
        self._init_params = jax.jit(lambda: nnx.state(_new_model(cfg, vocab_size, lora=self.lora), trained),
                                    out_shardings=self.param_sh)
        self._init_base = jax.jit(lambda: nnx.state(_new_model(cfg, vocab_size), nnx.Param),
                                  out_shardings=self.base_sh)
        self._base = self._base_ref = None  # loaded and digested on first use
        self._init_opt = jax.jit(self.tx.init, out_shardings=self.opt_sh)
        self._shared = shared_devices
        self._copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p))
        # several processes: each engine needs the whole weights on its own devices
        self._replicate = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=sharding.replicated(mesh)) \
            if jax.process_count() > 1 else None
        self.use_ref = cfg.learner.kl_coef > 0
        # the step's second argument: the KL reference (full weights), or the frozen base (LoRA)
        second = self.base_sh if self.lora is not None else self.param_sh if self.use_ref else None
        self.teacher = teacher
        shardings = (self.state_sh, second, self._batch_shardings())
        shardings += (self.teacher.shardings,) if self.teacher is not None else ()
        self._step = jax.jit(self._train_step, donate_argnums=(0,), in_shardings=shardings,
                             out_shardings=(self.state_sh, sharding.replicated(mesh)))

    # deeper models are scanned on CPU too: unrolled, a 30-layer step takes many minutes to compile
    CPU_UNROLL_MAX_LAYERS = 8

    @staticmethod
    def layer_unroll(platform: str, n_layers: int = 0) -> bool | int:
        """Layers per scan iteration. XLA:CPU runs a loop body's matmuls on one core, and CPU
        models are mostly shallow: unrolled there (True) up to CPU_UNROLL_MAX_LAYERS layers;
        scanned on accelerators and for deeper models (1)."""
        return True if platform == "cpu" and n_layers <= Learner.CPU_UNROLL_MAX_LAYERS else 1

    # ---- state -------------------------------------------------------------------------

    def init_params(self) -> nnx.State:
        """The trained parameters at step 0: the weights, or with LoRA fresh adapters."""
        if self.lora is not None:
            return self._init_params()
        return self._load_weights(self.param_sh)

    def _load_weights(self, shardings) -> nnx.State:
        if self.cfg.model.hf_path:  # pretrained weights, each tensor read straight into its sharding
            from async_rl.model import hf
            return hf.load_params(self.cfg.model.hf_path, self.abstract_base, shardings)
        return self._init_params() if self.lora is None else self._init_base()

    def base_params(self) -> nnx.State:
        """LoRA: the frozen base weights, loaded once and kept for the run."""
        if self._base is None:
            self._base = self._load_weights(self.base_sh)
        return self._base

    def base_reference(self) -> dict:
        """LoRA: the base's path (or seed) and digest, as a checkpoint records them (`lora`)."""
        if self._base_ref is None:
            base = None
            if not self.cfg.model.hf_path:
                base = self.base_params()
                if self._replicate is not None:
                    base = jax.tree.map(lambda x: x.addressable_shards[0].data, self._replicate(base))
            self._base_ref = lora_mod.base_reference(self.cfg, base)
        return self._base_ref

    def check_init_params(self) -> None:
        """Raises where `init_params` would refuse the pretrained weights, reading only the
        files' headers (nothing is loaded)."""
        if self.cfg.model.hf_path:
            from async_rl.model import hf
            hf.check_params(self.cfg.model.hf_path, self.abstract_base)

    def init_state(self, params: nnx.State) -> dict:
        return {"params": params, "opt": self._init_opt(params)}

    def abstract_state(self) -> dict:
        """ShapeDtypeStructs with target shardings: the restore target (reshards on load)."""
        abstract = {"params": self.abstract_params, "opt": jax.eval_shape(self.tx.init, self.abstract_params)}
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, self.state_sh)

    def publishable(self, params: nnx.State) -> nnx.State:
        """Params for the engine, in buffers that the next (donating) step cannot free.

        On shared devices a replicated layout could make the engine's device_put a no-op
        that aliases the learner's buffers, so copy; onto other devices, the transfer copies.
        With several processes: all-gather, then this process's full local copy."""
        if self._replicate is not None:
            return jax.tree.map(lambda x: x.addressable_shards[0].data, self._replicate(params))
        return self._copy(params) if self._shared else params

    # ---- step --------------------------------------------------------------------------

    @staticmethod
    def _check_splits(cfg: Config, mesh) -> None:
        """Every minibatch and micro-batch must split evenly over the batch shards."""
        lc, shards = cfg.learner, sharding.batch_shards(mesh)
        per_update = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt // lc.minibatches
        if lc.minibatches > 1 and per_update % shards:
            raise ConfigError(f"learner.minibatches={lc.minibatches}: {per_update} rows per update do not split "
                              f"over the {shards} batch shards (mesh data x fsdp x expert)")
        if lc.micro_batch_rows % shards:
            raise ConfigError(f"learner.micro_batch_rows={lc.micro_batch_rows}: must be a multiple of the {shards} "
                              "batch shards (mesh data x fsdp x expert)")

    def _batch_shardings(self):
        shapes = {"tokens_BxT": 2, "positions_BxT": 2, "valid_BxT": 2, "completion_BxN": 2,
                  "behav_logp_BxN": 2, "mask_BxN": 2, "rewards_B": 1, "row_valid_B": 1, "truncated_B": 1}
        if self.cfg.learner.routing_replay:
            shapes["routes_BxTxLxK"] = 4
        return {k: sharding.batch_sharding(self.mesh, nd) for k, nd in shapes.items()}

    def _model(self, params, second):
        """The policy: the weights, or the frozen base (`second`) with the adapters."""
        return nnx.merge(self.graphdef, params) if self.lora is None else nnx.merge(self.graphdef, second, params)

    def _ref_model(self, second):
        """The KL reference: the initial weights, or the base without adapters."""
        return nnx.merge(self.base_graphdef, second)

    def _model_logprobs(self, model, b, router: bool = False, replay: bool = False):
        """(logprobs, entropies) of the completion tokens; `router`: also the MoE router's
        per-layer statistics (`moe.stats`); `replay`: the policy under routing replay takes the
        engine's experts (`routes_BxTxLxK`, when the batch has them)."""
        t, n = b["tokens_BxT"].shape[1], b["completion_BxN"].shape[1]
        pb = t - n  # the batch's prompt width; its column 0 is the engine's column P - pb
        x = model.hidden(b["tokens_BxT"], b["positions_BxT"], b["valid_BxT"], col_offset=self.P - pb,
                         attn=self.attn, remat=self.cfg.learner.remat, unroll=self.unroll or self._layer_unroll,
                         gather=self.gather, router=router,
                         routes_BxTxLxK=b.get("routes_BxTxLxK") if replay else None)
        x, routed = x if router else (x, None)
        x_c = x[:, pb - 1:pb + n - 1]  # column c-1 predicts column c
        out = losses.completion_logprobs(model.logits, x_c, b["completion_BxN"], self.cfg.engine.temperature,
                                         self.cfg.learner.logits_chunk, unroll=self.unroll or 1)
        return (*out, routed) if router else out

    def _router_loss(self, routed_L, share):
        """The MoE router's load-balancing loss (model.router_aux_coef x its mean over layers)
        and statistics, each times `share`, this micro-batch's share of the tokens routed."""
        aux = routed_L["aux"].mean() * share
        stats = {"router_aux": jax.lax.stop_gradient(aux),
                 "router_entropy": jax.lax.stop_gradient(routed_L["entropy"].mean() * share),
                 "expert_load_max": jax.lax.stop_gradient(routed_L["load"].max())}
        stats.update({f"expert_load_l{i}": jax.lax.stop_gradient(v * share) for i, v in enumerate(routed_L["load"])})
        return self.cfg.model.router_aux_coef * aux, stats

    def _split(self, rows: dict, k: int) -> dict:
        """[B, ...] -> [k, B / k, ...]: part j holds rows r with r % k == j (each spread over the devices)."""
        def one(x):
            y = x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)
            spec = PS(None, sharding.BATCH_AXES, *([None] * (x.ndim - 1)))
            return jax.lax.with_sharding_constraint(y, NamedSharding(self.mesh, spec))
        return jax.tree.map(one, rows)

    def _micro_count(self, rows: int) -> int:
        m = self.cfg.learner.micro_batch_rows
        return rows // m if m and m < rows else 1

    def _loss(self, params, ref_params, mb, denom):
        """One micro-batch's share of the update's loss (its sums over the update's token count)."""
        lc = self.cfg.learner
        mask, moe = mb["mask_BxN"], self.cfg.model.moe
        logp, ent, *routed = self._model_logprobs(self._model(params, ref_params), mb, router=moe, replay=True)
        low, high = lc.clip_eps_low or lc.clip_eps, lc.clip_eps_high or lc.clip_eps
        loss, stats = losses.policy_loss(logp, mb["behav_logp_BxN"], mb["adv_B"], mask, clip_eps=low, clip_high=high,
                                         correction=lc.is_correction, is_cap=lc.is_cap, prox_BxN=mb.get("prox_BxN"),
                                         denom=denom, ratio_level=lc.ratio_level, row_w_B=mb.get("row_w_B"))
        stats["approx_kl"] = losses.approx_kl(logp, mb["behav_logp_BxN"], mask, denom)
        if self.use_ref:
            ref_logp, _ = self._model_logprobs(self._ref_model(ref_params), mb)
            kl = losses.kl_k3(logp, jax.lax.stop_gradient(ref_logp), mask, denom)
            loss = loss + lc.kl_coef * kl
            stats["kl"] = kl
        fm = mask.astype(jnp.float32)
        stats["entropy"] = jax.lax.stop_gradient((ent * fm).sum() / denom)
        stats["logp_diff_max"] = jnp.max(jnp.where(mask, jnp.abs(logp - mb["behav_logp_BxN"]), 0.0))
        if moe:
            aux, router_stats = self._router_loss(routed[0], mb["router_w_B"].sum())
            loss, stats = loss + aux, {**stats, **router_stats}
        return loss, stats

    def _grads(self, params, ref_params, rows):
        """(loss, stats, grads) of one update's rows, accumulated over micro-batches."""
        denom = losses.token_count(rows["mask_BxN"])
        if self.cfg.learner.loss_agg != "token_mean":
            rows = dict(rows, row_w_B=losses.row_weights(rows["mask_BxN"], self.cfg.learner.loss_agg, self.N))
        if self.cfg.model.moe:  # each row's share of the tokens the router saw (the router's stats are means over them)
            seen_B = rows["valid_BxT"].sum(1).astype(jnp.float32)
            rows = dict(rows, router_w_B=seen_B / jnp.maximum(seen_B.sum(), 1.0))
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        k = self._micro_count(rows["mask_BxN"].shape[0])
        if k == 1:
            (loss, stats), grads = grad_fn(params, ref_params, rows, denom)
            return loss, stats, grads

        def micro(acc, mb):
            (loss, stats), g = grad_fn(params, ref_params, mb, denom)
            add = lambda a, b: a + b.astype(a.dtype)
            stats = {s: (jnp.maximum if s in losses.MAX_STATS else add)(acc[1][s], v) for s, v in stats.items()}
            return (acc[0] + loss, stats, jax.tree.map(add, acc[2], g)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        stats0 = jax.eval_shape(lambda: self._loss(params, ref_params, jax.tree.map(lambda x: x[0], self._split(
            rows, k)), denom)[1])
        acc0 = (jnp.zeros((), jnp.float32), {s: jnp.zeros(v.shape, v.dtype) for s, v in stats0.items()}, zeros)
        (loss, stats, grads), _ = jax.lax.scan(micro, acc0, self._split(rows, k), unroll=self.unroll or 1)
        return loss, stats, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

    def _rows_logprobs(self, model, rows, replay: bool = False):
        """`model`'s logprobs of every row's completion, micro-batch by micro-batch (no gradient);
        `replay`: see `_model_logprobs`."""
        k = self._micro_count(rows["mask_BxN"].shape[0])
        if k == 1:
            return jax.lax.stop_gradient(self._model_logprobs(model, rows, replay=replay)[0])
        _, lp = jax.lax.scan(lambda c, mb: (c, self._model_logprobs(model, mb, replay=replay)[0]), None,
                             self._split(rows, k),
                             unroll=self.unroll or 1)
        return jax.lax.stop_gradient(lp.swapaxes(0, 1).reshape(rows["mask_BxN"].shape))

    def _distill(self, teacher_params, rows, adv_B):
        """learner.distill=reverse_kl: each token's advantage adds distill_coef x (log pi_teacher -
        log mu) of its sampled token, mu the behaviour policy (minus a per-token k1 estimate of
        KL(mu || teacher)); (advantages [B, N], metrics)."""
        lc, mask = self.cfg.learner, rows["mask_BxN"]
        teacher_BxN = self._rows_logprobs(nnx.merge(self.teacher.graphdef, teacher_params), rows)
        d_BxN = jnp.where(mask, teacher_BxN - rows["behav_logp_BxN"], 0.0)
        fm, denom = mask.astype(jnp.float32), losses.token_count(mask)
        rv = rows["row_valid_B"].astype(jnp.float32)
        metrics = {"learner/distill_reverse_kl": -(d_BxN * fm).sum() / denom,
                   "learner/teacher_logp": (teacher_BxN * fm).sum() / denom,
                   "learner/student_logp": (rows["behav_logp_BxN"] * fm).sum() / denom,
                   "learner/distill_adv_abs": lc.distill_coef * jnp.abs(d_BxN).sum() / denom,
                   "learner/reward_adv_abs": (jnp.abs(adv_B) * rv).sum() / jnp.maximum(rv.sum(), 1)}
        return adv_B[:, None] + lc.distill_coef * d_BxN, metrics

    def _update(self, state, ref_params, rows):
        loss, stats, grads = self._grads(state["params"], ref_params, rows)
        updates, opt = self.tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        grad_norm = optax.tree.norm(grads)
        # an update whose loss, gradient or step is not finite is never applied: the weights and the
        # optimizer state stay as they were (learner.nonfinite decides whether the run goes on)
        finite = [jnp.isfinite(u).all() for u in jax.tree.leaves(updates)]  # an lr of inf in float32: a finite
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.all(jnp.stack(finite))  # gradient, inf update
        new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), {"params": params, "opt": opt}, state)
        return new, dict(stats, loss=loss, grad_norm=grad_norm, skipped_updates=(~ok).astype(jnp.int32))

    def _train_step(self, state, ref_params, b, teacher_params=None):
        lc = self.cfg.learner
        mask = b["mask_BxN"] & b["row_valid_B"][:, None]
        rewards = b["rewards_B"]
        lens = mask.sum(axis=1)
        if lc.overlong == "penalty":
            rewards = rewards + losses.overlong_penalty(lens, self.N, lc.overlong_buffer, lc.overlong_coef)
        r_GxS = rewards.reshape(-1, self.G)
        adv = losses.advantages(r_GxS, lc.advantage, lc.adv_eps).reshape(-1)
        truncated = b["truncated_B"] & b["row_valid_B"]
        train_mask = mask & ~truncated[:, None] if lc.overlong == "filter" else mask
        rows, distilled = dict(b, mask_BxN=train_mask, adv_B=adv), {}
        if self.teacher is not None:
            rows["adv_B"], distilled = self._distill(teacher_params, rows, adv)
        u, m = updates_per_step(self.cfg), lc.minibatches
        if u == 1:
            state, stats = self._update(state, ref_params, rows)
        else:
            if lc.is_correction != "none":  # "none" clips against the behaviour policy instead
                rows["prox_BxN"] = self._rows_logprobs(self._model(state["params"], ref_params), rows, replay=True)
            parts = self._split(rows, m)

            def one(state, i):
                return self._update(state, ref_params, jax.tree.map(lambda x: x[i % m], parts))

            state, per_update = jax.lax.scan(one, state, jnp.arange(u), unroll=self.unroll or 1)
            stats = {s: v.max() if s in losses.MAX_STATS else v.sum() if s == "skipped_updates" else v.mean()
                     for s, v in per_update.items()}
        rv = b["row_valid_B"].astype(jnp.float32)
        r_mean = (b["rewards_B"] * rv).sum() / jnp.maximum(rv.sum(), 1)
        r_std = jnp.sqrt((((b["rewards_B"] - r_mean) ** 2) * rv).sum() / jnp.maximum(rv.sum(), 1))
        metrics = {"rollout/reward_mean": r_mean, "rollout/reward_std": r_std, "rollout/completion_tokens": mask.sum()}
        n_rows, g_valid = jnp.maximum(rv.sum(), 1), b["row_valid_B"].reshape(-1, self.G).all(axis=1)
        zero_adv = g_valid & jnp.all(r_GxS == r_GxS[:, :1], axis=1)  # equal rewards: every estimator gives 0
        metrics.update({
            "rollout/response_len_mean": (lens * rv).sum() / n_rows,
            "rollout/response_len_max": lens.max(),
            "rollout/truncated_frac": truncated.sum() / n_rows,
            "rollout/zero_adv_group_frac": zero_adv.sum() / jnp.maximum(g_valid.sum(), 1),
        })
        if lc.overlong == "filter":
            metrics["rollout/overlong_filtered"] = truncated.sum()
        metrics.update({f"learner/{k}": v for k, v in stats.items()}, **distilled)
        return state, metrics

    def agreed(self, batch: Batch, pad_id: int = 0) -> Batch:
        """`batch` widened to the widest prompt and completion widths any process has this step."""
        if jax.process_count() == 1:
            return batch
        p, n = (int(w) for w in sharding.agree(list(batch.widths)).max(axis=0))
        return widen(batch, p, n, pad_id)

    def step(self, state, batch: Batch, ref_params=None):
        """Dispatches one step (returns at once; metrics are device arrays). With LoRA the
        frozen base goes where the KL reference would (it is the reference)."""
        if self.lora is not None:
            ref_params = self.base_params()
        batch = self.agreed(batch)
        if batch.widths not in self.compiled_widths:
            self.compiled_widths.add(batch.widths)
            pb, nb = batch.widths
            self.log(f"learner: compiling the step for {batch.tokens_BxT.shape[0]} rows x ({pb} prompt + {nb} "
                     f"completion) columns")
        args = (state, ref_params, sharding.global_batch(self.mesh, batch.device_dict()))
        return self._step(*args, *((self.teacher.params(self.log),) if self.teacher is not None else ()))


def params_fingerprint(params: nnx.State) -> str:
    """sha256 over every parameter's bytes, in a fixed (path-sorted) order."""
    h = hashlib.sha256()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(flat, key=lambda kv: jax.tree_util.keystr(kv[0])):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.asarray(jax.device_get(leaf)).tobytes())
    return h.hexdigest()[:32]
