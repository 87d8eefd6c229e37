"""The remote backend (`engine.backend=remote`): a `rollout.Rollout` over a fleet of generation servers.

Owns: each slot's stream (one streamed `/v1/completions` request per sample on one server,
`docs/fleet.md`: the prompt and the tokens recorded so far, the budget left, the sampling key),
which server a waiting sample goes to (the least loaded that holds the run's weights and has
room), checking what comes back (token ids inside the vocabulary, finite logprobs, versions
the run published, the budget kept, an end that is an end), and chunks of whatever arrived
per slot (`Chunk.count_S`). A stream that fails, goes silent past `engine.health_timeout_s` or
answers garbage takes its server down: every sample on it is reported lost (`Chunk.lost`) once
the tokens that did arrive are handed over, and the allocator continues it on another server.
A stock vLLM server (`fleet`, `vllm_worker`) is asked with vLLM's own sampling fields, and its
tokens carry the version it held when the request began (with LoRA, the adapter the request names).
Runs its HTTP calls on an event loop of its own thread; the pump's calls only queue work and
read what arrived. Needs the `[fleet]` extra (httpx).
Does not own: membership and health (`fleet`), weights publication (`publication`), the server
(`server`), the ledger.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from async_rl.config import ConfigError
from async_rl.rollout.fleet import PROBE_EVERY_S, Fleet, Server
from async_rl.rollout.interface import Chunk, Start
from async_rl.rollout.vllm_backend import sample_seed


class _Garbage(Exception):
    """A server's answer that cannot be what it claims to be."""


@dataclass(eq=False)
class _Stream:
    start: Start
    server: Server | None = None
    task: asyncio.Task | None = None
    toks: list = field(default_factory=list)  # arrived, not yet collected
    lps: list = field(default_factory=list)
    vers: list = field(default_factory=list)
    got: int = 0  # tokens this stream brought in all
    version: int = 0  # the weights its server held when it began (a vLLM server's tokens carry none)
    model: str = ""  # the model its request names (LoRA on vLLM: the adapter of `version`)
    ended: bool = False  # the server ended the sample (its tokens end it)
    lost: str = ""  # why the sample must go on elsewhere


class RemoteRollout:
    # `async-rl serve` prefills each sequence alone: a sample's tokens depend only on its key and
    # weights, never on the server or what else it generates (run.determinism)
    bit_identical = True

    def __init__(self, cfg, *, fingerprint: dict, run_dir, run_tag: str, n_tokens: int, stop_ids, params,
                 version: int, log=print):
        try:
            import httpx
        except ImportError as e:
            raise ConfigError("engine.backend=remote needs the fleet extra: pip install 'async_rl[fleet]'") from e
        e = cfg.engine
        self.capacity, self.steps_per_call, self.version = e.max_concurrent_decodes, e.steps_per_call, version
        self.timeout_s, self.n_tokens, self.stops = e.health_timeout_s, n_tokens, frozenset(stop_ids)
        self.run_tag, self.log, self.seed = run_tag, log, cfg.run.seed
        # what a stock vLLM server is asked per request (async-rl serve has the run's config)
        self.sampling = {"temperature": e.temperature, "top_k": e.top_k if e.top_k > 0 else -1, "top_p": e.top_p}
        self._cv = threading.Condition()
        self._streams: dict[int, _Stream] = {}  # slot -> its sample's stream
        self._queue: deque[_Stream] = deque()  # waiting for a server with room
        self._n = 0  # requests made (ids)
        self.lost = 0  # samples moved off a server that went down
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleet", daemon=True)
        self._thread.start()
        # one connection per slot kept open between samples (httpx keeps 20 by default: the rest
        # would connect again for every sample), never a wait for a free one
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=5.0),
                                         limits=httpx.Limits(max_connections=None,
                                                             max_keepalive_connections=self.capacity + 16))
        self._failed: BaseException | None = None  # publishing a version failed (the run stops)
        self.fleet = Fleet(cfg, fingerprint, run_dir, self._client, log, self._changed, run_tag=run_tag,
                           n_tokens=n_tokens)
        self.fleet.weights.publish(params, version)
        self._ticker = asyncio.run_coroutine_threadsafe(self._tick(), self._loop)

    # ---- the Rollout protocol (pump thread) ----------------------------------------------------

    def swap(self, params, version: int) -> None:
        """New samples wait for servers holding `version`: it is written and pushed off the
        pump's thread (the pump holds the ledger lock here), in version order."""
        with self._cv:
            self.version = version
        asyncio.run_coroutine_threadsafe(self._publish(params, version), self._loop)

    async def _publish(self, params, version: int) -> None:
        try:
            if await self.fleet.weights.publish_newer(params, version):
                await self.fleet.push_all()
        except Exception as e:  # noqa: BLE001 - raised on the pump's thread at its next collect
            self._failed = self._failed or e
            with self._cv:
                self._cv.notify_all()

    def start(self, starts: Sequence[Start]) -> None:
        with self._cv:
            for st in starts:
                s = self._streams[st.slot] = _Stream(st)
                self._queue.append(s)
        self._loop.call_soon_threadsafe(self._dispatch)

    def step(self, live: Sequence[bool]):
        """The streams run on their own: stops those no longer live; the handle means nothing."""
        self.stop([slot for slot in list(self._streams) if not live[slot]])
        return True

    def collect(self, pending) -> Chunk:
        """What arrived since the last collect, waiting up to a moment for something."""
        end = time.monotonic() + max(1.0, PROBE_EVERY_S)
        with self._cv:
            while not any(s.toks or s.lost for s in self._streams.values()) and time.monotonic() < end \
                    and self._failed is None:
                self._cv.wait(end - time.monotonic())
            if self._failed is not None:
                raise self._failed
            if self._queue and not self.fleet.ready(self.version):
                self.fleet.say_waiting(self.version)
            n = max([len(s.toks) for s in self._streams.values()] + [1])
            toks, lps = np.zeros((n, self.capacity), np.int32), np.zeros((n, self.capacity), np.float32)
            vers, count = np.full((n, self.capacity), self.version, np.int64), np.zeros(self.capacity, np.int64)
            lost = []
            for slot, s in list(self._streams.items()):
                if s.toks:
                    k = count[slot] = len(s.toks)
                    toks[:k, slot], lps[:k, slot], vers[:k, slot] = s.toks, s.lps, s.vers
                    s.toks, s.lps, s.vers = [], [], []
                elif s.lost:  # its arrived tokens went out first, in an earlier chunk
                    lost.append(slot)
                    del self._streams[slot]
                    self.lost += 1
            return Chunk(toks, lps, self.version, versions_KxS=vers, count_S=count, lost=tuple(lost))

    def stop(self, slots: Sequence[int]) -> None:
        with self._cv:
            for slot in slots:
                s = self._streams.pop(slot, None)
                if s is not None and s.task is not None and not s.task.done():
                    self._loop.call_soon_threadsafe(s.task.cancel)  # closing the stream aborts it there

    def forget(self, ordinals: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        async def shut():
            # every task of the fleet's loop (streams, joins, probes, weights loads) ends here,
            # before the client closes: none fails on a closed connection and takes a server down
            self.fleet.closing = True
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._client.aclose()
        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - closing is best effort; the threads are daemons
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # ---- the fleet's loop (its own thread) ------------------------------------------------------

    async def _tick(self) -> None:
        joining: set = set()
        while True:
            try:
                await self.fleet.refresh()
                for srv in list(self.fleet.servers.values()):
                    if srv.state in ("new", "down") and srv not in joining:
                        joining.add(srv)
                        self._loop.create_task(self.fleet.join(srv)).add_done_callback(
                            lambda _, srv=srv: joining.discard(srv))
                    elif srv.state == "ready":
                        self._loop.create_task(self.fleet.probe(srv))
                self._changed()
            except Exception as e:  # noqa: BLE001 - membership problems are said and the loop goes on
                self.log(f"fleet: {type(e).__name__}: {e}")
            await asyncio.sleep(PROBE_EVERY_S)

    def _changed(self) -> None:
        """A server joined, went down or loaded weights: samples on a server that is not up are
        lost; waiting samples may go to one that is."""
        with self._cv:
            for s in self._streams.values():
                if s.server is not None and s.server.state != "ready" and not s.ended and not s.lost:
                    self._lose(s, f"server {s.server.url} is {s.server.state}")
        self._dispatch()

    def _lose(self, s: _Stream, why: str) -> None:  # under the lock
        s.lost = why
        if s.task is not None and not s.task.done() and asyncio.current_task() is not s.task:
            s.task.cancel()
        self._cv.notify_all()

    def _dispatch(self) -> None:
        with self._cv:
            while self._queue and not self.fleet.closing:
                room = [v for v in self.fleet.ready(self.version) if v.active < v.capacity]
                if not room:
                    return
                s = self._queue.popleft()
                if self._streams.get(s.start.slot) is not s:
                    continue  # stopped while it waited
                s.server = min(room, key=lambda v: v.active / v.capacity)
                s.version, s.model = s.server.version, s.server.model  # taken together: a push may follow
                s.server.active += 1  # given back when the task ends, even one cancelled before it ran
                s.task = self._loop.create_task(self._run(s))
                s.task.add_done_callback(lambda _, v=s.server: self._ended_on(v))

    def _ended_on(self, server: Server) -> None:
        server.active -= 1
        self._dispatch()

    async def _run(self, s: _Stream) -> None:
        srv, st = s.server, s.start
        self._n += 1
        body = {"model": s.model, "prompt": [int(t) for t in st.prompt] + list(st.tokens),
                "max_tokens": st.budget, "stream": True, "logprobs": 1, "return_token_ids": True}
        if srv.kind == "vllm":  # sampling as the vLLM backend asks for it (vllm_backend.VLLMRollout.start)
            body |= self.sampling | {"logprobs": 0, "ignore_eos": True, "stop_token_ids": sorted(self.stops),
                                     "skip_special_tokens": False, "request_id": f"{self.run_tag}-{self._n}",
                                     "seed": sample_seed(self.seed, st.ordinal, st.sample, len(st.tokens)),
                                     # a prompt cached under another version is never read (vllm_backend)
                                     "cache_salt": f"{self.run_tag}-v{s.version}"}
        else:
            body["async_rl"] = {"prompt_len": len(st.prompt), "ordinal": st.ordinal, "sample": st.sample,
                                "run": self.run_tag, "request_id": f"{self.run_tag}-{self._n}"}
        try:
            async with self._client.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode("utf-8", "replace")[:200]
                    raise _Garbage(f"/v1/completions answered {r.status_code}: {text}")
                async for line in r.aiter_lines():
                    if line.startswith("data:") and (data := line[5:].strip()) != "[DONE]":
                        self._take(s, json.loads(data))
            if not (s.ended or s.lost):
                raise _Garbage("the stream ended before the sample did")
            srv.last_ok = time.monotonic()
        except asyncio.CancelledError:
            pass  # stopped by the run, or its server went down
        except Exception as e:  # noqa: BLE001 - a dead, silent or garbled server: down, its samples go on elsewhere
            why = f"answered garbage: {e}" if isinstance(e, (_Garbage, ValueError, KeyError, TypeError)) \
                else f"{type(e).__name__} {e}".strip()[:200]
            with self._cv:
                if not s.ended:
                    self._lose(s, why)
            self.fleet.down(srv, why)

    def _take(self, s: _Stream, ev: dict) -> None:
        """One event of a stream, checked before anything of it is kept."""
        ch = ev["choices"][0]
        if s.server.kind == "vllm":  # its tokens come from the version it held at the start (`Fleet._push_vllm`)
            toks = list(ch.get("token_ids") or [])
            lps = list((ch.get("logprobs") or {}).get("token_logprobs") or []) if toks else []
            vers = [s.version] * len(toks)
        else:
            toks, lps, vers = list(ch["token_ids"]), list(ch["logprobs"]["token_logprobs"]), list(ev["weight_versions"])
        if not (len(toks) == len(lps) == len(vers)):
            raise _Garbage(f"{len(toks)} tokens, {len(lps)} logprobs, {len(vers)} versions")
        if any(not isinstance(t, int) or not 0 <= t < self.n_tokens for t in toks):
            raise _Garbage(f"a token id outside the vocabulary [0, {self.n_tokens}): {toks}")
        if any(not isinstance(x, (int, float)) or not math.isfinite(x) or x > 1e-3 for x in lps):
            raise _Garbage(f"a logprob that is not one: {lps}")
        if any(v not in self.fleet.weights.given for v in vers):
            raise _Garbage(f"weights versions {sorted(set(vers) - self.fleet.weights.given)} it was never given")
        if (s.ended and toks) or any(t in self.stops for t in toks[:-1]):
            raise _Garbage("tokens after the sample's end")
        got = s.got + len(toks)
        if got > s.start.budget:
            raise _Garbage(f"{got} tokens for a budget of {s.start.budget}")
        finish = ch.get("finish_reason")
        ended = got == s.start.budget or bool(toks and toks[-1] in self.stops)
        if finish in ("stop", "length") and not ended:
            raise _Garbage(f"finish_reason {finish!r} where the sample did not end")
        with self._cv:
            s.toks += toks
            s.lps += lps
            s.vers += vers
            s.got, s.ended = got, ended
            if finish == "abort" and not ended:
                self._lose(s, f"server {s.server.url} aborted it")
            self._cv.notify_all()
