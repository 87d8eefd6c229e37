"""The ledger: the single source of truth for every prompt drawn and not yet trained.

Owns: one `Group` per drawn record (prompt, stream ordinal, target step, and per sample
the tokens so far with behaviour logprobs and per-token policy versions, done flag,
reward), their states, the lock that makes "draw from the iterator" and "enter the
ledger" one step, and the conversion to and from a snapshot of ragged arrays for the
checkpoint. Does not own: which groups train when (sampler), the engine (pump), the
iterator itself (pump), or writing files (checkpoint, lineage).

Invariant I1 lives here: a group leaves only through `commit` (trained, written to the
lineage log by the caller under the same lock) or `drop` (explicit, counted, logged).
"""

from __future__ import annotations

import enum
import json
import threading
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np


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

    @property
    def started(self) -> bool:
        return self.in_engine or bool(self.tokens)


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
        vs = [min(s.versions) for s in self.samples if s.versions]
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

    def by_state(self, state: State) -> list[Group]:
        return [g for g in self.groups.values() if g.state == state]

    def counts(self) -> dict[str, int]:
        out = {s.name.lower(): 0 for s in State}
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

    def snapshot(self) -> "LedgerSnapshot":
        """Ragged arrays + JSON header of every group (I2: take the iterator state in the same
        `with ledger.lock:` block)."""
        with self.lock:
            return self._snapshot()

    def _snapshot(self) -> "LedgerSnapshot":
        groups = list(self.groups.values())
        S = self.samples_per_prompt
        prompt_lens = np.array([len(g.prompt_tokens) for g in groups], np.int64)
        sample_lens = np.array([len(s.tokens) for g in groups for s in g.samples], np.int64)
        cat = lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt)
        arrays = {
            "prompt_tokens": cat([g.prompt_tokens for g in groups], np.int32),
            "prompt_lens": prompt_lens,
            "tokens": cat([np.asarray(s.tokens, np.int32) for g in groups for s in g.samples], np.int32),
            "logprobs": cat([np.asarray(s.logprobs, np.float32) for g in groups for s in g.samples], np.float32),
            "versions": cat([np.asarray(s.versions, np.int32) for g in groups for s in g.samples], np.int32),
            "sample_lens": sample_lens,
            "done": np.array([s.done for g in groups for s in g.samples], np.bool_),
            "reward": np.array([np.nan if s.reward is None else s.reward for g in groups for s in g.samples],
                               np.float64),
        }
        header = {
            "samples_per_prompt": S,
            "next_ordinal": self.next_ordinal,
            "exhausted": self.exhausted,
            "trained_groups": self.trained_groups,
            "trained_tokens": self.trained_tokens,
            "regenerated_groups": self.regenerated_groups,
            "regenerated_tokens": self.regenerated_tokens,
            "dropped": dict(self.dropped),
            "groups": [[g.ordinal, g.prompt_id, g.epoch, g.target_step, g.regenerations, g.prompt, g.answer]
                       for g in groups],
        }
        return LedgerSnapshot(header=header, arrays=arrays)

    @classmethod
    def from_snapshot(cls, snap: "LedgerSnapshot") -> "Ledger":
        h, a = snap.header, snap.arrays
        S = int(h["samples_per_prompt"])
        led = cls(S)
        led.next_ordinal = int(h["next_ordinal"])
        led.exhausted = bool(h["exhausted"])
        led.trained_groups = int(h["trained_groups"])
        led.trained_tokens = int(h.get("trained_tokens", 0))
        led.regenerated_groups = int(h.get("regenerated_groups", 0))
        led.regenerated_tokens = int(h.get("regenerated_tokens", 0))
        led.dropped = dict(h["dropped"])
        p_off = np.concatenate([[0], np.cumsum(a["prompt_lens"])])
        s_off = np.concatenate([[0], np.cumsum(a["sample_lens"])])
        for i, (ordinal, pid, epoch, step, regen, prompt, answer) in enumerate(h["groups"]):
            samples = []
            for j in range(i * S, (i + 1) * S):
                lo, hi = s_off[j], s_off[j + 1]
                r = float(a["reward"][j])
                samples.append(Sample(tokens=a["tokens"][lo:hi].tolist(), logprobs=a["logprobs"][lo:hi].tolist(),
                                      versions=a["versions"][lo:hi].tolist(), done=bool(a["done"][j]),
                                      reward=None if np.isnan(r) else r))
            led.groups[int(ordinal)] = Group(
                ordinal=int(ordinal), prompt_id=int(pid), epoch=int(epoch), prompt=prompt, answer=answer,
                prompt_tokens=a["prompt_tokens"][p_off[i]:p_off[i + 1]].copy(), samples=samples,
                target_step=None if step is None else int(step), regenerations=int(regen))
        return led


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
