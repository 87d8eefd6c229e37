"""Building a run from its config: the model, tokenizer, data, learner, engine and checkpointer
(`build`, which writes nothing in run.dir), choosing the step to start from (`choose_start`), and
taking the run directory for it (`take`). The train loop (`train`) asks this module for its parts.

See docs/design.md, "Start-up".
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
from flax import nnx

from async_rl import config as C
from async_rl import faults
from async_rl.buffer.ledger import Ledger
from async_rl.config import Config, ConfigError
from async_rl.data import dataset as data_mod
from async_rl.data import rewards
from async_rl.data.tokenizer import build_tokenizer
from async_rl.env import identity
from async_rl.env.interface import load_env, use_env_tools
from async_rl.learner.step import Learner, split_model
from async_rl.model import sharding
from async_rl.plan import memory
from async_rl.rollout.backends import make_engine
from async_rl.rollout.engine import Engine
from async_rl.run.evaluate import build_eval_set
from async_rl.state import reshard, teacher
from async_rl.state.checkpoint import Checkpointer, CheckpointError, DamagedStep, Restored
from async_rl.store import remote_io, rundir, runfiles, storage


@dataclass
class Parts:
    """Everything a run is built from; building them writes nothing in run.dir."""
    cfg: Config
    run_dir: Path
    tok: Any
    pd: data_mod.PromptDataset
    iterator: data_mod.PromptIterator
    reward_fn: Callable
    learner: Learner
    engine: Engine
    ckpt: Checkpointer
    local_pps: int  # this process's groups per step
    eval_set: Any = None  # held-out prompts (eval.every_steps > 0, process 0), encoded
    generations: list = field(default_factory=list)  # re-partitions onto other process counts (reshard)
    env: Any = None  # the multi-turn env object (rollout.env), None for single-turn episodes



@dataclass
class Start:
    """Where the run begins: a restored step, or step 0."""
    step: int
    ledger: Ledger
    state: Any
    restored: Restored | None = None
    damaged: list[DamagedStep] = field(default_factory=list)
    restart: bool = False  # move the old history to previous/ first (run.resume=restart)



@contextlib.contextmanager
def compilation_cache(path: str, max_gb: float = 0.0):
    """run.compilation_cache for every program the run compiles (any size, any compile time);
    afterwards the caller's own settings, so a notebook's later compilations are not written
    there. JAX reads its cache settings once: reset_cache makes each change take effect.
    `max_gb` > 0 caps the folder with JAX's own least-recently-used eviction."""
    if not path:
        yield
        return
    from jax.experimental.compilation_cache import compilation_cache as cc
    folder = Path(path).expanduser()
    cap = int(max_gb * 1e9) if max_gb > 0 else -1
    ours = {"jax_compilation_cache_dir": str(folder), "jax_compilation_cache_max_size": cap,
            "jax_persistent_cache_min_compile_time_secs": 0, "jax_persistent_cache_min_entry_size_bytes": 0}
    if cap > 0:
        trim_compilation_cache(folder, cap)
    theirs = {k: getattr(jax.config, k) for k in ours}
    for k, v in ours.items():
        jax.config.update(k, v)
    cc.reset_cache()
    try:
        yield
    finally:
        for k, v in theirs.items():
            jax.config.update(k, v)
        cc.reset_cache()


def trim_compilation_cache(folder: Path, cap: int, log=print) -> None:
    """Makes `folder` one JAX's capped cache can evict from, and evicts down to `cap` bytes now
    (JAX evicts only when it writes). An entry written without a cap (or cut off by a kill) has
    no access time, on which JAX's eviction fails, and then writes nothing: it gets its file's
    modification time. Another process writing the folder meanwhile (without a cap, or evicting)
    can add or take entries under us: a few tries, then a warning; the cache never stops a run."""
    from jax._src import lru_cache  # the cache's own eviction and its file names; no public API
    cache = lru_cache.LRUCache(str(folder), max_size=cap)
    for tries_left in (2, 1, 0):
        try:
            with cache.lock.acquire(timeout=cache.lock_timeout_secs):
                for entry in folder.glob(f"*{lru_cache._CACHE_SUFFIX}"):
                    atime = folder / (entry.name.removesuffix(lru_cache._CACHE_SUFFIX) + lru_cache._ATIME_SUFFIX)
                    if not atime.exists():
                        atime.write_bytes(entry.stat().st_mtime_ns.to_bytes(8, "little"))
                cache._evict_if_needed()
            return
        except (OSError, TimeoutError) as e:
            if not tries_left:
                log(f"warning: run.compilation_cache={str(folder)!r}: not trimmed to its cap now "
                    f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); JAX evicts as it writes")


def store_failed(e: BaseException) -> bool:
    """Did the run stop because its object store failed to answer? (A lost lease is not that:
    the store answers, and the write guard refuses what the run would still write.)"""
    return isinstance(e, remote_io.StorageError) or getattr(e, "store_failed", False) or remote_io.cause(e) is not None



def object_store_config(cfg: Config, log) -> Config:
    """What a run on an object store writes: everything but TensorBoard's event file (its
    writer appends to one file), turned off with one line."""
    if cfg.log.tensorboard:
        log(f"warning: run.dir={cfg.run.dir}: log.tensorboard turned off (its event file is appended to; an object "
            "store has no append): metrics.jsonl has every metric")
    return C.replace(cfg, log={"tensorboard": False})



def build(cfg: Config, run_dir: Path, log) -> Parts:
    pi, pc = jax.process_index(), jax.process_count()
    devices = sharding.make_devices(cfg.mesh)
    pps, G = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    if pps % pc:
        raise ConfigError(f"rollout.prompts_per_step={pps}: must divide over the {pc} processes (each "
                          "process generates its share of every step from its own shard of the data)"
                          + reshard.count_note(run_dir))
    shards = sharding.batch_shards(devices.learner)
    if (pps * G) % shards:
        raise ConfigError(f"rollout.prompts_per_step={pps}: prompts_per_step x samples_per_prompt "
                          f"({pps * G}) must divide evenly over the {shards} data-parallel shards")
    memory.check_host(cfg, pc)  # sizes the host could never hold, before anything is read
    tok = build_tokenizer(cfg.tokenizer, synthetic=cfg.data.char_vocab)
    env = load_env(cfg.rollout.env, cfg)  # made once per process; a bad one is refused before anything is read
    use_env_tools(tok, env)  # before any prompt is encoded: `{tools}` in the system message lists them
    pd = data_mod.build_dataset(cfg, tok, process_index=pi, process_count=pc)
    for line, reason in pd.bad_records[:20]:
        log(f"data: skipped bad record at {line}: {reason}")
    if pd.bad_records:
        log(f"data: skipped {len(pd.bad_records)} bad records (data.on_bad_record=skip)")
    _, reward_fn = rewards.reward_for_config(cfg)
    vocab = model_vocab(cfg, tok)
    teacher_spec = teacher.resolve(cfg, tok)  # its configs only: refused before anything large is read
    memory.check(cfg, vocab, teacher_spec)  # before anything large is allocated
    learner = Learner(cfg, vocab, devices.learner, shared_devices=devices.shared, n_tokens=tok.vocab_size,
                      horizon=total_steps(cfg, pd),
                      teacher=teacher_spec and teacher.Teacher(teacher_spec, devices.learner, tok.vocab_size))
    eval_set = build_eval_set(cfg, tok) if cfg.eval.every_steps and pi == 0 else None
    engine = make_engine(cfg, learner.graphdef, vocab, devices=devices.engine, all_devices=devices.engine_all,
                         routes=cfg.learner.routing_replay)
    ckpt = Checkpointer(run_dir / runfiles.CHECKPOINTS, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_)
    return Parts(cfg=cfg, run_dir=run_dir, tok=tok, pd=pd, iterator=data_mod.make_iterator(pd),
                 reward_fn=reward_fn, learner=learner, engine=engine, ckpt=ckpt, local_pps=pps // pc,
                 eval_set=eval_set, env=env)



def model_vocab(cfg: Config, tok) -> int:
    """Embedding rows: model.vocab_size, or the tokenizer's vocabulary size."""
    vocab = cfg.model.vocab_size or tok.vocab_size
    if vocab < tok.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab}: smaller than the tokenizer's {tok.vocab_size}")
    return vocab


def serving_parts(cfg: Config) -> tuple[Any, Engine, Any]:
    """What `async-rl serve` generates with: (tokenizer, engine on every device of this
    process, the engine tree's abstract parameters); no weights, nothing read or written."""
    tok = build_tokenizer(cfg.tokenizer, synthetic=cfg.data.char_vocab)
    vocab = model_vocab(cfg, tok)
    graphdef, trained, base = split_model(cfg, vocab, tok.vocab_size)
    abstract = trained if base is trained else nnx.merge_state(base, trained)
    return tok, make_engine(cfg, graphdef, vocab, devices=jax.local_devices()), abstract


def choose_start(parts: Parts, log) -> Start:
    """Where the run starts; refused (nothing in run.dir changed, the lock not yet taken) where
    the run's env or reward code changed since it recorded them (`env.identity`), or a
    distillation teacher's weights cannot be read."""
    start = _choose_start(parts, log)
    if not start.restart:
        code = identity.identity(parts.cfg, parts.env, parts.reward_fn)
        identity.check(parts.run_dir, code, parts.cfg.run.env_changed, log)
    if parts.learner.teacher is not None:  # read (a resume's pinned step) before the run writes anything
        parts.learner.teacher.params(log)
    return start


def _choose_start(parts: Parts, log) -> Start:
    cfg, run_dir, ckpt = parts.cfg, parts.run_dir, parts.ckpt
    steps = ckpt.steps()
    if cfg.run.resume == "never" and (steps or rundir.history(run_dir)):
        raise ConfigError(f"run.resume=never: {run_dir} already holds a run "
                          f"({rundir.describe(rundir.history(run_dir))}); use a new run.dir (nothing was changed)")
    half = rundir.interrupted_restart(run_dir)
    if half is not None and cfg.run.resume != "restart":
        left = rundir.describe(rundir.history(run_dir)) or "no history"
        raise CheckpointError(
            f"{run_dir}: a run.resume=restart was interrupted while moving the history to {half} (left here: "
            f"{left}); pass run.resume=restart again to finish moving it and start over (nothing was changed)")
    if half is not None:
        return Start(step=0, ledger=Ledger(cfg.rollout.samples_per_prompt), state=None, restart=True)
    damaged: list[DamagedStep] = []
    if steps:
        base = parts.learner.base_reference if parts.learner.lora is not None else None
        choice = ckpt.restore_latest(parts.learner.abstract_state(), cfg=cfg, warn=lambda m: log(f"warning: {m}"),
                                     base=base)
        damaged = choice.damaged
        if choice.restored is not None:
            return resumed(parts, choice.restored, damaged, log)
    if cfg.run.resume == "must":
        raise ConfigError(f"run.resume=must: no restorable checkpoint in {run_dir / runfiles.CHECKPOINTS} "
                          "(nothing was changed)")
    hist = rundir.history(run_dir)
    fresh = Start(step=0, ledger=Ledger(cfg.rollout.samples_per_prompt), state=None, damaged=damaged)
    if rundir.durable(run_dir) and cfg.run.resume != "restart":
        bad = f"; damaged steps: {', '.join(str(d.step) for d in damaged)}" if damaged else ""
        raise CheckpointError(
            f"{run_dir} holds a run's history ({rundir.describe(hist) or 'the mark that a checkpoint covered it'}) "
            "but no checkpoint step to resume "
            f"from{bad}; refusing to start over and bury it. Resume it with its original config, use a new "
            "run.dir, or pass run.resume=restart to move that history to run.dir/previous/ and start over "
            "(nothing was changed)")
    fresh.restart = bool(hist) and cfg.run.resume == "restart"
    return fresh



def resumed(parts: Parts, restored: Restored, damaged: list[DamagedStep], log) -> Start:
    if parts.learner.teacher is not None:  # the teacher this step was trained with, or refused
        parts.learner.teacher.pin(restored.meta.get("teacher"), f"{parts.ckpt.directory} (step {restored.step})", log)
    reshard.restore_data(parts, restored, log)  # another process count: re-partitioned; sets the iterator
    ledger = Ledger.from_snapshot(restored.ledger)
    if ledger.exhausted and not parts.iterator.exhausted:
        ledger.exhausted = False  # more epochs than before: the stream continues
        log(f"data.num_epochs={parts.cfg.data.num_epochs}: the data stream continues past the end it had reached")
    if restored.changes:
        log(f"resume: changed since step {restored.step}: " + "; ".join(map(str, restored.changes)))
    state = restored.state
    if restored.reset_optimizer:
        log(f"run.reset_optimizer=true: resuming step {restored.step} with its parameters and a fresh optimizer "
            "state (moments and the schedule's step count start from zero)")
        state = parts.learner.init_state(state["params"])
    return Start(step=restored.step, ledger=ledger, state=state, restored=restored, damaged=damaged)



def take(parts: Parts, start: Start, log) -> None:
    cfg, run_dir, primary = parts.cfg, parts.run_dir, jax.process_index() == 0
    code = identity.identity(cfg, parts.env, parts.reward_fn)
    if start.restart and primary:
        dest = rundir.archive_history(run_dir)
        log(f"run.resume=restart: moved the previous history of {run_dir} to {dest}; starting over")
    for d in start.damaged if not start.restart else []:
        dest = runfiles.damaged_step(run_dir, d.step, int(time.time()))
        if primary and storage.is_remote(run_dir):
            faults.point("set_aside", d.step)
            storage.move(parts.ckpt.directory / str(d.step), dest)
        elif primary:
            dest.parent.mkdir(parents=True, exist_ok=True)
            faults.point("set_aside", d.step)
            shutil.move(str(parts.ckpt.directory / str(d.step)), dest)
        log(f"warning: checkpoint step {d.step} set aside in {dest} ({d.why})")
    sharding.agree([1])  # every process sees the moves before opening the manager
    parts.ckpt.open()
    if primary:
        cut = reshard.cut_inactive_logs(run_dir, parts.generations, jax.process_count())
        if cut:
            log(f"cut {cut} bytes of the logs of processes this run no longer has (written after its checkpoint)")
        rundir.write_if_changed(run_dir / runfiles.CONFIG, C.to_yaml(cfg))
        rundir.write_if_changed(run_dir / runfiles.ENV_IDENTITY, identity.text(code))
        rundir.write_if_changed(run_dir / runfiles.DATA, json.dumps({
            "prompt_ids": [int(i) for i in parts.pd.prompt_ids], "num_epochs": cfg.data.num_epochs,
            "records_per_epoch": int(parts.pd.records_per_epoch), "bad_records": len(parts.pd.bad_records)}))
        announce_drops(cfg, parts.pd, log)
    if start.state is None:
        start.state = parts.learner.init_state(parts.learner.init_params())



def resume_line(restored, ledger: Ledger, cut: int) -> str:
    summ = restored.ledger.summary()
    with ledger.lock:
        ready_steps = sorted({g.target_step for g in ledger.groups.values()
                              if g.state.name == "READY" and g.target_step is not None})
    return (f"resumed step {restored.step}: {summ['ready']} ready groups"
            + (f" (step {', '.join(map(str, ready_steps))})" if ready_steps else "")
            + f", {summ['generating']} generating ({summ['kept_tokens']} tokens kept), {summ['pending']} pending; "
            f"iterator at ordinal {ledger.next_ordinal}" + (" (exhausted)" if ledger.exhausted else "")
            + (f"; cut {cut} bytes of lineage written after it" if cut else ""))



def total_steps(cfg: Config, pd) -> int:
    """The step the run ends at: where train.max_steps or the data (every epoch) ends it."""
    per_epoch = len(pd.prompt_ids)
    data_steps = math.ceil(per_epoch * cfg.data.num_epochs / cfg.rollout.prompts_per_step)
    return min(cfg.train.max_steps, data_steps) if cfg.train.max_steps else data_steps


def announce_drops(cfg: Config, pd, log) -> None:
    """I4: a config that consumes data without training it says so, with how much it may."""
    n = len(pd.prompt_ids) * cfg.data.num_epochs
    if cfg.rollout.filter_zero_variance:
        log(f"note: rollout.filter_zero_variance=true: groups whose {cfg.rollout.samples_per_prompt} rewards are "
            f"all equal are consumed without training (up to all {n} prompt-epochs; each is logged in "
            "drops.jsonl and counted in data/dropped/zero_variance)")
    if cfg.learner.overlong == "filter":
        log(f"note: learner.overlong=filter: completions cut at rollout.max_new_tokens={cfg.rollout.max_new_tokens} "
            "without a stop token are left out of the loss (each group's are logged in drops.jsonl, reason "
            "overlong, and counted in rollout/overlong_filtered)")
    if cfg.sampler.name != "in_order":
        log(f"note: sampler.name={cfg.sampler.name}: READY groups older than sampler.max_staleness="
            f"{cfg.sampler.max_staleness} are regenerated (their rollouts discarded, logged in drops.jsonl); "
            "no prompt is dropped")
