"""The lease fences a holder's writes by epoch: a holder stalled past run.lease_s while another
took its lease over commits no step and appends to no log, even where its own clock missed
the stall. Against real servers on loopback (fake-gcs-server, moto)."""
import json
import time

import numpy as np
import pytest

from async_rl.state import orbax_patch
from async_rl.state.layout import committed_steps, temporary_path_class
from async_rl.store import applog, rundir, runlock, storage


def _save(mngr, step: int) -> None:
    import orbax.checkpoint as ocp
    state = {"w": np.arange(4, dtype=np.float32)}
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))


def _chain(e: BaseException) -> list:
    out = []
    while e is not None:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


@pytest.mark.parametrize("bucket", [pytest.param("gs", marks=pytest.mark.soak), "s3"], indirect=True)
def test_a_holder_stalled_past_a_takeover_commits_and_appends_nothing(bucket, monkeypatch):
    """The holder's process freezes (heartbeat and all) and its monotonic clock does not count
    the freeze (a suspended host: CLOCK_MONOTONIC stops there), so by its clock the lease is
    fresh; another holder takes it over meanwhile (epoch 2). Once it runs again, its commit of
    the step it was saving, its lineage and metrics appends are all refused by reading the lease
    object (one line naming the new holder and both epochs), and the store holds none of them."""
    import orbax.checkpoint as ocp
    orbax_patch.install()  # as a run does when it opens its checkpoints
    run = storage.run_path(f"{bucket}/run")
    d = run / "checkpoints"
    old = runlock.run_lock(run, 0, lease_s=2)
    old.acquire(run)
    # this process stands for two: the write guard it registered is put back after the new holder's
    old_guard = storage._guards[storage.url(run).rstrip("/") + "/"]
    lineage, metrics = applog.AppendLog(run / "lineage.jsonl"), applog.AppendLog(run / "metrics.jsonl")
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True,
                                        temporary_path_class=temporary_path_class(d))
    new = runlock.run_lock(run, 0, lease_s=2)
    try:
        with ocp.CheckpointManager(d, options=opts) as mngr:
            _save(mngr, 1)
            lineage.append(b'{"step": 1}\n')
            metrics.append(b'{"step": 1}\n')
            before = {p: applog.read(run / p) for p in ("lineage.jsonl", "metrics.jsonl")}
            old._stop.set()  # frozen: no renewal from here on
            old._thread.join(timeout=10)
            time.sleep(2.2)  # its lease looks stale to another process
            new.acquire(run)  # watched unchanged for HOLD_OFF leases, then taken
            assert json.loads(storage.read_text(run / ".lock"))["epoch"] == 2
            storage.guard(run, old_guard)
            old._renewed = time.monotonic()  # its clock saw no time pass
            with pytest.raises(Exception) as got:
                _save(mngr, 2)
            lost = [x for x in _chain(got.value) if isinstance(x, rundir.LockLostError)]
            assert lost, _chain(got.value)
            msg = str(lost[0])
            assert "\n" not in msg and "taken over by" in msg and "epoch 2" in msg and "epoch 1" in msg, msg
            for log in (lineage, metrics):
                with pytest.raises(rundir.LockLostError):
                    log.append(b'{"step": 2}\n')
        assert committed_steps(d) == [1]
        assert {p: applog.read(run / p) for p in before} == before
    finally:
        old.release()  # lost: leaves the new holder's lease alone
        assert json.loads(storage.read_text(run / ".lock"))["token"] == new._doc["token"]
        new.release()
