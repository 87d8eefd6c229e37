"""Per-step host metrics (metrics.py)."""
from __future__ import annotations

import numpy as np


def test_main_thread_ledger_reads_hold_the_lock_while_the_pump_thread_mutates():
    """The per-step metrics read the ledger while the pump thread adds and removes groups;
    every read of `ledger.groups` and `ledger.dropped` must hold the ledger's lock (checked on each read, so the
    test does not depend on a thread switch landing mid-iteration)."""
    from async_rl.learner import build_batch
    from async_rl.ledger import Ledger
    from async_rl.metrics import host_metrics

    led = Ledger(2)
    rec = lambda i: {"prompt_id": i, "epoch": 0, "prompt": "1=", "answer": "1", "prompt_tokens": np.ones(2, np.int32)}
    for i in range(5):
        led.add(rec(i), None)
    unlocked = []

    class Guarded(dict):  # records any read made without the lock held by the reading thread
        def _read(self, what):
            if not led.lock._is_owned():
                unlocked.append(what)

        def __iter__(self):
            self._read("iter")
            return super().__iter__()

        def __len__(self):
            self._read("len")
            return super().__len__()

        def values(self):
            self._read("values")
            return super().values()

        def items(self):
            self._read("items")
            return super().items()

        def keys(self):
            self._read("keys")
            return super().keys()

    led.groups, led.dropped = Guarded(led.groups), Guarded(led.dropped)
    batch = build_batch([], n_rows=2, prompt_len=2, max_new=2, pad_id=0)
    m = host_metrics(batch, 1, [], led)
    assert m["data/ledger_pending"] + m["data/ledger_generating"] + m["data/ledger_ready"] == 5, m
    assert not unlocked, unlocked
    led.groups.values()  # the guard itself sees an unlocked read
    assert unlocked == ["values"]
