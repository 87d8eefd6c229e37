"""Reads what W&B wrote offline (its transaction log, run-<id>.wandb), for the tests to check
the rows a run handed it. LevelDB log framing: a 7-byte file header, then 32 KiB blocks of
chunks, each with a 7-byte header (CRC-32 of type + payload, length, type); a record split
over blocks as FIRST, MIDDLE..., LAST. The package itself never reads these files."""
from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK, _HDR = 32768, 7
_FILE_HEADER = (b":W&B", 0xBEE1, 0)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def transaction_records(path: Path) -> Iterator[Any]:
    """The complete records of a transaction log, in order; stops at a chunk cut short or
    failing its checksum (the tail a killed writer left)."""
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
