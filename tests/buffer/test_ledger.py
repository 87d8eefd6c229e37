import numpy as np
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
