"""A start-up memory estimate: refuse plainly a job that cannot fit, before allocating it.

Owns: the bytes a run needs at least (parameters in their storage dtype, Adam's two fp32
moments, the engine's copy of the weights in the compute dtype, a frozen reference copy
when the KL penalty is on, a distillation teacher's parameters, the KV cache; with LoRA the frozen base and the adapters'
parameters and moments), the host memory that size fields make a process
allocate whatever the model (a step's batch arrays, the synthetic record index), and the
memory the job can use (the device's limit where the backend reports one, else the host's
available memory). Does not own:
activation memory or compiled-program sizes (`plan` compiles a step ahead of time for that).
"""

from __future__ import annotations

import os

from async_rl.config import Config, ConfigError
from async_rl.model.flops import adapter_count, param_count

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def estimate(cfg: Config, vocab: int, teacher=None) -> dict[str, int]:
    """The bytes each part of the run needs at least; `teacher`: learner.distill's
    (`teacher.TeacherSpec`), its parameters in their storage dtype."""
    out = _estimate(cfg, vocab)
    if teacher is not None:
        out["teacher"] = param_count(teacher.model, teacher.vocab) * _BYTES.get(teacher.model.param_dtype, 4)
    return out


def _estimate(cfg: Config, vocab: int) -> dict[str, int]:
    m, n = cfg.model, param_count(cfg.model, vocab)
    p_bytes, c_bytes = _BYTES.get(m.param_dtype, 4), _BYTES.get(m.dtype, 4)
    width = cfg.engine.max_prompt_len + cfg.rollout.max_new_tokens
    kv = 2 * m.n_layers * cfg.engine.max_concurrent_decodes * width * m.n_kv_heads * m.resolved_head_dim * c_bytes
    if cfg.learner.lora_rank:
        return _lora_estimate(cfg, vocab, n, p_bytes, c_bytes, kv)
    out = {"parameters": n * p_bytes, "optimizer": 2 * n * 4, "engine weights": n * c_bytes, "KV cache": kv}
    if cfg.learner.kl_coef > 0:
        out["reference model"] = n * p_bytes
    return out


def _lora_estimate(cfg: Config, vocab: int, n: int, p_bytes: int, c_bytes: int, kv: int) -> dict[str, int]:
    """LoRA: the frozen base (no moments, and the KL reference itself), fp32 adapters with
    Adam's moments, the engine's adapters; the engine's base is the learner's own buffers
    where it shares their devices and dtype (`Engine.adopt`), else a copy."""
    a = adapter_count(cfg, vocab)
    shared = cfg.mesh.engine_devices == 0 and p_bytes == c_bytes
    return {"frozen base": n * p_bytes, "adapters": a * 4, "optimizer": 2 * a * 4,
            "engine weights": (0 if shared else n * c_bytes) + a * c_bytes, "KV cache": kv}


def host_estimate(cfg: Config, processes: int = 1) -> dict[str, tuple[int, str]]:
    """{field: (bytes, what)}: the host memory that size fields make one process allocate at
    least: a step's batch arrays (`batch.build_batch`: per cell of prompt + completion columns
    two int32 and a bool, per completion cell three int32 or float32 and a bool), and for
    synthetic data the index of every record id (int64 arrays, data.json's list) and the
    held-out records."""
    r = cfg.rollout
    rows = r.prompts_per_step // max(processes, 1) * r.samples_per_prompt
    width = cfg.engine.max_prompt_len + r.max_new_tokens
    out = {"rollout.prompts_per_step": (rows * (9 * width + 13 * r.max_new_tokens + 6),
                                        f"a step's batch ({rows} rows: x rollout.samples_per_prompt"
                                        f"{' / processes' if processes > 1 else ''}; {width} columns: "
                                        "engine.max_prompt_len + rollout.max_new_tokens)")}
    if cfg.data.source == "synthetic":
        out["data.num_records"] = (cfg.data.num_records * _BYTES_PER_RECORD_ID, "the index of the record ids")
        if cfg.eval.every_steps and not cfg.eval.path:
            out["eval.num_records"] = (cfg.eval.num_records * _BYTES_PER_EVAL_RECORD, "the held-out records")
    return out


_BYTES_PER_RECORD_ID = 64  # four int64 copies of the ids, and each as a Python int in data.json's list
_BYTES_PER_EVAL_RECORD = 512  # a record's dict, prompt, answer and encoded tokens


def check_host(cfg: Config, processes: int = 1) -> None:
    """Raises ConfigError naming the field when `host_estimate` exceeds the host's available
    memory (run.memory_check=false skips); reads and allocates nothing else."""
    have = host_available() if cfg.run.memory_check else None
    if have is None:
        return
    for key, (need, what) in host_estimate(cfg, processes).items():
        if need > have[0]:
            from async_rl.config import get
            raise ConfigError(f"{key}={get(cfg, key)}: {what} needs at least {_gib(need)} of host memory, more than "
                              f"the {_gib(have[0])} of {have[1]}; lower it (or run.memory_check=false to try anyway)")


def available() -> tuple[int, str] | None:
    """(bytes, where) the job can use: the first device's limit if it reports one, else the
    host's available memory; None if neither is known."""
    try:
        import jax
        stats = jax.devices()[0].memory_stats() or {}
        if stats.get("bytes_limit"):
            return int(stats["bytes_limit"]) * jax.local_device_count(), f"{jax.local_device_count()} device(s)"
    except Exception:  # a backend without memory statistics
        pass
    return host_available()


def host_available() -> tuple[int, str] | None:
    """(bytes, where) of the host's available memory; None if it is not known."""
    try:  # MemAvailable counts the page cache the kernel would give back; free pages do not
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available host memory"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host memory"
    except (ValueError, OSError):
        return None


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def check(cfg: Config, vocab: int, teacher=None) -> None:
    """Raises ConfigError when the estimate exceeds what the job can use (run.memory_check=false skips)."""
    if not cfg.run.memory_check:
        return
    need, have = estimate(cfg, vocab, teacher), available()
    total = sum(need.values())
    if have is None or total <= have[0]:
        return
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in need.items())
    raise ConfigError(f"model.d_model={cfg.model.d_model}, model.n_layers={cfg.model.n_layers}: the run needs at least "
                      f"{_gib(total)} ({parts}), more than the {_gib(have[0])} of {have[1]}; use a smaller model or "
                      "fewer engine.max_concurrent_decodes, more devices, or run.memory_check=false to try anyway")
