"""Re-partitioning onto another process count, without processes: every record of every epoch
is handed out once across any chain of process counts and cut points, the partition is a
pure function of the positions (deterministic, JSON round trip), later epochs are sharded
the new way, and every ledger group is dealt to exactly one new process, never restamped to
a later step (docs/design.md, "Elastic resume")."""
import json
import random
from collections import Counter

import numpy as np
import pytest
from helpers import MODEL

from async_rl import config
from async_rl.buffer.ledger import Ledger
from async_rl.data.dataset import Partition, build_dataset, make_iterator
from async_rl.data.tokenizer import ByteTokenizer
from async_rl.state.reshard import deal, new_ledger

TOK = ByteTokenizer()


def _cfg(n, epochs, shuffle):
    return config.load(None, [*MODEL, f"data.num_records={n}", f"data.num_epochs={epochs}", f"data.shuffle={shuffle}",
                              "data.seed=3"])


def _draw(pd, k):
    it = make_iterator(pd)
    return [(r["prompt_id"], r["epoch"]) for r in (next(it) for _ in range(k))]


@pytest.mark.parametrize("seed", range(12))
def test_every_record_once_per_epoch_across_a_chain_of_process_counts(seed):
    rng = random.Random(seed)
    n, epochs = rng.randint(7, 40), rng.randint(1, 3)
    cfg = _cfg(n, epochs, rng.random() < 0.7)
    chain = [2, 1, 3] if seed < 4 else [rng.randint(1, 4) for _ in range(rng.randint(2, 4))]
    pd0 = build_dataset(cfg, TOK, process_index=0, process_count=chain[0])
    part, drawn = pd0.partition, Counter()
    for m in chain[1:]:
        pds = [pd0.for_partition(part, p) for p in range(part.processes)]
        nexts = [rng.randint(0, len(pd.dataset)) for pd in pds]
        for pd, k in zip(pds, nexts):
            drawn.update(_draw(pd, k))
        child = pd0.repartition(part, nexts, m)
        # a pure function of the positions: the same child again, and it survives JSON
        assert child == pd0.repartition(part, nexts, m) == Partition.from_json(json.loads(json.dumps(child.to_json())))
        # epochs from epoch0 on are sharded the new way: shard q::m
        for q in range(m):
            pd = pd0.for_partition(child, q)
            later = [pid for pid, e in _draw(pd, len(pd.dataset)) if e >= child.epoch0]
            assert sorted(later) == sorted(list(range(q, n, m)) * (epochs - child.epoch0))
            assert pd.stream_signature()["partition"] == child.digest()
        part = child
    for q in range(part.processes):
        pd = pd0.for_partition(part, q)
        drawn.update(_draw(pd, len(pd.dataset)))
    assert drawn == Counter({(pid, e): 1 for pid in range(n) for e in range(epochs)})


def test_the_remainder_is_what_no_old_process_drew_in_the_started_epochs():
    cfg = _cfg(10, 3, True)
    pd0 = build_dataset(cfg, TOK, process_index=0, process_count=2)
    # process 0 drew 7 of its 5 + 5 + 5 (into epoch 1), process 1 drew 3 (epoch 0)
    child = pd0.repartition(pd0.partition, [7, 3], 3)
    assert child.epoch0 == 2 and child.generation == 1
    rem, origin = pd0.remainder(child)
    assert Counter(rem[:, 1].tolist()) == {0: 2, 1: 8}  # epoch 0: 2 of process 1's; epoch 1: 3 + 5
    assert list(rem[:, 1]) == sorted(rem[:, 1])  # in epoch order
    assert Counter(origin.tolist()) == {0: 3, 1: 7}
    # epoch 0's undrawn records are exactly those process 1 had not reached
    it = make_iterator(pd0.for_partition(pd0.partition, 1))
    p1 = [next(it)["prompt_id"] for _ in range(5)]
    assert sorted(rem[rem[:, 1] == 0][:, 0].tolist()) == sorted(p1[3:])
    # the stream of new process q starts with rem[q::3], then epoch 2 of shard q::3
    pd = pd0.for_partition(child, 1)
    got = _draw(pd, len(pd.dataset))
    assert got[:len(rem[1::3])] == [(int(i), int(e)) for i, e in rem[1::3]]
    assert pd.epoch_at(0) == got[0][1] and pd.epoch_at(len(pd.dataset)) == 3


def _ledger(stamps, base=0, spp=2, seed=0):
    rng = np.random.default_rng(seed)
    led = Ledger(spp)
    led.base_step = base
    for i, t in enumerate(stamps):
        g = led.add({"prompt_id": seed * 100 + i, "epoch": 0, "prompt": f"{i}=", "answer": str(i),
                     "prompt_tokens": np.ones(2, np.int32)}, target_step=t)
        k = int(rng.integers(0, 4))
        g.samples[0].tokens, g.samples[0].logprobs, g.samples[0].versions = [3] * k, [-.5] * k, [base] * k
        g.samples[0].done = k == 3
        g.samples[0].reward = 1.0 if k == 3 else None
    led.trained_groups, led.dropped = 5 + seed, {"zero_variance": 1}
    return led


@pytest.mark.parametrize("m", [1, 3, 6])
@pytest.mark.parametrize("in_order", [True, False])
def test_every_group_is_dealt_once_and_never_trains_later(m, in_order):
    pps, step = 6, 4
    # two old processes (3 groups per step each), the second a little behind
    olds = [_ledger([5, 5, 5, 6, 6, 6, 7], base=step, seed=0), _ledger([5, 5, 5, 6, 6], base=step, seed=1)]
    owners, order = deal(olds, m, pps, in_order)
    assert sorted((p, g.ordinal) for p, g in order) == sorted((p, o) for p, led in enumerate(olds) for o in led.groups)
    snaps = [led.snapshot() for led in olds]
    old_stamp = {(g.prompt_id): g.target_step for led in olds for g in led.groups.values()}
    old_tokens = {g.prompt_id: [s.tokens for s in g.samples] for led in olds for g in led.groups.values()}
    seen = []
    for q in range(m):
        mine = [g for (_, g), owner in zip(order, owners) if owner == q]
        led = Ledger.from_snapshot(new_ledger(mine, snaps, q, step, pps // m, in_order, {"lineage_bytes": 7}))
        assert list(led.groups) == list(range(len(led.groups))) and led.next_ordinal == len(led.groups)
        assert led.base_step == step
        for g in led.groups.values():
            seen.append(g.prompt_id)
            assert [s.tokens for s in g.samples] == old_tokens[g.prompt_id]  # finished or partial work kept
            if in_order:
                assert g.target_step == step + g.ordinal // (pps // m) + 1 <= old_stamp[g.prompt_id]
            else:
                assert g.target_step is None
        assert led.trained_groups == (11 if q == 0 else 0) and led.dropped == ({"zero_variance": 2} if q == 0 else {})
    assert sorted(seen) == sorted(old_stamp)
    # each new step holds pps groups spread evenly (the last one may be short)
    assert max(Counter(owners).values()) - min(Counter(owners).values() or [0]) <= pps // m
