"""The rollout backends by name (`engine.backend`): the one place that chooses one.

Owns: building the built-in `Engine` from a config (training, evaluation and the plans build
it here), what each backend needs before JAX takes a device (`prepare`), and the `Rollout` a
run generates with (`for_training`) or evaluates with (`for_eval`). Does not own: the backends
themselves (`interface.BuiltinRollout`, `vllm_backend`, `remote`) or what runs on them (pump).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from async_rl import config as C
from async_rl.rollout.engine import Engine
from async_rl.rollout.interface import BuiltinRollout, Rollout


def make_engine(cfg: C.Config, graphdef, vocab_size: int, *, slots: int | None = None, devices=None,
                sampling: dict | None = None, model_cfg=None, **extra) -> Engine:
    """The built-in engine of `cfg` (`engine.*`, `rollout.max_new_tokens`, `run.seed`);
    `slots` and `sampling` (temperature, top_k, top_p) override the config's (evaluation),
    `model_cfg` its model (a plan's shortened stack); `extra`: `Engine`'s other arguments."""
    e = cfg.engine
    kw = dict(slots=e.max_concurrent_decodes if slots is None else slots, max_prompt_len=e.max_prompt_len,
              max_new_tokens=cfg.rollout.max_new_tokens, temperature=e.temperature, top_k=e.top_k, top_p=e.top_p,
              seed=cfg.run.seed, devices=devices, steps_per_call=e.steps_per_call, tensor=e.tensor,
              windows=not cfg.run.determinism)
    kw.update(sampling or {}, **extra)
    model_cfg = cfg.model if model_cfg is None else model_cfg
    if e.kv_layout == "paged":
        from async_rl.rollout.paged_engine import PagedEngine
        return PagedEngine(model_cfg, graphdef, vocab_size=vocab_size, page_size=e.page_size,
                           pool_tokens=e.kv_pool_tokens, **kw)
    return Engine(model_cfg, graphdef, vocab_size=vocab_size, **kw)


@dataclass(frozen=True)
class RunSide:
    """What a training run hands its backend: the built-in engine (which places the weights
    for every backend), the weights it starts with, and the run's pieces a backend may need."""
    engine: Engine
    params: Any  # the engine's weights for `version`
    version: int
    stop_ids: frozenset
    n_tokens: int  # the tokenizer's vocabulary size
    spare_slots: int  # room for an evaluation view beside the run's slots
    lora: Any  # the learner's LoRA spec, or None
    tok: Any = None  # the tokenizer (a fleet's servers must have the same)
    run_dir: Any = None
    run_tag: str = ""  # the run's identity and attempt: names its requests on shared servers
    log: Callable[[str], None] = print


def _builtin(cfg: C.Config, run: RunSide) -> Rollout:
    return BuiltinRollout(run.engine, run.params, run.version, deterministic=cfg.run.determinism,
                          prefill_rows=cfg.engine.prefill_rows)


def _vllm(cfg: C.Config, run: RunSide) -> Rollout:
    from async_rl.rollout.vllm_backend import from_config
    return from_config(cfg, run.stop_ids, run.n_tokens, run.params, run.version, spare_slots=run.spare_slots,
                       lora=run.lora)


def _remote(cfg: C.Config, run: RunSide) -> Rollout:
    import jax

    from async_rl.rollout import weights
    from async_rl.rollout.remote import RemoteRollout
    if jax.process_count() > 1:
        raise C.ConfigError("engine.backend=remote: one training process drives the fleet "
                            f"(this run has {jax.process_count()})")
    return RemoteRollout(cfg, fingerprint=weights.fingerprint(cfg, run.tok), run_dir=run.run_dir,
                         run_tag=run.run_tag, n_tokens=run.n_tokens, stop_ids=run.stop_ids, params=run.params,
                         version=run.version, log=run.log)


_TRAINING: dict[str, Callable[[C.Config, RunSide], Rollout]] = {"builtin": _builtin, "vllm": _vllm,
                                                                 "remote": _remote}


def prepare(cfg: C.Config) -> None:
    """What a backend must do before JAX takes a device (vLLM on a GPU: split its memory)."""
    if cfg.engine.backend == "vllm":
        from async_rl.rollout.vllm_backend import split_gpu_memory
        split_gpu_memory(cfg.engine.gpu_memory_utilization)


def for_training(cfg: C.Config, run: RunSide) -> Rollout:
    """The backend a run generates with (`engine.backend`)."""
    return _TRAINING[cfg.engine.backend](cfg, run)


def shares_engine(rollout: Rollout) -> bool:
    """Whether evaluation may run as a view beside the run's slots on this backend."""
    return hasattr(rollout, "view")


def for_eval(cfg: C.Config, graphdef, vocab_size: int, stops, n_tokens: int, *, slots: int, sampling: dict,
             devices=None):
    """A backend of its own for evaluation (`async-rl eval`, or a run whose backend has no
    views): vLLM when the run uses it, else the built-in engine on `devices`."""
    if cfg.engine.backend == "vllm":
        from async_rl.rollout.vllm_backend import from_config
        return from_config(C.replace(cfg, engine={"max_concurrent_decodes": slots, **sampling}), stops, n_tokens,
                           None, 0)
    return make_engine(cfg, graphdef, vocab_size, slots=slots, devices=devices, sampling=sampling)
