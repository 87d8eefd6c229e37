"""Weights & Biases logging: a mirror of metrics.jsonl, one W&B run per run.dir, best effort.

Owns: run.dir/wandb.json (the W&B run id, reused by every later session of the job, and the
newest step a cleanly closed session handed to W&B) and the W&B run itself (resolved config
as its config, one history row per learner step). Does not own: which metrics exist (learner,
train) or metrics.jsonl (metrics), which stays the record of the run.

Each session resumes the run by id (`resume="allow"`) and first sends the rows of
metrics.jsonl (cut back to the checkpoint) that W&B may lack, then every step live. Which rows
W&B has comes from W&B's own resume state where there is a server to ask (`run.starting_step`,
the step after its newest history row); offline, from wandb.json: after a SIGKILL a session
sends every row after the last clean stop, and `wandb sync` keeps the first row of a step it
sees twice. Steps trained again after a resume keep the row W&B has first. Optional:
`pip install async_rl[wandb]`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import string
import tempfile
import time
from pathlib import Path
from typing import Any

from async_rl.config import ConfigError
from async_rl.store import runfiles


def _write(path: Path, doc: dict) -> None:
    from async_rl.store.rundir import write_atomic  # rundir imports config; keep this module's import light
    write_atomic(path, json.dumps(doc))


def check_installed() -> None:
    """Refuses log.wandb=true before the run starts when the extra is missing."""
    import importlib.util
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("log.wandb=true: the wandb package is not installed (pip install 'async_rl[wandb]')")


@contextlib.contextmanager
def _temp_files_in(folder: Path):
    """W&B's temporary folders (made when wandb is imported, and by the wandb-core process that
    wandb.init starts: its socket folder, media and artifact staging, debug logs in its cache)
    go in `folder` instead of /tmp and ~/.cache, so a session killed with its wandb-core leaves
    them in run.dir, where the next session's start empties them. The caller's settings return
    afterwards: the rest of the process, and processes it starts, keep their own."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    ours = {"TMPDIR": str(folder), "WANDB_CACHE_DIR": str(folder / "cache"), "WANDB_DATA_DIR": str(folder / "data")}
    # WANDB_SERVICE (set by wandb.init) would point child processes at a socket in `folder`
    theirs, tempdir = {k: os.environ.get(k) for k in (*ours, "WANDB_SERVICE")}, tempfile.tempdir
    os.environ.update(ours)
    tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = tempdir
        for k, v in theirs.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def read_state(path: Path) -> dict:
    """wandb.json: the W&B run this run logs to ({} before its first session); one ConfigError if damaged."""
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_bytes())
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        rid = state.get("id")
        if rid is not None and not (isinstance(rid, str) and rid.replace("-", "").replace("_", "").isalnum()):
            raise ValueError(f"id {rid!r} is not a W&B run id")
        int(state.get("logged", -1))
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{path}: damaged ({' '.join(str(e).split())[:200]}); delete it to log to a new W&B run, "
                          "or write back the run's id as {\"id\": \"...\"}") from None
    return state


class WandbLog:
    """A W&B run for `run_dir`: created on the job's first session, resumed by id on every later one."""

    def __init__(self, run_dir: Path, config: dict, *, project: str, entity: str = "", name: str = "",
                 tags: tuple[str, ...] = (), log=print):
        check_installed()
        self.path = Path(run_dir) / runfiles.WANDB_STATE
        state = read_state(self.path)
        run_id = state.get("id") or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        # wandb names a session's folder by its start second: a second session of this run in
        # the same second would reuse the folder and overwrite the earlier session's files
        while any((Path(run_dir) / runfiles.WANDB).glob(f"*run-{time.strftime('%Y%m%d_%H%M%S')}-{run_id}")):
            time.sleep(0.1)
        with _temp_files_in(Path(run_dir) / runfiles.WANDB_TMP):
            import wandb
            self.run = wandb.init(project=project, entity=entity or None, name=name or Path(run_dir).resolve().name,
                                  tags=list(tags), id=run_id, resume="allow", dir=str(run_dir), config=config)
        self.offline = bool(getattr(self.run, "offline", False))
        if self.offline:
            self.logged = int(state.get("logged", -1))
        else:
            self.logged = int(getattr(self.run, "starting_step", 0) or 0) - 1
        self._doc = {"id": run_id, "project": project, "entity": entity}
        _write(self.path, self._doc)  # until this session closes cleanly, a later one sends everything again
        self._log = log
        log(f"wandb: run {run_id} ({'resumed' if state else 'new'}"
            + (f", its history has steps <= {self.logged}" if self.logged >= 0 else "")
            + (", offline" if self.offline else "") + ")")

    def catch_up(self, rows: list[dict]) -> None:
        """Sends the rows of metrics.jsonl (cut at the checkpoint) that W&B may not have."""
        missing = [r for r in rows if isinstance(r.get("step"), int) and r["step"] > self.logged]
        for r in missing:
            self.log(r["step"], {k: v for k, v in r.items() if k not in ("step", "time")})
        if missing:
            self._log(f"wandb: sent steps {missing[0]['step']}..{missing[-1]['step']} from metrics.jsonl")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """One history row for `step`, unless W&B has it already."""
        if step <= self.logged:
            return
        row = {k: v for k, v in metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        self.run.log(row, step=step, commit=True)
        self.logged = step

    def close(self) -> None:
        """Finishes the run (W&B writes or uploads what it holds) and records the newest step handed to it."""
        self.run.finish()
        _write(self.path, {**self._doc, "logged": self.logged})
