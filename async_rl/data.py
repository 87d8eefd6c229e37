"""Prompt datasets: synthetic tasks and prompt files, as checkpointable Grain streams.

Owns: generating synthetic records, loading and validating JSONL/Parquet prompt
files (bad records are errors or skipped-and-counted, never silently dropped),
per-process sharding, per-epoch shuffling, tokenising prompts, and the Grain
iterator whose state says exactly which records have been handed out. Does not own:
what happens to a record after it is drawn (`ledger`), rewards (`rewards`), or
saving the iterator state (`checkpoint`).

Stream layout: this process's shard of the records, shuffled with a different order
every epoch (when `data.shuffle`), repeated `data.num_epochs` times. Stream index `i`
is epoch `i // records_per_epoch`. Every record with the same `prompt_id` is
identical in every epoch and in every process.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import grain
import numpy as np

from async_rl.config import Config, ConfigError

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A prompt file or record that cannot be used; names the file and line."""


class BadRecord(NamedTuple):
    line: int  # JSONL: 1-based line; Parquet: 0-based row
    reason: str


@dataclass
class PromptDataset:
    dataset: grain.MapDataset  # all epochs of this process's shard, in stream order
    prompt_ids: np.ndarray  # every valid id of the dataset (all processes), sorted
    shard_prompt_ids: np.ndarray  # this process's ids, in unshuffled shard order
    records_per_epoch: int  # this process's records per epoch
    num_epochs: int
    max_prompt_len: int  # longest encoded prompt, tokens
    bad_records: list[BadRecord] = field(default_factory=list)
    source: str = ""  # "synthetic:reverse" or the file path, for messages
    process_index: int = 0
    process_count: int = 1

    @property
    def total_records(self) -> int:
        return self.records_per_epoch * self.num_epochs

    def stream_signature(self) -> dict[str, Any]:
        """What an iterator state is only valid for: this shard of these ids."""
        digest = hashlib.sha256(np.ascontiguousarray(self.shard_prompt_ids, np.int64).tobytes())
        return {"shard": [self.process_index, self.process_count],
                "records_per_epoch": self.records_per_epoch,
                "ids_sha256": digest.hexdigest()[:16]}


# --- synthetic tasks -------------------------------------------------------------------

_TASK_SALT = {"reverse": 1, "addition": 2}


def _digits(rng: np.random.Generator, n: int, leading_zero: bool) -> str:
    d = rng.integers(0, 10, size=n)
    if not leading_zero and n > 1:
        d[0] = rng.integers(1, 10)
    return "".join(map(str, d.tolist()))


def synthetic_record(task: str, seed: int, prompt_id: int, min_digits: int, max_digits: int) -> dict:
    """The record `prompt_id` of a synthetic task: a pure function of its arguments."""
    rng = np.random.default_rng([seed % 2**64, _TASK_SALT[task], prompt_id])
    if task == "reverse":
        s = _digits(rng, int(rng.integers(min_digits, max_digits + 1)), leading_zero=True)
        return {"prompt_id": prompt_id, "prompt": f"{s}=", "answer": s[::-1]}
    a = _digits(rng, int(rng.integers(min_digits, max_digits + 1)), leading_zero=False)
    b = _digits(rng, int(rng.integers(min_digits, max_digits + 1)), leading_zero=False)
    return {"prompt_id": prompt_id, "prompt": f"{a}+{b}=", "answer": str(int(a) + int(b))}


def _longest_synthetic_prompt(task: str, max_digits: int) -> str:
    return "9" * max_digits + ("=" if task == "reverse" else "+" + "9" * max_digits + "=")


class _Synthetic:
    def __init__(self, d):
        self.args = (d.task, d.seed, d.min_digits, d.max_digits)

    def __call__(self, prompt_id: int) -> dict:
        task, seed, lo, hi = self.args
        return synthetic_record(task, seed, int(prompt_id), lo, hi)


# --- prompt files ----------------------------------------------------------------------

def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, BadRecord(lineno, f"not UTF-8 text ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, BadRecord(lineno, f"not valid JSON ({e.msg} at column {e.colno})")


def _parquet_rows(path: Path, wanted: list[str]) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        # Only the needed columns: prompt files may carry long solutions we never use.
        cols = [c for c in wanted if c in schema.names]
        table = pq.read_table(path, columns=cols)
    except Exception as e:  # pyarrow raises several unrelated types for a bad file
        raise DataError(f"{path}: cannot read as Parquet ({e})") from None
    for row, rec in enumerate(table.to_pylist()):
        yield row, rec


def _validate(rec: Any, where: int, d, tokenizer, max_len: int) -> dict | BadRecord:
    if isinstance(rec, BadRecord):
        return rec
    if not isinstance(rec, dict):
        return BadRecord(where, f"expected a JSON object, got {type(rec).__name__}")
    for name in (d.prompt_field, d.answer_field) + ((d.id_field,) if d.id_field else ()):
        if rec.get(name) is None:
            return BadRecord(where, f"missing field {name!r}" if name not in rec else f"field {name!r} is null")
    prompt, answer = rec[d.prompt_field], rec[d.answer_field]
    if not isinstance(prompt, str):
        return BadRecord(where, f"field {d.prompt_field!r} is {type(prompt).__name__}, expected a string")
    if not prompt.strip():
        return BadRecord(where, f"field {d.prompt_field!r} is empty")
    # Numeric answers are common (e.g. GSM8K exports); booleans are almost surely a mistake.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return BadRecord(where, f"field {d.answer_field!r} is {type(answer).__name__}, "
                                "expected a string or a number")
    out = {"prompt": prompt, "answer": answer if isinstance(answer, str) else str(answer)}
    if d.id_field:
        pid = rec[d.id_field]
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 2**63:
            return BadRecord(where, f"field {d.id_field!r} is {pid!r}, expected a non-negative integer")
        out["prompt_id"] = pid
    n = len(tokenizer.encode_prompt(prompt))
    if n > max_len:
        return BadRecord(where, f"prompt is {n} tokens, longer than engine.max_prompt_len={max_len}")
    out["_len"] = n
    return out


def load_prompt_file(cfg: Config, tokenizer) -> tuple[list[dict], list[BadRecord], int]:
    """The valid records (`prompt_id`, `prompt`, `answer`) of the prompt file, the bad
    ones, and the longest encoded prompt of the valid ones."""
    d = cfg.data
    path = Path(d.path).expanduser()
    if path.is_dir():
        raise DataError(f"data.path={d.path!r}: is a directory; expected a {d.source.upper()} file")
    if not path.is_file():
        raise DataError(f"data.path={d.path!r}: no such file")
    kind = "line" if d.source == "jsonl" else "row"
    if d.source == "jsonl":
        rows = _jsonl_rows(path)
    else:
        rows = _parquet_rows(path, [d.prompt_field, d.answer_field] + ([d.id_field] if d.id_field else []))
    records: list[dict] = []
    bad: list[BadRecord] = []
    seen: dict[int, int] = {}
    longest = 0
    for ordinal, (where, rec) in enumerate(rows):
        r = _validate(rec, where, d, tokenizer, cfg.engine.max_prompt_len)
        if isinstance(r, BadRecord):
            if d.on_bad_record == "error":
                raise DataError(f"{path}: {kind} {r.line}: {r.reason} "
                                "(data.on_bad_record=skip skips and counts such records)")
            bad.append(r)
            continue
        # Without an id field the row ordinal is the id, so ids survive fixing a bad row.
        pid = r.setdefault("prompt_id", ordinal)
        if pid in seen:
            raise DataError(f"{path}: duplicate {d.id_field} {pid} at {kind} {seen[pid]} "
                            f"and {kind} {where}")
        seen[pid] = where
        longest = max(longest, r.pop("_len"))
        records.append(r)
        if d.num_records and len(records) == d.num_records:
            break
    if not records:
        raise DataError(f"{path}: no valid records ({len(bad)} bad)")
    if d.num_records and len(records) < d.num_records:
        raise DataError(f"data.num_records={d.num_records}: {path} has only {len(records)} valid "
                        f"records ({len(bad)} bad)")
    if bad:
        log.warning("%s: skipped %d bad records (first: %s %d: %s)", path, len(bad), kind,
                    bad[0].line, bad[0].reason)
    return records, bad, longest


# --- the stream ------------------------------------------------------------------------

class _Finalize:
    """Stream index + record -> the record the pump sees (epoch set, prompt tokenised)."""

    def __init__(self, tokenizer, records_per_epoch: int, max_len: int):
        self.tokenizer, self.n, self.max_len = tokenizer, records_per_epoch, max_len

    def __call__(self, index: int, rec: dict) -> dict:
        tokens = self.tokenizer.encode_prompt(rec["prompt"])
        if len(tokens) > self.max_len:
            raise DataError(f"prompt_id {rec['prompt_id']}: prompt is {len(tokens)} tokens, longer "
                            f"than engine.max_prompt_len={self.max_len}")
        # A fresh dict: the source records are shared by every epoch.
        return {"prompt_id": int(rec["prompt_id"]), "epoch": index // self.n, "prompt": rec["prompt"],
                "answer": rec["answer"], "prompt_tokens": tokens}


def _shuffle_seed(seed: int) -> int:
    # Decorrelated from the record seed; grain folds the epoch in as seed + epoch.
    return int(np.random.SeedSequence([seed % 2**64, 0x5EED]).generate_state(1)[0])


def build_dataset(cfg: Config, tokenizer, *, process_index: int = 0, process_count: int = 1) -> PromptDataset:
    """The prompt stream of process `process_index` of `process_count`, all epochs."""
    d = cfg.data
    max_len = cfg.engine.max_prompt_len
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
    bad: list[BadRecord] = []
    if d.source == "synthetic":
        longest = len(tokenizer.encode_prompt(_longest_synthetic_prompt(d.task, d.max_digits)))
        if longest > max_len:
            raise ConfigError(f"engine.max_prompt_len={max_len}: data.task={d.task} with "
                              f"data.max_digits={d.max_digits} needs prompts of {longest} tokens; "
                              f"set engine.max_prompt_len>={longest}")
        ids = np.arange(d.num_records, dtype=np.int64)
        base = grain.MapDataset.range(d.num_records).map(_Synthetic(d))
        source = f"synthetic:{d.task}"
    else:
        records, bad, longest = load_prompt_file(cfg, tokenizer)
        ids = np.asarray([r["prompt_id"] for r in records], dtype=np.int64)
        base = grain.MapDataset.source(records)
        source = str(d.path)
    if len(ids) < process_count:
        raise DataError(f"{source}: {len(ids)} records cannot be split over {process_count} processes")
    # Shard before shuffling so a process keeps the same records in every epoch.
    shard = base[process_index::process_count]
    n = len(shard)
    if d.shuffle:
        shard = shard.shuffle(seed=_shuffle_seed(d.seed))
    stream = shard.repeat(d.num_epochs).map_with_index(_Finalize(tokenizer, n, max_len))
    return PromptDataset(
        dataset=stream, prompt_ids=np.sort(ids), shard_prompt_ids=ids[process_index::process_count],
        records_per_epoch=n, num_epochs=d.num_epochs, max_prompt_len=longest, bad_records=bad,
        source=source, process_index=process_index, process_count=process_count)


class PromptIterator(grain.DatasetIterator):
    """Grain's in-order iterator, with a state that refuses a different stream on restore.

    The state is grain's (`{"next_index": i}`, the count of records handed out) plus
    the stream signature; restoring it into an iterator over another shard, another
    process count or other records raises DataError instead of silently drawing
    other prompts. A plain grain state (no signature) is accepted.
    """

    def __init__(self, parent: grain.DatasetIterator, signature: dict[str, Any], length: int):
        super().__init__(parent)
        self._signature = signature
        self._length = length

    def __next__(self) -> dict:
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return {**self._parent.get_state(), "stream": self._signature}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("stream")
        if saved is not None and saved != self._signature:
            raise DataError(f"data iterator state is for another stream ({saved}), this one is "
                            f"{self._signature}: the data, its order or the process count changed")
        inner = {k: v for k, v in state.items() if k != "stream"}
        if not 0 <= inner.get("next_index", -1) <= self._length:
            raise DataError(f"data iterator state {inner} is outside this stream of {self._length} records")
        self._parent.set_state(inner)

    @property
    def next_index(self) -> int:
        return self._parent.get_state()["next_index"]

    @property
    def exhausted(self) -> bool:
        return self.next_index >= self._length

    def __str__(self) -> str:
        return "PromptIterator"


def make_iterator(pd: PromptDataset) -> PromptIterator:
    """An iterator over `pd.dataset` with no reader threads: its state counts exactly the
    records returned by `next()`, and nothing is read or tokenised ahead of it."""
    opts = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    inner = pd.dataset.to_iter_dataset(opts).__iter__()
    return PromptIterator(inner, pd.stream_signature(), len(pd.dataset))
