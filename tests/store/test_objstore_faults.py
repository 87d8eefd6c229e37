"""Object stores that fail a run: a lease deleted under a live run, a holder paused past its
lease, a store that stops answering (killed, or paused so connections hang), no credentials,
an endpoint that is down. Against real servers on loopback (fake-gcs-server, moto, and a
socket that accepts connections and never answers)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from objstore import GCS_ENV, TINY, GcsServer, new_bucket, pointed_at, train_proc, wait_past

from async_rl.run import cli
from async_rl.state import orbax_patch
from async_rl.state.layout import committed_steps
from async_rl.store import remote_io, rundir, runlock, storage


@pytest.fixture(autouse=True)
def _tensorstore_env(monkeypatch):
    """remote_io.configure in this process sets tensorstore's variables; put back afterwards,
    so no later training subprocess inherits them as the user's."""
    orbax_patch.install()  # as a run does when it opens its checkpoints
    for k in ("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"):
        monkeypatch.setenv(k, "1")
        monkeypatch.delenv(k)


def _after_steps(stderr: str) -> list[str]:
    """The lines a run printed after its last step line."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    last = max((i for i, ln in enumerate(lines) if ln.startswith("step ")), default=-1)
    return lines[last + 1:]


def _audit(run: str, capsys) -> dict:
    """`async-rl audit --json` of the run, in this process (one interpreter start-up fewer)."""
    capsys.readouterr()
    code = cli.main(["audit", "--json", run])
    out = capsys.readouterr()
    assert code == 0, out.out[-2000:] + out.err[-2000:]
    return json.loads(out.out)


# CI runs s3:// (where a lease deletion once went unnoticed); gs:// under make soak: a renewal that
# finds the lease deleted is checked on both by test_lease_renewal_that_finds_it_gone_is_lost
@pytest.mark.slow
@pytest.mark.parametrize("scheme", [pytest.param("gs", marks=pytest.mark.soak), "s3"])
def test_lease_deleted_under_a_live_run(scheme, request, xla_cache, capsys):
    """`.lock` deleted under a live run and a second `train` started at once: the second takes
    the lease and reads the run only once the first must have stopped writing; the first finds
    its lease gone at its next renewal and stops (one line, exit 1) before writing anything
    more; the second trains to the end and the audit passes: every prompt trained once."""
    request.getfixturevalue("gcs_endpoint" if scheme == "gs" else "s3_endpoint")
    run = f"{new_bucket(scheme)}/run"
    first = train_proc(run, xla_cache, "run.lease_s=6", delay="step:0.5")
    try:
        wait_past(run, first, 3)
        storage.remove(storage.run_path(run) / ".lock")
        second = train_proc(run, xla_cache, "run.lease_s=6")
        try:
            assert first.wait(timeout=120) == 1
            err = first.stderr.read()
            tail = _after_steps(err)  # deleted, or taken by the second if it renewed after that one took it
            assert len(tail) == 1 and re.fullmatch(
                f"error: {run}/.lock: the run lock was (deleted|taken by pid {second.pid} on host .*) while this run "
                r"held it; stopped before writing anything more \(the last committed checkpoint step is intact\)",
                tail[0]), err[-3000:]
            assert second.wait(timeout=600) == 0, second.stderr.read()[-3000:]
            err2 = second.stderr.read()
            assert f"{run}/.lock was missing although" in err2 and "resumed step" in err2, err2[-3000:]
        finally:
            second.kill()
            second.wait(timeout=60)
    finally:
        first.kill()
        first.wait(timeout=60)
    rep = _audit(run, capsys)
    assert rep["finished"] and rep["epochs"][0]["trained_once"] == 36 and not rep["problems"]


HOLD_AND_PRUNE = """
import sys
from async_rl.store import rundir, runlock
from async_rl.store import storage
from async_rl.state.checkpoint import Checkpointer
run = storage.run_path(sys.argv[1])
lock = runlock.run_lock(run, 0, lease_s=2)
lock.acquire(run)
ckpt = Checkpointer(run / "checkpoints", keep=1, async_save=False)
ckpt.open()
print("held", flush=True)
sys.stdin.readline()
try:
    ckpt.prune()
    print("pruned", flush=True)
except rundir.LockLostError as e:
    print("lost:", e, flush=True)
"""


def test_a_paused_holder_deletes_nothing_after_its_lease_was_taken(bucket):
    """A holder SIGSTOPped past run.lease_s, its lease taken over meanwhile: once resumed, its
    first write (Orbax's keep-N deletion of old steps, ours on an object store) is refused by
    its own clock or its lost renewal, whichever comes first, and deletes nothing."""
    run = storage.run_path(f"{bucket}/run")
    for s in (1, 2):  # two committed steps, as Orbax marks them
        storage.write_atomic(run / "checkpoints" / str(s) / "commit_success.txt", b"ok")
    assert committed_steps(run / "checkpoints") == [1, 2]
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_PRUNE, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()[-2000:]
        holder.send_signal(signal.SIGSTOP)
        time.sleep(2.5)  # past its lease
        taker = runlock.run_lock(run, 0, lease_s=2)
        taker.acquire(run)  # watched unchanged for HOLD_OFF leases, then taken
        try:
            holder.stdin.write("go\n")  # it prunes the moment it runs again, racing its heartbeat
            holder.stdin.flush()
            holder.send_signal(signal.SIGCONT)
            out = holder.stdout.readline().strip()
            assert out.startswith("lost:"), (out, holder.stderr.read()[-2000:])
            assert committed_steps(run / "checkpoints") == [1, 2]  # nothing deleted
            assert json.loads(storage.read_text(run / ".lock"))["pid"] == os.getpid()
        finally:
            taker.release()
    finally:
        holder.kill()
        holder.wait(timeout=30)


# CI: killed, and paused with no signal (the bound ends it); the soak also pauses then sends a
# SIGTERM under a long bound (the signal ends it within seconds)
STALLS = [pytest.param("killed", marks=pytest.mark.slow), pytest.param("paused", marks=pytest.mark.slow),
          pytest.param("paused-sigterm", marks=pytest.mark.soak)]


@pytest.mark.parametrize("how", STALLS)
def test_store_stops_answering_mid_run(how, tmp_path, xla_cache, capsys):
    """The store stops answering at step 4, killed (connections refused) or paused with SIGSTOP
    (connections hang): the run stops with one line naming a path and the cause, exit 1, within
    run.storage_timeout_s (or within seconds of a SIGTERM, under a long bound), and exits
    without waiting on the clients' threads still inside their retries. Started again on the
    same data, the next `train` resumes the last committed step and the audit passes."""
    server = GcsServer(tmp_path / "gcs").start()
    env = GCS_ENV(server.url)
    try:
        with pointed_at(env):
            run = f"{new_bucket('gs')}/run"
            bound = 300 if how == "paused-sigterm" else 8
            p = train_proc(run, xla_cache, f"run.storage_timeout_s={bound}", "run.lease_s=60",
                           env={**env, "PYTHONFAULTHANDLER": "1"})
            try:
                wait_past(run, p, 3)
                server.kill() if how == "killed" else server.pause()
                t0 = time.monotonic()
                if how == "paused-sigterm":
                    time.sleep(3)
                    p.send_signal(signal.SIGTERM)
                    t0 = time.monotonic()
                try:
                    code = p.wait(timeout=240)
                except subprocess.TimeoutExpired:  # every thread's stack into stderr (faulthandler), for the failure
                    p.send_signal(signal.SIGABRT)
                    p.wait(timeout=60)
                    code = None
                took = time.monotonic() - t0
                err = p.stderr.read()
            finally:
                p.kill()
                p.wait(timeout=60)
            assert code == 1, (code, err[-3000:])
            assert took < (25 if how == "paused-sigterm" else bound + 30), (took, err[-3000:])
            tail = [ln for ln in _after_steps(err) if not ln.startswith("SIGTERM: stopping")]
            assert len(tail) == 1 and tail[0].startswith("error: ") and f"{run}/" in tail[0], err[-3000:]
            cause = {"killed": "Connect", "paused": r"no answer within 8 s|did not answer for \d+ s",
                     "paused-sigterm": "asked to stop"}[how]  # a call of ours, or a wait on Orbax's, gave up first
            assert re.search(cause, tail[0]) and "step is intact" in tail[0] and "Traceback" not in err, tail
            server.start() if how == "killed" else server.pause(False)
            steps = committed_steps(storage.run_path(run) / "checkpoints")
            again = train_proc(run, xla_cache, env=env)
            assert again.wait(timeout=600) == 0, again.stderr.read()[-3000:]
            assert f"resumed step {steps[-1]}" in again.stderr.read()
            rep = _audit(run, capsys)
        assert rep["finished"] and rep["epochs"][0]["trained_once"] == 36 and not rep["problems"]
    finally:
        server.close()


class _Silent:
    """A TCP port that accepts connections and never answers (a stalled store's endpoint)."""

    def __enter__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc):
        self.sock.close()


@pytest.mark.parametrize("scheme,stop", [("gs", False), ("s3", False), ("s3", True)], ids=["gs", "s3", "s3-stop"])
def test_a_call_the_store_never_answers_is_bounded_and_named(scheme, stop, monkeypatch):
    """A request the store accepts and never answers: it fails after run.storage_timeout_s as
    StorageError naming the path and 'no answer', not after the clients' own retries (minutes);
    once the run is asked to stop, within STALL_S whatever the bound."""
    from async_rl import signals
    with _Silent() as url:
        env = GCS_ENV(url) if scheme == "gs" else {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "k",
                                                    "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}
        if stop:
            monkeypatch.setattr(signals, "requested", lambda: True)
        with pointed_at(env):
            remote_io.configure(300 if stop else 3)
            try:
                t0 = time.monotonic()
                why = "no answer for [0-9]+ s, and the run was asked to stop" if stop else "no answer within 3 s"
                with pytest.raises(remote_io.StorageError, match=f"{scheme}://b1/run/x: read failed \\({why}"):
                    storage.read_bytes(storage.run_path(f"{scheme}://b1/run/x"))
                assert time.monotonic() - t0 < 9
            finally:
                remote_io.configure(remote_io.DEFAULT_TIMEOUT_S)


NO_KEYS = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SESSION_TOKEN": None, "AWS_PROFILE": None,
           "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
           "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.mark.parametrize("case", ["s3-no-credentials", "s3-endpoint-down", "gs-endpoint-down"])
def test_start_names_missing_credentials_or_a_down_endpoint(case, s3_endpoint, monkeypatch, capsys, request):
    """`train` and `audit` on a store they cannot use: one line naming the cause (not 'bucket
    does not exist'), exit 2, within seconds."""
    scheme = case[:2]
    url = f"{scheme}://b1/run"
    # a down gs:// endpoint is named when the probe's bound ends (the client retries until then):
    # a shorter bound, the same path
    monkeypatch.setattr(rundir, "PROBE_S", 3.0)
    if case == "s3-no-credentials":
        for k, v in NO_KEYS.items():
            monkeypatch.delenv(k, raising=False) if v is None else monkeypatch.setenv(k, v)
        want = ("no credentials",)
    else:
        # a port nothing listens on, held (bound, never listening) until the test ends so that no
        # server started beside it can take it: connections to it are refused
        held = socket.socket()
        request.addfinalizer(held.close)
        held.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{held.getsockname()[1]}"
        for k, v in (GCS_ENV(closed) if scheme == "gs" else {"AWS_ENDPOINT_URL": closed}).items():
            monkeypatch.setenv(k, v)
        # refused at once, or (a loaded host: the client's own socket timeout fires first) the bound
        want = ("connect", "no answer within")
    storage._fs.cache_clear()
    try:
        for args in (["audit", url], ["train", *TINY, f"run.dir={url}"]):
            capsys.readouterr()
            t0 = time.monotonic()
            assert cli.main(args) == 2
            err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
            assert len(err) == 1 and err[0].startswith("error: ") and any(w in err[0].lower() for w in want), err
            assert "does not exist" not in err[0] and "b1/run" in err[0]
            assert time.monotonic() - t0 < rundir.PROBE_S + 8, args[0]
    finally:
        storage._fs.cache_clear()
        remote_io.configure(remote_io.DEFAULT_TIMEOUT_S)


def test_lease_renewal_that_finds_it_gone_is_lost(bucket):
    """A renewal that finds the lease deleted (S3: 404 on a conditional replace; GCS: 412) loses
    it: the next check stops the holder before it writes, and a write under the run is refused."""
    run = storage.run_path(f"{bucket}/run")
    # renewed every 2 s: the deletion is found by a renewal long before the lease could expire
    # by the holder's own clock (a loaded host delays renewals), which would stop it for that instead
    lk = runlock.run_lock(run, 0, lease_s=6)
    lk.acquire(run)
    storage.remove(run / ".lock")  # as another process would
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                lk.check(run)
            except rundir.LockLostError as e:
                assert "was deleted" in str(e)
                break
            time.sleep(0.1)
        else:
            pytest.fail("the holder never noticed that its lease was deleted")
        with pytest.raises(rundir.LockLostError):
            storage.write_atomic(run / "lineage.jsonl" / "0000000001", b"{}\n")
    finally:
        lk.release()
    assert not storage.exists(run / "lineage.jsonl" / "0000000001")


def test_the_commit_record_is_written_only_while_the_lease_holds(bucket):
    """Orbax's commit record on an object store goes through the run's write guard (the lease
    check), after the metadata update that may wait on the store: a save whose lease was lost
    meanwhile never commits its step."""
    import numpy as np
    import orbax.checkpoint as ocp

    from async_rl.state.layout import temporary_path_class
    run = storage.run_path(f"{bucket}/run")
    d = run / "checkpoints"
    held = [True]

    def check():
        if not held[0]:
            raise rundir.LockLostError("lost")
    storage.guard(run, check)
    try:
        opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True,
                                            temporary_path_class=temporary_path_class(d))
        state = {"w": np.arange(4, dtype=np.float32)}
        with ocp.CheckpointManager(d, options=opts) as mngr:
            mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
            held[0] = False
            with pytest.raises(Exception) as got:
                mngr.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
            chain, e = [], got.value
            while e is not None:
                chain.append(e)
                e = e.__cause__ or e.__context__
            assert any(isinstance(x, rundir.LockLostError) for x in chain), chain
    finally:
        storage.unguard(run)
    assert committed_steps(d) == [1]


STUCK = """
import os, sys, threading, time
from async_rl import signals
from async_rl.store import remote_io
from async_rl.store import storage
signals.install()
remote_io.configure(300)
remote_io.watch_stop("s3://b1/run", lambda m: print(m, file=sys.stderr, flush=True))
def read():  # a call of ours: given up STALL_S after the stop request (the store counts as stalled)
    try:
        storage.read_bytes(storage.run_path("s3://b1/run/x"))
    except remote_io.StorageError:
        pass
threading.Thread(target=read, daemon=True).start()
print("waiting", flush=True)
time.sleep(120)  # the main thread inside a library's own wait, where no code of ours runs
"""


def test_a_stop_request_while_the_store_stalls_ends_the_process():
    """The backstop: a SIGTERM while the store does not answer and the main thread waits where
    no stalled call of ours can be given up (inside a library): the process exits 1 within
    seconds with one line, instead of after the library's own retries."""
    with _Silent() as url:
        env = dict(os.environ, AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s",
                   AWS_DEFAULT_REGION="us-east-1")
        p = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
        try:
            assert p.stdout.readline().strip() == "waiting", p.stderr.read()[-2000:]
            time.sleep(1)
            p.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            assert p.wait(timeout=60) == 1
            assert time.monotonic() - t0 < 2 * remote_io.STALL_S + 5
            err = [ln for ln in p.stderr.read().splitlines() if ln.strip() and not ln.startswith("SIGTERM: stopping")]
            assert len(err) == 1 and err[0].startswith("error: s3://b1/run: the store did not answer") \
                and "asked to stop" in err[0], err
        finally:
            p.kill()
            p.wait(timeout=30)
