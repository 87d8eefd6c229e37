"""Weights publication: the learner publishes version v once; a server is given v, and fetches
it, before it serves v.

Owns, on the trainer's side (`Publication`, driven from the remote backend's event loop): making
a version the fleet's, in version order (`publish_newer`; an older one arriving late is
skipped), by the transport `engine.weights_transport` names: `file`, one file per version under
run.dir (`weights.save`; local, gs://, s3://), the newest few kept and any file a server is still
reading kept until it ends; LoRA, the frozen base once per session and adapters alone after; or
`jax`, the version's leaves kept on this process and registered once per server and version
for it to pull (`transfer`). Pushing a version to one server (`catch_up`, `push`): an
`async-rl serve` server's `/update_weights`; a stock vLLM server's worker extension
(`worker_rpc`), and with LoRA the newest adapters as a PEFT directory loaded by name
(`/v1/load_lora_adapter`). Every push is bounded, and versions reach a server in order. The
versions given (`given`: a server reporting another one answers garbage).
On the server's side (`Fetcher`, `async-rl serve`): the version an `/update_weights` names
fetched (a file read, or the arrays pulled) and checked against the engine's tree, laid out on
the engine for its loop to swap in between chunks.
In-process backends take the learner's arrays directly (`pump.Pump.publish`); nothing here.
Does not own: the file format and the fingerprint (`weights`), moving arrays point to point
(`transfer`), which servers a run has and whether they are up (`fleet`), the HTTP server (`server`).
"""

from __future__ import annotations

import asyncio
import re
import time

from async_rl import faults
from async_rl.config import ConfigError
from async_rl.rollout import transfer, weights
from async_rl.store import runfiles, storage

BASE = "base.npz"  # LoRA: the frozen base, written once per session
VERSION_FILE = re.compile(r"v\d+\.npz")
PEFT_DIR = re.compile(r"peft-v\d+")  # LoRA on vLLM servers: one PEFT adapter directory per version
KEEP_VERSIONS = 3  # version files kept (a joining server may still be loading an older one)


class LoadFailed(RuntimeError):
    """A server did not load a weights version (the line names the version)."""


async def worker_rpc(client, url: str, method: str, *args: str, timeout: float = 30.0):
    """One `vllm_worker.FleetWorker` method on a vLLM server (its first worker's answer);
    None where the server has no such endpoint or method (it is not set up for a fleet)."""
    r = await client.post(f"{url}/collective_rpc", json={"method": method, "args": list(args), "timeout": timeout},
                          timeout=timeout + 10.0)
    if r.status_code in (404, 405) or (r.status_code == 500 and method in r.text):
        return None
    if r.status_code != 200:
        raise RuntimeError(f"/collective_rpc {method} answered {r.status_code}: {r.text[:200]}")
    return r.json()["results"][0]


class Publication:
    """One run's published weights and their way to each server (`fleet.Server`)."""

    def __init__(self, cfg, run_dir, client, on_change, *, run_tag: str = "", timeout_s: float = 60.0):
        self.cfg, self.client, self.on_change, self.run_tag = cfg, client, on_change, run_tag
        self.bound = max(60.0, timeout_s)  # seconds one server is given to load a version
        self.dir = storage.run_path(run_dir) / runfiles.FLEET_WEIGHTS
        self.transport = cfg.engine.weights_transport
        if self.transport == "jax" and (why := transfer.unavailable()) is not None:
            raise ConfigError(f"engine.weights_transport=jax: {why}")
        self.lora = cfg.learner.lora_rank > 0
        self.current: tuple[int, str] | None = None  # (version, uri) every server should hold
        self.given: set[int] = set()  # versions published (a server reporting another is garbage)
        self.offer: transfer.Offer | None = None  # jax: the newest version, kept on this process
        self.owner: transfer.Owner | None = None  # jax: this run's transfer server (started at the first push)
        self._owner_lock = asyncio.Lock()
        self._writing = asyncio.Lock()  # one version written at a time, in order
        self.base_uri: str | None = None  # LoRA: the frozen base's file (version files hold adapters)
        self._adapters: tuple | None = None  # LoRA: (version, its adapters) for vLLM servers' PEFT directories
        self._reading: dict[str, int] = {}  # version file -> servers loading it now (kept until they end)

    # ---- the trainer publishes ----------------------------------------------------------------

    def publish(self, params, version: int) -> str:
        """Makes `version` the fleet's (off the pump's lock): writes its file and keeps the newest
        few (file), or keeps its leaves here for the servers to pull (jax: no file; "" returned)."""
        if self.transport == "jax":
            self.offer = transfer.Offer(params, version)  # the previous one goes with its last registration
            self.current = (version, "")
            self.given.add(version)
            return ""
        storage.mkdirs(self.dir)
        uri = storage.url(self.dir / f"v{version:010d}.npz")
        only = None
        if self.base_uri is not None or any(map(weights.is_adapter, weights.keys(params))):
            only = weights.is_adapter  # LoRA: the frozen base once per session, then adapters alone
            if self.base_uri is None:
                base = storage.url(self.dir / BASE)
                weights.save(base, params, version, only=lambda k: not weights.is_adapter(k))
                self.base_uri = base
        weights.save(uri, params, version, only=only)
        if only is not None:
            from flax import nnx
            self._adapters = (version, nnx.filter_state(params, nnx.LoRAParam))
        self.current = (version, uri)
        self.given.add(version)
        for name in sorted(n for n in storage.listdir(self.dir) if VERSION_FILE.fullmatch(n))[:-KEEP_VERSIONS]:
            if name not in self._reading:
                storage.remove(self.dir / name)
        return uri

    async def publish_newer(self, params, version: int) -> bool:
        """`publish` off the event loop, one version at a time; False (nothing written) for a
        version no newer than the one published."""
        async with self._writing:
            if self.current is not None and version <= self.current[0]:
                return False
            await asyncio.to_thread(self.publish, params, version)
            return True

    # ---- each server is given it --------------------------------------------------------------

    async def catch_up(self, s) -> None:
        """Has one server load the newest version, one push at a time per server (a version
        published meanwhile is pushed next): versions reach a server in order."""
        async with s.pushing:
            while self.current is not None and s.version != self.current[0]:
                await self.push(s, *self.current)

    async def push(self, s, version: int, uri: str) -> None:
        """Has one server load `version` (bounded: a server killed mid-fetch is down, not awaited).
        Its file stays while the server reads it, however many versions are published meanwhile
        (a slow server is not taken down by the newest few being kept)."""
        name = uri.rsplit("/", 1)[-1]
        self._reading[name] = self._reading.get(name, 0) + 1
        try:
            await self._push(s, version, uri)
        except Exception as e:
            raise LoadFailed(f"loading weights version {version} failed: {type(e).__name__} {e}".strip()) from e
        finally:
            self._reading[name] -= 1
            if not self._reading[name]:
                del self._reading[name]

    async def _push(self, s, version: int, uri: str) -> None:
        if s.kind == "vllm":
            return await (self._push_lora(s) if self.lora else self._push_vllm(s, version, uri))
        if self.transport == "jax":
            offer = self.offer  # the newest version's leaves: an older one is gone already
            version = offer.version
            body = {"version": version, "transfer": await self._register(s, offer), "run": self.run_tag}
        else:
            body = {"version": version, "uri": uri, "run": self.run_tag}
            if self.base_uri is not None:
                body["base"] = self.base_uri
        r = await self.client.post(f"{s.url}/update_weights", json=body, timeout=self.bound)
        if r.status_code != 200:
            raise RuntimeError(f"/update_weights answered {r.status_code}: {r.text[:200]}")
        got = r.json().get("version")
        if got != version:
            raise RuntimeError(f"/update_weights answered version {got}, asked {version}")
        s.version = version
        s.last_ok = time.monotonic()
        self.on_change()

    async def _register(self, s, offer: transfer.Offer) -> dict:
        """`/update_weights`' transfer for one server: `offer` registered for one pull, kept for
        the push's bound (what the server is given to pull it in) and a margin, then dropped."""
        async with self._owner_lock:
            if self.owner is None:
                from urllib.parse import urlsplit
                host = transfer.local_host(urlsplit(s.url).hostname or "127.0.0.1")
                self.owner = await asyncio.to_thread(transfer.Owner, host)
        uuid = await asyncio.to_thread(self.owner.offer, offer, self.bound + 30.0)
        return {"address": self.owner.address, "uuid": uuid, "leaves": offer.leaves, "timeout_s": self.bound}

    async def _push_vllm(self, s, version: int, uri: str) -> None:
        """A vLLM server's tokens carry no version: it loads only with none of this run's
        samples on it (they continue elsewhere, or here once it holds the new version), so
        every token it sends comes from the version it held when its request began."""
        ready, s.state = s.state == "ready", "loading" if s.state == "ready" else s.state
        if ready:
            self.on_change()
        await worker_rpc(self.client, s.url, "async_rl_load", uri, timeout=self.bound)
        r = await self.client.post(f"{s.url}/reset_prefix_cache", timeout=min(30.0, self.bound))
        r.raise_for_status()
        s.version, s.last_ok = version, time.monotonic()
        if ready and s.state == "loading":
            s.state = "ready"
        self.on_change()

    async def _push_lora(self, s) -> None:
        """A LoRA run's newest adapters into a vLLM server under a name of their own
        (`/v1/load_lora_adapter`): each request names the adapter it runs with, so samples on the
        server keep theirs and the version a token carries is the one its request named. The
        name before the previous one is unloaded (in-flight requests keep what they hold; the
        previous may still be named by a request being sent). In place: a server that was down
        but kept running may hold the name already."""
        version, path = await asyncio.to_thread(self._peft)
        name = f"{self.run_tag or 'async-rl'}-v{version}"
        r = await self.client.post(f"{s.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path,
                                                                         "load_inplace": True},
                                   timeout=self.bound)
        if r.status_code != 200:
            raise RuntimeError(f"/v1/load_lora_adapter answered {r.status_code}: {r.text[:200]}")
        s.adapters.append(name)
        s.model, s.version, s.last_ok = name, version, time.monotonic()
        for old in s.adapters[:-2]:
            r = await self.client.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": old}, timeout=self.bound)
            if r.status_code not in (200, 404):
                raise RuntimeError(f"/v1/unload_lora_adapter answered {r.status_code}: {r.text[:200]}")
        del s.adapters[:-2]
        self.on_change()

    def _peft(self) -> tuple[int, str]:
        """The newest version's adapters as a PEFT directory under run.dir (written once; the
        newest few kept: vLLM reads an adapter again from its directory once it dropped it)."""
        from async_rl.model import hf

        version, adapters = self._adapters
        out = storage.run_path(self.dir) / f"peft-v{version:010d}"
        if not (out / "adapter_config.json").exists():
            tmp = out.with_name(out.name + ".tmp")
            storage.remove_tree(tmp)
            hf.save_peft(adapters, tmp, rank=self.cfg.learner.lora_rank,
                         alpha=self.cfg.learner.lora_alpha, gemma=self.cfg.model.gemma)
            storage.move(tmp, out)
        for name in sorted(n for n in storage.listdir(self.dir) if PEFT_DIR.fullmatch(n))[:-KEEP_VERSIONS]:
            storage.remove_tree(storage.run_path(self.dir) / name)
        return version, str(out.resolve())


class Fetcher:
    """A server's side: what an `/update_weights` body names, fetched and laid out on its engine."""

    def __init__(self, engine, like):
        self.engine, self.like = engine, like  # `like`: the tree a version is checked against (`weights.engine_like`)
        self._base: tuple[str | None, object] = (None, None)  # LoRA: (its uri, leaves), read once per trainer session

    def fetch(self, src, base: str | None = None):
        """The version `src` names on this server's engine (blocking: run off the event loop)."""
        faults.delay("weights")  # a fault test's slow fetch (ASYNC_RL_DELAY=weights:<s>): a kill lands inside it
        if isinstance(src, str):
            if base is not None and self._base[0] != base:
                self._base = (base, weights.load_leaves(base))
            return self.engine.load_params(weights.load(src, self.like, base=self._base[1] if base else None))
        address = src["address"]
        transfer.check(src["leaves"], self.like, f"weights from {address}")
        tree = transfer.pull(address, src["uuid"], self.like, device=self.engine.mesh.devices.flat[0],
                             seconds=src["timeout_s"])
        return self.engine.load_params(tree)
