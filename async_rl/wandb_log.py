"""Weights & Biases logging that survives restarts: one job is one W&B run.

Owns: run.dir/wandb.json (the W&B run id, reused by every later session of the job, and the
newest step logged) and the W&B run itself (resolved config as its config, one history row
per learner step). Does not own: which metrics exist (learner, train) or metrics.jsonl
(metrics). The history follows the checkpoint as metrics.jsonl does: a resumed session
re-runs the steps after its checkpoint, and steps at or below the newest one already
logged are not sent again, so each step appears once. Optional: `pip install async_rl[wandb]`.
"""

from __future__ import annotations

import json
import math
import secrets
import string
from pathlib import Path
from typing import Any

from .config import ConfigError

STATE_FILE = "wandb.json"


def _write(path: Path, doc: dict) -> None:
    from .rundir import write_atomic  # rundir imports config; keep this module's import light
    write_atomic(path, json.dumps(doc))


def check_installed() -> None:
    """Refuses log.wandb=true before the run starts when the extra is missing."""
    import importlib.util
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("log.wandb=true: the wandb package is not installed (pip install 'async_rl[wandb]')")


class WandbLog:
    """A W&B run for `run_dir`: created on the job's first session, resumed by id on every later one."""

    def __init__(self, run_dir: Path, config: dict, *, project: str, entity: str = "", name: str = "",
                 tags: tuple[str, ...] = (), log=print):
        check_installed()
        import wandb
        self.path = Path(run_dir) / STATE_FILE
        state = json.loads(self.path.read_text()) if self.path.is_file() else {}
        run_id = state.get("id") or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        self.last_step = int(state.get("last_step", 0))
        self.run = wandb.init(project=project, entity=entity or None, name=name or Path(run_dir).resolve().name,
                              tags=list(tags), id=run_id, resume="allow", dir=str(run_dir), config=config)
        self.state = {"id": run_id, "project": project, "entity": entity, "last_step": self.last_step}
        _write(self.path, self.state)
        log(f"wandb: run {run_id} ({'resumed' if state else 'new'}"
            + (f", steps <= {self.last_step} already logged" if self.last_step else "") + ")")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """One history row for `step`, unless an earlier session of the job logged it already."""
        if step <= self.last_step:
            return
        row = {k: v for k, v in metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        self.run.log(row, step=step)
        self.last_step = self.state["last_step"] = step
        _write(self.path, self.state)

    def close(self) -> None:
        self.run.finish()
