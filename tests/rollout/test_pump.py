"""Pump weight swaps: which published version the engine runs, and when it learns of one."""
import threading
import time

import numpy as np
import pytest

from async_rl.buffer.ledger import Ledger
from async_rl.rollout.interface import BuiltinRollout
from async_rl.rollout.pump import Pump


class Weights:
    """Stands for published params: computed or still in flight on the learner."""

    def __init__(self, version: int, computed: bool = True):
        self.version, self.computed = version, computed
        self._done = threading.Event()
        if computed:
            self._done.set()

    def is_ready(self) -> bool:
        return self._done.is_set()

    def block_until_ready(self):
        self._done.wait()
        return self

    def finish(self) -> None:
        self._done.set()


class Engine:
    max_concurrent_decodes = 2

    def __init__(self):
        self.swaps: list[int] = []

    def init_decode_state(self):
        return None

    def update_params(self, params, version):
        self.swaps.append(version)


class Tok:
    eos_id = 0


def make_pump(deterministic=False) -> tuple[Pump, Engine]:
    eng = Engine()
    pump = Pump(ledger=Ledger(2), sampler=None, rollout=BuiltinRollout(eng, Weights(0), 0, deterministic=deterministic),
                iterator=iter(()), tokenizer=Tok(), reward_fn=None,
                max_new_tokens=4, params=Weights(0), version=0, partial=False, deterministic=deterministic)
    return pump, eng


def test_engine_takes_a_computed_version_while_a_newer_one_is_in_flight():
    pump, eng = make_pump()
    w1, w2 = Weights(1, computed=False), Weights(2, computed=False)
    pump.publish(1, w1)
    pump.publish(2, w2)  # the learner runs ahead: version 2 is dispatched before 1 is done
    with pump.ledger.lock:
        pump._maybe_swap()
    assert eng.swaps == []  # nothing computed yet: keep the running weights
    w1.finish()
    with pump.ledger.lock:
        pump._maybe_swap()
    # version 1 must still be there: waiting for 2 would idle the engine for a whole step
    assert eng.swaps == [1] and pump.version == 1
    assert sorted(pump.published) == [1, 2]
    w2.finish()
    with pump.ledger.lock:
        pump._maybe_swap()
    assert eng.swaps == [1, 2] and sorted(pump.published) == [2]


def test_a_computed_version_makes_older_uncomputed_ones_useless():
    pump, eng = make_pump()
    pump.slots[0] = object()  # a slot in use: without partial rollouts no swap happens now
    pump.publish(1, Weights(1))
    pump.publish(2, Weights(2))
    pump.publish(3, Weights(3, computed=False))
    with pump.ledger.lock:
        pump._maybe_swap()
    assert eng.swaps == [] and sorted(pump.published) == [0, 2, 3]  # 1 can never be used again


def test_pump_wakes_when_published_weights_are_computed():
    pump, _ = make_pump()
    pump._watcher.start()
    try:
        w = Weights(1, computed=False)
        pump.publish(1, w)
        woke, parked = [], threading.Event()

        def wait():
            with pump.ledger.changed:
                parked.set()
                t0 = time.perf_counter()
                pump.ledger.changed.wait(5.0)
                woke.append(time.perf_counter() - t0)

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert parked.wait(10)
        with pump.ledger.changed:  # acquired only once the waiter is inside wait() (it releases the lock)
            w.finish()
        waiter.join(10)
        assert woke and woke[0] < 2.0  # notified, not timed out
    finally:
        pump._computing.put(None)
        pump._watcher.join(5)


class ChunkEngine:
    """Decodes K tokens per call, slowly: token = 10 + the version of the weights passed to the
    call, except a stop token (0) at the (3 + ordinal % 11)-th token of a sample."""

    max_concurrent_decodes, steps_per_call = 3, 4

    def __init__(self):
        self.rows: dict[int, list[int]] = {}  # slot -> [ordinal, tokens made]
        self.prefill_rows: list[int] = []  # sequences per prefill call

    def init_decode_state(self):
        return None

    def update_params(self, params, version):
        pass

    def prefill_many(self, params, seqs):
        self.prefill_rows.append(len(seqs))
        return [0 if completion is None else len(completion) for _, completion in seqs]

    def insert_many(self, prefix, state, todo):
        for slot, row, ordinal, _ in todo:
            self.rows[slot] = [ordinal, prefix[row]]
        return state

    def active_slots(self, state):
        return np.zeros(self.max_concurrent_decodes, bool)  # tracks no slot: nothing to free

    def generate_steps_async(self, params, state):
        time.sleep(0.01)
        toks = np.zeros((self.steps_per_call, self.max_concurrent_decodes), np.int32)
        for slot, row in self.rows.items():
            for k in range(self.steps_per_call):
                row[1] += 1
                toks[k, slot] = 0 if row[1] == 3 + row[0] % 11 else 10 + params.version
        return state, toks, -toks.astype(np.float32)


def test_overlapped_chunks_record_each_token_with_the_weights_that_made_it():
    """Chunks of K tokens, recorded while the next one runs, slots refilled before the record,
    weights swapped mid-sample (partial rollouts): every token carries the version of the
    weights of the call that made it, every sample ends at its stop token or at N."""
    from async_rl.buffer.sampler import make_sampler
    from async_rl.config import load

    n, steps = 12, 10
    cfg = load("configs/tiny.yaml", ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                                     f"rollout.max_new_tokens={n}", "sampler.max_lookahead=2", "model.learned_positions=24"])
    ledger = Ledger(2)
    sampler = make_sampler(cfg, ledger)
    recs = ({"prompt_id": i, "epoch": 0, "prompt": "1=", "answer": "1", "prompt_tokens": np.ones(2, np.int32)}
            for i in range(2 * steps))
    tok = type("Tok", (), {"eos_id": 0, "stop_ids": (0,), "decode": lambda self, ids: "x"})()
    engine = ChunkEngine()
    pump = Pump(ledger=ledger, sampler=sampler, rollout=BuiltinRollout(engine, Weights(0), 0, prefill_rows=2),
                iterator=recs, tokenizer=tok,
                reward_fn=lambda text, answer: 1.0, max_new_tokens=n, params=Weights(0), version=0, partial=True,
                deterministic=False, log=lambda *a: None)
    pump.start()
    trained = []
    try:
        for t in range(1, steps + 1):
            groups = sampler.next_batch(t, should_stop=lambda: pump.error is not None)
            assert groups, pump.error
            trained += groups
            time.sleep(0.01)
            pump.publish(t, Weights(t))
            with ledger.lock:
                ledger.commit(groups)
    finally:
        pump.stop()
    assert pump.error is None
    straddling = 0
    for g in trained:
        for s in g.samples:
            stop_at = 3 + g.ordinal % 11
            assert len(s.tokens) == min(stop_at, n) and (s.tokens[-1] == 0) == (stop_at <= n)
            assert len(s.versions) == len(s.logprobs) == len(s.tokens)
            for t, v in zip(s.tokens, s.versions):
                assert t == 0 or t == 10 + v
            assert s.versions == sorted(s.versions)
            straddling += len(set(s.versions)) > 1
    assert straddling, "no sample straddled a weight swap"
    # groups picked together share a prefill call (at most prefill_rows sequences)
    assert max(engine.prefill_rows) == 2 and sum(engine.prefill_rows) >= 2 * steps
    assert pump.rollout.batches(list(range(5))) == [[0, 1], [2, 3], [4]]
    pump.rollout.deterministic = True  # there a prefill depends on its own sequence alone
    assert pump.rollout.batches(list(range(3))) == [[0], [1], [2]]


@pytest.mark.parametrize("value", [1e200, -1e7, float("nan"), float("inf")])
def test_a_reward_out_of_range_is_refused_before_anything_records_it(value):
    """A Python float of 1e200 is finite, but inf in float32: refused where it enters, naming
    the prompt, the sample and the value; no reward set, no journal record."""
    from async_rl.data.tokenizer import CharTokenizer
    from async_rl.rollout.pump import RewardError

    class Journal:
        waits, records = {}, []

        def encode(self, g, s, r):
            return (g.ordinal, r)

        def append(self, records):
            self.records += records

    tok, led = CharTokenizer(), Ledger(3)
    calls = iter([0.5, value, 0.25])
    pump = Pump(ledger=led, sampler=None, rollout=BuiltinRollout(Engine(), Weights(0), 0), iterator=iter(()),
                tokenizer=tok,
                reward_fn=lambda text, answer: next(calls), max_new_tokens=4, params=Weights(0), version=0,
                partial=False, deterministic=False, journal=Journal(), reward_max_abs=1e6)
    with led.lock:
        g = led.add({"prompt_id": 11, "epoch": 0, "prompt": "12=", "answer": "21",
                     "prompt_tokens": tok.encode_prompt("12=")}, None)
    for s in g.samples:
        s.tokens, s.done = tok.encode("21"), True
    with pytest.raises(RewardError) as e:
        pump._reward([(g, s) for s in g.samples])
    msg = str(e.value)
    assert "\n" not in msg and "prompt_id=11 sample 1" in msg and repr(value) in msg, msg
    assert [s.reward for s in g.samples] == [None] * 3 and pump.journal.records == []


def test_the_tokens_in_flight_at_a_kill_are_the_ledgers_unfinished_samples():
    """A fault point's message counts the ledger's unfinished samples, engine slots or not."""
    pump, _ = make_pump()
    with pump.ledger.lock:
        g = pump.ledger.add({"prompt_id": 3, "epoch": 0, "prompt": "1=", "answer": "1",
                             "prompt_tokens": np.array([1, 2], np.int32)}, None)
    g.samples[0].tokens, g.samples[0].done = [4, 5, 6], True  # finished: the journal keeps it
    g.samples[1].tokens = [4, 5]  # unfinished, in no slot (e.g. waiting for an env step)
    pump.stats.tokens = 5
    assert pump._progress() == "generated_tokens=5 in_flight_tokens=2"
