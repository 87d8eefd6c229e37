"""Batch generation over a `rollout.Rollout`: `generate_all`, for evaluation and the benchmarks.

Owns: `Requests`, the slot scheduler's source for a fixed list of prompts x samples (each
sample with its length cap; a prompt's samples start one after another, so they share its
prefill), and the completions it gathers. Does not own: the loop (`scheduler.Scheduler`,
the one the pump runs on too), the compiled programs, KV slots or sampling (engine), the
ledger or rewards (pump).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from async_rl.buffer.ledger import Sample
from async_rl.rollout.interface import BuiltinRollout, Rollout, Start
from async_rl.rollout.scheduler import Fill, Piece, Scheduler


@dataclasses.dataclass
class Completion:
    tokens: np.ndarray  # int32 [n], includes the stop token if one was drawn
    logprobs: np.ndarray  # float32 [n], the behaviour logprobs (`engine` module docstring)
    routes: np.ndarray | None = None  # a backend recording MoE routes: [prompt + n - 1, n_layers, k] (`Sample.routes`)


@dataclasses.dataclass(eq=False)
class _Row:
    prompt: int  # index into the prompts
    sample: int
    s: Sample = dataclasses.field(default_factory=Sample)  # its tokens, logprobs and routes so far

    @property
    def tokens(self) -> list:
        return self.s.tokens


class Requests:
    """Every sample of `prompts` as a scheduler source: prompt i, sample s starts with the
    sampling ordinal `ordinals[i]` and may have `limits[i][s]` tokens. `collected` does
    nothing; a benchmark overrides it to time chunks."""

    def __init__(self, prompts: list[np.ndarray], *, samples: int, limits: list[list[int]],
                 ordinals: list[int] | None = None):
        self.prompts = [np.asarray(p, np.int32) for p in prompts]
        self.samples, self.limits = samples, limits
        self.ordinals = list(range(len(prompts))) if ordinals is None else list(ordinals)
        self.waiting = [(i, s) for i in range(len(prompts)) for s in range(samples)][::-1]  # popped from the end
        self.out: list[list[Completion | None]] = [[None] * samples for _ in prompts]
        self.again: list[_Row] = []  # samples whose slot the backend lost: continued first

    @property
    def pending(self) -> bool:
        return bool(self.waiting or self.again)

    def fill(self, free: list[int], busy: bool) -> Fill:
        starts, rows, forget = [], [], []
        for slot in free[:len(self.again)]:
            r = self.again.pop()
            starts.append(Start(slot, self.ordinals[r.prompt], r.sample, self.prompts[r.prompt], tuple(r.tokens),
                                self.limits[r.prompt][r.sample] - len(r.tokens)))
            rows.append(r)
        for slot in free[len(rows):len(rows) + len(self.waiting)]:
            i, s = self.waiting.pop()
            starts.append(Start(slot, self.ordinals[i], s, self.prompts[i], (), self.limits[i][s]))
            rows.append(_Row(i, s))
            if s == self.samples - 1:
                forget.append(self.ordinals[i])  # every sample of the prompt is in a slot: its prefill may go
        return Fill(starts, rows, forget)

    def record(self, pieces: list[Piece], version: int) -> None:
        for p in pieces:
            r = p.occupant
            if p.routes is not None:
                r.s.add_routes(len(self.prompts[r.prompt]), p.head, p.routes)
            r.s.tokens += p.tokens
            r.s.logprobs += p.logprobs
            if p.ended:
                self.out[r.prompt][r.sample] = Completion(np.asarray(r.s.tokens, np.int32),
                                                          np.asarray(r.s.logprobs, np.float32), r.s.route_rows())

    def collected(self, calls: int) -> None:
        pass

    def release(self, occupants: list) -> None:
        self.again.extend(occupants)

    def run(self, rollout: Rollout, stops) -> list[list[Completion]]:
        """Generates every sample; returns completions indexed [prompt][sample]."""
        sched = Scheduler(rollout, self, stops)
        sched.run(lambda: not self.pending and sched.idle)
        return self.out  # type: ignore[return-value]


def rollout_for(backend, params) -> Rollout:
    """`backend` itself when it is a `Rollout` (it holds its weights), else an `Engine` with
    `params` behind `BuiltinRollout`, one prefill per prompt (shared by its samples, so a
    result never depends on which prompts were batched with it)."""
    return backend if isinstance(backend, Rollout) else BuiltinRollout(backend, params, 0, prefill_rows=1)


def generate_all(backend, params, prompts: list[np.ndarray], *, samples: int = 1,
                 eos_id: int | tuple[int, ...] | None, ordinals: list[int] | None = None,
                 max_tokens: list[list[int]] | None = None, max_new_tokens: int | None = None
                 ) -> list[list[Completion]]:
    """Continuous batching through the slot scheduler: fill free slots, step, retire ended
    samples, refill. `backend`: see `rollout_for`.

    Returns completions indexed [prompt][sample]. A sample ends at `eos_id` (one id or a tuple
    of stop ids; kept as its last token) or after `max_new_tokens` tokens (by default the
    engine's; or `max_tokens[i][s]` for sample s of prompt i, when given, within [1, that]);
    `eos_id=None` never stops early."""
    n_max = max_new_tokens or backend.max_new_tokens
    limits = [[n_max if max_tokens is None else max(1, min(int(max_tokens[i][s]), n_max)) for s in range(samples)]
              for i in range(len(prompts))]
    stops = () if eos_id is None else (eos_id,) if isinstance(eos_id, int) else eos_id
    return Requests(prompts, samples=samples, limits=limits, ordinals=ordinals).run(rollout_for(backend, params), stops)
