"""Per-step host metrics (metrics.py)."""
from __future__ import annotations

import numpy as np


def test_main_thread_ledger_reads_hold_the_lock_while_the_pump_thread_mutates():
    """The per-step metrics read the ledger while the pump thread adds and removes groups;
    every read of `ledger.groups` and `ledger.dropped` must hold the ledger's lock (checked on each read, so the
    test does not depend on a thread switch landing mid-iteration)."""
    from async_rl.buffer.ledger import Ledger
    from async_rl.learner.step import build_batch
    from async_rl.obs.metrics import host_metrics

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


def _tb_steps(tb_dir):
    import struct

    from tensorboardX.proto.event_pb2 import Event
    steps = []
    for f in sorted(tb_dir.glob("events.out.tfevents.*")):
        raw, pos = f.read_bytes(), 0
        while pos + 16 <= len(raw):
            n = struct.unpack("<Q", raw[pos:pos + 8])[0]
            if pos + 16 + n > len(raw):
                break
            ev = Event.FromString(raw[pos + 12:pos + 12 + n])
            if ev.summary.value:
                steps.append(ev.step)
            pos += 16 + n
    return steps


def test_tensorboard_events_are_cut_back_to_the_restored_step(tmp_path):
    from tensorboardX import SummaryWriter

    from async_rl.obs.tensorboard import cut_events
    for i, session in enumerate(((1, 2, 3, 4, 5), (4, 5, 6))):  # a killed session logged 4, 5 past step 3
        w = SummaryWriter(str(tmp_path / "tb"), filename_suffix=f".s{i}")
        for s in session:
            w.add_scalar("x", float(s), s)
        w.close()
    first = sorted((tmp_path / "tb").glob("events.*"))[0]
    first.write_bytes(first.read_bytes() + b"\x05\x00")  # and a torn record at the end
    assert sorted(_tb_steps(tmp_path / "tb")) == [1, 2, 3, 4, 4, 5, 5, 6]
    assert cut_events(tmp_path / "tb", 3) == 5
    assert sorted(_tb_steps(tmp_path / "tb")) == [1, 2, 3]
    assert cut_events(tmp_path / "tb", 3) == 0  # nothing more to cut: files left alone
    assert not list((tmp_path / "tb").glob(".*tmp*"))
