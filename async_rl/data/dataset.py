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
identical in every epoch and in every process. After a resume on another process count
(`Partition`), a process's stream starts with its share of the records the old processes
had not drawn from the epochs they had started, then continues with its new shard.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import grain
import numpy as np

from async_rl.config import Config, ConfigError
from async_rl.data import sequences, tool_tasks, word_problems
from async_rl.errors import UsageError

log = logging.getLogger(__name__)


class DataError(UsageError):
    """A prompt file or record that cannot be used; names the file and line."""


class BadRecord(NamedTuple):
    line: int  # JSONL: 1-based line; Parquet: 0-based row
    reason: str


@dataclass(frozen=True)
class Partition:
    """How the records are split over the processes, from one process count to the next.

    Generation 0 (no parent): process q of `processes` owns records q::processes every epoch.
    A resume on another process count makes a child: the records of the epochs before
    `epoch0` that no parent process had drawn (each parent stream from its position in
    `parent_next`) are merged in epoch order and dealt q::processes (the *remainder*); from
    `epoch0` on, every epoch is sharded q::processes again. A pure function of its fields:
    every process computes the same streams from it, and a checkpoint stores it as JSON.
    """
    processes: int
    epoch0: int = 0  # first epoch no parent process had drawn from
    parent: "Partition | None" = None
    parent_next: tuple = ()  # each parent process's iterator position (records handed out) at the re-partition

    @property
    def generation(self) -> int:
        return 0 if self.parent is None else self.parent.generation + 1

    def to_json(self) -> dict:
        return {"processes": self.processes, "epoch0": self.epoch0, "parent_next": list(self.parent_next),
                "parent": self.parent.to_json() if self.parent is not None else None}

    @classmethod
    def from_json(cls, d: dict) -> "Partition":
        parent = cls.from_json(d["parent"]) if d.get("parent") else None
        return cls(int(d["processes"]), int(d.get("epoch0", 0)), parent,
                   tuple(int(k) for k in d.get("parent_next", ())))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


class _Order:
    """Which record (index into the source) and epoch sits at each position of each process's
    stream, for a partition: Grain datasets of (index, epoch) pairs, nothing read."""

    def __init__(self, n: int, shuffle_seed: int | None, num_epochs: int):
        self.n, self.seed, self.num_epochs = n, shuffle_seed, num_epochs
        self._remainders: dict[Partition, tuple[np.ndarray, np.ndarray]] = {}

    def shard_len(self, q: int, m: int) -> int:
        return (self.n - q + m - 1) // m

    def standard(self, q: int, m: int) -> grain.MapDataset:
        # shard before shuffling so a process keeps the same records in every epoch
        shard = grain.MapDataset.range(self.n)[q::m]
        if self.seed is not None:
            shard = shard.shuffle(seed=self.seed)
        return shard.repeat(self.num_epochs).map_with_index(_WithEpoch(self.shard_len(q, m)))

    def stream(self, part: Partition, q: int) -> grain.MapDataset:
        std = self.standard(q, part.processes)
        if part.parent is None:
            return std
        rem = self.remainder(part)[0][q::part.processes]
        parts = [grain.MapDataset.source([(int(i), int(e)) for i, e in rem])] if len(rem) else []
        if part.epoch0 < self.num_epochs:
            parts.append(std[part.epoch0 * self.shard_len(q, part.processes):])
        if not parts:
            return grain.MapDataset.source([])
        return parts[0] if len(parts) == 1 else grain.MapDataset.concatenate(parts)

    def epoch_starts(self, part: Partition, q: int, epoch: int) -> int:
        """The position in process q's stream where records of epochs >= `epoch` begin."""
        rem = len(self.remainder(part)[0][q::part.processes]) if part.parent is not None else 0
        return rem + max(0, epoch - part.epoch0) * self.shard_len(q, part.processes)

    def remainder(self, part: Partition) -> tuple[np.ndarray, np.ndarray]:
        """([R, 2] (index, epoch), [R] parent process) of the records no parent process had
        drawn from epochs before `part.epoch0`, in epoch order, interleaving the parents."""
        if part not in self._remainders:
            parent, rows = part.parent, []
            for p in range(parent.processes):
                stream = self.stream(parent, p)
                for pos in range(part.parent_next[p], self.epoch_starts(parent, p, part.epoch0)):
                    idx, epoch = stream[pos]
                    rows.append((idx, epoch, p))
            a = np.asarray(rows, np.int64).reshape(-1, 3)
            # rank of each record among its parent's undrawn records of the same epoch
            first = {}
            rank = np.array([i - first.setdefault((e, p), i) for i, (_, e, p) in enumerate(a.tolist())], np.int64)
            order = np.lexsort((a[:, 2], rank, a[:, 1])) if len(a) else np.zeros(0, np.int64)
            self._remainders[part] = (a[order, :2], a[order, 2])
        return self._remainders[part]

    def repartition(self, parent: Partition, parent_next: list[int], processes: int) -> Partition:
        """The child of `parent` for `processes` processes, the parent's iterators standing at
        `parent_next`: `epoch0` is the first epoch that no parent process had started."""
        epoch0 = parent.epoch0
        for p, pos in enumerate(parent_next):
            past = pos - self.epoch_starts(parent, p, parent.epoch0)
            if past > 0:
                n_p = self.shard_len(p, parent.processes)
                epoch0 = max(epoch0, parent.epoch0 + -(-past // n_p))
        return Partition(processes, epoch0, parent, tuple(int(k) for k in parent_next))


class _WithEpoch:
    def __init__(self, records_per_epoch: int):
        self.n = records_per_epoch

    def __call__(self, index: int, source_index) -> tuple[int, int]:
        return int(source_index), index // self.n


@dataclass
class PromptDataset:
    dataset: grain.MapDataset  # all epochs of this process's stream, in stream order
    prompt_ids: np.ndarray  # every valid id of the dataset (all processes), sorted
    shard_prompt_ids: np.ndarray  # this process's ids, in unshuffled shard order
    records_per_epoch: int  # this process's records per epoch (of its shard)
    num_epochs: int
    max_prompt_len: int  # longest encoded prompt, tokens
    bad_records: list[BadRecord] = field(default_factory=list)
    source: str = ""  # "synthetic:reverse" or the file path, for messages
    process_index: int = 0
    process_count: int = 1
    partition: Partition | None = None
    _source: "_Source | None" = None
    _index: grain.MapDataset | None = None  # (source index, epoch) at each position of the stream

    @property
    def total_records(self) -> int:
        return len(self.dataset)

    def stream_signature(self) -> dict[str, Any]:
        """What an iterator state is only valid for: this shard of these ids (and, after a
        re-partition, that partition)."""
        digest = hashlib.sha256(np.ascontiguousarray(self.shard_prompt_ids, np.int64).tobytes())
        sig = {"shard": [self.process_index, self.process_count],
               "records_per_epoch": self.records_per_epoch,
               "ids_sha256": digest.hexdigest()[:16]}
        if self._source is not None and self._source.digests is not None:
            mine = self._source.digests[self.process_index::self.process_count]
            sig["records_sha256"] = hashlib.sha256(mine.tobytes()).hexdigest()[:16]
        if self.partition is not None and self.partition.generation:
            sig["partition"] = self.partition.digest()
        return sig

    def record_digests(self) -> str | None:
        """This shard's per-record content digests (base64), saved with the iterator state so
        that a changed file can be refused naming its first changed record."""
        if self._source is None or self._source.digests is None:
            return None
        return base64.b64encode(self._source.digests[self.process_index::self.process_count].tobytes()).decode()

    def first_changed(self, saved_b64: str) -> str:
        """The first record of this shard whose content differs from the saved digests."""
        src, q, m = self._source, self.process_index, self.process_count
        saved = np.frombuffer(base64.b64decode(saved_b64), np.uint32)
        now = src.digests[q::m]
        n = min(len(saved), len(now))
        diff = np.flatnonzero(saved[:n] != now[:n])
        if not len(diff):
            return f"the shard had {len(saved)} records, now {len(now)}"
        i = q + int(diff[0]) * m
        return f"{src.kind} {src.where[i]} (prompt_id {int(src.ids[i])}) differs from what was trained"

    def epoch_at(self, position: int) -> int:
        """The epoch of the record at `position` of this stream (num_epochs past its end)."""
        return self.num_epochs if position >= len(self._index) else int(self._index[position][1])

    def for_partition(self, partition: Partition, process_index: int) -> "PromptDataset":
        """This process's stream under another partition (the records are not read again)."""
        return _assemble(self._source, partition, process_index, self.bad_records)

    def repartition(self, parent: Partition, parent_next: list[int], processes: int) -> Partition:
        """The child of `parent` for `processes` processes (see `Partition`)."""
        return self._source.order.repartition(parent, parent_next, processes)

    def remainder(self, partition: Partition) -> tuple[np.ndarray, np.ndarray]:
        """The records `partition` deals before its new shards: [R, 2] (index, epoch) and the
        parent process each comes from (see `Partition`)."""
        return self._source.order.remainder(partition)


# --- synthetic tasks -------------------------------------------------------------------

_TASK_SALT = {"reverse": 1, "addition": 2, "word_problem": 3, "lookup": 4, "recall": 5, "sequence": 6}


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
    if task in ("word_problem", "sequence"):
        make = word_problems.record if task == "word_problem" else sequences.record
        prompt, answer = make(rng, min_digits, max_digits)
        return {"prompt_id": prompt_id, "prompt": prompt, "answer": answer}
    if task in ("lookup", "recall"):  # the answer is in a table only the task's env reads
        make = tool_tasks.record if task == "lookup" else tool_tasks.recall_record
        prompt, answer = make(rng, seed, min_digits, max_digits)
        return {"prompt_id": prompt_id, "prompt": prompt, "answer": answer}
    a = _digits(rng, int(rng.integers(min_digits, max_digits + 1)), leading_zero=False)
    b = _digits(rng, int(rng.integers(min_digits, max_digits + 1)), leading_zero=False)
    return {"prompt_id": prompt_id, "prompt": f"{a}+{b}=", "answer": str(int(a) + int(b))}


def _longest_synthetic_prompt(task: str, max_digits: int) -> list[str]:
    if task == "word_problem":
        return word_problems.longest_prompts(max_digits)
    if task == "sequence":
        return sequences.longest_prompts(max_digits)
    if task == "lookup":
        return tool_tasks.longest_prompts(max_digits)
    return ["9" * max_digits + ("=" if task in ("reverse", "recall") else "+" + "9" * max_digits + "=")]


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
            except ValueError as e:  # an integer of more digits than Python converts
                yield lineno, BadRecord(lineno, f"not readable JSON ({' '.join(str(e).split())[:200]})")
            except RecursionError:
                yield lineno, BadRecord(lineno, "JSON nested too deeply to be read")


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
    for name, text in ((d.prompt_field, prompt), (d.answer_field, answer)):
        if isinstance(text, str) and (bad := _not_unicode(text)):
            return BadRecord(where, f"field {name!r} {bad}")
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


def _not_unicode(text: str) -> str:
    """Why `text` cannot be encoded (JSON's \\ud800 escapes decode to lone surrogates), or ""."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is not text"
    return ""


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
        r["_where"] = where
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


def _content_digest(rec: dict) -> int:
    """What training reads of a record (id, prompt, answer), as 32 bits of sha256."""
    raw = json.dumps([int(rec["prompt_id"]), rec["prompt"], rec["answer"]], ensure_ascii=False).encode()
    return int.from_bytes(hashlib.sha256(raw).digest()[:4], "little")


# --- the stream ------------------------------------------------------------------------

class _Finalize:
    """(source index, epoch) -> the record the pump sees (epoch set, prompt tokenised)."""

    def __init__(self, tokenizer, lookup, max_len: int):
        self.tokenizer, self.lookup, self.max_len = tokenizer, lookup, max_len

    def __call__(self, item: tuple[int, int]) -> dict:
        index, epoch = item
        rec = self.lookup[index]
        tokens = self.tokenizer.encode_prompt(rec["prompt"])
        if len(tokens) > self.max_len:
            raise DataError(f"prompt_id {rec['prompt_id']}: prompt is {len(tokens)} tokens, longer "
                            f"than engine.max_prompt_len={self.max_len}")
        # A fresh dict: the source records are shared by every epoch.
        return {"prompt_id": int(rec["prompt_id"]), "epoch": int(epoch), "prompt": rec["prompt"],
                "answer": rec["answer"], "prompt_tokens": tokens}


def _shuffle_seed(seed: int) -> int:
    # Decorrelated from the record seed; grain folds the epoch in as seed + epoch.
    return int(np.random.SeedSequence([seed % 2**64, 0x5EED]).generate_state(1)[0])


@dataclass
class _Source:
    """The loaded records of a run and the order they are streamed in, for any partition."""
    lookup: Any  # source index -> record (prompt_id, prompt, answer)
    ids: np.ndarray  # prompt_id of each source index
    order: _Order
    tokenizer: Any
    max_len: int  # engine.max_prompt_len
    longest: int  # longest encoded prompt
    name: str
    digests: np.ndarray | None = None  # uint32 content digest of each record (prompt files only)
    where: list | None = None  # line/row of each record in the file, for messages
    kind: str = "record"  # "line" or "row"


def build_dataset(cfg: Config, tokenizer, *, process_index: int = 0, process_count: int = 1,
                  partition: Partition | None = None) -> PromptDataset:
    """The prompt stream of process `process_index` of `process_count`, all epochs (under
    `partition`, by default the plain q::process_count sharding)."""
    d = cfg.data
    max_len = cfg.engine.max_prompt_len
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
    bad: list[BadRecord] = []
    if d.source == "synthetic":
        longest = max(len(tokenizer.encode_prompt(p)) for p in _longest_synthetic_prompt(d.task, d.max_digits))
        if longest > max_len:
            raise ConfigError(f"engine.max_prompt_len={max_len}: data.task={d.task} with "
                              f"data.max_digits={d.max_digits} needs prompts of {longest} tokens; "
                              f"set engine.max_prompt_len>={longest}")
        ids = np.arange(d.num_records, dtype=np.int64)
        lookup = grain.MapDataset.range(d.num_records).map(_Synthetic(d))
        name = f"synthetic:{d.task}"
        where, digests = None, None  # the config fields alone define synthetic records
    else:
        records, bad, longest = load_prompt_file(cfg, tokenizer)
        ids = np.asarray([r["prompt_id"] for r in records], dtype=np.int64)
        where = [r.pop("_where") for r in records]
        digests = np.asarray([_content_digest(r) for r in records], dtype=np.uint32)
        lookup = records
        name = str(d.path)
    if len(ids) < process_count:
        raise DataError(f"{name}: {len(ids)} records cannot be split over {process_count} processes")
    order = _Order(len(ids), _shuffle_seed(d.seed) if d.shuffle else None, d.num_epochs)
    src = _Source(lookup, ids, order, tokenizer, max_len, longest, name, digests, where,
                  "line" if d.source == "jsonl" else "row")
    part = partition or Partition(process_count)
    if part.processes != process_count:
        raise ValueError(f"partition for {part.processes} processes, this job has {process_count}")
    return _assemble(src, part, process_index, bad)


def _assemble(src: _Source, part: Partition, q: int, bad: list[BadRecord]) -> PromptDataset:
    m = part.processes
    index = src.order.stream(part, q)
    return PromptDataset(
        dataset=index.map(_Finalize(src.tokenizer, src.lookup, src.max_len)), prompt_ids=np.sort(src.ids),
        shard_prompt_ids=src.ids[q::m], records_per_epoch=src.order.shard_len(q, m),
        num_epochs=src.order.num_epochs, max_prompt_len=src.longest, bad_records=bad, source=src.name,
        process_index=q, process_count=m, partition=part, _source=src, _index=index)


class PromptIterator(grain.DatasetIterator):
    """Grain's in-order iterator, with a state that refuses a different stream on restore.

    The state is grain's (`{"next_index": i}`, the count of records handed out) plus
    the stream signature; restoring it into an iterator over another shard, another
    process count or other records raises DataError instead of silently drawing
    other prompts. A plain grain state (no signature) is accepted.
    """

    def __init__(self, parent: grain.DatasetIterator, signature: dict[str, Any], length: int,
                 pd: "PromptDataset | None" = None):
        super().__init__(parent)
        self._signature = signature
        self._length = length
        self._pd = pd
        self._records = pd.record_digests() if pd is not None else None

    def __next__(self) -> dict:
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        state = {**self._parent.get_state(), "stream": self._signature}
        if self._records is not None:
            state["records"] = self._records
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("stream")
        now = self._signature
        if saved is not None and "records_sha256" not in saved:  # saved before content digests
            now = {k: v for k, v in now.items() if k != "records_sha256"}
        if saved is not None and saved != now:
            # the content digests cover each record's id too: ids that moved are a changed record
            same_shape = {**saved, "records_sha256": None, "ids_sha256": None} == \
                {**now, "records_sha256": None, "ids_sha256": None}
            if (saved.get("records_sha256") != now.get("records_sha256") and state.get("records")
                    and self._pd is not None and same_shape):
                raise DataError(f"{self._pd.source}: the prompt file changed since the checkpoint was written: "
                                f"{self._pd.first_changed(state['records'])}; resuming would train other prompts "
                                "than the saved ledger and iterator mean. Restore the file or use a new run.dir "
                                "(nothing was changed)")
            raise DataError(f"data iterator state is for another stream ({saved}), this one is "
                            f"{self._signature}: the data, its order or the process count changed")
        inner = {k: v for k, v in state.items() if k not in ("stream", "records")}
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
    return PromptIterator(inner, pd.stream_signature(), len(pd.dataset), pd)
