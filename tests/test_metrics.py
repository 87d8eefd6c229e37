"""Per-step host metrics (metrics.py)."""
from __future__ import annotations

import numpy as np


def test_main_thread_ledger_reads_hold_the_lock_while_the_pump_thread_mutates():
    """The per-step metrics read the ledger while the pump thread adds and removes groups;
    without the lock, iterating `ledger.groups` raises 'dictionary changed size'."""
    import sys
    import threading
    import time

    from async_rl.learner import build_batch
    from async_rl.ledger import Ledger
    from async_rl.metrics import host_metrics

    led = Ledger(2)
    rec = lambda i: {"prompt_id": i, "epoch": 0, "prompt": "1=", "answer": "1", "prompt_tokens": np.ones(2, np.int32)}
    for i in range(400):
        led.add(rec(i), None)
    stop, errors = threading.Event(), []

    def pump():  # draws and trains as the real pump and learner do: always under the lock
        i = 400
        while not stop.is_set():
            with led.lock:
                led.add(rec(i), None)
                led.commit([led.groups[min(led.groups)]])
            i += 1

    batch = build_batch([], n_rows=2, prompt_len=2, max_new=2, pad_id=0)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: any unlocked read collides
    t = threading.Thread(target=pump)
    t.start()
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            try:
                host_metrics(batch, 1, [], led)
            except RuntimeError as e:
                errors.append(e)
                break
    finally:
        stop.set()
        t.join(10)
        sys.setswitchinterval(switch)
    assert not errors, errors


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
    from async_rl.metrics import cut_tensorboard
    for i, session in enumerate(((1, 2, 3, 4, 5), (4, 5, 6))):  # a killed session logged 4, 5 past step 3
        w = SummaryWriter(str(tmp_path / "tb"), filename_suffix=f".s{i}")
        for s in session:
            w.add_scalar("x", float(s), s)
        w.close()
    first = sorted((tmp_path / "tb").glob("events.*"))[0]
    first.write_bytes(first.read_bytes() + b"\x05\x00")  # and a torn record at the end
    assert sorted(_tb_steps(tmp_path / "tb")) == [1, 2, 3, 4, 4, 5, 5, 6]
    assert cut_tensorboard(tmp_path / "tb", 3) == 5
    assert sorted(_tb_steps(tmp_path / "tb")) == [1, 2, 3]
    assert cut_tensorboard(tmp_path / "tb", 3) == 0  # nothing more to cut: files left alone
    assert not list((tmp_path / "tb").glob(".*tmp*"))
