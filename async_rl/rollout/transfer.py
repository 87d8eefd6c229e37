"""Weights moved point to point (`engine.weights_transport=jax`): a generation server pulls a
version's arrays straight from the trainer's memory with `jax.experimental.transfer` (the path
TPU and GPU clusters take over DCN or RDMA); no file lies between them.

Owns: starting a transfer server (`start`, on the address a peer reaches this machine at,
`local_host`); the trainer's side (`Offer`: one version's engine-layout leaves, each whole on
one trainer device; `Owner.offer` registers them for ONE pull, as the library serves a
registration once, with a deadline past which the transfer server drops it); what a server
checks before it pulls (`leaves_of`, `check`: every leaf's name, dtype and shape, the first
that differs named); the server's side (`pull`: the leaves onto one engine device, shaped as
the server's own tree). Nothing in the library times out: every call here runs in a thread
with a deadline (`bounded`) and fails with one line naming the address and the seconds; a
call past its deadline is left to finish in its (daemon) thread.
The wire layout is each leaf whole on one device at both ends: the library copies buffer by
buffer, so both sides must name the same layout, and a server's mesh is not the trainer's
(`Engine.load_params` lays the pulled leaves out on the server's mesh afterwards).
Does not own: when a version is published or pushed (`fleet`), swapping it in (`server`),
the file transport (`weights`).
"""

from __future__ import annotations

import datetime
import itertools
import random
import socket
import threading

import jax

from async_rl.rollout.weights import _flat

START_S = 30.0  # starting a transfer server
REGISTER_S = 30.0  # registering a version for one pull (returns at once when it works)
PULL_S = 60.0  # a pull, where the trainer names no bound


class TransferError(RuntimeError):
    """A transfer that failed or did not finish in time (one line, naming the address)."""


def unavailable() -> str | None:
    """Why this JAX cannot move weights point to point; None where it can."""
    try:
        from jax.experimental import transfer
        transfer.start_transfer_server  # noqa: B018 - present since jax 0.5
    except (ImportError, AttributeError) as e:
        return f"jax.experimental.transfer is not available in jax {jax.__version__} ({type(e).__name__}: {e})"
    return None


def _line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def bounded(fn, seconds: float, what: str):
    """fn() in a daemon thread; TransferError (`what: ...`, one line) where it raises or has not
    returned within `seconds` (it is then left running)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
    t = threading.Thread(target=run, name="weights-transfer", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TransferError(f"{what}: no answer in {seconds:g} s")
    if "error" in box:
        raise TransferError(f"{what}: {_line(box['error'])}") from None
    return box["value"]


def local_host(toward: str) -> str:
    """This machine's address on its route to host `toward` (no packet is sent): the address
    a peer there can reach; the host name's address, then loopback, where there is no route."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(toward, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


def host_of(address: str) -> str:
    """The host of `HOST:PORT` or `[V6]:PORT`."""
    return address.rpartition(":")[0].strip("[]")


def start(host: str, seconds: float = START_S):
    """A transfer server of this process's default JAX client on `host` (a free port; its
    `address()` is what peers connect to)."""
    from jax.experimental import transfer
    devices = jax.devices()
    at = f"[{host}]:0" if ":" in host else f"{host}:0"
    return bounded(lambda: transfer.start_transfer_server(devices[0].client, at, [at] * len(devices)), seconds,
                   f"starting a transfer server on {host}")


def leaves_of(tree) -> list[list]:
    """[name, dtype, shape] of every leaf, in tree order (what a server checks before it pulls)."""
    return [[name, jax.numpy.dtype(x.dtype).name, list(x.shape)] for name, x in _flat(tree)]


def check(sent, like, where: str) -> None:
    """ValueError (one line, `where: ...`) naming the first leaf of `sent` (`leaves_of` of the
    trainer's tree) that is missing, extra, or of another dtype or shape than `like`'s."""
    if not isinstance(sent, list) or not all(isinstance(x, list) and len(x) == 3 for x in sent):
        raise ValueError(f"{where}: leaves is not a list of [name, dtype, shape]")
    have = {str(n): (str(d), [int(i) for i in s]) for n, d, s in sent}
    mine = leaves_of(like)
    for name, dtype, shape in mine:
        if name not in have:
            raise ValueError(f"{where}: leaf {name} missing from the trainer's tree")
        if have[name] != (dtype, shape):
            d, s = have[name]
            raise ValueError(f"{where}: leaf {name} is {d}{s} on the trainer, the engine's is {dtype}{shape}")
    extra = sorted(set(have) - {n for n, _, _ in mine})
    if extra:
        raise ValueError(f"{where}: leaf {extra[0]} of the trainer's tree is not in the engine's tree")


# ---- the trainer's side ---------------------------------------------------------------------

class Offer:
    """One version's leaves on the trainer, each whole on one device (a copy only where a leaf
    is elsewhere or sharded), made once per version and registered once per pulling server."""

    def __init__(self, params, version: int, device=None):
        device = device if device is not None else jax.devices()[0]
        self.version, self.leaves = version, leaves_of(params)
        self.arrays = jax.block_until_ready([jax.device_put(x, device) for _, x in _flat(params)])


class Owner:
    """The trainer's transfer server, alive for the run; `offer` registers a version for one pull."""

    def __init__(self, host: str):
        self.server = start(host)
        self.address = self.server.address()
        self._uuids = itertools.count(random.randrange(1, 2 ** 40) << 20)

    def offer(self, offer: Offer, keep_s: float) -> int:
        """A uuid under which one server may pull `offer` within `keep_s` seconds; the transfer
        server drops the registration after that (at its next registration)."""
        uuid = next(self._uuids)
        until = datetime.datetime.now() + datetime.timedelta(seconds=keep_s)
        bounded(lambda: self.server.await_pull(uuid, offer.arrays, timeout=until), REGISTER_S,
                f"registering weights version {offer.version} at {self.address}")
        return uuid


# ---- the server's side ----------------------------------------------------------------------

_LOCAL: dict[str, object] = {}  # local host -> this process's transfer server
_LOCAL_LOCK = threading.Lock()


def local_server(toward: str):
    """This process's transfer server on its address toward host `toward` (started once)."""
    host = local_host(toward)
    with _LOCAL_LOCK:
        if host not in _LOCAL:
            _LOCAL[host] = start(host)
        return _LOCAL[host]


def reachable(address: str, seconds: float, what: str) -> None:
    """TransferError where nothing accepts a connection at `address`: the library would retry
    such a pull forever (and a call still running when the process exits aborts it)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=min(seconds, 10.0)).close()
    except (OSError, ValueError) as e:
        raise TransferError(f"{what}: nothing answers there ({_line(e)})") from None


def pull(address: str, uuid: int, like, *, device=None, seconds: float = PULL_S):
    """The tree registered under `uuid` at `address`, shaped as `like` (arrays or
    ShapeDtypeStructs, any tree), its leaves on `device` (default: the first). TransferError
    (one line naming the address and the seconds) where it fails or takes longer than `seconds`."""
    from jax.sharding import SingleDeviceSharding
    on = SingleDeviceSharding(device if device is not None else jax.devices()[0])
    want = [jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=on) for _, x in _flat(like)]
    what = f"pulling weights from {address}"
    reachable(address, seconds, what)
    server = local_server(host_of(address))

    def go():
        return jax.block_until_ready(server.connect(address).pull(uuid, want))
    got = bounded(go, seconds, what)
    if len(got) != len(want):
        raise TransferError(f"{what}: {len(got)} arrays came, {len(want)} were asked for")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), got)
