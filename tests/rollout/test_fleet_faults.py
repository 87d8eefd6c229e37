"""Bad input and faults of a fleet (docs/fleet.md, "Faults"): each is one line naming the server
or the file, nothing is lost, and the trainer never hangs on a server."""
import asyncio
import signal
import threading

import pytest
from fleet_servers import SHARED, TRAIN, Server, shared_server, stop_all, write_servers
from helpers import lineage, run_cli, spawn, wait_until

from async_rl import config as C
from async_rl.rollout.fleet import Fleet, parse_urls
from async_rl.state.audit import audit

pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

SMALL = ["data.num_records=16"]  # 8 steps


@pytest.fixture
def servers():
    yield
    stop_all()


@pytest.fixture(scope="module")
def good():
    """A well-behaved server the tests that need one share, one trainer after another."""
    with shared_server() as s:
        yield s


def remote(servers_file) -> list[str]:
    return [*SHARED, *TRAIN, *SMALL, "engine.backend=remote", f"engine.servers_file={servers_file}"]


def finished_once(run_dir, prompts: int = 16) -> None:
    rep = audit(run_dir)
    assert rep["ok"], rep
    assert sorted(r["prompt_id"] for r in lineage(run_dir)) == list(range(prompts))


def unreachable() -> str:
    from helpers import free_port
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


@pytest.mark.slow
def test_garbage_from_a_server_takes_it_down_and_its_samples_go_on_elsewhere(tmp_path, xla_cache, servers, good):
    """A token past the vocabulary, a version never given, a stream cut inside an event; and a
    server on another model (refused by fingerprint, the field named)."""
    bad = {kind: Server(fault=f"garble:{kind}:3") for kind in ("token", "version", "cut")}
    other = Server("model.d_ff=128")
    for s in (*bad.values(), other):
        s.ready()
    write_servers(tmp_path / "servers.txt", [*bad.values(), other, good])
    r = run_cli(tmp_path / "run", *remote(tmp_path / "servers.txt"), cache=xla_cache, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    said = r.stderr
    assert f"fleet: server {bad['token'].url} is down: answered garbage: a token id outside the vocabulary" in said
    assert f"fleet: server {bad['version'].url} is down: answered garbage: weights versions [" in said
    assert f"fleet: server {bad['cut'].url} is down: answered garbage" in said
    assert f"fleet: refused server {other.url}: model.d_ff: 64 vs 128" in said
    finished_once(tmp_path / "run")


class Said:
    """A process's stderr, read on a thread as it comes (every wait on it bounded)."""

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        threading.Thread(target=lambda: self.lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        wait_until(lambda: any(text in line for line in self.lines) or self.proc.poll() is not None, timeout, text)
        assert any(text in line for line in self.lines), "".join(self.lines)[-3000:]

    def __str__(self) -> str:
        return "".join(self.lines)


@pytest.mark.slow
def test_no_server_at_start_is_said_the_trainer_waits_then_trains_when_one_joins(tmp_path, xla_cache, good):
    late = good  # joins the servers file while the trainer waits
    servers_file = tmp_path / "servers.txt"
    gone = unreachable()
    servers_file.write_text(gone + "\n")
    p = spawn(tmp_path / "run", *remote(servers_file), cache=xla_cache)
    said = Said(p)
    try:
        said.wait_for(f"fleet: server {gone} is down: ConnectError")
        said.wait_for("fleet: waiting for a generation server: none ready")
        write_servers(servers_file, [late])
        said.wait_for(f"fleet: server {late.url} joined")
        assert p.wait(timeout=300) == 0, str(said)
    finally:
        if p.poll() is None:
            p.kill()
    finished_once(tmp_path / "run")


@pytest.mark.slow
def test_with_every_server_gone_the_trainer_says_it_waits_and_sigterm_exits_zero(tmp_path, xla_cache, servers):
    servers_file = tmp_path / "servers.txt"
    servers_file.write_text(unreachable() + "\n")
    p = spawn(tmp_path / "run", *remote(servers_file), cache=xla_cache)
    said = Said(p)
    try:
        said.wait_for("fleet: waiting for a generation server: none ready")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0, str(said)
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
def test_a_server_killed_while_it_loads_weights_is_down_and_the_run_goes_on(tmp_path, xla_cache, servers, good):
    slow = Server(weights_delay=4.0)
    write_servers(tmp_path / "servers.txt", [slow.ready(), good])
    p = spawn(tmp_path / "run", *remote(tmp_path / "servers.txt"), cache=xla_cache)
    said = Said(p)
    try:
        said.wait_for(f"fleet: server {good.url} joined")  # `slow` is loading version 0 for 4 s meanwhile
        slow.kill()
        said.wait_for(f"fleet: server {slow.url} is down")
        assert p.wait(timeout=300) == 0, str(said)
    finally:
        if p.poll() is None:
            p.kill()
    finished_once(tmp_path / "run")


@pytest.mark.slow
def test_a_slow_server_loading_weights_does_not_hold_the_learner(tmp_path, xla_cache, servers, good):
    """A server alive but 10 s slow to load each version: new samples go to the server that holds
    the run's version and the slow one's samples keep theirs, so no step waits for its loads,
    and its version file is kept while it reads it. The slow server alone makes the first
    step's samples; the other joins then, and the run publishes more versions than are kept
    while the slow one loads one. Held at each swap, the 22 steps after the second would take
    22 x 10 s; they take a fraction."""
    from async_rl.obs.metrics import read_jsonl

    delay = 10.0
    slow = Server(weights_delay=delay)
    servers_file = tmp_path / "servers.txt"
    write_servers(servers_file, [slow.ready()])
    p = spawn(tmp_path / "run", *remote(servers_file), "data.num_records=48", cache=xla_cache)
    said = Said(p)
    try:
        said.wait_for(f"fleet: server {slow.url} joined")
        write_servers(servers_file, [slow, good])
        assert p.wait(timeout=300) == 0, str(said)
    finally:
        if p.poll() is None:
            p.kill()
    assert f"fleet: server {good.url} joined" in str(said)
    assert f"fleet: server {slow.url} is down" not in str(said), str(said)[-3000:]  # slow, not down
    times = {m["step"]: m["time"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "time" in m}
    span = times[max(times)] - times[min(times) + 1]  # the first step (the slow server's) left out
    assert max(times) - min(times) - 1 == 22 and span < 0.3 * 22 * delay, times
    finished_once(tmp_path / "run", prompts=48)


def test_a_missing_or_garbage_servers_file_is_one_line_and_the_servers_stay(tmp_path):
    """Membership read straight from the fleet: the previous servers are kept."""
    f = tmp_path / "servers.txt"
    f.write_text("http://127.0.0.1:1\nhttp://127.0.0.1:2\n")
    cfg = C.load("configs/tiny.yaml", ["engine.backend=remote", f"engine.servers_file={f}"])
    said: list[str] = []
    fleet = Fleet(cfg, {}, tmp_path / "run", client=None, log=said.append, on_change=lambda: None)

    async def refresh():
        return await fleet.refresh()
    asyncio.run(refresh())
    assert sorted(fleet.servers) == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    f.write_text("http://127.0.0.1:1\nnot a url\n")
    assert asyncio.run(refresh()) == []
    assert said == [f"fleet: engine.servers_file={f}: 'not a url' is not an http:// or https:// URL; "
                    "the previous servers are kept"]
    f.unlink()
    asyncio.run(refresh())
    assert len(said) == 2 and said[1].startswith(f"fleet: engine.servers_file={f}: ") and "kept" in said[1]
    assert all(s.state == "new" for s in fleet.servers.values()), "a bad read dropped a server"
    f.write_text("http://127.0.0.1:2\n")
    gone = asyncio.run(refresh())
    assert [s.url for s in gone] == ["http://127.0.0.1:1"]
    assert parse_urls("http://a:1, https://b:2 # comment", "x") == ["http://a:1", "https://b:2"]
    with pytest.raises(ValueError, match="'ftp://a' is not an http"):
        parse_urls("ftp://a", "engine.servers")
