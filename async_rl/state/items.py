"""The items of a checkpoint step and their digests: the ledger item (a small Orbax handler
writing each process's ragged arrays into one file with a JSON header), the iterator-state item,
the per-leaf digests of the train state, the structure of a saved state, and `Damaged`, raised when
an item is unreadable or fails its digest. `checkpoint` composes them into one atomic step.

See docs/design.md, "The checkpoint".
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future

from async_rl import faults
from async_rl.buffer.ledger import Capture, LedgerSnapshot
from async_rl.state.layout import process_prefix
from async_rl.store import remote_io, storage


class Damaged(Exception):
    """One item of a step is unreadable or fails its digest."""

    def __init__(self, item: str, path: Path | str, why: str):
        super().__init__(f"{item}: {why} ({path})")
        self.item, self.path, self.why = item, str(path), why


def unreadable(item: str, path, e: BaseException) -> Damaged:
    """A failed read of a step's item: Damaged, unless the store did not answer (StorageError:
    a step is never set aside because its store was down)."""
    why = remote_io.cause(e)
    if why:
        raise remote_io.StorageError(path, why, "read") from None
    return Damaged(item, path, f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")


def array_digest(arr: np.ndarray) -> str:
    """blake2b-128 of an array's bytes: a flipped bit, a changed word and two swapped words all
    change it."""
    return hashlib.blake2b(np.ascontiguousarray(arr).reshape(-1).view(np.uint8), digest_size=16).hexdigest()


def _legacy_sum64(b: np.ndarray) -> int:
    """The checksum ledger headers carried before `array_digest` (the wrapping sum of the
    64-bit words, which does not see swapped words): still checked where a step has it."""
    n = len(b) // 8 * 8
    total = int(b[:n].view(np.uint64).sum(dtype=np.uint64)) if n else 0
    if len(b) > n:
        total += int(np.frombuffer(b[n:].tobytes() + bytes(8 - (len(b) - n)), np.uint64)[0])
    return total % 2**64


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def json_digest(doc: dict) -> str:
    return sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def process_prefix_here(index: int | None = None, count: int | None = None) -> str:
    return process_prefix(jax.process_index() if index is None else index,
                          jax.process_count() if count is None else count)


# ---- state digests -------------------------------------------------------------------------


def _leaf_digest(x):
    """A uint32 sum of a bijective mix of (bits, flat index) per element: any change to one
    element changes it. Elementwise then one reduction, so a sharded leaf is never gathered
    and the value does not depend on the sharding."""
    if x.dtype == jnp.bool_:
        u = x.astype(jnp.uint32)
    else:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        u = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    idx, stride = jnp.zeros(u.shape, jnp.uint32), 1
    for d in reversed(range(u.ndim)):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, u.shape, d) * jnp.uint32(stride % 2**32)
        stride *= u.shape[d]
    h = u ^ (idx * jnp.uint32(0x9E3779B9))
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    return jnp.sum(h, dtype=jnp.uint32)


def _finite(x):
    return jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.bool_(True)


@jax.jit
def _digest_leaves(leaves):
    return [_leaf_digest(x) for x in leaves], jnp.all(jnp.stack([_finite(x) for x in leaves] or [jnp.bool_(True)]))


def _host(x) -> np.ndarray:
    """A replicated (possibly multi-process) scalar's value on this host."""
    return np.asarray(x.addressable_shards[0].data if hasattr(x, "addressable_shards") else x)


def path_str(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def state_digests(state) -> tuple[dict[str, int], bool]:
    """({leaf path: digest}, every floating leaf finite) of a (sharded) train state."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    digests, finite = _digest_leaves([leaf for _, leaf in flat])
    return ({path_str(p): int(_host(d)) for (p, _), d in zip(flat, digests)}, bool(_host(finite)))


class _DamagedReads(logging.Filter):
    """Orbax reads a state's arrays' metadata in concurrent tasks; on a damaged step the first
    failure is raised (and reported as Damaged), the others are logged by asyncio whenever their
    tasks are collected ("Task exception was never retrieved"). Only those records are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("Task exception was never retrieved" in msg and "DATA_LOSS" in msg)


def quiet_damaged_reads() -> None:
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, _DamagedReads) for f in log.filters):
        log.addFilter(_DamagedReads())


def saved_arrays(state_dir: Path) -> dict[str, tuple[tuple, str]]:
    """{leaf path: (shape, dtype)} of a saved state item, from Orbax's metadata (no array read)."""
    handler = ocp.StandardCheckpointHandler()
    try:
        md = handler.metadata(epath.Path(state_dir))
    finally:
        handler.close()
    tree = getattr(md, "tree", md)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {path_str(p): (tuple(m.shape), str(np.dtype(m.dtype))) for p, m in flat}


def target_arrays(abstract) -> dict[str, tuple[tuple, str]]:
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    return {path_str(p): (tuple(a.shape), str(np.dtype(a.dtype))) for p, a in flat}


def structure_diff(saved: dict, target: dict, limit: int = 6) -> list[str]:
    out = []
    for k in sorted(saved.keys() | target.keys()):
        if k not in target:
            out.append(f"{k}: in the checkpoint, not in this config's state")
        elif k not in saved:
            out.append(f"{k}: in this config's state, not in the checkpoint")
        elif saved[k] != target[k]:
            out.append(f"{k}: saved {saved[k][0]} {saved[k][1]}, now {target[k][0]} {target[k][1]}")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


# ---- the ledger item ---------------------------------------------------------------------


class LedgerHandler(ocp.AsyncCheckpointHandler):
    """Writes each process's ledger shard as `<prefix>.bin` (every ragged array back to back)
    and `<prefix>.json` (the header, where each array lies in the .bin with a blake2b digest of its
    bytes, the sha256 of the process's iterator state, and a digest of the header itself).

    One file of raw bytes costs what one np.save of them costs. Asynchronous: the arrays are
    built from the cut and written from Orbax's background commit, so a save holds the learner
    only for the cut."""

    def _write(self, directory: epath.Path, args: "LedgerSave") -> None:
        remote = storage.is_remote(directory)
        directory = storage.run_path(str(directory)) if remote else Path(directory)
        storage.mkdirs(directory)
        pre, snap = process_prefix_here(), args.cut.build()
        index, offset = {}, 0
        # an object is written whole (one PUT of the buffer); a local file as it goes
        with (io.BytesIO() if remote else open(directory / f"{pre}.bin", "wb")) as f:
            for i, (name, arr) in enumerate(snap.arrays.items()):
                arr = np.ascontiguousarray(arr)
                index[name] = {"dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset,
                               "blake2b": array_digest(arr)}
                f.write(arr.tobytes()) if remote else arr.tofile(f)
                offset += arr.nbytes
                if i == 1:
                    f.flush()
                    faults.point("ckpt_write", args.step)
                    faults.raise_enospc("ledger", args.step)
            if remote:
                storage.write_atomic(directory / f"{pre}.bin", f.getvalue())
        header = dict(snap.header, arrays=index, bytes=offset,
                      iterator_sha256=args.iterator_sha256)
        header["header_sha256"] = json_digest(header)
        storage.write_atomic(directory / f"{pre}.json", json.dumps(header)) if remote else \
            (directory / f"{pre}.json").write_text(json.dumps(header))

    async def async_save(self, directory: epath.Path, args: "LedgerSave"):
        async def write():
            await asyncio.to_thread(self._write, directory, args)
        return [future.CommitFutureAwaitingContractedSignals(write(), name="ledger_save")]

    def save(self, directory: epath.Path, args: "LedgerSave") -> None:
        self._write(directory, args)

    def restore(self, directory: epath.Path, args: "LedgerRestore" = None) -> LedgerSnapshot:
        return read_ledger(storage.run_path(str(directory)), process_prefix_here())

    def metadata(self, directory: epath.Path) -> Any:
        return None

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


def read_signed_json(item: str, path: Path, digest_key: str) -> dict:
    """A JSON object that carries the digest of the rest of itself under `digest_key`."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise unreadable(item, path, e) from None
    if not isinstance(doc, dict):
        raise Damaged(item, path, "not a JSON object")
    want = doc.pop(digest_key, None)
    if want is not None and json_digest(doc) != want:
        raise Damaged(item, path, "digest mismatch (the file was changed after it was written)")
    return doc


def read_ledger(directory: Path, prefix: str) -> LedgerSnapshot:
    """One process's ledger shard, checked against its digests; raises Damaged."""
    jpath, bpath = directory / f"{prefix}.json", directory / f"{prefix}.bin"
    header = read_signed_json("ledger", jpath, "header_sha256")
    try:
        index, size = header.pop("arrays"), header.pop("bytes")
        raw = bpath.read_bytes()
    except (KeyError, OSError) as e:
        raise unreadable("ledger", bpath, e) from None
    if len(raw) != size:
        raise Damaged("ledger", bpath, f"{len(raw)} bytes, the header says {size} (truncated?)")
    arrays = {}
    try:
        for name, a in index.items():
            dt, shape = np.dtype(a["dtype"]), tuple(a["shape"])
            arrays[name] = np.frombuffer(raw, dt, count=int(np.prod(shape)), offset=a["offset"]).reshape(shape)
            if ("blake2b" in a and array_digest(arrays[name]) != a["blake2b"]) or \
                    ("sum64" in a and _legacy_sum64(arrays[name].reshape(-1).view(np.uint8)) != a["sum64"]):
                raise Damaged("ledger", bpath, f"checksum mismatch in array {name!r} (the file was changed "
                                               "after it was written)")
        snap = LedgerSnapshot(header=header, arrays=arrays)
        snap.validate()
    except (KeyError, TypeError, ValueError) as e:
        raise Damaged("ledger", bpath, f"invalid ({e})") from None
    return snap


@ocp.args.register_with_handler(LedgerHandler, for_save=True)
@dataclasses.dataclass
class LedgerSave(ocp.args.CheckpointArgs):
    cut: Capture  # the ledger at the cut (a LedgerSnapshot works too: it has build())
    step: int = -1
    iterator_sha256: str | None = None  # of this process's iterator state at the same cut


@ocp.args.register_with_handler(LedgerHandler, for_restore=True)
@dataclasses.dataclass
class LedgerRestore(ocp.args.CheckpointArgs):
    pass


class IteratorState:
    """The iterator state captured at the cut; Grain's handler saves/restores it as JSON."""

    def __init__(self, state: dict | None = None):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()

    def set_state(self, raw: bytes) -> None:
        self.state = json.loads(raw)

    def start_prefetch(self) -> None:  # called by Grain's handler after restore
        pass
