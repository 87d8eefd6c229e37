"""The rollout journal's files: record framing, encoding and reading back.

Owns: the byte layout of a journal record (`magic | payload bytes | crc32 | payload`; a
header record opening each segment, then one record per finished sample, and for multi-turn
episodes one per recorded env step too; a sample with routing replay's routes ends its
payload with them, a sample without has the layout it always had), encoding a sample,
splitting a segment into records with valid checksums (corrupt ranges and a torn tail
reported, not guessed at), decoding them into `Entry`s, and the sampling signature a
segment is written under. Does not own: when records are written, which are used, or which
files are deleted (journal).
"""

from __future__ import annotations

import functools
import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from async_rl.buffer.ledger import OBSERVATION, Group, Sample
from async_rl.store import applog

MAGIC = b"\xa5JR1"
_FRAME = struct.Struct("<4sII")  # magic, payload bytes, crc32 of the payload
_SAMPLE = struct.Struct("<BqqqiiIId")  # kind, epoch, prompt_id, ordinal, sample, regenerations, prompt crc, n, reward
_EPISODE = struct.Struct("<?I")  # after a sample's fields: done, bytes of the episode's JSON
_ROUTES = struct.Struct("<IHHB")  # an optional last block: rows, layers, k, bytes per expert id; then the ids
_ROUTE_DTYPES = {1: np.dtype("u1"), 2: np.dtype("<u2")}
KIND_HEADER, KIND_SAMPLE, KIND_EPISODE = 0, 1, 2
FORMAT = 1


def prompt_crc(tokens: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(tokens, "<i4"))


@functools.lru_cache(maxsize=4096)
def _sample_struct(n: int) -> struct.Struct:
    """The payload of a sample of n tokens, packed in one call (several times faster than
    building its arrays one by one: this runs on the pump thread for every sample)."""
    return struct.Struct(f"{_SAMPLE.format}{n}i{n}f{n}i")


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def _routes_block(g: Group, s: Sample) -> bytes:
    """The sample's route rows as raw bytes after a small header (b"" without routes: the
    record keeps its old layout). Rows past prompt + tokens - 1 belong to no position yet."""
    if not s.routes:
        return b""
    r = s.route_rows()[:len(g.prompt_tokens) + len(s.tokens) - 1]
    if not len(r):
        return b""
    r = np.ascontiguousarray(r, _ROUTE_DTYPES[r.dtype.itemsize])
    return _ROUTES.pack(len(r), r.shape[1], r.shape[2], r.dtype.itemsize) + r.tobytes()


def _decode_routes(p: bytes, o: int) -> np.ndarray | None | bool:
    """The routes block at offset o, the payload's last (None: none there; False: malformed)."""
    if len(p) == o:
        return None
    if len(p) < o + _ROUTES.size:
        return False
    m, L, k, size = _ROUTES.unpack_from(p, o)
    dt = _ROUTE_DTYPES.get(size)
    if dt is None or not (m and L and k) or len(p) != o + _ROUTES.size + m * L * k * size:
        return False
    return np.frombuffer(p, dt, m * L * k, o + _ROUTES.size).reshape(m, L, k)


def encode_sample(g: Group, si: int, s: Sample, reward: float, crc: int) -> bytes:
    n = len(s.tokens)
    return _frame(_sample_struct(n).pack(KIND_SAMPLE, g.epoch, g.prompt_id, g.ordinal, si, g.regenerations, crc,
                                         n, reward, *s.tokens, *s.logprobs, *s.versions) + _routes_block(g, s))


def encode_episode(g: Group, si: int, s: Sample, reward: float | None, crc: int) -> bytes:
    """A multi-turn episode's sample: finished (with its reward), or its progress after an env
    step (reward None), with the episode's turns and env state."""
    n, ep = len(s.tokens), json.dumps(s.episode or {}, sort_keys=True, separators=(",", ":")).encode()
    done = reward is not None
    head = _sample_struct(n).pack(KIND_EPISODE, g.epoch, g.prompt_id, g.ordinal, si, g.regenerations, crc, n,
                                  reward if done else float("nan"), *s.tokens, *s.logprobs, *s.versions)
    return _frame(head + _EPISODE.pack(done, len(ep)) + ep + _routes_block(g, s))


def encode_header(doc: dict) -> bytes:
    return _frame(bytes([KIND_HEADER]) + json.dumps(doc, sort_keys=True).encode())


@dataclass
class Entry:
    """One journaled sample, as read back."""
    epoch: int
    prompt_id: int
    ordinal: int
    sample: int
    regenerations: int
    prompt_crc: int
    reward: float
    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    versions: np.ndarray  # int32 [n]
    layout: tuple  # (data partition generation, process index, process count) of the writer
    where: str  # file:offset, for messages
    done: bool = True  # False: a multi-turn episode's progress after an env step
    episode: dict | None = None  # the episode's turns and env state (multi-turn samples)
    routes: np.ndarray | None = None  # [rows, layers, k] uint8/uint16 (routing replay), rows of prompt + tokens

    @property
    def vmin(self) -> int:
        v = self.versions[self.versions != OBSERVATION]
        return int(v.min()) if v.size else -1

    @property
    def vmax(self) -> int:
        return int(self.versions.max())

    @property
    def turns(self) -> int:
        return len(self.episode["turns"]) if self.episode else 0


def _decode_sample(p: bytes, layout: tuple, where: str) -> Entry | None:
    if len(p) < _SAMPLE.size:
        return None
    kind, epoch, pid, ordinal, si, regen, crc, n, reward = _SAMPLE.unpack_from(p)
    end = _SAMPLE.size + 12 * n
    if n == 0 or len(p) < end:
        return None
    o = _SAMPLE.size
    t, lp, v = (np.frombuffer(p, dt, n, o + 4 * n * i) for i, dt in enumerate(("<i4", "<f4", "<i4")))
    if kind == KIND_SAMPLE:
        routes = _decode_routes(p, end)
        return None if routes is False else Entry(epoch, pid, ordinal, si, regen, crc, reward, t, lp, v, layout,
                                                  where, routes=routes)
    if len(p) < end + _EPISODE.size:
        return None
    done, k = _EPISODE.unpack_from(p, end)
    o = end + _EPISODE.size + k
    routes = _decode_routes(p, o) if len(p) >= o else False
    if routes is False:
        return None
    try:
        ep = json.loads(p[end + _EPISODE.size:o])
    except ValueError:
        return None
    if not isinstance(ep, dict) or not isinstance(ep.get("turns", []), list):
        return None
    return Entry(epoch, pid, ordinal, si, regen, crc, reward, t, lp, v, layout, where, bool(done), ep, routes)


def scan(data: bytes) -> tuple[list[tuple[int, bytes]], list[tuple[int, int]], tuple[int, int] | None]:
    """Splits a segment into (offset, payload) records with valid checksums. Returns them,
    the corrupt byte ranges that valid records follow, and the torn tail (offset, bytes) after
    the last valid record, if any."""
    out, bad, pos, n, start = [], [], 0, len(data), None
    while pos < n:
        ok = n - pos >= _FRAME.size and data.startswith(MAGIC, pos)
        if ok:
            _, size, crc = _FRAME.unpack_from(data, pos)
            end = pos + _FRAME.size + size
            payload = data[pos + _FRAME.size:end]
            ok = end <= n and zlib.crc32(payload) == crc
        if not ok:
            start = pos if start is None else start
            nxt = data.find(MAGIC, pos + 1)
            pos = n if nxt < 0 else nxt
            continue
        if start is not None:
            bad.append((start, pos - start))
            start = None
        out.append((pos, payload))
        pos = end
    return out, bad, (None if start is None else (start, n - start))


@dataclass
class Segment:
    """A segment file read back: its header and the samples it holds."""
    path: Path
    header: dict | None
    entries: list[Entry]
    corrupt: list[tuple[int, int]]
    torn: tuple[int, int] | None

    @property
    def max_vmin(self) -> int:
        return max((e.vmin for e in self.entries), default=-1)


def read_segment(path) -> Segment:
    data = applog.read(path)  # a file, or the concatenated segments of one on an object store
    recs, bad, torn = scan(data)
    header = None
    if recs and recs[0][1][:1] == bytes([KIND_HEADER]):
        try:
            header = json.loads(recs[0][1][1:])
        except ValueError:
            header = None
    layout = layout_of(header)
    entries = []
    for off, p in recs:
        if p[:1] in (bytes([KIND_SAMPLE]), bytes([KIND_EPISODE])):
            e = _decode_sample(p, layout, f"{path.name}:{off}")
            if e is None:
                bad.append((off, _FRAME.size + len(p)))
            else:
                entries.append(e)
    return Segment(path, header, entries, bad, torn)


def layout_of(header: dict | None) -> tuple:
    """(generation, process index, process count) a segment was written under: ordinals mean the
    same only within one (an elastic resume re-deals groups and numbers them again)."""
    if header is None:
        return (None, None, None)
    return (header.get("generation", 0), header.get("process"), header.get("processes"))


def signature(cfg, reward: str, stop_ids) -> dict:
    """The settings a journaled sample was generated under; a segment written under others is not used."""
    e, r = cfg.engine, cfg.rollout
    return {"seed": cfg.run.seed, "engine.temperature": e.temperature, "engine.top_k": e.top_k,
            "engine.top_p": e.top_p, "rollout.max_new_tokens": r.max_new_tokens,
            "rollout.samples_per_prompt": r.samples_per_prompt, "rollout.reward": reward,
            "stop_ids": sorted(int(s) for s in stop_ids)} | _episode_signature(r) | _routes_signature(cfg)


def _episode_signature(r) -> dict:
    """Multi-turn settings, named only when an env is set (single-turn segments keep their signature)."""
    if not r.env:
        return {}
    return {"rollout.env": r.env, "rollout.env_max_turns": r.env_max_turns,
            "rollout.turn_max_tokens": r.turn_max_tokens}


def _routes_signature(cfg) -> dict:
    """Named only under routing replay: its samples carry routes, and a session's samples
    without them could not be replayed (segments without it keep their signature)."""
    return {"learner.routing_replay": True} if cfg.learner.routing_replay else {}
