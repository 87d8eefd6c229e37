"""Weights moved point to point (`engine.weights_transport=jax`, `rollout.transfer`): between two
real processes, bit for bit (bfloat16 included); a pull from an address nobody serves fails
within its bound with one line; a run on two servers that pull every version from the trainer."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("jax.experimental.transfer", reason="jax.experimental.transfer is not in this jax")

from async_rl.rollout import transfer  # noqa: E402

if (why := transfer.unavailable()) is not None:
    pytest.skip(why, allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

TREE = """
import numpy as np, jax.numpy as jnp
def tree():
    r = np.random.default_rng(7)
    return {"embed": jnp.asarray(r.normal(size=(6, 5)), jnp.float32),
            "layers": {"w": jnp.asarray(r.normal(size=(3, 4)) * 1e-3, jnp.bfloat16),
                       "ids": jnp.asarray(r.integers(-9, 9, size=(2, 2)), jnp.int32)}}
"""

OWNER = TREE + """
import sys
from async_rl.rollout import transfer
owner = transfer.Owner("127.0.0.1")
offer = transfer.Offer(tree(), 3)
uuids = [owner.offer(offer, 60.0) for _ in range(2)]  # one registration per pull
print(json.dumps({"address": owner.address, "uuids": uuids, "leaves": offer.leaves}), flush=True)
sys.stdin.read()  # until the test closes it
"""


def _tree():
    scope: dict = {}
    exec(TREE, scope)
    return scope["tree"]()


def _bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind not in "iu" else a


def test_a_tree_moves_between_two_processes_bit_for_bit_and_each_registration_serves_one_pull():
    owner = subprocess.Popen([sys.executable, "-c", "import json\n" + OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        line = owner.stdout.readline()
        assert line, owner.stderr.read()[-3000:]
        got = json.loads(line)
        want = _tree()
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), want)
        transfer.check(got["leaves"], like, "test")  # the trainer's tree is the engine's
        for uuid, device in zip(got["uuids"], jax.devices()[:2]):
            t0 = time.perf_counter()
            out = transfer.pull(got["address"], uuid, like, device=device, seconds=60)
            print(f"pulled in {time.perf_counter() - t0:.3f} s")
            assert jax.tree.structure(out) == jax.tree.structure(want)
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
                assert a.dtype == b.dtype and a.shape == b.shape and a.devices() == {device}
                np.testing.assert_array_equal(_bits(a), _bits(b))
        assert jax.tree.leaves(out)[-1].dtype == jnp.bfloat16
    finally:
        owner.stdin.close()
        owner.wait(timeout=60)


def test_a_pull_from_an_address_nobody_serves_fails_within_its_bound_in_one_line():
    like = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(transfer.TransferError) as e:
        transfer.pull(address, 12345, like, seconds=3)
    assert "\n" not in str(e.value) and address in str(e.value), e.value
    with socket.socket() as silent:  # accepts connections, never answers: the pull's own deadline ends it
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(transfer.TransferError) as e:
            transfer.pull(address, 12345, like, seconds=3)
        took = time.monotonic() - t0
    msg = str(e.value)
    assert 3 <= took < 3 + 5, took
    assert msg == f"pulling weights from {address}: no answer in 3 s", msg
    stuck = [t for t in threading.enumerate() if t.name == "weights-transfer"]
    for t in stuck:  # the listener is gone: the call left behind ends too
        t.join(30)
    assert not any(t.is_alive() for t in stuck)


def test_a_tree_that_differs_is_named_by_its_first_leaf():
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _tree())
    sent = transfer.leaves_of(like)
    transfer.check(sent, like, "w")
    with pytest.raises(ValueError, match=r"^w: leaf layers/w is float32\[3, 4\] on the trainer, the engine's is bfloat16"):
        transfer.check([[n, "float32" if n == "layers/w" else d, s] for n, d, s in sent], like, "w")
    with pytest.raises(ValueError, match="leaf embed missing"):
        transfer.check(sent[1:], like, "w")
    with pytest.raises(ValueError, match="leaf extra of the trainer's tree is not in the engine's"):
        transfer.check([*sent, ["extra", "float32", [1]]], like, "w")


@pytest.mark.slow
def test_a_run_on_two_servers_pulling_each_version_from_the_trainer(tmp_path, xla_cache):
    pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from fleet_servers import SHARED, Server, stop_all
    from helpers import run_cli

    from async_rl.state.audit import audit
    run_dir = tmp_path / "run"
    a, b = Server(), Server()
    try:
        servers = f"engine.servers={a.ready().url},{b.ready().url}"
        r = run_cli(run_dir, *SHARED, "data.num_records=16", "engine.backend=remote", "engine.weights_transport=jax",
                    servers, cache=xla_cache)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        stop_all()
    rep = audit(run_dir)
    assert rep["ok"], rep
    final = json.loads((run_dir / "final.json").read_text())
    assert final["step"] == 8, final
    held = sorted((run_dir / "fleet_weights").glob("*.npz"))  # the session tag is there, no weights
    assert held == [], held
    said = [line for line in r.stderr.splitlines() if line.startswith("fleet:")]
    assert any("joined" in line and a.url in line for line in said), said
    assert not any("is down" in line for line in said), said


def test_update_weights_names_what_is_wrong_with_a_transfer_body():
    from async_rl.rollout.server import Api, BadRequest
    src = Api.source({"version": 1, "transfer": {"address": "10.0.0.1:5", "uuid": 7, "leaves": []}})
    assert src == {"address": "10.0.0.1:5", "uuid": 7, "leaves": [], "timeout_s": transfer.PULL_S}
    assert Api.source({"version": 1, "uri": "/w.npz"}) == "/w.npz"
    for body, said in [({}, "missing uri (a weights file) or transfer"), ({"transfer": []}, "transfer: not an object"),
                       ({"transfer": {"uuid": 7}}, "missing transfer.address"),
                       ({"transfer": {"address": "a:1", "uuid": "7"}}, "transfer.uuid='7': not an integer"),
                       ({"transfer": {"address": "a:1", "uuid": 7}}, "transfer.leaves: missing"),
                       ({"transfer": {"address": "a:1", "uuid": 7, "leaves": [], "timeout_s": 0}}, "transfer.timeout_s=0")]:
        with pytest.raises(BadRequest, match=said.replace("(", r"\(").replace(")", r"\)")):
            Api.source(body)
