"""Run configuration: one frozen dataclass per concept, YAML presets, dotted overrides.

Owns: the declared fields (each with a one-line meaning and unit), parsing of YAML
and `group.key=value` overrides into those types, validation that names the field
and the value received, and the list of fields that define what the data stream
means (a resume may not change them); the housekeeping groups (train, mesh, checkpoint,
journal, eval, log) are declared in `config_groups` and re-exported here. Does not own: checks that need devices
(mesh vs. device count lives in `sharding`) or a checkpoint (lives in `checkpoint`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from async_rl.config_groups import (  # noqa: F401  (re-exported: config owns every group)
    CheckpointConfig,
    ConfigError,
    EvalConfig,
    JournalConfig,
    LogConfig,
    MeshConfig,
    TrainConfig,
    _check,
    _one_of,
)


@dataclass(frozen=True)
class RunConfig:
    dir: str = ""  # run directory: config.yaml, logs, lineage, checkpoints; required to train
    seed: int = 0  # seeds parameter init and the per-token sampling keys
    resume: str = "auto"  # auto | never | must | restart: as auto, but history without a checkpoint moves to previous/
    env_changed: str = "refuse"  # refuse | accept: resume when rollout.env's or rollout.reward's code changed
    reset_optimizer: bool = False  # resume with restored params and a fresh optimizer when its structure changed
    determinism: bool = False  # bit-identical resume (in_order sampler only)
    compilation_cache: str = "~/.cache/async_rl/xla"  # persistent XLA cache dir; "" disables
    compilation_cache_max_gb: float = 4.0  # cap on that dir, least recently used programs evicted; 0 = no cap, GB
    memory_check: bool = True  # refuse at start-up a model whose estimated memory exceeds what is available
    lease_s: float = 60.0  # gs:// / s3:// run.dir: a run lock not renewed for this long is taken over, seconds
    storage_timeout_s: float = 300.0  # gs:// / s3:// run.dir: a storage call unanswered this long (with retries) stops the run, seconds

    def __post_init__(self):
        _one_of("run.resume", self.resume, ("auto", "never", "must", "restart"))
        _one_of("run.env_changed", self.env_changed, ("refuse", "accept"))
        _check(self.lease_s >= 1, "run.lease_s", self.lease_s, "must be >= 1 (seconds; renewed every third of it)")
        _check(self.storage_timeout_s >= 5, "run.storage_timeout_s", self.storage_timeout_s, "must be >= 5 (seconds)")
        _check(self.compilation_cache_max_gb >= 0, "run.compilation_cache_max_gb", self.compilation_cache_max_gb,
               "must be >= 0 (GB; 0 = no cap)")


@dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"  # synthetic | jsonl | parquet
    # synthetic task: reverse | addition | word_problem (arithmetic in sentences) | sequence (next term of
    # an arithmetic sequence) | lookup | recall (need a tool)
    task: str = "reverse"
    path: str = ""  # prompt file for jsonl/parquet sources
    num_records: int = 2048  # records per epoch (synthetic); 0 = the whole file
    shuffle: bool = True  # reshuffle the records every epoch
    seed: int = 0  # seed for synthetic records and the shuffle
    num_epochs: int = 1  # passes over the records; the run ends after the last
    min_digits: int = 3  # synthetic tasks: shortest operand, digits
    max_digits: int = 6  # synthetic tasks: longest operand, digits
    prompt_field: str = "prompt"  # file sources: field holding the prompt text
    answer_field: str = "answer"  # file sources: field holding the reference answer
    id_field: str = ""  # file sources: integer id field; "" = row number
    on_bad_record: str = "error"  # error: stop naming file and line | skip: skip and count

    @property
    def char_vocab(self) -> bool:
        """The digit tasks speak the synthetic character vocabulary; word problems and lookups are text."""
        return self.source == "synthetic" and self.task not in ("word_problem", "sequence", "lookup")

    def __post_init__(self):
        _one_of("data.source", self.source, ("synthetic", "jsonl", "parquet"))
        if self.source == "synthetic":
            _one_of("data.task", self.task, ("reverse", "addition", "word_problem", "lookup", "recall", "sequence"))
            _check(self.num_records > 0, "data.num_records", self.num_records, "must be > 0")
        else:
            _check(bool(self.path), "data.path", self.path, f"required for data.source={self.source}")
            _check(self.num_records >= 0, "data.num_records", self.num_records, "must be >= 0")
        _check(self.num_epochs > 0, "data.num_epochs", self.num_epochs, "must be > 0")
        _check(self.min_digits >= 1, "data.min_digits", self.min_digits, "must be >= 1")
        _check(self.max_digits >= self.min_digits, "data.max_digits", self.max_digits, f"must be >= data.min_digits ({self.min_digits})")
        _one_of("data.on_bad_record", self.on_bad_record, ("error", "skip"))

@dataclass(frozen=True)
class TokenizerConfig:
    kind: str = "auto"  # auto: hf if path is set, else char (synthetic) or byte | hf | byte | char
    path: str = ""  # directory with tokenizer.json (a Hugging Face tokenizer)
    template: str = "{prompt}"  # prompt template; {prompt} is replaced by the record's prompt
    chat: bool = False  # wrap the prompt with the tokenizer's chat template
    reply_prefix: str = ""  # text the reply starts with, put at the end of the prompt (after the chat format)
    system: str = ""  # tokenizer.chat: a system message before every prompt; {tools} = the env's tools, one line each; "" = none
    first_reply_prefix: str = ""  # an episode's first reply starts with this instead of reply_prefix (a forced tool call's opening)

    def __post_init__(self):
        _one_of("tokenizer.kind", self.kind, ("auto", "hf", "byte", "char"))
        _check(self.chat or not self.system, "tokenizer.system", self.system[:40],
               "needs tokenizer.chat=true (a system message is a chat turn)")
        _check("{prompt}" in self.template, "tokenizer.template", self.template, "must contain {prompt}")

# Architecture fields without a default: model.hf_path's config.json or the YAML must give them.
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")

@dataclass(frozen=True)
class ModelConfig:
    hf_path: str = ""  # local Hugging Face checkpoint dir; "" = random init from the fields below
    vocab_size: int = 0  # embedding rows; 0 = the tokenizer's vocabulary size
    d_model: int = 0  # residual width, units; 0 = from model.hf_path (required without it)
    n_layers: int = 0  # transformer blocks; 0 = from model.hf_path (required without it)
    n_heads: int = 0  # query heads; 0 = from model.hf_path (required without it)
    n_kv_heads: int = 0  # key/value heads (< n_heads: grouped-query); 0 = from model.hf_path (required without it)
    head_dim: int = 0  # per-head width; 0 = d_model // n_heads
    d_ff: int = 0  # SwiGLU hidden width, units; 0 = from model.hf_path (required without it)
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_scaling: str = "none"  # RoPE frequency scaling (HF rope_scaling type): none | linear | llama3
    rope_factor: float = 1.0  # linear/llama3: how many times slower the scaled frequencies turn
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original/this are fully scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original/this are kept
    rope_original_max_positions: int = 8192  # llama3: context length before scaling, tokens
    norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_embeddings: bool = True  # output projection shares the embedding matrix
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2-style)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    gemma: bool = False  # Gemma 3 block: norms scale by 1 + w, post-attention/MLP norms, GeGLU (gelu tanh), embeddings x sqrt(d_model)
    sliding_window: int = 0  # local layers: a query sees the keys less than this many tokens back; 0 = all layers global
    global_every: int = 0  # with sliding_window: every n-th layer (n-1, 2n-1, ...) is global, the rest local
    rope_local_theta: float = 0.0  # RoPE base of local (sliding-window) layers, unscaled; 0 = rope_theta
    query_pre_attn_scalar: float = 0.0  # attention scores are q.k / sqrt(this); 0 = head_dim
    final_logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0 = off
    learned_positions: int = 0  # learned absolute position table over columns (>= P + N); 0 = RoPE only
    n_experts: int = 0  # mixture of experts (Qwen3-MoE): routed experts per block; 0 = a dense MLP in every block
    n_experts_per_token: int = 0  # MoE: experts each token is routed to (top-k), 1 .. n_experts
    d_ff_expert: int = 0  # MoE: each expert's SwiGLU hidden width, units
    norm_topk_prob: bool = True  # MoE: a token's top-k routing weights renormalised to sum to 1
    router_aux_coef: float = 0.001  # MoE: weight of the router's load-balancing loss in the learner objective
    dtype: str = "float32"  # activation/compute dtype
    param_dtype: str = "float32"  # parameter storage dtype
    attention: str = "auto"  # full-row attention kernel: auto | xla | blockwise | cudnn | splash

    def __post_init__(self):
        _one_of("model.attention", self.attention, ("auto", "xla", "blockwise", "cudnn", "splash"))
        for k in SHAPE_FIELDS:
            _check(getattr(self, k) >= 0, f"model.{k}", getattr(self, k), "must be > 0")
        _check(self.vocab_size >= 0, "model.vocab_size", self.vocab_size, "must be >= 0")
        if all(getattr(self, k) for k in SHAPE_FIELDS):  # an unset shape is read from hf_path or refused by Config
            _check(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads", self.n_kv_heads, f"must divide model.n_heads ({self.n_heads})")
            if self.head_dim == 0:
                _check(self.d_model % self.n_heads == 0, "model.n_heads", self.n_heads,
                       f"must divide model.d_model ({self.d_model}) when model.head_dim=0")
            _check(self.head_dim >= 0 and self.resolved_head_dim % 2 == 0, "model.head_dim",
                   self.head_dim, "must be even (RoPE rotates pairs)")
        _check(self.learned_positions >= 0, "model.learned_positions", self.learned_positions, "must be >= 0")
        _one_of("model.rope_scaling", self.rope_scaling, ("none", "linear", "llama3"))
        _check(self.rope_factor > 0, "model.rope_factor", self.rope_factor, "must be > 0")
        if self.rope_scaling == "llama3":
            _check(0 < self.rope_low_freq_factor < self.rope_high_freq_factor, "model.rope_high_freq_factor",
                   self.rope_high_freq_factor, f"must be > model.rope_low_freq_factor ({self.rope_low_freq_factor}) > 0")
            _check(self.rope_original_max_positions > 0, "model.rope_original_max_positions",
                   self.rope_original_max_positions, "must be > 0")
        for k in ("dtype", "param_dtype"):
            _one_of(f"model.{k}", getattr(self, k), ("float32", "bfloat16", "float16"))
        self._check_family()

    def _check_family(self):
        """Refuses feature mixes no model family has (one line each): the fields select
        Llama, Qwen2 (qkv_bias), Qwen3 (qk_norm) or Gemma 3 (gemma + qk_norm)."""
        for k in ("sliding_window", "global_every"):
            _check(getattr(self, k) >= 0, f"model.{k}", getattr(self, k), "must be >= 0")
        for k in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcap"):
            _check(getattr(self, k) >= 0, f"model.{k}", getattr(self, k), "must be >= 0")
        _check(not (self.qkv_bias and self.qk_norm), "model.qk_norm", self.qk_norm,
               "cannot be combined with model.qkv_bias (no model family has both)")
        _check(not self.gemma or self.qk_norm, "model.qk_norm", self.qk_norm, "must be true with model.gemma (Gemma 3)")
        gemma_only = ("sliding_window", "global_every", "rope_local_theta", "query_pre_attn_scalar",
                      "final_logit_softcap")
        for k in gemma_only:
            _check(self.gemma or not getattr(self, k), f"model.{k}", getattr(self, k), "needs model.gemma=true (only Gemma 3 has it here)")
        _check(bool(self.sliding_window) == bool(self.global_every), "model.global_every", self.global_every,
               f"must be set together with model.sliding_window ({self.sliding_window})")
        _check(not self.rope_local_theta or self.sliding_window, "model.rope_local_theta", self.rope_local_theta,
               "needs model.sliding_window (it is the local layers' base)")
        _check(not (self.gemma and self.learned_positions), "model.learned_positions", self.learned_positions, "must be 0 with model.gemma")
        self._check_moe()

    def _check_moe(self):
        _check(self.n_experts >= 0, "model.n_experts", self.n_experts, "must be >= 0 (0 = dense)")
        _check(math.isfinite(self.router_aux_coef) and self.router_aux_coef >= 0, "model.router_aux_coef",
               self.router_aux_coef, "must be a finite number >= 0")
        if not self.n_experts:
            for k in ("n_experts_per_token", "d_ff_expert"):
                _check(not getattr(self, k), f"model.{k}", getattr(self, k), "needs model.n_experts > 0")
            return
        _check(1 <= self.n_experts_per_token <= self.n_experts, "model.n_experts_per_token", self.n_experts_per_token,
               f"must be in [1, model.n_experts ({self.n_experts})]")
        _check(self.d_ff_expert > 0, "model.d_ff_expert", self.d_ff_expert, "must be > 0 with model.n_experts")
        _check(self.qk_norm and not self.gemma, "model.n_experts", self.n_experts,
               "needs the Qwen3 block (model.qk_norm=true, model.gemma=false): Qwen3-MoE is the MoE family here")

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def unread(self) -> bool:
        """model.hf_path names a checkpoint whose config.json has not set these fields yet
        (`hf.resolve` does): what depends on the architecture cannot be checked until then."""
        return bool(self.hf_path) and not self.n_layers

    def local_layers(self) -> tuple[bool, ...]:
        """Per layer: True where attention is sliding-window (local)."""
        every = self.global_every
        return tuple(bool(every) and (i + 1) % every != 0 for i in range(self.n_layers))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

@dataclass(frozen=True)
class EngineConfig:
    max_concurrent_decodes: int = 64  # KV-cache slots decoded together (continuous batching)
    max_prompt_len: int = 512  # prompt tokens; longer prompts are a data error
    tensor: int = 1  # engine devices per tensor-parallel group (weights and KV heads split over it)
    temperature: float = 1.0  # sampling temperature; 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus mass kept; 1 = off
    steps_per_call: int = 8  # decode steps per engine call (one dispatch and host sync per K tokens)
    prefill_rows: int = 32  # sequences per batched prefill call (deterministic runs: 1), rows
    kv_layout: str = "slots"  # builtin: slots (one contiguous KV block per slot) | paged (a page pool, group prompts shared)
    page_size: int = 16  # paged: tokens per KV page
    kv_pool_tokens: int = 0  # paged: tokens of KV the pool holds; 0 = every slot at full length (never evicts)
    backend: str = "builtin"  # builtin | vllm (in-process vLLM on model.hf_path; the [vllm] extra) | remote (servers)
    servers: str = ""  # remote: generation servers, comma-separated http:// URLs (`async-rl serve`)
    servers_file: str = ""  # remote: a file of server URLs, one per line, re-read every few seconds
    servers_dns: str = ""  # remote: host:port; every address the host resolves to is a server
    health_timeout_s: float = 60.0  # remote: a server silent this long loses its samples, seconds
    weights_transport: str = "file"  # remote: file (a file per version under run.dir) | jax (servers pull arrays from the trainer)
    gpu_memory_utilization: float = 0.45  # vllm on GPU: fraction of GPU memory vLLM takes (JAX gets the rest)
    vllm_cpu_kv_cache_gib: int = 1  # vllm on CPU: KV-cache space, GiB
    vllm_enforce_eager: bool = False  # vllm: no torch.compile/graph capture (faster start, slower steps)

    def __post_init__(self):
        _check(self.max_concurrent_decodes > 0, "engine.max_concurrent_decodes", self.max_concurrent_decodes, "must be > 0")
        _check(self.max_prompt_len > 0, "engine.max_prompt_len", self.max_prompt_len, "must be > 0")
        _check(0 < self.top_p <= 1, "engine.top_p", self.top_p, "must be in (0, 1]")
        _one_of("engine.backend", self.backend, ("builtin", "vllm", "remote"))
        _one_of("engine.kv_layout", self.kv_layout, ("slots", "paged"))
        for k, least in (("tensor", 1), ("steps_per_call", 1), ("prefill_rows", 1), ("page_size", 1),
                         ("vllm_cpu_kv_cache_gib", 1), ("temperature", 0), ("top_k", 0), ("kv_pool_tokens", 0)):
            _check(getattr(self, k) >= least, f"engine.{k}", getattr(self, k), f"must be >= {least}")
        _check(self.health_timeout_s > 0, "engine.health_timeout_s", self.health_timeout_s, "must be > 0")
        _one_of("engine.weights_transport", self.weights_transport, ("file", "jax"))
        _check(self.backend != "remote" or bool(self.servers or self.servers_file or self.servers_dns), "engine.backend",
               self.backend, "remote needs engine.servers, engine.servers_file or engine.servers_dns")
        _check(0 < self.gpu_memory_utilization < 1, "engine.gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1)")

@dataclass(frozen=True)
class RolloutConfig:
    prompts_per_step: int = 32  # groups (prompts) trained per learner step
    samples_per_prompt: int = 8  # completions per prompt (the GRPO group)
    max_new_tokens: int = 512  # completion length cap, tokens
    reward: str = ""  # reward function name or module:function; "" = the task's own; none = 0 (learner.distill alone)
    partial: bool = False  # publish weights mid-generation; samples continue under new weights
    filter_zero_variance: bool = False  # skip groups whose rewards are all equal (logged, counted)
    reward_timeout_s: float = 60.0  # one reward call running longer fails the run, seconds
    reward_max_abs: float = 1e6  # a reward (function's or env's) with a larger magnitude fails the run, reward units
    env: str = ""  # multi-turn env: "" = single turn | lookup | recall | mcp | module:factory (docs/envs-and-tools.md)
    env_max_turns: int = 4  # built-in envs (lookup, recall, mcp): assistant turns per episode
    env_max_concurrent: int = 16  # env steps running at once
    env_timeout_s: float = 60.0  # one env step running longer fails the run, seconds
    turn_max_tokens: int = 0  # multi-turn: tokens per assistant turn; 0 = what the episode has left
    mcp_server: str = ""  # rollout.env=mcp: streamable-HTTP URL (http://...) or stdio command of the server
    env_state_max_depth: int = 32  # an env step's state nested deeper (dicts and lists) fails the run, levels
    env_state_max_bytes: int = 1_000_000  # an env step's state larger as JSON fails the run, bytes
    max_observation_chars: int = 16_384  # an observation's text beyond this is cut and marked, characters
    max_observation_tokens: int = 2048  # an observation's tokens beyond this are cut (its text shortened), tokens

    def __post_init__(self):
        _check(self.prompts_per_step > 0, "rollout.prompts_per_step", self.prompts_per_step, "must be > 0")
        _check(self.samples_per_prompt > 0, "rollout.samples_per_prompt", self.samples_per_prompt, "must be > 0")
        _check(self.max_new_tokens > 0, "rollout.max_new_tokens", self.max_new_tokens, "must be > 0")
        _check(self.reward_timeout_s > 0, "rollout.reward_timeout_s", self.reward_timeout_s, "must be > 0")
        _check(0 < self.reward_max_abs <= 1e12, "rollout.reward_max_abs", self.reward_max_abs,
               "must be in (0, 1e12]: rewards, their squares and sums must stay finite in float32")
        _check(self.env_max_turns > 0, "rollout.env_max_turns", self.env_max_turns, "must be > 0")
        _check(self.env_max_concurrent > 0, "rollout.env_max_concurrent", self.env_max_concurrent, "must be > 0")
        _check(self.env_timeout_s > 0, "rollout.env_timeout_s", self.env_timeout_s, "must be > 0")
        _check(self.turn_max_tokens >= 0, "rollout.turn_max_tokens", self.turn_max_tokens, "must be >= 0")
        for k, least in (("env_state_max_depth", 1), ("env_state_max_bytes", 2), ("max_observation_chars", 64),
                         ("max_observation_tokens", 64)):  # 64: room for an observation's truncation mark
            _check(getattr(self, k) >= least, f"rollout.{k}", getattr(self, k), f"must be >= {least}")
        if self.env == "mcp":
            _check(bool(self.mcp_server.strip()), "rollout.mcp_server", self.mcp_server,
                   "required for rollout.env=mcp (an http:// URL or a command)")

@dataclass(frozen=True)
class SamplerConfig:
    name: str = "in_order"  # in_order | fifo | windowed
    max_lookahead: int = 1  # in_order: steps generation may run ahead of the learner
    max_staleness: Optional[int] = None  # fifo/windowed: oldest policy version lag trained
    max_buffered_groups: int = 0  # hard cap on PENDING + GENERATING + READY groups; 0 = automatic

    def __post_init__(self):
        _one_of("sampler.name", self.name, ("in_order", "fifo", "windowed"))
        _check(self.max_lookahead >= 0, "sampler.max_lookahead", self.max_lookahead, "must be >= 0")
        if self.max_staleness is not None:
            _check(self.max_staleness >= 0, "sampler.max_staleness", self.max_staleness, "must be >= 0")
        _check(self.max_buffered_groups >= 0, "sampler.max_buffered_groups", self.max_buffered_groups, "must be >= 0")

LORA_GROUPS = {"attention": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down")}  # learner.lora_targets' groups

@dataclass(frozen=True)
class LearnerConfig:
    lr: float = 1e-6  # peak learning rate (a pretrained model's scale; a policy trained from scratch wants far more)
    warmup_steps: int = 5  # linear warm-up, steps
    schedule: str = "constant"  # after warm-up: constant | cosine (to lr * end_lr_ratio)
    decay_steps: int = 0  # cosine: the step the floor is reached at, warm-up included; 0 = train.max_steps, else the data's end
    end_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    b1: float = 0.9  # Adam beta1
    b2: float = 0.99  # Adam beta2
    grad_clip: float = 1.0  # global gradient-norm clip; 0 = off
    clip_eps: float = 0.2  # PPO ratio clip (lower and upper)
    is_correction: str = "tis"  # off-policy correction: none | tis | seq_tis | decoupled
    is_cap: float = 2.0  # truncation cap for importance weights
    kl_coef: float = 0.0  # KL penalty to the frozen initial policy; 0 = no reference model
    adv_eps: float = 1e-6  # added to the group reward std before dividing
    logits_chunk: int = 0  # completion columns projected to the vocabulary at once; 0 = all
    remat: str = "none"  # recompute in the backward pass: none | block (keep only block inputs) | dots
    micro_batch_rows: int = 0  # rows per gradient-accumulation micro-batch within an update; 0 = all
    ppo_epochs: int = 1  # passes over a step's rows, each of learner.minibatches optimizer updates
    minibatches: int = 1  # optimizer updates per pass; each takes 1/minibatches of the rows
    bucket_min: int = 0  # length buckets: widths round up to bucket_min * 2^k tokens (cap P, N); 0 = P + N
    clip_eps_low: float = 0.0  # ratio clip below 1 (ratio >= 1 - low); 0 = clip_eps
    clip_eps_high: float = 0.0  # ratio clip above 1 (ratio <= 1 + high; DAPO clip-higher); 0 = clip_eps
    loss_agg: str = "token_mean"  # token_mean (over the update) | seq_mean (of token means) | token_sum_norm (Dr. GRPO)
    ratio_level: str = "token"  # token | sequence (GSPO: length-normalised sequence ratio, clipped per sequence)
    advantage: str = "grpo"  # grpo (group mean/std) | mean (Dr. GRPO: mean only) | rloo (leave-one-out mean)
    overlong: str = "none"  # truncated completions: none | filter (out of the loss, DAPO) | penalty (soft ramp)
    overlong_buffer: int = 1  # penalty: tokens before max_new_tokens where the ramp starts, tokens
    overlong_coef: float = 1.0  # penalty: reward subtracted at max_new_tokens, reward units
    nonfinite: str = "fail"  # a step whose loss or gradient is NaN/inf (never applied): fail (stop the run) | skip (go on)
    lora_rank: int = 0  # LoRA adapter rank r: train only adapters A [d_in, r], B [r, d_out] on a frozen base; 0 = full weights
    lora_alpha: float = 16.0  # LoRA scale numerator: a projection adds (lora_alpha / lora_rank) * (x A) B
    lora_targets: str = "attention,mlp"  # projections given adapters: attention (q,k,v,o), mlp (gate,up,down), single names, comma-sep.
    distill: str = "none"  # on-policy distillation: none | reverse_kl (per-token advantage log pi_teacher - log pi_behaviour)
    teacher: str = ""  # learner.distill's frozen teacher: a run directory (its newest verified step) or a Hugging Face directory
    distill_coef: float = 1.0  # weight of the distillation advantage beside the reward's (rollout.reward=none: it alone)
    routing_replay: bool = False  # MoE: the learner's forward uses the experts the engine chose for each token (R3)

    def __post_init__(self):
        _check(self.lr > 0, "learner.lr", self.lr, "must be > 0")
        _check(self.warmup_steps >= 0, "learner.warmup_steps", self.warmup_steps, "must be >= 0")
        _one_of("learner.schedule", self.schedule, ("constant", "cosine"))
        _check(self.decay_steps >= 0, "learner.decay_steps", self.decay_steps, "must be >= 0")
        _check(self.schedule != "cosine" or not self.decay_steps or self.decay_steps > self.warmup_steps,
               "learner.decay_steps", self.decay_steps, f"must be 0 or more than learner.warmup_steps "
               f"({self.warmup_steps}): the cosine starts after the warm-up")
        _check(0 <= self.end_lr_ratio <= 1, "learner.end_lr_ratio", self.end_lr_ratio, "must be in [0, 1]")
        _check(self.weight_decay >= 0, "learner.weight_decay", self.weight_decay, "must be >= 0")
        _check(0 <= self.b1 < 1, "learner.b1", self.b1, "must be in [0, 1)")
        _check(0 <= self.b2 < 1, "learner.b2", self.b2, "must be in [0, 1)")
        _check(self.grad_clip >= 0, "learner.grad_clip", self.grad_clip, "must be >= 0")
        _check(0 < self.clip_eps < 1, "learner.clip_eps", self.clip_eps, "must be in (0, 1)")
        _one_of("learner.is_correction", self.is_correction, ("none", "tis", "seq_tis", "decoupled"))
        _check(self.is_cap >= 1, "learner.is_cap", self.is_cap, "must be >= 1")
        _check(self.kl_coef >= 0, "learner.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.logits_chunk >= 0, "learner.logits_chunk", self.logits_chunk, "must be >= 0")
        _one_of("learner.remat", self.remat, ("none", "block", "dots"))
        _check(self.micro_batch_rows >= 0, "learner.micro_batch_rows", self.micro_batch_rows, "must be >= 0")
        _check(self.ppo_epochs >= 1, "learner.ppo_epochs", self.ppo_epochs, "must be >= 1")
        _check(self.minibatches >= 1, "learner.minibatches", self.minibatches, "must be >= 1")
        _check(self.bucket_min >= 0, "learner.bucket_min", self.bucket_min, "must be >= 0")
        _check(0 <= self.clip_eps_low < 1, "learner.clip_eps_low", self.clip_eps_low, "must be in [0, 1)")
        _check(self.clip_eps_high >= 0, "learner.clip_eps_high", self.clip_eps_high, "must be >= 0")
        _one_of("learner.loss_agg", self.loss_agg, ("token_mean", "seq_mean", "token_sum_norm"))
        _one_of("learner.ratio_level", self.ratio_level, ("token", "sequence"))
        _one_of("learner.advantage", self.advantage, ("grpo", "mean", "rloo"))
        _one_of("learner.overlong", self.overlong, ("none", "filter", "penalty"))
        _one_of("learner.nonfinite", self.nonfinite, ("fail", "skip"))
        _check(self.overlong_buffer >= 1, "learner.overlong_buffer", self.overlong_buffer, "must be >= 1")
        _check(self.overlong_coef >= 0, "learner.overlong_coef", self.overlong_coef, "must be >= 0")
        _check(self.lora_rank >= 0, "learner.lora_rank", self.lora_rank, "must be >= 0 (0 = LoRA off)")
        _check(self.lora_alpha > 0, "learner.lora_alpha", self.lora_alpha, "must be > 0")
        bad = [n.strip() for n in self.lora_targets.split(",") if n.strip() not in ("attention", "mlp", *sum(LORA_GROUPS.values(), ()))]
        _check(not bad, "learner.lora_targets", self.lora_targets, f"unknown projection {(bad or [''])[0]!r} (known: "
               "attention, mlp, q, k, v, o, gate, up, down; comma-separated)")
        _one_of("learner.distill", self.distill, ("none", "reverse_kl"))
        _check(math.isfinite(self.distill_coef) and self.distill_coef >= 0, "learner.distill_coef", self.distill_coef,
               "must be a finite number >= 0")
        _check((self.distill == "none") == (not self.teacher), "learner.teacher", self.teacher,
               "required with learner.distill=reverse_kl" if self.teacher == "" else "needs learner.distill=reverse_kl")
        _check(self.ratio_level == "token" or self.is_correction in ("none", "seq_tis"), "learner.ratio_level",
               self.ratio_level, f"is not defined with learner.is_correction={self.is_correction} (a per-token "
               "weight on a sequence ratio); use is_correction none or seq_tis")

    def lora_projections(self) -> set[str]:
        """The projections `lora_targets` names, its groups expanded."""
        return {p for n in self.lora_targets.split(",") for p in LORA_GROUPS.get(n.strip(), (n.strip(),))}


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self):
        if not self.model.hf_path:
            for k in SHAPE_FIELDS:
                _check(getattr(self.model, k) > 0, f"model.{k}", getattr(self.model, k),
                       "required (no default) unless model.hf_path names a checkpoint")
        s = self.sampler
        if self.model.moe and self.learner.lora_rank:
            mlp = [n for n in LORA_GROUPS["mlp"] if n in self.learner.lora_projections()]
            _check(not mlp, "learner.lora_targets", self.learner.lora_targets, "MoE blocks take no adapters on "
                   f"their experts ({', '.join(mlp)}); set learner.lora_targets=attention")
        if self.mesh.expert > 1 and not self.model.unread:
            _check(self.model.moe, "mesh.expert", self.mesh.expert,
                   "needs a mixture-of-experts model (model.n_experts > 0): a dense model has no experts to split")
            _check(self.model.n_experts % self.mesh.expert == 0, "mesh.expert", self.mesh.expert,
                   f"must divide model.n_experts ({self.model.n_experts})")
        if self.learner.routing_replay:
            _check(self.model.moe or self.model.unread, "learner.routing_replay",
                   True, "needs a mixture-of-experts model (model.n_experts > 0): a dense model has no routes")
            _check(self.engine.backend == "builtin", "learner.routing_replay", True,
                   f"needs engine.backend=builtin (engine.backend={self.engine.backend} returns no routes yet)")
        if self.engine.backend == "vllm":
            _check(not self.run.determinism, "run.determinism", True,
                   "needs engine.backend=builtin (vLLM is not bit-identical across kills)")
            _check(bool(self.model.hf_path), "model.hf_path", self.model.hf_path,
                   "required for engine.backend=vllm (vLLM loads the Hugging Face directory)")
            _check(self.engine.tensor == 1, "engine.tensor", self.engine.tensor, "engine.backend=vllm runs on one device here")
            _check(self.learner.lora_rank <= 512, "learner.lora_rank", self.learner.lora_rank,
                   "must be <= 512 with engine.backend=vllm (vLLM's largest max_lora_rank)")
        e, width = self.engine, self.engine.max_prompt_len + self.rollout.max_new_tokens
        if e.kv_layout == "paged" and e.kv_pool_tokens:  # one sequence's pages and the one a group's sample copies
            seq = (-(-width // e.page_size) + 1) * e.page_size
            _check(e.kv_pool_tokens >= seq, "engine.kv_pool_tokens", e.kv_pool_tokens,
                   f"must hold one sequence of max_prompt_len + max_new_tokens plus a page ({seq} tokens)")
            _check(not self.run.determinism or e.kv_pool_tokens >= seq * e.max_concurrent_decodes, "engine.kv_pool_tokens",
                   e.kv_pool_tokens, f"run.determinism needs a pool that never evicts ({seq * e.max_concurrent_decodes} tokens, or 0)")
        if self.rollout.env:
            _check(not self.run.determinism, "run.determinism", True, "not with rollout.env (env steps finish in any order)")
        if s.name == "in_order":
            _check(s.max_staleness is None, "sampler.max_staleness", s.max_staleness,
                   "applies to fifo/windowed; in_order bounds staleness with sampler.max_lookahead")
        else:
            _check(not self.run.determinism, "run.determinism", True, f"needs sampler.name=in_order (got {s.name})")
            _check(s.max_staleness is not None, "sampler.max_staleness", s.max_staleness,
                   f"required for sampler.name={s.name} (the oldest policy lag a trained group may have)")
        if self.rollout.filter_zero_variance:
            _check(self.rollout.samples_per_prompt >= 2, "rollout.filter_zero_variance", True,
                   f"needs rollout.samples_per_prompt >= 2 (got {self.rollout.samples_per_prompt}): "
                   "a group of one sample always has zero reward variance")
        # every sample is its own group's mean: every advantage is zero and nothing is learned
        _check(self.rollout.samples_per_prompt >= 2 or self.learner.distill != "none", "rollout.samples_per_prompt",
               self.rollout.samples_per_prompt,
               "must be >= 2: advantages are normalised within each prompt's group, so a group of one "
               "sample always has advantage 0 and the policy never changes")
        if s.max_buffered_groups:
            _check(s.max_buffered_groups >= self.rollout.prompts_per_step, "sampler.max_buffered_groups", s.max_buffered_groups,
                   f"must hold at least one step (rollout.prompts_per_step={self.rollout.prompts_per_step})")
        rows, lc = self.rollout.prompts_per_step * self.rollout.samples_per_prompt, self.learner
        _check(rows % lc.minibatches == 0, "learner.minibatches", lc.minibatches,
               f"must divide the step's rows (rollout.prompts_per_step x samples_per_prompt = {rows})")
        if lc.micro_batch_rows:
            _check((rows // lc.minibatches) % lc.micro_batch_rows == 0, "learner.micro_batch_rows",
                   lc.micro_batch_rows, f"must divide the rows of one update ({rows // lc.minibatches})")
        if self.eval.every_steps and not self.eval.path:
            _check(self.data.source == "synthetic", "eval.path", self.eval.path,
                   f"required with eval.every_steps > 0 for data.source={self.data.source}")
        if lc.overlong == "penalty":
            _check(lc.overlong_buffer <= self.rollout.max_new_tokens, "learner.overlong_buffer", lc.overlong_buffer,
                   f"must be <= rollout.max_new_tokens ({self.rollout.max_new_tokens})")
        # each of a call's steps is unrolled in its compiled program; a slot never has more columns
        _check(self.engine.steps_per_call <= width, "engine.steps_per_call", self.engine.steps_per_call,
               f"must be <= engine.max_prompt_len + rollout.max_new_tokens ({width}), the columns of a slot")
        if self.model.learned_positions:
            _check(self.model.learned_positions >= width, "model.learned_positions", self.model.learned_positions,
                   f"must cover engine.max_prompt_len + rollout.max_new_tokens ({width})")


GROUPS = tuple(f.name for f in dataclasses.fields(Config))
_YAML_ALIASES = {"async": "async_"}  # YAML/override key -> field name (Python keywords)
_FIELD_ALIASES = {v: k for k, v in _YAML_ALIASES.items()}


def _group_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {g: hints[g] for g in GROUPS}


_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1


def _parse_scalar(key: str, raw: Any, tp: Any) -> Any:
    """Parses `raw` (an override string or a YAML value) into the declared type `tp`."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional, tp = True, args[0]
    if optional and (raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "null", ""))):
        return None
    try:
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in ("true", "1", "yes", "on"):
                return True
            if s in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            v = int(str(raw).strip()) if isinstance(raw, str) else int(raw)
            _check(_INT_MIN <= v <= _INT_MAX, key, raw, f"outside the 64-bit integers ({_INT_MIN} to {_INT_MAX}) "
                   "that numpy and JAX hold")
            return v
        if tp is float:
            if isinstance(raw, bool):
                raise ValueError
            v = float(raw)
            # inf or nan in a rate, a bound or a timeout would only fail later, mid-run
            _check(math.isfinite(v), key, raw, "must be a finite number")
            return v
        if tp is str:
            if isinstance(raw, (dict, list)):
                raise ValueError
            return "" if raw is None else str(raw)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        pass
    else:
        raise ConfigError(f"{key}: unsupported field type {tp}")
    raise ConfigError(f"{key}={raw!r}: expected {'optional ' if optional else ''}{tp.__name__}")


def _set_path(tree: dict, key: str, raw: Any) -> None:
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"{key}: expected group.field (groups: {', '.join(GROUPS)})")
    group, name = parts
    if group not in GROUPS:
        raise ConfigError(f"{key}: unknown config group {group!r} (groups: {', '.join(GROUPS)})")
    fname = _YAML_ALIASES.get(name, name)
    ftypes = typing.get_type_hints(_group_types()[group])
    if fname not in ftypes:
        known = ", ".join(_FIELD_ALIASES.get(f, f) for f in ftypes)
        raise ConfigError(f"{key}: unknown key (fields of {group}: {known})")
    tree.setdefault(group, {})[fname] = _parse_scalar(key, raw, ftypes[fname])


def build(tree: dict[str, dict[str, Any]]) -> Config:
    """Builds and validates a Config from {group: {field: parsed value}}."""
    try:
        groups = {g: tp(**tree.get(g, {})) for g, tp in _group_types().items()}
        return Config(**groups)
    except TypeError as e:  # a dataclass rejected a keyword: report it as a config error
        raise ConfigError(str(e)) from None


def _apply(tree: dict, overrides) -> None:
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"{ov!r}: overrides are written group.field=value")
        key, raw = ov.split("=", 1)
        _set_path(tree, key.strip(), raw)


def with_overrides(cfg: Config, overrides) -> Config:
    """`cfg` with `group.field=value` overrides applied (e.g. to a run's saved config)."""
    tree: dict[str, dict[str, Any]] = {}
    for g, sub in to_dict(cfg).items():
        for k, v in sub.items():
            _set_path(tree, f"{g}.{k}", v)
    _apply(tree, overrides)
    return build(tree)


def load(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Loads a YAML preset (optional) and applies `group.field=value` overrides, in order."""
    tree: dict[str, dict[str, Any]] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config={path!r}: no such file")
        try:
            doc = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"--config={path!r}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise ConfigError(f"--config={path!r}: cannot be read ({e.strerror or e})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"--config={path!r}: not valid YAML ({' '.join(str(e).split())})") from None
        except RecursionError:
            raise ConfigError(f"--config={path!r}: nested too deeply to be a config") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"--config={path!r}: top level must be a mapping of config groups")
        for group, fields_ in doc.items():
            if not isinstance(fields_, dict):
                raise ConfigError(f"{group}: expected a mapping of fields in {path}")
            for name, raw in fields_.items():
                _set_path(tree, f"{group}.{name}", raw)
    _apply(tree, overrides)
    return build(tree)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict with YAML key names (`async`, not `async_`)."""
    out = {}
    for g in GROUPS:
        sub = dataclasses.asdict(getattr(cfg, g))
        out[g] = {_FIELD_ALIASES.get(k, k): v for k, v in sub.items()}
    return out


def from_dict(tree: dict[str, dict[str, Any]]) -> Config:
    """Inverse of `to_dict` (e.g. for a config.yaml written by a run)."""
    parsed: dict[str, dict[str, Any]] = {}
    for g, sub in tree.items():
        for k, v in sub.items():
            _set_path(parsed, f"{g}.{k}", v)
    return build(parsed)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def replace(cfg: Config, **groups: dict[str, Any]) -> Config:
    """Copy of `cfg` with fields replaced per group, e.g. replace(cfg, train={"max_steps": 4})."""
    new = {g: dataclasses.replace(getattr(cfg, g), **{_YAML_ALIASES.get(k, k): v for k, v in kv.items()})
           for g, kv in groups.items()}
    return dataclasses.replace(cfg, **new)


def get(cfg: Config, dotted: str) -> Any:
    group, name = dotted.split(".")
    return getattr(getattr(cfg, group), _YAML_ALIASES.get(name, name))


def field_docs() -> dict[str, list[tuple[str, str, str]]]:
    """{group: [(key, default, comment)]}, the comments read from this module's source."""
    import inspect
    out = {}
    for g, tp in _group_types().items():
        src = inspect.getsource(tp).splitlines()
        comments = {}
        for line in src:
            stripped = line.strip()
            if ":" in stripped and "#" in stripped and not stripped.startswith(("#", "def", "_check")):
                name = stripped.split(":", 1)[0].strip()
                comments[name] = stripped.split("#", 1)[1].strip()
        out[g] = [(_FIELD_ALIASES.get(f.name, f.name), repr(f.default), comments.get(f.name, ""))
                  for f in dataclasses.fields(tp)]
    return out
