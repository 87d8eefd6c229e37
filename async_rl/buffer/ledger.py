"""The ledger: the single source of truth for every prompt drawn and not yet trained.

Owns: one `Group` per drawn record (prompt, stream ordinal, target step, and per sample
the tokens so far with behaviour logprobs and per-token policy versions, done flag,
reward, and under routing replay the experts each position was routed to), their states,
the lock that makes "draw from the iterator" and "enter the ledger" one step, and the
conversion to and from a snapshot of ragged arrays for the checkpoint. Does not own:
which groups train when (sampler), the engine (pump), the iterator itself (pump), or
writing files (checkpoint, lineage).

Invariant I1 lives here: a group leaves only through `commit` (trained, written to the
lineage log by the caller under the same lock) or `drop` (explicit, counted, logged).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import itertools
import json
import threading
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np


@contextlib.contextmanager
def _gc_paused():
    """Building or copying many small containers triggers the cyclic collector over and
    over (it scans the growing heap each time): 5-8x of the cost at 10k+ groups."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# the version of an observation token: an env's text in a multi-turn episode, prefilled by the
# engine, never trained and with no behaviour logprob (docs/envs-and-tools.md)
OBSERVATION = -1


class State(enum.IntEnum):
    PENDING = 0  # drawn, no sample started
    GENERATING = 1  # some sample started and not all finished
    READY = 2  # every sample finished and rewarded


@dataclass
class Sample:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    in_engine: bool = False  # occupies an engine slot right now (never saved)
    # multi-turn episodes (rollout.env): the env steps recorded, in order, each
    # {"key", "observation", "role", "at": its first token's index, "n": its tokens}
    turns: list[dict] = field(default_factory=list)
    env_state: dict = field(default_factory=dict)  # what the last recorded step returned
    env_reward: float | None = None  # a final reward the env gave (wins over rollout.reward)
    awaiting: bool = False  # an assistant turn ended and its env step is not recorded yet
    in_env: bool = False  # its env step runs now (never saved)
    # routing replay (learner.routing_replay): the experts the engine chose, uint8/16 segments
    # [n, n_layers, k] whose rows are positions 0, 1, ... of prompt + tokens (the position
    # that predicted token i is prompt length - 1 + i; at most prompt + tokens - 1 rows)
    routes: list = field(default_factory=list)

    def route_rows(self):
        """The recorded routes as one array [m, n_layers, k] (None: none recorded)."""
        if not self.routes:
            return None
        return self.routes[0] if len(self.routes) == 1 else np.concatenate(self.routes)

    @property
    def n_routes(self) -> int:
        return sum(len(r) for r in self.routes)

    def add_routes(self, prompt_len: int, head, routes) -> None:
        """Before new tokens are appended: the rows of the positions a start prefilled that the
        sample has none for yet (`head`: a new sample's prompt, an episode's observations; the
        saved tokens' own stay), then one row per new token (`routes`). A sample whose rows
        would not line up with its positions (routes recorded only in part) keeps none: the
        learner routes it itself."""
        if head is not None and len(head) > self.n_routes:
            self.routes.append(head[self.n_routes:])
        if self.n_routes != prompt_len - 1 + len(self.tokens):
            self.routes = []  # a new list: a checkpoint cut taken before keeps the old one
        else:
            self.routes.append(routes)

    @property
    def started(self) -> bool:
        return self.in_engine or bool(self.tokens)

    @property
    def episode(self) -> dict | None:
        """The episode's saved fields (None for a single-turn sample)."""
        if not (self.turns or self.env_state or self.awaiting or self.env_reward is not None):
            return None
        return {"turns": self.turns, "state": self.env_state, "reward": self.env_reward, "awaiting": self.awaiting}

    def set_episode(self, ep: dict | None) -> None:
        ep = ep or {}
        self.turns = [dict(t) for t in ep.get("turns", [])]
        self.env_state = dict(ep.get("state", {}))
        self.env_reward = ep.get("reward")
        self.awaiting = bool(ep.get("awaiting", False))


@dataclass
class Group:
    ordinal: int
    prompt_id: int
    epoch: int
    prompt: str
    answer: str
    prompt_tokens: np.ndarray
    samples: list[Sample]
    target_step: int | None = None
    regenerations: int = 0  # times sent back to PENDING (staleness)

    @property
    def state(self) -> State:
        if all(s.done and s.reward is not None for s in self.samples):
            return State.READY
        if any(s.started or s.done for s in self.samples):
            return State.GENERATING
        return State.PENDING

    @property
    def min_version(self) -> int:
        vs = [v for s in self.samples for v in s.versions if v != OBSERVATION]
        return min(vs) if vs else -1

    def reset(self) -> None:
        self.samples = [Sample() for _ in self.samples]
        self.regenerations += 1


class Ledger:
    """Thread-safe map ordinal -> Group, in draw order. All access goes through `lock`."""

    def __init__(self, samples_per_prompt: int):
        self.samples_per_prompt = samples_per_prompt
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # notified on every state change
        self.groups: dict[int, Group] = {}
        self.next_ordinal = 0  # ordinal the next drawn record gets
        self.base_step = 0  # learner steps before ordinal 0 was drawn (a re-partitioned ledger starts later)
        self.exhausted = False  # the iterator raised StopIteration (I7)
        self.trained_groups = 0
        self.trained_tokens = 0
        self.regenerated_groups = 0  # READY groups sent back to PENDING (staleness)
        self.regenerated_tokens = 0  # tokens those groups had generated, discarded
        self.dropped: dict[str, int] = {}  # reason -> groups consumed without training

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, record: dict, target_step: int | None) -> Group:
        """Enters a record just drawn from the iterator (call under `lock`, with the draw)."""
        with self.changed:
            return self._add(record, target_step)

    def _add(self, record: dict, target_step: int | None) -> Group:
        g = Group(ordinal=self.next_ordinal, prompt_id=int(record["prompt_id"]),
                  epoch=int(record["epoch"]), prompt=str(record["prompt"]), answer=str(record["answer"]),
                  prompt_tokens=np.asarray(record["prompt_tokens"], np.int32),
                  samples=[Sample() for _ in range(self.samples_per_prompt)], target_step=target_step)
        self.groups[g.ordinal] = g
        self.next_ordinal += 1
        self.changed.notify_all()
        return g

    def mark_exhausted(self) -> None:
        with self.changed:
            self.exhausted = True
            self.changed.notify_all()

    def counts(self) -> dict[str, int]:
        out = {s.name.lower(): 0 for s in State}
        with self.lock:  # the pump thread adds and removes groups
            for g in self.groups.values():
                out[g.state.name.lower()] += 1
        return out

    def commit(self, groups: Iterable[Group]) -> None:
        """Removes groups that a learner step consumed (call under `lock`, with the lineage write)."""
        with self.changed:
            for g in groups:
                del self.groups[g.ordinal]
                self.trained_groups += 1
                self.trained_tokens += sum(len(s.tokens) for s in g.samples)
            self.changed.notify_all()

    def regenerate(self, group: Group) -> None:
        """Sends a READY group back to PENDING: its rollouts are discarded, the prompt stays."""
        with self.changed:
            self.regenerated_groups += 1
            self.regenerated_tokens += sum(len(s.tokens) for s in group.samples)
            group.reset()
            self.changed.notify_all()

    def drop(self, groups: Iterable[Group], reason: str) -> None:
        """Removes groups without training them: only for drops the config asked for (I4);
        the caller logs them (lineage, drops) under the same lock."""
        with self.changed:
            for g in groups:
                del self.groups[g.ordinal]
                self.dropped[reason] = self.dropped.get(reason, 0) + 1
            self.changed.notify_all()

    # ---- snapshot (checkpoint) -------------------------------------------------------

    def capture(self) -> "Capture":
        """The cut: which groups exist and how far each sample got. Cheap (no token copies),
        so it is what runs under the lock, next to the iterator's get_state (I2); `build`
        turns it into arrays afterwards. Samples only grow by appending and a group is
        reset or removed only by the thread that saves, so the recorded prefixes stay put."""
        with self.lock, _gc_paused():
            groups = list(self.groups.values())
            samples = [[(s, len(s.tokens), s.done, s.reward, _episode_json(s), len(s.routes), s.routes) for s in g.samples]
                       for g in groups]
            ints = [(g.ordinal, g.prompt_id, g.epoch, -1 if g.target_step is None else g.target_step,
                     g.regenerations) for g in groups]
            counters = {"samples_per_prompt": self.samples_per_prompt, "next_ordinal": self.next_ordinal,
                        "base_step": self.base_step, "exhausted": self.exhausted, "trained_groups": self.trained_groups,
                        "trained_tokens": self.trained_tokens, "regenerated_groups": self.regenerated_groups,
                        "regenerated_tokens": self.regenerated_tokens, "dropped": dict(self.dropped)}
            return Capture(groups, samples, ints, counters)

    def snapshot(self) -> "LedgerSnapshot":
        return self.capture().build()

    @classmethod
    def from_snapshot(cls, snap: "LedgerSnapshot") -> "Ledger":
        with _gc_paused():
            return cls._from_snapshot(snap)

    @classmethod
    def _from_snapshot(cls, snap: "LedgerSnapshot") -> "Ledger":
        h, a = snap.header, snap.arrays
        S = int(h["samples_per_prompt"])
        led = cls(S)
        led.next_ordinal = int(h["next_ordinal"])
        led.base_step = int(h.get("base_step", 0))
        led.exhausted = bool(h["exhausted"])
        led.trained_groups = int(h["trained_groups"])
        led.trained_tokens = int(h.get("trained_tokens", 0))
        led.regenerated_groups = int(h.get("regenerated_groups", 0))
        led.regenerated_tokens = int(h.get("regenerated_tokens", 0))
        led.dropped = dict(h["dropped"])
        p_off = np.concatenate([[0], np.cumsum(a["prompt_lens"])])
        s_off = np.concatenate([[0], np.cumsum(a["sample_lens"])]).tolist()
        # one conversion per array, then list slices: per-sample .tolist() dominates otherwise
        tokens, logprobs, versions = a["tokens"].tolist(), a["logprobs"].tolist(), a["versions"].tolist()
        done, reward = a["done"].tolist(), a["reward"].tolist()
        texts = _unpack_texts(a["text_bytes"], a["text_lens"])
        episodes = _unpack_texts(a["episode_bytes"], a["episode_lens"]) if "episode_lens" in a else None
        r_off = np.concatenate([[0], np.cumsum(a["route_lens"])]).tolist() if "route_lens" in a else None
        for i, (ordinal, pid, epoch, step, regen) in enumerate(a["group_ints"].tolist()):
            samples = []
            for j in range(i * S, (i + 1) * S):
                lo, hi = s_off[j], s_off[j + 1]
                smp = Sample(tokens=tokens[lo:hi], logprobs=logprobs[lo:hi], versions=versions[lo:hi],
                             done=done[j], reward=None if reward[j] != reward[j] else reward[j])
                if episodes is not None and episodes[j]:
                    smp.set_episode(json.loads(episodes[j]))
                if r_off is not None and r_off[j + 1] > r_off[j]:  # a copy: the loaded file's buffer can go
                    smp.routes.append(a["routes"][r_off[j]:r_off[j + 1]].copy())
                samples.append(smp)
            led.groups[ordinal] = Group(
                ordinal=ordinal, prompt_id=pid, epoch=epoch, prompt=texts[2 * i], answer=texts[2 * i + 1],
                prompt_tokens=a["prompt_tokens"][p_off[i]:p_off[i + 1]].copy(), samples=samples,
                target_step=None if step < 0 else step, regenerations=regen)
        return led


@dataclass
class Capture:
    groups: list[Group]
    # per group, per sample: (Sample, tokens at the cut, done, reward, episode JSON, route segments at the
    # cut, the route list they are in)
    samples: list[list[tuple]]
    ints: list[tuple]  # per group: ordinal, prompt_id, epoch, target_step (-1 = none), regenerations
    counters: dict

    def build(self) -> "LedgerSnapshot":
        """Ragged arrays (tokens, logprobs, versions, per-group ints, texts) + a small header."""
        with _gc_paused():
            return self._build()

    def _build(self) -> "LedgerSnapshot":
        flat = [x for per in self.samples for x in per]
        n = sum(x[1] for x in flat)

        def cat(attr, dt):
            it = itertools.chain.from_iterable(getattr(smp, attr)[:k] for smp, k, *_ in flat)
            return np.fromiter(it, dt, count=n)

        groups = self.groups
        prompts = [g.prompt_tokens for g in groups]
        text_bytes, text_lens = _pack_texts([t for g in groups for t in (g.prompt, g.answer)])
        arrays = {
            "prompt_tokens": np.concatenate(prompts).astype(np.int32, copy=False) if prompts else np.zeros(0, np.int32),
            "prompt_lens": np.array([len(p) for p in prompts], np.int64),
            "tokens": cat("tokens", np.int32),
            "logprobs": cat("logprobs", np.float32),
            "versions": cat("versions", np.int32),
            "sample_lens": np.array([x[1] for x in flat], np.int64),
            "done": np.array([x[2] for x in flat], np.bool_),
            "reward": np.array([np.nan if x[3] is None else x[3] for x in flat], np.float64),
            "group_ints": np.array(self.ints, np.int64).reshape(-1, 5),
            "text_bytes": text_bytes,
            "text_lens": text_lens,
        }
        if any(x[4] for x in flat):  # multi-turn episodes: one JSON text per sample ("" = none)
            arrays["episode_bytes"], arrays["episode_lens"] = _pack_texts([x[4] for x in flat])
        if any(x[5] for x in flat):  # routing replay: the rows of each sample's positions at the cut
            routes, lens = self._routes()
            if routes is not None:
                arrays["routes"], arrays["route_lens"] = routes, lens
        return LedgerSnapshot(header=dict(self.counters), arrays=arrays)

    def _routes(self) -> tuple[np.ndarray | None, np.ndarray]:
        """Every sample's route rows at the cut, concatenated (None: no rows), and rows per sample.
        Only segments recorded by the cut, and of those at most prompt - 1 + tokens rows: a
        segment may have been recorded with tokens the cut does not have."""
        parts, lens = [], []
        for g, per in zip(self.groups, self.samples):
            for smp, k, *_, segs, held in per:
                cap = left = max(0, len(g.prompt_tokens) - 1 + k)
                for r in held[:segs]:  # the list the cut saw (`Sample.add_routes` may replace it since)
                    if left <= 0:
                        break
                    parts.append(r[:left])
                    left -= len(parts[-1])
                lens.append(cap - left)
        lens = np.array(lens, np.int64)
        if not lens.sum():
            return None, lens
        return np.concatenate([p for p in parts if len(p)]), lens


def _episode_json(s: Sample) -> str:
    ep = s.episode
    # turns only grow and the state is replaced, never changed in place: what is read now is the cut
    return "" if ep is None else json.dumps(ep, sort_keys=True, separators=(",", ":"))


def _pack_texts(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    enc = [t.encode("utf-8") for t in texts]
    return np.frombuffer(b"".join(enc), np.uint8).copy(), np.array([len(e) for e in enc], np.int64)


def _unpack_texts(data: np.ndarray, lens: np.ndarray) -> list[str]:
    raw, out, pos = data.tobytes(), [], 0
    for n in lens.tolist():
        out.append(raw[pos:pos + n].decode("utf-8"))
        pos += n
    return out


_ARRAYS = ("prompt_tokens", "prompt_lens", "tokens", "logprobs", "versions", "sample_lens", "done", "reward",
           "group_ints", "text_bytes", "text_lens")


def _lengths(name: str, lens: np.ndarray, count: int, data: np.ndarray, minimum: int = 0) -> None:
    if len(lens) != count or (count and lens.min() < minimum) or int(lens.sum()) != len(data):
        raise ValueError(f"{name}: {len(lens)} entries (expected {count}) summing to {int(lens.sum())}, "
                         f"data has {len(data)}")


def _check_routes(a: dict, count: int, S: int) -> None:
    """Routing replay's arrays: one row count per sample, each within its prompt + tokens - 1."""
    if "routes" not in a or "route_lens" not in a:
        raise ValueError("routes and route_lens must be saved together")
    r, lens = a["routes"], a["route_lens"]
    if r.ndim != 3 or lens.ndim != 1 or not (np.issubdtype(r.dtype, np.integer) and
                                            np.issubdtype(lens.dtype, np.integer)):
        raise ValueError(f"routes {r.shape} {r.dtype} (expected [rows, layers, k] of integers), "
                         f"route_lens {lens.dtype}")
    _lengths("route_lens", lens, count, r)
    most = np.repeat(a["prompt_lens"], S) + a["sample_lens"] - 1
    if count and (lens > most).any():
        j = int(np.argmax(lens > most))
        raise ValueError(f"sample {j} has {int(lens[j])} route rows, more than its {int(most[j])} positions")
    if len(r) and np.issubdtype(r.dtype, np.signedinteger) and r.min() < 0:
        raise ValueError("negative expert ids in routes")


@dataclass
class LedgerSnapshot:
    header: dict
    arrays: dict[str, np.ndarray]

    def summary(self) -> dict[str, int]:
        """Counts used by the resume line: groups per state and tokens kept."""
        S = self.header["samples_per_prompt"]
        done = self.arrays["done"].reshape(-1, S) if S else self.arrays["done"]
        lens = self.arrays["sample_lens"].reshape(-1, S)
        rewarded = ~np.isnan(self.arrays["reward"].reshape(-1, S))
        ready = (done & rewarded).all(axis=1)
        started = (lens > 0).any(axis=1) | done.any(axis=1)
        unfinished_tokens = int(lens[~done].sum()) if lens.size else 0
        return {"ready": int(ready.sum()), "generating": int((~ready & started).sum()),
                "pending": int((~ready & ~started).sum()), "kept_tokens": unfinished_tokens}

    def to_json(self) -> str:
        return json.dumps(self.header)

    def validate(self, max_version: int | None = None) -> None:
        """Raises ValueError unless header and arrays describe a consistent ledger (lengths
        that add up, ordinals unique and drawn, versions no newer than the saved weights)."""
        h, a = self.header, self.arrays
        for k in ("samples_per_prompt", "next_ordinal", "exhausted", "trained_groups", "dropped"):
            if k not in h:
                raise ValueError(f"header lacks {k!r}")
        missing = sorted(set(_ARRAYS) - a.keys())
        if missing:
            raise ValueError(f"arrays missing: {', '.join(missing)}")
        S, nxt = int(h["samples_per_prompt"]), int(h["next_ordinal"])
        gi = a["group_ints"]
        if S < 1 or nxt < 0 or gi.ndim != 2 or gi.shape[1] != 5 or int(h.get("base_step", 0)) < 0:
            raise ValueError(f"samples_per_prompt={S}, next_ordinal={nxt}, base_step={h.get('base_step', 0)}, "
                             f"group_ints {gi.shape}")
        G = len(gi)
        _lengths("prompt_lens", a["prompt_lens"], G, a["prompt_tokens"], minimum=1)
        _lengths("sample_lens", a["sample_lens"], G * S, a["tokens"])
        _lengths("text_lens", a["text_lens"], 2 * G, a["text_bytes"])
        if "episode_lens" in a:
            _lengths("episode_lens", a["episode_lens"], G * S, a["episode_bytes"])
        if "routes" in a or "route_lens" in a:
            _check_routes(a, G * S, S)
        n = len(a["tokens"])
        if len(a["logprobs"]) != n or len(a["versions"]) != n:
            raise ValueError(f"tokens {n}, logprobs {len(a['logprobs'])}, versions {len(a['versions'])}")
        if len(a["done"]) != G * S or len(a["reward"]) != G * S:
            raise ValueError(f"done/reward lengths {len(a['done'])}/{len(a['reward'])}, expected {G * S}")
        ordinal, pid, epoch, target, regen = gi.T if G else (np.zeros(0, np.int64),) * 5
        if len(np.unique(ordinal)) != G or (G and (ordinal.min() < 0 or ordinal.max() >= nxt)):
            raise ValueError(f"group ordinals not unique or outside [0, next_ordinal={nxt})")
        if G and (pid.min() < 0 or epoch.min() < 0 or target.min() < -1 or regen.min() < 0):
            raise ValueError("negative prompt_id, epoch, target step or regeneration count")
        v = a["versions"]
        if n and (v.min() < OBSERVATION or (max_version is not None and v.max() > max_version)):
            raise ValueError(f"token versions in [{v.min()}, {v.max()}], outside [{OBSERVATION}, {max_version}]")
        if n and (a["tokens"].min() < 0 or not np.all(np.isfinite(a["logprobs"]))):
            raise ValueError("negative token ids or non-finite logprobs")
        r = a["reward"]
        if np.any(np.isinf(r)) or np.any(~a["done"] & ~np.isnan(r)):
            raise ValueError("infinite rewards, or a reward on an unfinished sample")

    def build(self) -> "LedgerSnapshot":
        return self
