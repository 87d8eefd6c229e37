"""The run's housekeeping config groups (train, mesh, checkpoint, journal, eval, log) and the
checks every group uses. `config` owns the whole: import these through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from async_rl.errors import UsageError


class ConfigError(UsageError):
    """A usage or configuration error: the CLI prints it on one line and exits 2."""


def _check(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r}: {why}")


def _one_of(key: str, value: Any, choices: tuple) -> None:
    _check(value in choices, key, value, f"must be one of {', '.join(map(str, choices))}")


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 0  # stop after this many learner steps in total; 0 = when the data ends
    reward_target: float = 0.9  # reported at the end: first step whose mean reward reached it

    def __post_init__(self):
        _check(self.max_steps >= 0, "train.max_steps", self.max_steps, "must be >= 0")


@dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # data-parallel axis size; -1 = all learner devices left over
    fsdp: int = 1  # parameter/optimizer sharding axis size
    tensor: int = 1  # tensor-parallel axis size
    expert: int = 1  # expert-parallel axis size (MoE): each layer's experts split over it, the batch rows too
    engine_devices: int = 0  # devices given to the engine alone; 0 = share the learner's

    def __post_init__(self):
        _check(self.data == -1 or self.data > 0, "mesh.data", self.data, "must be -1 or > 0")
        _check(self.fsdp > 0, "mesh.fsdp", self.fsdp, "must be > 0")
        _check(self.tensor > 0, "mesh.tensor", self.tensor, "must be > 0")
        _check(self.expert > 0, "mesh.expert", self.expert, "must be > 0")
        _check(self.engine_devices >= 0, "mesh.engine_devices", self.engine_devices, "must be >= 0")


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 50  # save every N learner steps; 0 = only at the end and on SIGTERM
    keep: int = 2  # committed steps kept on disk
    async_: bool = True  # write in the background while the learner trains (YAML key: async)

    def __post_init__(self):
        _check(self.every_steps >= 0, "checkpoint.every_steps", self.every_steps, "must be >= 0")
        _check(self.keep >= 1, "checkpoint.keep", self.keep, "must be >= 1")


@dataclass(frozen=True)
class JournalConfig:
    enabled: bool = True  # append finished samples to run.dir/journal; a resume uses them instead of generating
    fsync_every_s: float = 1.0  # fdatasync (object stores: upload) the journal at most this often, seconds; 0 = every write

    def __post_init__(self):
        _check(self.fsync_every_s >= 0, "journal.fsync_every_s", self.fsync_every_s, "must be >= 0")


@dataclass(frozen=True)
class EvalConfig:
    every_steps: int = 0  # score held-out prompts every N learner steps (and at the end); 0 = off
    path: str = ""  # held-out prompt file, fields as data.*; "" = synthetic ids disjoint from training
    num_records: int = 256  # held-out prompts (a file: its first N, 0 = all)
    samples_per_prompt: int = 1  # 1 = greedy pass@1; k > 1 = k samples at engine.temperature, pass@k
    correct_threshold: float = 1.0  # a completion is correct when its reward is at least this
    at_start: bool = False  # also score the starting weights (a step-0 row) before a fresh run trains

    def __post_init__(self):
        _check(self.every_steps >= 0, "eval.every_steps", self.every_steps, "must be >= 0")
        _check(self.num_records >= 0, "eval.num_records", self.num_records, "must be >= 0")
        _check(self.samples_per_prompt >= 1, "eval.samples_per_prompt", self.samples_per_prompt, "must be >= 1")
        _check(not self.at_start or self.every_steps > 0, "eval.at_start", self.at_start, "needs eval.every_steps > 0")


@dataclass(frozen=True)
class LogConfig:
    progress: bool = True  # live progress bar on stderr
    tensorboard: bool = True  # TensorBoard event files in run.dir/tb
    plot: bool = True  # reward.png learning curve at the end
    every_steps: int = 1  # console/TensorBoard cadence, steps (metrics.jsonl gets every step)
    rollouts: bool = False  # rollouts.jsonl: every trained sample's tokens, versions and reward
    wandb: bool = False  # also log to Weights & Biases (extra: async_rl[wandb]); one W&B run per run.dir
    wandb_project: str = "async_rl"  # W&B project
    wandb_entity: str = ""  # W&B entity (user or team); "" = the account's default
    wandb_name: str = ""  # W&B run name; "" = run.dir's folder name
    wandb_tags: str = ""  # W&B tags, comma-separated

    def __post_init__(self):
        _check(self.every_steps > 0, "log.every_steps", self.every_steps, "must be > 0")
