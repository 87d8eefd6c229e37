"""Pump weight swaps: which published version the engine runs, and when it learns of one."""
import threading
import time

from async_rl.ledger import Ledger
from async_rl.pump import Pump


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
    pump = Pump(ledger=Ledger(2), sampler=None, engine=eng, iterator=iter(()), tokenizer=Tok(), reward_fn=None,
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
