"""The run's history logs, which follow the checkpoint: lineage, drops and rollouts.

Owns: `JsonlLog` (an append-only JSON-lines log, `applog`'s, written per append, cut back on
resume to the byte size a checkpoint recorded), `lineage.jsonl` (one line per consumed group:
trained, or consumed untrained by explicit config with `"filtered": true`), `drops.jsonl`
(every rollout or group not trained, with its reason: I4), the optional `rollouts.jsonl`
(every trained sample's tokens, and its routes under routing replay: `decode_routes` reads
them back), their byte sizes recorded in each checkpoint's ledger header, and cutting them
back to those sizes on resume (I5: lines a killed process wrote after its last checkpoint
describe groups that come back from the ledger). After a resume on another process count
each line carries the generation (`gen`): ordinals start again.
Does not own: deciding what is trained or dropped (sampler, train) or reading the logs back
(audit).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

from async_rl.buffer.ledger import OBSERVATION, Group
from async_rl.store import applog, runfiles, storage
from async_rl.store.applog import AppendLog
from async_rl.store.rundir import storage_error

LOGS = ("lineage", "drops", "rollouts")


def _encode(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in rows)


class JsonlLog:
    """An append-only JSON-lines log (`applog.AppendLog`: a file, or segment objects on an
    object store) whose valid length is recorded in checkpoints; a failed open or append is
    named by `storage_error`."""

    def __init__(self, path):
        self.path = storage.run_path(path)
        try:
            storage.mkdirs(self.path.parent)
            self._log = AppendLog(path)
        except OSError as e:
            raise storage_error(path, e, "opening") from None

    def truncate(self, nbytes: int) -> int:
        """Cuts the log back to `nbytes` (lines written after that checkpoint); returns bytes cut."""
        return self._log.truncate(nbytes)

    def append(self, rows: list[dict]) -> None:
        if rows:
            try:  # written at once: survives SIGKILL of this process (the OS holds the page, or the PUT landed)
                self._log.append(_encode(rows))
            except OSError as e:
                raise storage_error(self.path, e) from None

    def tell(self) -> int:
        return self._log.tell()

    def close(self) -> None:
        self._log.close()


def encode_routes(rows: np.ndarray) -> dict:
    """A sample's routes [m, layers, k] for rollouts.jsonl: shape, dtype and the little-endian
    C-order bytes in base64 (a list of lists would be several times the size)."""
    r = np.ascontiguousarray(rows, np.dtype(rows.dtype).newbyteorder("<"))
    return {"shape": list(r.shape), "dtype": r.dtype.name, "b64": base64.b64encode(r.tobytes()).decode()}


def decode_routes(d: dict) -> np.ndarray:
    """The array `encode_routes` wrote (a sample's `"routes"` in rollouts.jsonl); ValueError if malformed."""
    try:
        dt, shape = np.dtype(d["dtype"]).newbyteorder("<"), tuple(int(x) for x in d["shape"])
        raw = base64.b64decode(d["b64"], validate=True)
    except (KeyError, TypeError) as e:
        raise ValueError(f"routes: {e!r}") from None
    if dt.kind != "u" or len(shape) != 3 or min(shape) < 0 or len(raw) != int(np.prod(shape)) * dt.itemsize:
        raise ValueError(f"routes: {len(raw)} bytes of {dt.name} for shape {list(shape)}")
    return np.frombuffer(raw, dt).reshape(shape).astype(dt.newbyteorder("="))


def read_jsonl(path) -> list[dict]:
    out = []
    for line in applog.read(path).decode().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


class RunLogs:
    def __init__(self, run_dir: Path, *, rollouts: bool, tokenizer, process: int = 0, generation: int = 0):
        """`process` (> 0 for process i of a multi-host job) picks the logs' names; `generation`
        (how many times the run was re-partitioned onto another process count) tags each line
        after the first, since ordinals count from 0 again in each generation."""
        self.tok = tokenizer
        self.gen = generation
        self.lineage = JsonlLog(runfiles.lineage(run_dir, process))
        self.drops = JsonlLog(runfiles.drops(run_dir, process))
        self.rollouts = JsonlLog(runfiles.rollouts(run_dir, process)) if rollouts else None
        # with rollouts off the file keeps what earlier sessions wrote: its size is still
        # recorded at each cut, so that turning them on again later cuts nothing of it
        self._rollouts_off = None if rollouts else runfiles.rollouts(run_dir, process)
        # env steps asked for (multi-turn episodes): opened at the first, never cut back
        self.env_requests, self._env_requests_path = None, runfiles.env_requests(run_dir, process)

    def _logs(self):
        return [(n, getattr(self, n)) for n in LOGS if getattr(self, n) is not None]

    def sizes(self) -> dict[str, int]:
        """Byte sizes for the checkpoint's meta (call at the cut)."""
        sizes = {f"{n}_bytes": log.tell() for n, log in self._logs()}
        if self._rollouts_off is not None:
            sizes["rollouts_bytes"] = applog.size(self._rollouts_off)
        return sizes

    def cut_to(self, meta: dict | None, warn) -> int:
        """Truncates each log to the size `meta` recorded (None: a fresh start, to 0); returns
        the bytes of lineage cut."""
        cut = 0
        off = self._rollouts_off
        if off is not None and (not meta or "rollouts_bytes" in meta):
            applog.cut(off, int(meta["rollouts_bytes"]) if meta else 0)
        for n, log in self._logs():
            if meta and n == "rollouts" and "rollouts_bytes" not in meta:
                continue  # a checkpoint from before this size was recorded with rollouts off: keep all
            want = int(meta.get(f"{n}_bytes", 0)) if meta else 0
            if n == "lineage" and log.tell() < want:
                warn(f"{log.path} has {log.tell()} bytes but the checkpoint recorded {want}; "
                     "lines of trained groups are missing from the log")
            got = log.truncate(want)
            cut += got if n == "lineage" else 0
        return cut

    def _row(self, step: int, g: Group) -> dict:
        row = {"step": step, "prompt_id": g.prompt_id, "epoch": g.epoch, "ordinal": g.ordinal,
               "versions": sorted({v for s in g.samples for v in s.versions if v != OBSERVATION})}
        env_steps = sum(len(s.turns) for s in g.samples)
        if env_steps:  # multi-turn episodes: the env steps recorded in them (the audit counts them)
            row["env_steps"] = env_steps
        return {**row, "gen": self.gen} if self.gen else row

    def trained(self, step: int, groups: list[Group]) -> None:
        self.lineage.append([self._row(step, g) for g in groups])
        if self.rollouts is not None:
            # the prompt's ids and each token's behaviour logprob: enough to score the run's own
            # tokens with any other implementation and compare (e.g. a backend against a reference)
            self.rollouts.append([{**self._row(step, g), "prompt": g.prompt, "answer": g.answer,
                                   "prompt_tokens": [int(t) for t in g.prompt_tokens],
                                   "samples": [{"tokens": s.tokens, "versions": s.versions, "reward": s.reward,
                                                "logprobs": [float(x) for x in s.logprobs],
                                                "text": self.tok.decode(s.tokens)}
                                               | ({"turns": [{"key": t["key"], "observation": t["observation"]}
                                                             for t in s.turns]} if s.turns else {})
                                               | ({"routes": encode_routes(s.route_rows())} if s.routes else {})
                                               for s in g.samples]}
                                  for g in groups])

    def filtered(self, step: int, groups: list[Group]) -> None:
        """Groups consumed without training (rollout.filter_zero_variance): the audit counts them once."""
        self.lineage.append([{**self._row(step, g), "filtered": True} for g in groups])
        self.drops.append([{**self._row(step, g), "reason": "zero_variance", "what": "group",
                            "rewards": [s.reward for s in g.samples]} for g in groups])

    def overlong(self, step: int, g: Group, samples: list[int]) -> None:
        """Samples of a trained group left out of the loss (learner.overlong=filter: cut at the length cap)."""
        self.drops.append([{**self._row(step, g), "reason": "overlong", "what": "samples", "samples": samples}])

    def nonfinite(self, step: int, groups: list[Group], updates: int) -> None:
        """Groups of a step whose loss or gradient was not finite (learner.nonfinite=skip): consumed
        (in the lineage at `step`), `updates` of the step's optimizer updates not applied."""
        self.drops.append([{**self._row(step, g), "reason": "nonfinite", "what": "group", "updates_skipped": updates}
                           for g in groups])

    def regenerated(self, step: int, g: Group) -> None:
        """A READY group too stale to train: its rollouts are discarded, the prompt is generated again."""
        self.drops.append([{**self._row(step, g), "reason": "stale", "what": "rollouts",
                            "tokens": sum(len(s.tokens) for s in g.samples)}])

    def env_requested(self, key) -> None:
        """An env step about to be asked for (before it is: a kill cannot hide a request)."""
        if self.env_requests is None:
            self.env_requests = JsonlLog(self._env_requests_path)
        self.env_requests.append([{"key": str(key)}])

    def close(self) -> None:
        for _, log in self._logs():
            log.close()
        if self.env_requests is not None:
            self.env_requests.close()

