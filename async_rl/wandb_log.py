"""Weights & Biases logging that survives restarts: one job is one W&B run, one row per step.

Owns: run.dir/wandb.json (the W&B run id, reused by every later session of the job) and the
W&B run itself (resolved config as its config, one history row per learner step). Does not
own: which metrics exist (learner, train) or metrics.jsonl (metrics).

The history follows the checkpoint as metrics.jsonl does. A SIGKILL loses what wandb had
not yet written (its service keeps the transaction log's current 32 KiB block in memory), so
what was handed to wandb says nothing; at start each session asks what W&B really has: the
newest history step of the run on the server (online: wandb's resume state) or in the
transaction logs of the earlier sessions under run.dir/wandb (offline). It then sends the
rows of metrics.jsonl after that step (the cut kept them up to the checkpoint) and, live,
every step after it. Each row is committed at once (`commit=True`) so wandb does not hold it
back until the next step. Optional: `pip install async_rl[wandb]`.
"""

from __future__ import annotations

import json
import math
import secrets
import string
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .config import ConfigError

STATE_FILE = "wandb.json"

# wandb's transaction log (run-<id>.wandb): a 7-byte file header, then LevelDB log framing: 32 KiB
# blocks of chunks, each with a 7-byte header (CRC-32 of type + payload, length, type), a record
# split over blocks as FIRST, MIDDLE..., LAST
_BLOCK, _HDR = 32768, 7
_FILE_HEADER = (b":W&B", 0xBEE1, 0)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _write(path: Path, doc: dict) -> None:
    from .rundir import write_atomic  # rundir imports config; keep this module's import light
    write_atomic(path, json.dumps(doc))


def check_installed() -> None:
    """Refuses log.wandb=true before the run starts when the extra is missing."""
    import importlib.util
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("log.wandb=true: the wandb package is not installed (pip install 'async_rl[wandb]')")


def transaction_records(path: Path) -> Iterator[Any]:
    """The complete records of a wandb transaction log (wandb_internal_pb2.Record), in order.
    Stops at the first chunk that is cut short or fails its checksum: the tail a killed
    writer left. Raises ValueError if the file is not a transaction log."""
    from wandb.proto import wandb_internal_pb2
    data = Path(path).read_bytes()
    if len(data) < _HDR or struct.unpack("<4sHB", data[:_HDR]) != _FILE_HEADER:
        raise ValueError(f"{path}: not a wandb transaction log (header {data[:_HDR]!r})")
    pos, parts = _HDR, []
    while pos + _HDR <= len(data):
        if _BLOCK - pos % _BLOCK < _HDR:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HDR])
        payload = data[pos + _HDR:pos + _HDR + length]
        if (kind == 0 and length == 0) or len(payload) < length or crc != zlib.crc32(bytes([kind]) + payload):
            return
        pos += _HDR + length
        if kind in (_FULL, _FIRST):
            parts = []
        parts.append(payload)
        if kind in (_FULL, _LAST):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(b"".join(parts))
            yield rec


def history_rows(path: Path) -> list[dict]:
    """The history rows of a transaction log, each with its "_step"."""
    rows = []
    for rec in transaction_records(path):
        if rec.WhichOneof("record_type") == "history":
            row = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item}
            if rec.history.HasField("step"):
                row.setdefault("_step", rec.history.step.num)
            rows.append(row)
    return rows


def logged_offline(run_dir: Path, run_id: str, log=print) -> int:
    """The newest step of run `run_id` in the transaction logs under run_dir/wandb (-1: none)."""
    newest = -1
    for f in sorted(Path(run_dir, "wandb").glob(f"*/run-{run_id}.wandb")):
        if f.parent.is_symlink():  # latest-run: one of the others
            continue
        try:
            newest = max([newest, *(int(r["_step"]) for r in history_rows(f) if "_step" in r)])
        except (OSError, ValueError) as e:
            log(f"warning: wandb: {f} could not be read ({e}); its steps may be logged again")
    return newest


class WandbLog:
    """A W&B run for `run_dir`: created on the job's first session, resumed by id on every later one."""

    def __init__(self, run_dir: Path, config: dict, *, project: str, entity: str = "", name: str = "",
                 tags: tuple[str, ...] = (), log=print):
        check_installed()
        import wandb
        self.path = Path(run_dir) / STATE_FILE
        state = json.loads(self.path.read_text()) if self.path.is_file() else {}
        run_id = state.get("id") or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        prior = logged_offline(run_dir, run_id, log)
        # wandb names a session's folder by its start second: a second session of this run in
        # the same second would reuse the folder and overwrite the earlier session's log
        while any(Path(run_dir, "wandb").glob(f"*run-{time.strftime('%Y%m%d_%H%M%S')}-{run_id}")):
            time.sleep(0.1)
        self.run = wandb.init(project=project, entity=entity or None, name=name or Path(run_dir).resolve().name,
                              tags=list(tags), id=run_id, resume="allow", dir=str(run_dir), config=config)
        _write(self.path, {"id": run_id, "project": project, "entity": entity})
        self.offline = bool(getattr(self.run, "offline", False))
        if self.offline:
            self.logged = prior
        else:  # wandb resumes at the server's newest step + 1 (0 for a new run or an empty history)
            self.logged = int(getattr(self.run, "starting_step", 0) or 0) - 1
        self._log = log
        log(f"wandb: run {run_id} ({'resumed' if state else 'new'}"
            + (f", its history has steps <= {self.logged}" if self.logged >= 0 else "") + ")")

    def catch_up(self, rows: list[dict]) -> None:
        """Sends the rows of metrics.jsonl (cut at the checkpoint) that W&B does not have."""
        missing = [r for r in rows if isinstance(r.get("step"), int) and r["step"] > self.logged]
        for r in missing:
            self.log(r["step"], {k: v for k, v in r.items() if k not in ("step", "time")})
        if missing:
            self._log(f"wandb: sent steps {missing[0]['step']}..{missing[-1]['step']} from metrics.jsonl "
                      "(written before the last stop, missing from W&B)")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """One history row for `step`, unless W&B has it already."""
        if step <= self.logged:
            return
        row = {k: v for k, v in metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        self.run.log(row, step=step, commit=True)
        self.logged = step

    def close(self, timeout: float = 30.0) -> None:
        """Finishes the run; offline, also waits until its transaction log is written through
        its exit record (finish() returns first), so a later session reads all of it."""
        path = Path(self.run.settings.sync_file)
        self.run.finish()
        end = time.monotonic() + timeout
        while self.offline and time.monotonic() < end:
            try:
                if any(r.WhichOneof("record_type") == "exit" for r in transaction_records(path)):
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        if self.offline:
            self._log(f"warning: wandb: {path} not written through its end {timeout:.0f} s after the run finished")
