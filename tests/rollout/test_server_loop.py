"""The generation server's engine loop (`rollout.server_loop`) over a stand-in engine: requests
into slots and back as chunks, a prompt's prefill shared only with the same prompt, and a
failure of the loop reaching every stream and the process."""
import threading
import time

import numpy as np
import pytest

from async_rl.rollout.server_loop import Request, ServerLoop


class FakeEngine:
    """BuiltinRollout's engine calls on two slots; every token is 5 (no stop token)."""
    max_concurrent_decodes, steps_per_call = 2, 2

    def __init__(self):
        self.fail: BaseException | None = None
        self.inserted: list[tuple[int, tuple]] = []  # (ordinal, prompt of the prefill the slot got)
        self.active = np.zeros(2, bool)

    def init_decode_state(self):
        return None

    def prefill_many(self, params, seqs):
        return [tuple(int(t) for t in p) for p, _ in seqs]

    def insert_many(self, prefix, state, todo):
        for slot, row, ordinal, _ in todo:
            self.inserted.append((ordinal, prefix[row]))
            self.active[slot] = True
        return state

    def generate_steps_async(self, params, state):
        if self.fail is not None:
            raise self.fail
        return state, np.full((2, 2), 5, np.int32), np.full((2, 2), -1.0, np.float32)

    def active_slots(self, state):
        return self.active.copy()

    def free_many(self, state, slots):
        self.active[list(slots)] = False
        return state

    def update_params(self, params, version):
        pass


class Collect:
    def __init__(self):
        self.items, self.ended = [], threading.Event()

    def __call__(self, item):
        self.items.append(item)
        if item is None or isinstance(item, str):
            self.ended.set()


def _request(rid: str, prompt, ordinal: int, budget: int = 3) -> tuple[Request, Collect]:
    c = Collect()
    return Request(id=rid, run="r", prompt=np.asarray(prompt, np.int32), done=(), ordinal=ordinal, sample=0,
                   budget=budget, emit=c), c


@pytest.fixture
def loop():
    lines, failures = [], []
    lp = ServerLoop(FakeEngine(), (2,), log=lines.append, on_failure=failures.append)
    lp.lines, lp.failures = lines, failures
    lp.start()
    lp.swap(None, 1).result(timeout=10)
    yield lp
    lp.close()


def test_requests_come_back_as_chunks_and_a_prompt_shares_only_its_own_prefill(loop):
    loop.pause()
    reqs = [_request("a", [1, 2], 0), _request("b", [1, 3], 0), _request("c", [1, 2], 0)]
    for r, _ in reqs:
        loop.submit(r)
    loop.resume()
    for _, c in reqs:
        assert c.ended.wait(10)
        assert c.items == [([5, 5], [-1.0, -1.0], [1, 1], None), ([5], [-1.0], [1], "length"), None]
    # b (the same ordinal, another prompt) was prefilled with its own prompt, not given a's
    assert sorted(loop.rollout.engine.inserted) == [(0, (1, 2)), (0, (1, 2)), (0, (1, 3))]


def test_a_failure_of_the_loop_ends_every_stream_and_is_reported_once(loop):
    loop.rollout.engine.fail = RuntimeError("device lost\nsecond line")
    r, c = _request("a", [1, 2], 0)
    loop.submit(r)
    assert c.ended.wait(10)
    line = "RuntimeError: device lost second line"
    assert c.items == [line] and loop.error == line
    assert loop.failures == [line] and loop.lines == [f"error: the generation loop failed: {line}"]
    with pytest.raises(RuntimeError, match="stopping"):
        loop.submit(_request("b", [1, 2], 0)[0])
    with pytest.raises(RuntimeError, match="device lost"):
        loop.swap(None, 2).result(timeout=10)
    assert not loop.pause(timeout_s=1)


def test_abort_ends_a_queued_request_at_once(loop):
    loop.pause()
    r, c = _request("a", [1, 2], 0)
    loop.submit(r)
    assert loop.abort(lambda x: x.id == "a") == 1
    assert c.items == [([], [], [], "abort"), None]
    loop.resume()
    time.sleep(0.2)
    assert loop.rollout.engine.inserted == []


class EvictingEngine(FakeEngine):
    """Takes slot 0's sample away at its second decode call, as a paged engine short of pages does."""

    def __init__(self):
        super().__init__()
        self.calls, self.evicted, self.seqs = 0, [], []

    def prefill_many(self, params, seqs):
        self.seqs += [(tuple(int(t) for t in p), () if c is None else tuple(int(t) for t in c)) for p, c in seqs]
        return super().prefill_many(params, seqs)

    def generate_steps_async(self, params, state):
        self.calls += 1
        if self.calls == 2 and self.active[0]:
            self.active[0] = False
            self.evicted = [0]
        return super().generate_steps_async(params, state)

    def take_evicted(self):
        out, self.evicted = self.evicted, []
        return out


def test_an_evicted_sample_continues_after_the_tokens_it_has_streamed():
    lp = ServerLoop(EvictingEngine(), (2,), log=lambda line: None)
    lp.start()
    try:
        lp.swap(None, 1).result(timeout=10)
        r, c = _request("a", [1, 2], 0, budget=5)
        lp.submit(r)
        assert c.ended.wait(10)
    finally:
        lp.close()
    assert c.items == [([5, 5], [-1.0, -1.0], [1, 1], None), ([5, 5], [-1.0, -1.0], [1, 1], None),
                       ([5], [-1.0], [1], "length"), None]
    assert lp.rollout.engine.seqs == [((1, 2), ()), ((1, 2), (5, 5))]  # continued after what it had sent
