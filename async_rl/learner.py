"""The learner: parameter init, optimizer, host batches and the jitted GRPO train step.

Owns: the train state {params, opt}, its shardings on the learner mesh, the optax
optimizer (AdamW, warm-up + constant/cosine, grad-norm clip), turning READY ledger
groups into a fixed-shape host batch, and the pure `train_step(state, batch) ->
(state, metrics)` jitted with explicit shardings and donated state. Does not own: which
groups form a step (sampler), the loss formulas (losses), files (checkpoint), or the
engine (weights leave through `publishable`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from . import losses, sharding
from .config import Config
from .ledger import Group
from .model import Transformer


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    lc = cfg.learner
    if lc.schedule == "cosine":
        decay = lc.decay_steps or max(cfg.train.max_steps, lc.warmup_steps + 1)
        sched = optax.warmup_cosine_decay_schedule(0.0, lc.lr, max(lc.warmup_steps, 1), decay,
                                                   end_value=lc.lr * lc.end_lr_ratio)
    elif lc.warmup_steps:
        sched = optax.join_schedules([optax.linear_schedule(0.0, lc.lr, lc.warmup_steps),
                                      optax.constant_schedule(lc.lr)], [lc.warmup_steps])
    else:
        sched = optax.constant_schedule(lc.lr)
    chain = [optax.clip_by_global_norm(lc.grad_clip)] if lc.grad_clip else []
    chain.append(optax.adamw(sched, b1=lc.b1, b2=lc.b2, weight_decay=lc.weight_decay))
    return optax.chain(*chain)


def _new_model(cfg: Config, vocab_size: int) -> Transformer:
    return Transformer(cfg.model, vocab_size, rngs=nnx.Rngs(cfg.run.seed))


@dataclass
class Batch:
    """One learner step on the host: B = groups x samples rows, T = P + N columns."""
    tokens_BxT: np.ndarray  # int32 prompt (left-padded to P) + completion
    positions_BxT: np.ndarray  # int32 RoPE positions (column - first valid column)
    valid_BxT: np.ndarray  # bool real tokens
    completion_BxN: np.ndarray  # int32 completion tokens (pad past the end)
    behav_logp_BxN: np.ndarray  # float32 engine logprobs of the completion tokens
    mask_BxN: np.ndarray  # bool tokens that count in the loss
    versions_BxN: np.ndarray  # int32 policy version that produced each token (-1 = none)
    rewards_B: np.ndarray  # float32
    row_valid_B: np.ndarray  # bool rows of real groups (a short last step is padded)

    def device_dict(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.__dict__.items() if k != "versions_BxN"}


def build_batch(groups: Sequence[Group], *, groups_per_step: int, samples: int, prompt_len: int,
                max_new: int, pad_id: int) -> Batch:
    """Lays groups out in the engine's column layout (prompt ends at column P)."""
    B, P, N = groups_per_step * samples, prompt_len, max_new
    T = P + N
    tokens = np.full((B, T), pad_id, np.int32)
    valid = np.zeros((B, T), bool)
    positions = np.zeros((B, T), np.int32)
    comp = np.full((B, N), pad_id, np.int32)
    behav = np.zeros((B, N), np.float32)
    mask = np.zeros((B, N), bool)
    versions = np.full((B, N), -1, np.int32)
    rewards = np.zeros((B,), np.float32)
    row_valid = np.zeros((B,), bool)
    for gi, g in enumerate(groups):
        L = len(g.prompt_tokens)
        for si, s in enumerate(g.samples):
            r, n = gi * samples + si, len(s.tokens)
            tokens[r, P - L:P] = g.prompt_tokens
            tokens[r, P:P + n] = s.tokens
            valid[r, P - L:P + n] = True
            positions[r, P - L:] = np.arange(T - (P - L))
            comp[r, :n] = s.tokens
            behav[r, :n] = s.logprobs
            mask[r, :n] = True
            versions[r, :n] = s.versions
            rewards[r] = s.reward
            row_valid[r] = True
    return Batch(tokens, positions, valid, comp, behav, mask, versions, rewards, row_valid)


class Learner:
    """Holds the compiled functions; the state itself is passed in and out (pure steps)."""

    def __init__(self, cfg: Config, vocab_size: int, mesh, shared_devices: bool = True):
        self.cfg, self.mesh, self.vocab_size = cfg, mesh, vocab_size
        self.P, self.N = cfg.engine.max_prompt_len, cfg.rollout.max_new_tokens
        self.G = cfg.rollout.samples_per_prompt
        self.tx = make_optimizer(cfg)
        abstract_model = nnx.eval_shape(lambda: _new_model(cfg, vocab_size))
        self.graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
        self.param_sh = sharding.param_shardings(abstract_params, mesh)
        self.opt_sh = sharding.opt_shardings(self.tx, abstract_params, self.param_sh, mesh)
        self.state_sh = {"params": self.param_sh, "opt": self.opt_sh}
        self.abstract_params = abstract_params
        self._init_params = jax.jit(lambda: nnx.state(_new_model(cfg, vocab_size), nnx.Param),
                                    out_shardings=self.param_sh)
        self._init_opt = jax.jit(self.tx.init, out_shardings=self.opt_sh)
        self._shared = shared_devices
        self._copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p))
        # several processes: each engine needs the whole weights on its own devices
        self._replicate = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=sharding.replicated(mesh)) \
            if jax.process_count() > 1 else None
        self.use_ref = cfg.learner.kl_coef > 0
        self._step = jax.jit(self._train_step, donate_argnums=(0,),
                             in_shardings=(self.state_sh, self.param_sh if self.use_ref else None,
                                           self._batch_shardings()),
                             out_shardings=(self.state_sh, sharding.replicated(mesh)))

    # ---- state -------------------------------------------------------------------------

    def init_params(self) -> nnx.State:
        if self.cfg.model.hf_path:  # pretrained weights, each tensor read straight into its sharding
            from . import hf
            return hf.load_params(self.cfg.model.hf_path, self.abstract_params, self.param_sh)
        return self._init_params()

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

    def _batch_shardings(self):
        shapes = {"tokens_BxT": 2, "positions_BxT": 2, "valid_BxT": 2, "completion_BxN": 2,
                  "behav_logp_BxN": 2, "mask_BxN": 2, "rewards_B": 1, "row_valid_B": 1}
        return {k: sharding.batch_sharding(self.mesh, nd) for k, nd in shapes.items()}

    def _logprobs(self, params, b):
        """Completion-token logprobs and entropies; only the N predicting columns reach the vocabulary."""
        model = nnx.merge(self.graphdef, params)
        x = model.hidden(b["tokens_BxT"], b["positions_BxT"], b["valid_BxT"])
        x_c = x[:, self.P - 1:self.P + self.N - 1]  # column c-1 predicts column c
        return losses.completion_logprobs(model.logits, x_c, b["completion_BxN"], self.cfg.engine.temperature,
                                          self.cfg.learner.logits_chunk)

    def _train_step(self, state, ref_params, b):
        lc = self.cfg.learner
        mask = b["mask_BxN"] & b["row_valid_B"][:, None]
        rewards_GxS = b["rewards_B"].reshape(-1, self.G)
        adv = losses.grpo_advantages(rewards_GxS, lc.adv_eps).reshape(-1)

        def loss_fn(params):
            logp, ent = self._logprobs(params, b)
            loss, stats = losses.policy_loss(logp, b["behav_logp_BxN"], adv, mask, clip_eps=lc.clip_eps,
                                             correction=lc.is_correction, is_cap=lc.is_cap)
            if self.use_ref:
                ref_logp, _ = self._logprobs(ref_params, b)
                kl = losses.kl_k3(logp, jax.lax.stop_gradient(ref_logp), mask)
                loss = loss + lc.kl_coef * kl
                stats["kl"] = kl
            fm = mask.astype(jnp.float32)
            stats["entropy"] = jax.lax.stop_gradient((ent * fm).sum() / jnp.maximum(fm.sum(), 1))
            stats["logp_diff_max"] = jnp.max(jnp.where(mask, jnp.abs(logp - b["behav_logp_BxN"]), 0.0))
            return loss, stats

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt = self.tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        rv = b["row_valid_B"].astype(jnp.float32)
        r_mean = (b["rewards_B"] * rv).sum() / jnp.maximum(rv.sum(), 1)
        r_std = jnp.sqrt((((b["rewards_B"] - r_mean) ** 2) * rv).sum() / jnp.maximum(rv.sum(), 1))
        metrics = {"learner/loss": loss, "learner/grad_norm": optax.tree.norm(grads),
                   "rollout/reward_mean": r_mean, "rollout/reward_std": r_std,
                   "rollout/completion_tokens": mask.sum()}
        metrics.update({f"learner/{k}": v for k, v in stats.items()})
        return {"params": params, "opt": opt}, metrics

    def step(self, state, batch: Batch, ref_params=None):
        """Dispatches one step (returns at once; metrics are device arrays)."""
        return self._step(state, ref_params, sharding.global_batch(self.mesh, batch.device_dict()))


def params_fingerprint(params: nnx.State) -> str:
    """sha256 over every parameter's bytes, in a fixed (path-sorted) order."""
    h = hashlib.sha256()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(flat, key=lambda kv: jax.tree_util.keystr(kv[0])):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.asarray(jax.device_get(leaf)).tobytes())
    return h.hexdigest()[:32]
