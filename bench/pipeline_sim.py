"""Simulated disjoint hardware: does the pipeline overlap generation with learning?

Owns: a simulated remote engine device and learner device (their work is a wait of a set
length that releases the GIL, one item after another per device, results ready when the
wait ends, as with JAX's asynchronous dispatch) and a step loop in the order of
`train.Session` (next_batch, dispatch the step, publish its weights, commit, then wait
for the previous step's outputs). Everything else is the real code: `pump.Pump` (slots,
chunks, recording, rewards, weight swaps), `ledger.Ledger`, the sampler and publishing.
Does not own: any trainer logic; bench/async.py prints the table.

On real shared CPUs engine and learner contend for the same cores, so lookahead cannot
show its worth there; here they cannot contend, and what remains is what the software
serialises (locks held across waits, swaps waiting on publication, the learner waiting on
the pump). With generation as costly as a learner step, lookahead 1 can be at most 2x
lookahead 0.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from async_rl import config as cfg_lib
from async_rl.buffer.ledger import Ledger
from async_rl.buffer.sampler import make_sampler
from async_rl.rollout.interface import BuiltinRollout
from async_rl.rollout.pump import Pump


class Device:
    """One simulated accelerator: items run one after another, each for its cost in seconds."""

    def __init__(self):
        self._free_at = 0.0
        self._lock = threading.Lock()

    def submit(self, cost_s: float) -> float:
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + cost_s
            return self._free_at


class Value:
    """A device value: ready at a wall-clock instant; reading it waits (GIL released) until then."""

    def __init__(self, ready_at: float, value=None):
        self.ready_at, self.value = ready_at, value

    def is_ready(self) -> bool:
        return time.perf_counter() >= self.ready_at

    def block_until_ready(self):
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self

    def __array__(self, dtype=None, copy=None):
        self.block_until_ready()
        return self.value if dtype is None else self.value.astype(dtype)


class Engine:
    """The engine API the pump uses; every chunk costs `chunk_s` on its own device.
    Every token is 5 (never a stop token), so each sample runs to max_new_tokens."""

    def __init__(self, slots: int, steps_per_call: int, max_new_tokens: int, chunk_s: float):
        self.max_concurrent_decodes, self.steps_per_call = slots, steps_per_call
        self.max_new_tokens, self.chunk_s = max_new_tokens, chunk_s
        self.device = Device()

    def init_decode_state(self):
        return None

    def load_params(self, params):
        return params

    def update_params(self, params, version: int) -> None:
        pass

    def prefill_many(self, params, seqs):
        return None

    def insert_many(self, prefix, decode_state, todo):
        return decode_state

    def active_slots(self, state):
        return np.zeros(self.max_concurrent_decodes, bool)  # tracks no slot: nothing to free

    def generate_steps_async(self, params, decode_state):
        ready = self.device.submit(self.chunk_s)
        shape = (self.steps_per_call, self.max_concurrent_decodes)
        return decode_state, Value(ready, np.full(shape, 5, np.int32)), Value(ready, np.full(shape, -1.0, np.float32))


class Tokenizer:
    eos_id = 0
    stop_ids = (0,)

    def decode(self, ids) -> str:
        return "".join(str(t % 10) for t in ids)


def records(n: int):
    for i in range(n):
        yield {"prompt_id": i, "epoch": 0, "prompt": f"{i}=", "answer": str(i),
               "prompt_tokens": np.asarray([1, 2, 3], np.int32)}


def run(lookahead: int, *, step_s: float, steps: int, warmup: int, prompts_per_step: int = 4,
        samples: int = 8, max_new_tokens: int = 8, steps_per_call: int = 8) -> dict:
    """One pipeline run; generating a step's samples costs `step_s`, as does a learner step.
    Returns steady-state steps/s over steps (warmup, steps]."""
    cfg = cfg_lib.load("configs/tiny.yaml", [f"sampler.max_lookahead={lookahead}",
                                             f"rollout.prompts_per_step={prompts_per_step}",
                                             f"rollout.samples_per_prompt={samples}",
                                             f"rollout.max_new_tokens={max_new_tokens}"])
    slots = prompts_per_step * samples  # a step's samples decode together
    chunks_per_step = -(-max_new_tokens // steps_per_call)
    engine = Engine(slots, steps_per_call, max_new_tokens, step_s / chunks_per_step)
    ledger = Ledger(samples)
    sampler = make_sampler(cfg, ledger)
    rs = np.random.RandomState(0)
    pump = Pump(ledger=ledger, sampler=sampler, rollout=BuiltinRollout(engine, Value(0.0), 0),
                iterator=records(prompts_per_step * (steps + 4)),
                tokenizer=Tokenizer(), reward_fn=lambda text, answer: float(rs.rand()), max_new_tokens=max_new_tokens,
                params=Value(0.0), version=0, partial=False, deterministic=False, log=lambda *a: None)
    learner = Device()
    pump.start()
    done_at = {}  # step -> when the learner device finished it
    prev = None
    try:
        for t in range(1, steps + 1):
            groups = sampler.next_batch(t, should_stop=lambda: pump.error is not None)
            weights = Value(learner.submit(step_s))  # dispatch: the step runs on the learner device
            done_at[t] = weights.ready_at
            pump.publish(t, weights)
            with ledger.lock:
                ledger.commit(groups)
            if prev is not None:  # the previous step's metrics are fetched after this dispatch
                prev.block_until_ready()
            prev = weights
        prev.block_until_ready()
    finally:
        pump.stop()
    if pump.error is not None:
        raise pump.error
    return {"steps_per_s": (steps - warmup) / (done_at[steps] - done_at[warmup]), "tokens": pump.stats.tokens,
            "calls": pump.stats.calls}
