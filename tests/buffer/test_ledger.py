import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.buffer.ledger import Ledger, State


def _rec(i):
    return {"prompt_id": 100 + i, "epoch": 0, "prompt": f"{i}=", "answer": str(i),
            "prompt_tokens": np.arange(i % 5 + 1, dtype=np.int32)}


def test_states_follow_samples():
    led = Ledger(2)
    g = led.add(_rec(0), target_step=1)
    assert g.state == State.PENDING and g.ordinal == 0 and led.next_ordinal == 1
    g.samples[0].tokens.append(5)
    assert g.state == State.GENERATING
    for s in g.samples:
        s.done, s.reward = True, 0.5
    assert g.state == State.READY
    led.commit([g])
    assert len(led) == 0 and led.trained_groups == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.booleans(), st.booleans()), min_size=0, max_size=12),
       st.booleans())
def test_snapshot_round_trip_preserves_every_field(spec, exhausted):
    led = Ledger(3)
    rng = np.random.default_rng(0)
    for i, (n, done, rewarded) in enumerate(spec):
        g = led.add(_rec(i), target_step=i // 2 + 1)
        for s in g.samples:
            k = int(rng.integers(0, n + 1))
            s.tokens = rng.integers(0, 50, k).tolist()
            s.logprobs = rng.normal(size=k).astype(np.float32).tolist()
            s.versions = rng.integers(0, 4, k).tolist()
            s.done = done
            s.reward = float(rng.random()) if rewarded else None
    if exhausted:
        led.mark_exhausted()
    back = Ledger.from_snapshot(led.snapshot())
    assert back.next_ordinal == led.next_ordinal and back.exhausted == led.exhausted
    assert list(back.groups) == list(led.groups)
    for o, g in led.groups.items():
        h = back.groups[o]
        assert (h.prompt_id, h.epoch, h.target_step, h.prompt, h.answer) == \
               (g.prompt_id, g.epoch, g.target_step, g.prompt, g.answer)
        np.testing.assert_array_equal(h.prompt_tokens, g.prompt_tokens)
        for a, b in zip(g.samples, h.samples):
            assert a.tokens == b.tokens and a.versions == b.versions and a.done == b.done
            assert np.allclose(a.logprobs, b.logprobs) and a.reward == b.reward
        assert h.state == g.state


def test_snapshot_stores_tokens_as_ragged_arrays():
    led = Ledger(2)
    g = led.add(_rec(1), target_step=1)
    g.samples[0].tokens, g.samples[0].logprobs, g.samples[0].versions = [1, 2, 3], [-.1, -.2, -.3], [0, 0, 1]
    snap = led.snapshot()
    assert snap.arrays["tokens"].dtype == np.int32 and snap.arrays["tokens"].tolist() == [1, 2, 3]
    assert snap.arrays["sample_lens"].tolist() == [3, 0]
    assert '"tokens"' not in snap.to_json() and "[1, 2, 3]" not in snap.to_json()  # arrays, not JSON lists
    assert snap.summary() == {"ready": 0, "generating": 1, "pending": 0, "kept_tokens": 3}


def test_capture_is_the_cut_even_if_samples_grow_before_build():
    led = Ledger(2)
    g = led.add(_rec(2), target_step=1)
    g.samples[0].tokens, g.samples[0].logprobs, g.samples[0].versions = [7, 8], [-.1, -.2], [0, 0]
    cut = led.capture()
    # the pump keeps going after the cut: more tokens, a finished sample, a new group
    g.samples[0].tokens.append(9), g.samples[0].logprobs.append(-.3), g.samples[0].versions.append(1)
    g.samples[0].done, g.samples[0].reward = True, 1.0
    led.add(_rec(3), target_step=1)
    back = Ledger.from_snapshot(cut.build())
    assert list(back.groups) == [0] and back.next_ordinal == 1
    s = back.groups[0].samples[0]
    assert s.tokens == [7, 8] and s.versions == [0, 0] and not s.done and s.reward is None


def _routes(m, seed=0, dtype=np.uint8, layers=3, k=2):
    return np.random.default_rng(seed).integers(0, 200, (m, layers, k)).astype(dtype)


def _grow(s, tokens, rows=None):
    s.tokens.extend(tokens), s.logprobs.extend([-0.5] * len(tokens)), s.versions.extend([0] * len(tokens))
    if rows is not None:
        s.routes.append(rows)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_snapshot_round_trip_keeps_routes(dtype):
    led = Ledger(3)
    g = led.add(_rec(3), target_step=1)  # a prompt of 4 tokens
    full = _routes(4 + 5 - 1, dtype=dtype)
    _grow(g.samples[0], [1, 2, 3], full[:6])  # routes in two segments, rows for prompt + 3 tokens - 1
    _grow(g.samples[0], [4, 5], full[6:])
    _grow(g.samples[1], [7])  # none recorded
    _grow(led.add(_rec(5), target_step=1).samples[2], [9, 9], _routes(1, seed=1, dtype=dtype))
    snap = led.snapshot()
    snap.validate()
    assert snap.arrays["routes"].dtype == dtype and snap.arrays["routes"].shape == (9, 3, 2)
    assert snap.arrays["route_lens"].tolist() == [8, 0, 0, 0, 0, 1]
    back = Ledger.from_snapshot(snap)
    s0, s1 = back.groups[0].samples[:2]
    assert len(s0.routes) == 1 and s0.routes[0].dtype == dtype
    np.testing.assert_array_equal(s0.route_rows(), full)
    assert s1.routes == [] and s1.route_rows() is None
    np.testing.assert_array_equal(back.groups[1].samples[2].route_rows(), _routes(1, seed=1, dtype=dtype))
    assert back.snapshot().arrays.keys() == snap.arrays.keys()


def test_without_routes_the_snapshot_has_no_route_arrays():
    led = Ledger(2)
    _grow(led.add(_rec(1), target_step=1).samples[0], [1, 2])
    assert set(led.snapshot().arrays) == {"prompt_tokens", "prompt_lens", "tokens", "logprobs", "versions",
                                          "sample_lens", "done", "reward", "group_ints", "text_bytes", "text_lens"}


def test_the_cut_keeps_only_the_routes_of_the_cut_tokens():
    led = Ledger(2)
    g = led.add(_rec(2), target_step=1)  # a prompt of 3 tokens
    full = _routes(3 + 4 - 1)
    s, t = g.samples
    _grow(s, [1, 2], full[:2])  # 2 of its prompt 3 + 2 tokens - 1 = 4 rows recorded so far
    # the engine recorded the next chunk's routes before its tokens: one row past the cut's 3
    _grow(t, [5], full[:4])
    cut = led.capture()
    _grow(s, [3, 4], full[2:])  # the pump goes on after the cut: tokens and routes
    t.tokens.append(6)
    snap = cut.build()
    snap.validate()
    assert snap.arrays["route_lens"].tolist() == [2, 3]
    back = Ledger.from_snapshot(snap).groups[0].samples
    assert back[0].tokens == [1, 2] and back[1].tokens == [5]
    np.testing.assert_array_equal(back[0].route_rows(), full[:2])
    np.testing.assert_array_equal(back[1].route_rows(), full[:3])


def test_invalid_routes_are_refused():
    led = Ledger(2)
    g = led.add(_rec(2), target_step=1)
    _grow(g.samples[0], [1, 2], _routes(4))
    snap = led.snapshot()
    r, lens = snap.arrays["routes"], snap.arrays["route_lens"]
    assert lens.tolist() == [4, 0]
    broken = {
        "1 entries": {"route_lens": lens[:1]},
        "summing to 3": {"route_lens": np.array([3, 0])},
        "5 route rows, more than its 4": {"route_lens": np.array([5, 0]), "routes": np.concatenate([r, r[:1]])},
        "sample 1 has 3 route rows, more than its 2": {"route_lens": np.array([1, 3])},  # prompt 3, no tokens
        "layers, k": {"routes": r[:, :, 0]},
        "integers": {"routes": r.astype(np.float32)},
        "saved together": {"routes": None},
    }
    for why, change in broken.items():
        arrays = {k: v for k, v in dict(snap.arrays, **change).items() if v is not None}
        with pytest.raises(ValueError, match=why):
            type(snap)(header=snap.header, arrays=arrays).validate()
