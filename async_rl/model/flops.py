"""Parameter and FLOP counts: of the model, from its own parameter tree, and of one learner step.

Owns: the parameter count by role (`param_counts`, read off `nnx.eval_shape` of the
Transformer, so it is what the model holds whatever its options) and of a run's LoRA
adapters (`adapter_count`), the model FLOPs of one
learner step (`step_flops`: useful work only, no recomputation, no padding), and the FLOPs
fused attention kernels perform (`kernel_flops`: what a cost model that cannot see inside
them must add). Used by the start-up memory estimate (memory), `async-rl plan` and the
learner benchmark. Does not own: the model (model), the hardware FLOPs XLA counts (plan).

A step's model FLOPs, per pass over its B rows of T = P + N columns:
  trunk      2 x (the blocks' matmul kernels) x B T: every column runs through every block,
             since prompt keys and values feed the completion
  head       2 x d x V x B N: logits only at the N completion columns (tied or untied alike;
             the input embedding is a gather, 0 FLOPs)
  attention  4 x L x H x hd x T^2 x B (QK^T and PV) over the full square, half of it (the
             causal triangle) for kernels that skip masked blocks
A forward and backward pass counts 3 of these, a forward-only one (the reference model, the
proximal policy) 1.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from async_rl import config as C


@dataclass(frozen=True)
class Counts:
    embed: int  # parameters of the token embedding and the learned position table
    head: int  # parameters of an untied output projection (0 when tied)
    trunk: int  # parameters of the blocks, all of them
    matmul: int  # of which the matmul kernels a token runs through (q, k, v, o, gate, up, down; MoE: router, k of E experts)
    other: int  # parameters outside those (the final norm)

    @property
    def total(self) -> int:
        return self.embed + self.head + self.trunk + self.other


_ROLES = {"embed": "embed", "pos_embed": "embed", "lm_head": "head", "layers": "trunk"}


@functools.lru_cache(maxsize=16)
def param_counts(model: C.ModelConfig, vocab: int) -> Counts:
    """The model's parameters by role, from its abstract parameter tree (nothing allocated)."""
    from flax import nnx

    from async_rl.model.transformer import Transformer
    abstract = nnx.eval_shape(lambda: Transformer(model, vocab, rngs=nnx.Rngs(0)))
    out = dict.fromkeys(("embed", "head", "trunk", "matmul", "other"), 0)
    for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        n = math.prod(v.get_value().shape)
        role = _ROLES.get(str(path[0]), "other")
        out[role] += n
        if role == "trunk" and path[-1] in ("kernel", "router"):
            out["matmul"] += n
        elif role == "trunk" and str(path[-1]).startswith("experts_"):  # each token runs k of the E experts
            out["matmul"] += n * model.n_experts_per_token // model.n_experts
    return Counts(**out)


def param_count(model: C.ModelConfig, vocab: int) -> int:
    return param_counts(model, vocab).total


def adapter_count(cfg: C.Config, vocab: int) -> int:
    """Adapter parameters of the run's LoRA (0 without), from the abstract model."""
    from flax import nnx

    from async_rl.model import lora
    from async_rl.model.transformer import Transformer
    sp = lora.spec(cfg)
    if sp is None:
        return 0
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, vocab, rngs=nnx.Rngs(0), lora=sp))
    return sum(math.prod(v.get_value().shape) for _, v in nnx.to_flat_state(nnx.state(abstract, lora.ADAPTERS)))


def passes(cfg: C.Config) -> tuple[int, int]:
    """(forward+backward passes over the step's rows, extra forward-only passes)."""
    lc = cfg.learner
    fwd_only = int(lc.ppo_epochs * lc.minibatches > 1 and lc.is_correction != "none")  # pi_prox
    fwd_only += lc.ppo_epochs * int(lc.kl_coef > 0)  # the reference model, with every update
    return lc.ppo_epochs, fwd_only


def attended_pairs(m: C.ModelConfig, T: int, causal: bool = True) -> float:
    """(query, key) pairs one row's attention computes, summed over layers: T^2/2 per causal
    layer (T^2 as the full square), and W*T - W^2/2 per sliding-window layer of window W
    when causal (masked-square kernels compute the full square whatever the window)."""
    full = T * T * (0.5 if causal else 1.0)
    n_local = sum(m.local_layers()) if causal else 0
    w = min(m.sliding_window, T)
    return (m.n_layers - n_local) * full + n_local * (w * T - w * w / 2)


def pass_flops(cfg: C.Config, m: C.ModelConfig, vocab: int, causal: bool = True) -> dict[str, float]:
    """Model FLOPs of one forward pass of model `m` over a step's rows, by part."""
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    N = cfg.rollout.max_new_tokens
    T = cfg.engine.max_prompt_len + N
    return {"trunk": 2.0 * param_counts(m, vocab).matmul * rows * T, "head": 2.0 * m.d_model * vocab * rows * N,
            "attention": 4.0 * m.n_heads * m.resolved_head_dim * rows * attended_pairs(m, T, causal)}


def step_flops(cfg: C.Config, vocab: int, causal: bool = True, teacher=None) -> dict[str, float]:
    """Model FLOPs of one learner step by part (trunk, head, attention), every pass included;
    `causal`: attention over the causal triangle (False: the full square, as plain XLA
    attention computes it); `teacher` (a `TeacherSpec`): its one forward pass added."""
    fb, fwd = passes(cfg)
    out = {k: (3 * fb + fwd) * v for k, v in pass_flops(cfg, cfg.model, vocab, causal).items()}
    if teacher is not None:
        out.update({f"teacher {k}": v for k, v in pass_flops(cfg, teacher.model, teacher.vocab, causal).items()})
    return out


def kernel_flops(cfg: C.Config, backward: int = 7, teacher=None) -> float:
    """FLOPs inside fused attention kernels: per causal matmul H hd T^2 per row and layer; 2
    in the forward, `backward` in the backward (splash 7: dq 3, dk/dv 4; cuDNN 5: scores,
    dP, dV, dK, dQ), 2 more when blocks are rematerialised; `teacher`'s one forward added."""
    lc = cfg.learner
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    T = cfg.engine.max_prompt_len + cfg.rollout.max_new_tokens
    unit = lambda m: 2 * m.n_heads * m.resolved_head_dim * rows * attended_pairs(m, T)  # noqa: E731
    fb, fwd = passes(cfg)
    out = unit(cfg.model) * (fb * (2 + backward + 2 * (lc.remat != "none")) + 2 * fwd)
    return out + (2 * unit(teacher.model) if teacher is not None else 0.0)


def expert_kernel_flops(cfg: C.Config) -> float:
    """FLOPs of MoE grouped-matmul kernels that XLA's cost model does not see: megablox's gmm
    states its cost to XLA, its tgmm (the experts' weight gradient, in each backward pass) does
    not: 2 x k x 3 D F per token and MoE layer. 0 for dense models; a teacher has no backward."""
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    T = cfg.engine.max_prompt_len + cfg.rollout.max_new_tokens
    m = cfg.model
    return 6.0 * m.n_experts_per_token * m.d_model * m.d_ff_expert * m.n_layers * rows * T * passes(cfg)[0]
