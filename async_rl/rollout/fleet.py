"""The fleet: which generation servers a run has, and whether each may take work.

Owns: membership (`engine.servers`, `engine.servers_file` re-read every few seconds,
`engine.servers_dns` resolved to every address behind a name), joining a server (its
`/v1/fleet/info` fingerprint against the run's: one line naming the field when they differ,
and the server is refused), having it load the weights version the run is on before it gets
work (`publication.Publication.catch_up`), health (a server that fails a probe or a stream,
or a weights load, is down; one silent past `engine.health_timeout_s` is down; a down server
is asked again and rejoins), and the previous trainer session's fence. Every call is bounded.
Does not own: the samples on a server or their streams (`remote`), publishing a version and
pushing it to a server (`publication`), which sample goes where (`allocator`).
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field

from async_rl.rollout import weights
from async_rl.rollout.publication import LoadFailed, Publication, worker_rpc
from async_rl.store import runfiles, storage

PROBE_EVERY_S = 2.0  # membership re-read and health probes
SESSION = "session"  # the request tag of the trainer session that drives the fleet now
VLLM_HOW = ("a vLLM server must run with VLLM_SERVER_DEV_MODE=1 and "
            "--worker-extension-cls async_rl.rollout.vllm_worker.FleetWorker")


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
        self.weights = Publication(cfg, run_dir, client, on_change, run_tag=run_tag, timeout_s=self.timeout_s)
        self.servers: dict[str, Server] = {}
        # the previous trainer session's tag: its requests still on a server are aborted at join
        self.run_tag = run_tag
        self.fence = self._take_session(run_tag) if run_tag else None
        self._file_said = ""
        self._waiting_said = 0.0
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
            await self.weights.catch_up(s)
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
               if self.weights.lora and storage.is_remote(self.cfg.run.dir)
               else "engine.weights_transport=jax reaches async-rl serve servers only" if self.weights.transport == "jax"
               else "model.hf_path is not set (the checkpoint a vLLM server serves)" if not hf_path else None)
        if why is not None:
            return f"a vLLM server: {why}"
        info = await worker_rpc(self.client, s.url, "async_rl_info", str(self.n_tokens))
        if info is None:
            return (f"{VLLM_HOW}: its /collective_rpc did not answer async_rl_info")
        if (why := weights.mismatch(weights.hf_fingerprint(hf_path), info["fingerprint"])) is not None:
            return why
        if info["logprobs_mode"] != "processed_logprobs":
            return f"--logprobs-mode is {info['logprobs_mode']}, not processed_logprobs"
        if info["max_model_len"] < (need := e.max_prompt_len + self.cfg.rollout.max_new_tokens):
            return f"--max-model-len {info['max_model_len']} < {need} (engine.max_prompt_len + rollout.max_new_tokens)"
        if self.weights.lora and (why := _lora_refusal(info.get("lora"), self.cfg.learner.lora_rank)) is not None:
            return why
        s.capacity = int(info["capacity"])
        return None

    async def push_all(self) -> None:
        """Every ready server loads the newest version."""
        async def one(s):
            try:
                await self.weights.catch_up(s)
            except Exception as e:  # noqa: BLE001 - push's LoadFailed names the version
                self.down(s, str(e) if isinstance(e, LoadFailed) else f"{type(e).__name__} {e}".strip())
        await asyncio.gather(*(one(s) for s in list(self.servers.values()) if s.state == "ready"))

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
