"""How a resume treats a config field that differs from the checkpoint's: free to change, part of
the data stream (refused: the saved iterator and ledger would mean other prompts), part of the
state's structure, or lowered where it may only grow. See docs/design.md, "Run directory safety".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from async_rl.config import Config, get, to_dict

# How a resume treats a field that differs from the checkpoint's config (docs/design.md, "Run
# directory safety"). Fields listed nowhere are free to change (learning rate, max_steps, logging...).
# Changing one of these would make a checkpoint's iterator state and ledger mean other prompts.
DATA_STREAM_FIELDS = (
    "data.source", "data.task", "data.num_records", "data.seed", "data.shuffle",
    "data.min_digits", "data.max_digits", "data.prompt_field", "data.answer_field", "data.id_field",
    "rollout.prompts_per_step", "rollout.samples_per_prompt", "sampler.name",
)
# The saved ledger's half-finished episodes continue only with the env that began them.
EPISODE_FIELDS = ("rollout.env",)
# Changing one of these changes the structure of the saved model/optimizer state.
STATE_FIELDS = (
    "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads",
    "model.head_dim", "model.d_ff", "model.tie_embeddings", "model.qkv_bias", "model.learned_positions",
    "model.param_dtype", "model.qk_norm", "model.gemma", "model.n_experts", "model.d_ff_expert", "learner.grad_clip",
)
# The adapters' shapes and meaning (a LoRA checkpoint holds adapters only, trained on one base).
LORA_FIELDS = ("learner.lora_rank", "learner.lora_alpha", "learner.lora_targets")
# These may grow on resume but not shrink: the saved iterator and ledger may hold what a lower
# value cannot (epochs already drawn; partial completions longer than the new cap).
NO_LOWER_FIELDS = {
    "data.num_epochs": "lowering it would drop epochs the saved iterator and ledger may already hold",
    "rollout.max_new_tokens": "the saved ledger may hold partial completions longer than the new cap",
}


@dataclass(frozen=True)
class Change:
    key: str  # group.field
    saved: Any
    now: Any
    kind: str  # free | state | stream | lowered | lora

    def __str__(self) -> str:
        return f"{self.key}: saved {self.saved!r}, now {self.now!r}"



def _state_value(key: str, value: Any) -> Any:
    # gradient clipping adds a state-free transform, but on/off changes the optimizer tree
    return bool(value) if key == "learner.grad_clip" else value



def changes(saved: dict[str, dict[str, Any]], cfg: Config) -> list[Change]:
    """Every field of `cfg` that differs from a checkpoint's saved config (`to_dict` form),
    with how a resume treats it. Fields the saved config lacks (older runs) are skipped."""
    out, now = [], to_dict(cfg)
    for g, fields_ in now.items():
        for name, value in fields_.items():
            key = f"{g}.{name}"
            if name not in saved.get(g, {}) or saved[g][name] == value:
                continue
            old = saved[g][name]
            if key in DATA_STREAM_FIELDS or key in EPISODE_FIELDS:
                kind = "stream"
            elif key in LORA_FIELDS:
                kind = "lora"
            elif key in NO_LOWER_FIELDS and value < old:
                kind = "lowered"
            elif key in STATE_FIELDS and _state_value(key, old) != _state_value(key, value):
                kind = "state"
            else:
                kind = "free"
            out.append(Change(key, old, value, kind))
    return out



def data_stream(cfg: Config) -> dict[str, Any]:
    """The fields that define which prompts the stream yields, in which order and grouping."""
    return {k: get(cfg, k) for k in DATA_STREAM_FIELDS}



def fingerprint(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
