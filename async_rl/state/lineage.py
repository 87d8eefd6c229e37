"""The run's history logs, which follow the checkpoint: lineage, drops and rollouts.

Owns: `JsonlLog` (an append-only JSON-lines file, flushed per append, cut back on resume to
the byte size a checkpoint recorded), `lineage.jsonl` (one line per consumed group:
trained, or consumed untrained by explicit config with `"filtered": true`), `drops.jsonl`
(every rollout or group not trained, with its reason: I4), the optional `rollouts.jsonl`
(every trained sample's tokens), their byte sizes recorded in each checkpoint's ledger
header, and cutting them back to those sizes on resume (I5: lines a killed process wrote
after its last checkpoint describe groups that come back from the ledger). After a resume
on another process count each line carries the generation (`gen`): ordinals start again.
Does not own: deciding what is trained or dropped (sampler, train) or reading the logs back
(audit).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from async_rl.buffer.ledger import Group
from async_rl.store import runfiles, storage
from async_rl.store.rundir import storage_error

LOGS = ("lineage", "drops", "rollouts")


def _encode(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in rows)


def open_log(path):
    """A JSON-lines log at `path`: an append-only file, or segment objects on an object store."""
    return SegmentLog(path) if storage.is_remote(path) else JsonlLog(path)


class SegmentLog:
    """A JSON-lines log on an object store (no append there): each append is one new segment
    object under `path/`, read back in order (`storage.read_log`); its length, cut-back and
    checkpoint record work as JsonlLog's."""

    def __init__(self, path):
        self.path = path
        segs = storage.segments(path)
        self._size = sum(n for _, n in segs)
        self._seq = int(segs[-1][0].rsplit("/", 1)[-1]) if segs else 0

    def truncate(self, nbytes: int) -> int:
        cut = storage.cut_log(self.path, nbytes)
        self._size = storage.log_size(self.path)
        return cut

    def append(self, rows: list[dict]) -> None:
        if rows:
            data = _encode(rows)
            self._seq += 1
            where = self.path / storage.segment_name(self._seq)
            try:  # one PUT: the segment appears whole or not at all
                storage.write_atomic(where, data)
            except OSError as e:
                raise storage_error(where, e) from None
            self._size += len(data)

    def tell(self) -> int:
        return self._size

    def close(self) -> None:
        pass


class JsonlLog:
    """An append-only JSON-lines file whose valid length is recorded in checkpoints."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # unbuffered: a failed write (disk full) is raised by the append that made it and
            # leaves nothing queued in the process for close() to fail on again
            self._f = open(self.path, "ab", buffering=0)
        except OSError as e:
            raise storage_error(self.path, e, "opening") from None

    def truncate(self, nbytes: int) -> int:
        """Cuts the file back to `nbytes` (lines written after that checkpoint); returns bytes cut."""
        self._f.flush()
        size = self.path.stat().st_size
        if size > nbytes:
            os.truncate(self.path, nbytes)
        self._f.seek(0, os.SEEK_END)
        return max(0, size - nbytes)

    def append(self, rows: list[dict]) -> None:
        if rows:
            data = memoryview(_encode(rows))
            try:  # written at once: survives SIGKILL of this process (the OS holds the page)
                while data:
                    data = data[self._f.write(data):]
            except OSError as e:
                raise storage_error(self.path, e) from None

    def tell(self) -> int:
        self._f.flush()
        return self._f.tell()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in storage.read_log(path).decode().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


class RunLogs:
    def __init__(self, run_dir: Path, *, rollouts: bool, tokenizer, process_index: int = 0, generation: int = 0):
        """`process_index` names the logs (process i > 0 of a multi-host job has its own); `generation`
        (how many times the run was re-partitioned onto another process count) tags each line
        after the first, since ordinals count from 0 again in each generation."""
        self.tok = tokenizer
        self.gen = generation
        self.lineage = open_log(run_dir / runfiles.log("lineage", process_index))
        self.drops = open_log(run_dir / runfiles.log("drops", process_index))
        self.rollouts = open_log(run_dir / runfiles.log("rollouts", process_index)) if rollouts else None
        # with rollouts off the file keeps what earlier sessions wrote: its size is still
        # recorded at each cut, so that turning them on again later cuts nothing of it
        self._rollouts_off = None if rollouts else run_dir / runfiles.log("rollouts", process_index)

    def _logs(self):
        return [(n, getattr(self, n)) for n in LOGS if getattr(self, n) is not None]

    def sizes(self) -> dict[str, int]:
        """Byte sizes for the checkpoint's meta (call at the cut)."""
        sizes = {f"{n}_bytes": log.tell() for n, log in self._logs()}
        if self._rollouts_off is not None:
            sizes["rollouts_bytes"] = storage.log_size(self._rollouts_off)
        return sizes

    def cut_to(self, meta: dict | None, warn) -> int:
        """Truncates each log to the size `meta` recorded (None: a fresh start, to 0); returns
        the bytes of lineage cut."""
        cut = 0
        off = self._rollouts_off
        if off is not None and (not meta or "rollouts_bytes" in meta):
            storage.cut_log(off, int(meta["rollouts_bytes"]) if meta else 0)
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
               "versions": sorted({v for s in g.samples for v in s.versions})}
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
                                                "text": self.tok.decode(s.tokens)} for s in g.samples]}
                                  for g in groups])

    def filtered(self, step: int, groups: list[Group]) -> None:
        """Groups consumed without training (rollout.filter_zero_variance): the audit counts them once."""
        self.lineage.append([{**self._row(step, g), "filtered": True} for g in groups])
        self.drops.append([{**self._row(step, g), "reason": "zero_variance", "what": "group",
                            "rewards": [s.reward for s in g.samples]} for g in groups])

    def overlong(self, step: int, g: Group, samples: list[int]) -> None:
        """Samples of a trained group left out of the loss (learner.overlong=filter: cut at the length cap)."""
        self.drops.append([{**self._row(step, g), "reason": "overlong", "what": "samples", "samples": samples}])

    def regenerated(self, step: int, g: Group) -> None:
        """A READY group too stale to train: its rollouts are discarded, the prompt is generated again."""
        self.drops.append([{**self._row(step, g), "reason": "stale", "what": "rollouts",
                            "tokens": sum(len(s.tokens) for s in g.samples)}])

    def close(self) -> None:
        for _, log in self._logs():
            log.close()

