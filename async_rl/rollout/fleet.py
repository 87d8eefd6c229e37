"""The fleet: which generation servers a run has, whether each may take work, and its weights.

Owns: membership (`engine.servers`, `engine.servers_file` re-read every few seconds,
`engine.servers_dns` resolved to every address behind a name), joining a server (its
`/v1/fleet/info` fingerprint against the run's: one line naming the field when they differ,
and the server is refused), giving it the weights version the run is on before it gets work
(`/update_weights`: with `engine.weights_transport=file` the file `publish` wrote under
run.dir, with `jax` a registration of the version `publish` kept, one per server and version,
that the server pulls from this process), health (a server that fails a probe or a stream is
down; one silent past `engine.health_timeout_s` is down; a down server is asked again and
rejoins), and the version files' lifetime. Every call is bounded.
Does not own: the samples on a server or their streams (`remote`), the weights file format
(`weights`), moving arrays point to point (`transfer`), which sample goes where (`allocator`).
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from dataclasses import dataclass, field

from async_rl.config import ConfigError
from async_rl.rollout import transfer, weights
from async_rl.store import runfiles, storage

PROBE_EVERY_S = 2.0  # membership re-read and health probes
BASE = "base.npz"  # LoRA: the frozen base, written once per session
VERSION_FILE = re.compile(r"v\d+\.npz")
PEFT_DIR = re.compile(r"peft-v\d+")  # LoRA on vLLM servers: one PEFT adapter directory per version
SESSION = "session"  # the request tag of the trainer session that drives the fleet now
VLLM_HOW = ("a vLLM server must run with VLLM_SERVER_DEV_MODE=1 and "
            "--worker-extension-cls async_rl.rollout.vllm_worker.FleetWorker")
KEEP_VERSIONS = 3  # version files kept (a joining server may still be loading an older one)


@dataclass(eq=False)
class Server:
    url: str
    state: str = "new"  # new | joining | ready | down | refused | gone
    version: int | None = None  # weights it holds
    capacity: int = 0  # samples it generates at once
    active: int = 0  # samples of this run on it now
    last_ok: float = field(default_factory=time.monotonic)  # last answer of any kind
    why: str = ""  # why it is down or refused (said once)
    pushing: asyncio.Lock = field(default_factory=asyncio.Lock)  # one weights load at a time
    kind: str = "async-rl"  # async-rl | vllm (a stock `vllm serve` with the worker extension)
    model: str = "async-rl"  # the model name its completions requests carry (LoRA on vLLM: the adapter's)
    adapters: list = field(default_factory=list)  # vLLM + LoRA: adapter names loaded, oldest first


class LoadFailed(RuntimeError):
    """A server did not load a weights version (the line names the version)."""


def parse_urls(text: str, source: str) -> list[str]:
    """URLs from a comma- or line-separated list; raises ValueError naming the bad entry."""
    urls = []
    for raw in text.replace(",", "\n").splitlines():
        u = raw.split("#", 1)[0].strip().rstrip("/")
        if not u:
            continue
        if not u.startswith(("http://", "https://")) or not u.split("//", 1)[1]:
            raise ValueError(f"{source}: {u!r} is not an http:// or https:// URL")
        urls.append(u)
    return urls


class Fleet:
    """The servers of one run, driven from the backend's event loop (`remote.RemoteRollout`)."""

    def __init__(self, cfg, fingerprint: dict, run_dir, client, log, on_change, run_tag: str = "",
                 n_tokens: int = 0):
        e = cfg.engine
        self.cfg, self.n_tokens = cfg, n_tokens
        self.static, self.file, self.dns = e.servers, e.servers_file, e.servers_dns
        self.timeout_s = e.health_timeout_s
        self.fingerprint, self.client, self.log, self.on_change = fingerprint, client, log, on_change
        self.dir = storage.run_path(run_dir) / runfiles.FLEET_WEIGHTS
        self.transport = e.weights_transport
        if self.transport == "jax" and (why := transfer.unavailable()) is not None:
            raise ConfigError(f"engine.weights_transport=jax: {why}")
        self.offer: transfer.Offer | None = None  # jax: the newest version, kept on this process
        self.owner: transfer.Owner | None = None  # jax: this run's transfer server (started at the first push)
        self._owner_lock = asyncio.Lock()
        self.servers: dict[str, Server] = {}
        # the previous trainer session's tag: its requests still on a server are aborted at join
        self.run_tag = run_tag
        self.fence = self._take_session(run_tag) if run_tag else None
        self.base_uri: str | None = None  # LoRA: the frozen base's file (version files hold adapters)
        self.lora = cfg.learner.lora_rank > 0
        self._adapters: tuple | None = None  # LoRA: (version, its adapters) for vLLM servers' PEFT directories
        self.current: tuple[int, str] | None = None  # (version, uri) every server should hold
        self.given: set[int] = set()  # versions published to the fleet (a server reporting another is garbage)
        self._file_said = ""
        self._waiting_said = 0.0
        self._reading: dict[str, int] = {}  # version file -> servers loading it now (kept until they end)
        self.closing = False  # the trainer is closing the fleet: its calls end, no server is down for it

    def _take_session(self, tag: str) -> str | None:
        """Records this session's request tag; returns the one recorded before (a killed trainer's)."""
        p = self.dir / SESSION
        before = storage.read_text(p).strip() if storage.exists(p) else None
        storage.mkdirs(self.dir)
        storage.write_atomic(p, tag + "\n")
        return before or None

    # ---- membership -------------------------------------------------------------------------

    async def members(self) -> list[str] | None:
        """The URLs the config names now; None where a source could not be read (kept as was)."""
        urls = parse_urls(self.static, "engine.servers") if self.static else []
        if self.file:
            try:
                text = await asyncio.to_thread(storage.read_text, self.file)
                urls += parse_urls(text, f"engine.servers_file={self.file}")
                self._file_said = ""
            except (OSError, ValueError) as e:  # parse_urls' lines name the file already
                named = str(e) if type(e) is ValueError else f"engine.servers_file={self.file}: {e}"
                why = f"fleet: {named}; the previous servers are kept"
                if why != self._file_said:
                    self.log(why)
                    self._file_said = why
                return None
        if self.dns:
            host, _, port = self.dns.rpartition(":")
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                urls += sorted({f"http://{_host(i[4][0])}:{port}" for i in infos})
            except (OSError, ValueError) as e:
                self.log(f"fleet: engine.servers_dns={self.dns} did not resolve ({e}); the previous servers are kept")
                return None
        return list(dict.fromkeys(urls))

    async def refresh(self) -> list[Server]:
        """Re-reads membership; returns the servers that left (their samples go elsewhere)."""
        urls = await self.members()
        gone = []
        if urls is not None:
            for url in urls:
                if url not in self.servers or self.servers[url].state == "gone":
                    self.servers[url] = Server(url)
            for url, s in self.servers.items():
                if url not in urls and s.state != "gone":
                    self.log(f"fleet: server {url} left the servers list")
                    s.state = "gone"
                    gone.append(s)
        return gone

    # ---- joining, health, weights -------------------------------------------------------------

    async def probe(self, s: Server) -> bool:
        """One health probe of a ready server; False once it is down."""
        try:
            r = await self.client.get(f"{s.url}/health", timeout=min(5.0, self.timeout_s))
            r.raise_for_status()
            s.last_ok = time.monotonic()
            return True
        except Exception as e:  # noqa: BLE001 - any failure to answer is the server's
            if time.monotonic() - s.last_ok > self.timeout_s:
                self.down(s, f"no answer for {self.timeout_s:g} s ({type(e).__name__})")
                return False
            return True

    async def join(self, s: Server) -> None:
        """Asks a new or down server who it is and gives it the run's weights; ready after. A
        down server that still does not answer stays down without another line."""
        was_down, s.state = s.state == "down", "joining"
        try:
            r = await self.client.get(f"{s.url}/v1/fleet/info", timeout=min(10.0, self.timeout_s))
            why = await (self._vllm(s) if r.status_code == 404 else self._ours(s, r))
            if why is not None:
                return self.refuse(s, why)
            s.version = None  # what it holds may be another session's: it loads this one's
            await self.catch_up(s)
            if s.state == "joining":
                was = s.why
                s.state, s.last_ok, s.why = "ready", time.monotonic(), ""
                self.log(f"fleet: server {s.url} {'is back' if was else 'joined'} ({'vLLM, ' * (s.kind == 'vllm')}"
                         f"capacity {s.capacity}, weights version {s.version})")
                self.on_change()
        except Exception as e:  # noqa: BLE001 - unreachable, refused or malformed: down, asked again later
            if s.state == "joining" and was_down:
                s.state = "down"
            elif s.state == "joining":
                self.down(s, f"{type(e).__name__}: {e}".strip().split("\n")[0][:200])

    async def _ours(self, s: Server, r) -> str | None:
        """An `async-rl serve` server's info checked (why it is refused, or None); the previous
        trainer session's requests on it are aborted, never mixed into this one's."""
        r.raise_for_status()
        info = r.json()
        if info.get("kind") != "async-rl":
            return f"kind is {info.get('kind')!r}, not 'async-rl'"
        if (why := weights.mismatch(self.fingerprint, info.get("fingerprint") or {})) is not None:
            return why
        if self.fence:
            r = await self.client.post(f"{s.url}/abort_requests", json={"run": self.fence},
                                       timeout=min(10.0, self.timeout_s))
            r.raise_for_status()
            if n := r.json().get("aborted", 0):
                self.log(f"fleet: server {s.url}: aborted {n} requests of the previous trainer session")
        s.capacity = int(info["capacity"])
        return None

    async def _vllm(self, s: Server) -> str | None:
        """A server without `/v1/fleet/info`: a stock vLLM server, asked through its worker
        extension (`vllm_worker`) what it serves; why it is refused, or None. No fence: vLLM
        aborts a request whose connection closed, as a dead trainer's did."""
        r = await self.client.get(f"{s.url}/v1/models", timeout=min(10.0, self.timeout_s))
        r.raise_for_status()
        models = r.json().get("data") or [{}]
        if models[0].get("owned_by") != "vllm":
            return "it answers neither /v1/fleet/info (async-rl serve) nor as a vLLM server"
        s.kind, s.model = "vllm", str(models[0].get("id"))
        s.adapters = []
        e, hf_path = self.cfg.engine, self.cfg.model.hf_path
        why = ("run.determinism: vLLM's tokens are not bit-identical to the built-in engine's" if self.cfg.run.determinism
               else "a LoRA run's adapters are read from run.dir by a vLLM server: it must be a local folder they share"
               if self.lora and storage.is_remote(self.cfg.run.dir)
               else "engine.weights_transport=jax reaches async-rl serve servers only" if self.transport == "jax"
               else "model.hf_path is not set (the checkpoint a vLLM server serves)" if not hf_path else None)
        if why is not None:
            return f"a vLLM server: {why}"
        info = await self.rpc(s, "async_rl_info", str(self.n_tokens))
        if info is None:
            return (f"{VLLM_HOW}: its /collective_rpc did not answer async_rl_info")
        if (why := weights.mismatch(weights.hf_fingerprint(hf_path), info["fingerprint"])) is not None:
            return why
        if info["logprobs_mode"] != "processed_logprobs":
            return f"--logprobs-mode is {info['logprobs_mode']}, not processed_logprobs"
        if info["max_model_len"] < (need := e.max_prompt_len + self.cfg.rollout.max_new_tokens):
            return f"--max-model-len {info['max_model_len']} < {need} (engine.max_prompt_len + rollout.max_new_tokens)"
        if self.lora and (why := _lora_refusal(info.get("lora"), self.cfg.learner.lora_rank)) is not None:
            return why
        s.capacity = int(info["capacity"])
        return None

    async def rpc(self, s: Server, method: str, *args: str, timeout: float = 30.0):
        """One `vllm_worker.FleetWorker` method on a vLLM server (its first worker's answer);
        None where the server has no such endpoint or method (it is not set up for a fleet)."""
        r = await self.client.post(f"{s.url}/collective_rpc", json={"method": method, "args": list(args),
                                                                    "timeout": timeout}, timeout=timeout + 10.0)
        if r.status_code in (404, 405) or (r.status_code == 500 and method in r.text):
            return None
        if r.status_code != 200:
            raise RuntimeError(f"/collective_rpc {method} answered {r.status_code}: {r.text[:200]}")
        return r.json()["results"][0]

    async def catch_up(self, s: Server) -> None:
        """Has one server load the newest version, one push at a time per server (a version
        published meanwhile is pushed next): versions reach a server in order."""
        async with s.pushing:
            while self.current is not None and s.version != self.current[0]:
                await self.push(s, *self.current)

    async def push(self, s: Server, version: int, uri: str) -> None:
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

    async def _push(self, s: Server, version: int, uri: str) -> None:
        bound = max(60.0, self.timeout_s)
        if s.kind == "vllm":
            return await (self._push_lora(s, bound) if self.lora else self._push_vllm(s, version, uri, bound))
        if self.transport == "jax":
            offer = self.offer  # the newest version's leaves: an older one is gone already
            version = offer.version
            body = {"version": version, "transfer": await self.register(s, offer, bound), "run": self.run_tag}
        else:
            body = {"version": version, "uri": uri, "run": self.run_tag}
            if self.base_uri is not None:
                body["base"] = self.base_uri
        r = await self.client.post(f"{s.url}/update_weights", json=body, timeout=bound)
        if r.status_code != 200:
            raise RuntimeError(f"/update_weights answered {r.status_code}: {r.text[:200]}")
        got = r.json().get("version")
        if got != version:
            raise RuntimeError(f"/update_weights answered version {got}, asked {version}")
        s.version = version
        s.last_ok = time.monotonic()
        self.on_change()

    async def _push_vllm(self, s: Server, version: int, uri: str, bound: float) -> None:
        """A vLLM server's tokens carry no version: it loads only with none of this run's
        samples on it (they continue elsewhere, or here once it holds the new version), so
        every token it sends comes from the version it held when its request began."""
        ready, s.state = s.state == "ready", "loading" if s.state == "ready" else s.state
        if ready:
            self.on_change()
        await self.rpc(s, "async_rl_load", uri, timeout=bound)
        r = await self.client.post(f"{s.url}/reset_prefix_cache", timeout=min(30.0, bound))
        r.raise_for_status()
        s.version, s.last_ok = version, time.monotonic()
        if ready and s.state == "loading":
            s.state = "ready"
        self.on_change()

    async def _push_lora(self, s: Server, bound: float) -> None:
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
                                   timeout=bound)
        if r.status_code != 200:
            raise RuntimeError(f"/v1/load_lora_adapter answered {r.status_code}: {r.text[:200]}")
        s.adapters.append(name)
        s.model, s.version, s.last_ok = name, version, time.monotonic()
        for old in s.adapters[:-2]:
            r = await self.client.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": old}, timeout=bound)
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

    async def push_all(self) -> None:
        """Every ready server loads the newest version."""
        async def one(s):
            try:
                await self.catch_up(s)
            except Exception as e:  # noqa: BLE001 - push's LoadFailed names the version
                self.down(s, str(e) if isinstance(e, LoadFailed) else f"{type(e).__name__} {e}".strip())
        await asyncio.gather(*(one(s) for s in list(self.servers.values()) if s.state == "ready"))

    async def register(self, s: Server, offer: transfer.Offer, bound: float) -> dict:
        """`/update_weights`' transfer for one server: `offer` registered for one pull, kept for
        `bound` seconds (what the server is given to pull it in) and a margin, then dropped."""
        async with self._owner_lock:
            if self.owner is None:
                from urllib.parse import urlsplit
                host = transfer.local_host(urlsplit(s.url).hostname or "127.0.0.1")
                self.owner = await asyncio.to_thread(transfer.Owner, host)
        uuid = await asyncio.to_thread(self.owner.offer, offer, bound + 30.0)
        return {"address": self.owner.address, "uuid": uuid, "leaves": offer.leaves, "timeout_s": bound}

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

    def down(self, s: Server, why: str) -> None:
        if s.state in ("down", "gone", "refused") or self.closing:
            return
        s.state, s.why = "down", why
        self.log(f"fleet: server {s.url} is down: {why}; its samples continue on other servers")
        self.on_change()

    def refuse(self, s: Server, why: str) -> None:
        s.state, s.why = "refused", why
        self.log(f"fleet: refused server {s.url}: {why}")

    def ready(self, version: int) -> list[Server]:
        """Servers that may take new samples: up and holding the run's weights."""
        return [s for s in list(self.servers.values()) if s.state == "ready" and s.version == version]

    def say_waiting(self, version: int, every_s: float = 30.0) -> None:
        """With no server able to take work for `version`, says so once per interval, and why
        for each (one up but still loading `version` says that)."""
        now = time.monotonic()
        if now - self._waiting_said >= every_s:
            self._waiting_said = now

            def why(s: Server) -> str:
                if s.state in ("ready", "loading") and s.version != version:
                    return f"loading weights version {version}"
                return s.state + (f": {s.why}" if s.why else "")
            named = ", ".join(f"{s.url} ({why(s)})" for s in list(self.servers.values()))
            self.log(f"fleet: waiting for a generation server: none ready ({named or 'none named yet'})")


def _lora_refusal(lora: dict | None, rank: int) -> str | None:
    """Why a vLLM server cannot serve a LoRA run's adapters of `rank` (its `async_rl_info`), or None."""
    if lora is None:
        return f"LoRA is off: start it with --enable-lora --max-lora-rank {rank} or more"
    if lora["max_lora_rank"] < rank:
        return f"--max-lora-rank {lora['max_lora_rank']} < learner.lora_rank {rank}"
    if not lora["runtime_updates"]:
        return "it loads no adapters while serving: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
    return None


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr
