"""`async-rl serve`: one generation server over the built-in engine, for trainers that drive
a fleet of them (docs/fleet.md).

Owns: the HTTP API (a Starlette app under uvicorn, the `fleet` extra, imported only here
and only when serving): health and info (the fingerprint a trainer compares), weights
updates (the body read, the version fetched off the event loop by `publication.Fetcher`,
swapped in between chunks), pause/resume, aborts, and `/v1/completions` streamed as
server-sent events, one event per engine chunk; checking each request (one-line 400s);
listening, the `serving on` line, and stopping on SIGTERM/SIGINT (streams end with
finish_reason "abort") or when the engine loop fails (exit 1). Does not own: the engine
loop (`server_loop`), building the engine from the config (`run.build.serving_parts`),
fetching a weights version (`publication`).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time

from async_rl import faults, signals
from async_rl.rollout import transfer, weights
from async_rl.rollout.publication import Fetcher
from async_rl.rollout.server_loop import Request, ServerLoop
from async_rl.store.remote_io import StorageError

INT32 = 2 ** 31  # the engine's sampling keys are int32
FAILED_EXIT_S = 30.0  # after the loop failed, the process exits within this even if HTTP shutdown hangs


class BadRequest(ValueError):
    """A request the server refuses (400), with a one-line reason."""


def _int(d: dict, key: str, where: str = "") -> int:
    if key not in d:
        raise BadRequest(f"missing {where}{key}")
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise BadRequest(f"{where}{key}={v!r}: not an integer")
    return v


def _str(d: dict, key: str, where: str = "") -> str:
    if key not in d:
        raise BadRequest(f"missing {where}{key}")
    if not isinstance(d[key], str):
        raise BadRequest(f"{where}{key}={d[key]!r}: not a string")
    return d[key]


def parse_completion(body, *, vocab: int, max_prompt_len: int, max_new_tokens: int) -> dict:
    """The fields of a `/v1/completions` body, checked: Request's keyword arguments but
    `emit` (BadRequest naming the first problem)."""
    if not isinstance(body, dict):
        raise BadRequest("the body is not a JSON object")
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("prompt: must be a non-empty list of token ids")
    for i, t in enumerate(prompt):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise BadRequest(f"prompt[{i}]={t!r}: not a token id of the vocabulary [0, {vocab})")
    ext = body.get("async_rl")
    if not isinstance(ext, dict):
        raise BadRequest("missing async_rl (an object: prompt_len, ordinal, sample, run, request_id)")
    n = _int(ext, "prompt_len", "async_rl.")
    ordinal, sample = _int(ext, "ordinal", "async_rl."), _int(ext, "sample", "async_rl.")
    run, rid = _str(ext, "run", "async_rl."), _str(ext, "request_id", "async_rl.")
    budget = _int(body, "max_tokens")
    if not 1 <= n <= len(prompt):
        raise BadRequest(f"async_rl.prompt_len={n}: must be in [1, {len(prompt)}] (the prompt's length)")
    if n > max_prompt_len:
        raise BadRequest(f"async_rl.prompt_len={n}: beyond engine.max_prompt_len={max_prompt_len}")
    for name, v in (("ordinal", ordinal), ("sample", sample)):
        if not 0 <= v < INT32:
            raise BadRequest(f"async_rl.{name}={v}: must be in [0, 2**31)")
    done = len(prompt) - n
    if budget < 1:
        raise BadRequest(f"max_tokens={budget}: must be >= 1")
    if budget > max_new_tokens - done:
        raise BadRequest(f"max_tokens={budget}: beyond rollout.max_new_tokens={max_new_tokens} less the {done} "
                         "tokens already generated")
    return dict(id=rid, run=run, prompt=prompt[:n], done=tuple(prompt[n:]), ordinal=ordinal, sample=sample,
                budget=budget)


def event(rid: str, item) -> bytes:
    """One server-sent event of a completion stream: a chunk, or the loop's failure (a str)."""
    if isinstance(item, str):
        return b"data: " + json.dumps({"error": item}).encode() + b"\n\n"
    tokens, logprobs, versions, finish = item
    out = {"id": rid, "object": "text_completion",
           "choices": [{"index": 0, "text": "", "token_ids": tokens, "logprobs": {"token_logprobs": logprobs},
                        "finish_reason": finish}],
           "weight_versions": versions}
    return b"data: " + json.dumps(out).encode() + b"\n\n"


def garble(rid: str, item, kind: str) -> bytes:
    """A fault test's event (`faults.garbled`): what a broken or foreign server might send."""
    tokens, logprobs, versions, finish = item
    if kind == "token":
        return event(rid, ([10**6] + list(tokens[1:]), logprobs, versions, finish))
    if kind == "version":
        return event(rid, (tokens, logprobs, [v + 1000 for v in versions], finish))
    return event(rid, item)[:20]  # cut: the stream ends inside the event


DONE = b"data: [DONE]\n\n"
KEEPALIVE, KEEPALIVE_S = b": keepalive\n\n", 2.0  # SSE comment lines clients skip; seconds between them


def one_line(e) -> str:
    return " ".join(str(e).split())[:500] or type(e).__name__


class Api:
    """The endpoints (docs/fleet.md, "API") over a started `ServerLoop`; `app()` is the Starlette app."""

    def __init__(self, loop: ServerLoop, engine, like, fp: dict, *, max_new_tokens: int):
        from starlette.responses import JSONResponse
        self.loop, self.engine, self.fp = loop, engine, fp
        self.fetcher = Fetcher(engine, like)
        self.max_new_tokens = max_new_tokens
        self.json = JSONResponse
        self.loading = asyncio.Lock()  # one weights version loaded at a time
        self.held_run: str | None = None  # the session tag the weights held came with
        self.events = 0  # completion events sent (fault tests garble the n-th, `faults.garbled`)

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route
        loop = self.loop

        def reply(fn):
            async def endpoint(req):
                return self.json(fn())
            return endpoint
        routes = [Route("/health", reply(lambda: {"status": "ok"})), Route("/v1/fleet/info", reply(self.info)),
                  Route("/weight_info", reply(lambda: {"version": loop.version})),
                  Route("/is_paused", reply(lambda: {"is_paused": loop.paused})),
                  Route("/pause", self.pause, methods=["POST"]), Route("/resume", self.resume, methods=["POST"]),
                  Route("/abort_requests", self.abort_requests, methods=["POST"]),
                  Route("/update_weights", self.update_weights, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={Exception: self.failed})

    def error(self, status: int, msg):
        return self.json({"error": one_line(msg)}, status_code=status)

    async def failed(self, req, exc):
        return self.error(500, f"{type(exc).__name__}: {one_line(exc)}")

    @staticmethod
    async def body_of(req) -> dict:
        try:
            body = json.loads(await req.body())
        except ValueError as e:
            raise BadRequest(f"the body is not JSON ({one_line(e)})") from None
        if not isinstance(body, dict):
            raise BadRequest("the body is not a JSON object")
        return body

    def info(self) -> dict:
        return {"kind": "async-rl", "fingerprint": self.fp, "version": self.loop.version,
                "capacity": self.engine.max_concurrent_decodes, "steps_per_call": self.engine.steps_per_call,
                "paused": self.loop.paused}

    @staticmethod
    def source(body: dict):
        """A weights file's uri, or the transfer to pull (address, uuid, leaves, timeout_s)."""
        if "transfer" not in body:
            if "uri" not in body:
                raise BadRequest("missing uri (a weights file) or transfer (an address and uuid to pull from)")
            return _str(body, "uri")
        t = body["transfer"]
        if not isinstance(t, dict):
            raise BadRequest("transfer: not an object (address, uuid, leaves)")
        src = {"address": _str(t, "address", "transfer."), "uuid": _int(t, "uuid", "transfer."),
               "leaves": t.get("leaves"), "timeout_s": t.get("timeout_s", transfer.PULL_S)}
        if not isinstance(src["leaves"], list):
            raise BadRequest("transfer.leaves: missing or not a list of [name, dtype, shape]")
        if isinstance(src["timeout_s"], bool) or not isinstance(src["timeout_s"], (int, float)) or src["timeout_s"] <= 0:
            raise BadRequest(f"transfer.timeout_s={src['timeout_s']!r}: not a number of seconds > 0")
        return src

    async def update_weights(self, req):
        import anyio.to_thread

        from async_rl.config import ConfigError
        try:
            body = await self.body_of(req)
            version, src = _int(body, "version"), self.source(body)
            base = _str(body, "base") if "base" in body else None  # LoRA: the base file; src holds adapters
            run = _str(body, "run") if "run" in body else None  # a trainer session's tag
        except BadRequest as e:
            return self.error(400, e)
        async with self.loading:
            held = self.loop.version
            # versions only grow within one trainer session; a restarted trainer starts again
            # from its checkpoint, older than what the killed one published
            if held is not None and version < held and run == self.held_run:
                return self.error(409, f"version={version}: older than the weights held (version {held})")
            try:
                params = await anyio.to_thread.run_sync(self.fetcher.fetch, src, base)
            except StorageError as e:
                return self.error(503, f"{e}; {e.hint}")
            except transfer.TransferError as e:
                return self.error(503, e)
            except (ValueError, OSError, ConfigError) as e:
                return self.error(400, e if isinstance(e, ValueError) else f"{src}: {one_line(e)}")
            try:
                await asyncio.wrap_future(self.loop.swap(params, version))
            except Exception as e:
                return self.error(503, e)
            self.held_run = run
        return self.json({"version": version})

    async def completions(self, req):
        import numpy as np
        try:
            fields = parse_completion(await self.body_of(req), vocab=self.engine.vocab_size,
                                      max_prompt_len=self.engine.max_prompt_len, max_new_tokens=self.max_new_tokens)
        except BadRequest as e:
            return self.error(400, e)
        if self.loop.version is None:
            return self.error(503, "no weights yet: a trainer publishes them with POST /update_weights")
        aio, q = asyncio.get_running_loop(), asyncio.Queue()

        def emit(item):
            try:
                aio.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the event loop has closed: the server has stopped
                pass
        r = Request(emit=emit, **(fields | {"prompt": np.asarray(fields["prompt"], np.int32)}))
        try:
            self.loop.submit(r)
        except RuntimeError as e:
            return self.error(503, e)
        return _stream_class()(self.stream(r, q), media_type="text/event-stream")

    async def stream(self, r: Request, q: asyncio.Queue):
        over = False
        try:
            while True:
                try:  # a comment line while the engine compiles or the request waits: the server is alive
                    item = await asyncio.wait_for(q.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield KEEPALIVE
                    continue
                if item is None:
                    over = True
                    yield DONE
                    return
                over = isinstance(item, str)
                self.events += 1
                if (kind := faults.garbled(self.events)) is not None and not over:
                    yield garble(r.id, item, kind)
                    if kind == "cut":
                        return
                    continue
                yield event(r.id, item)
                if over:
                    return
        finally:
            if not over:  # the client left mid-stream: an abort
                self.loop.abort(lambda x: x is r)

    async def abort_requests(self, req):
        try:
            body = await self.body_of(req)
            if "run" in body:
                run = _str(body, "run")
                n = self.loop.abort(lambda r: r.run == run)
            elif isinstance(body.get("request_ids"), list) and all(isinstance(i, str) for i in body["request_ids"]):
                ids = set(body["request_ids"])
                n = self.loop.abort(lambda r: r.id in ids)
            else:
                raise BadRequest("give run (a str) or request_ids (a list of str)")
        except BadRequest as e:
            return self.error(400, e)
        return self.json({"aborted": n})

    async def pause(self, req):
        import anyio.to_thread
        if not await anyio.to_thread.run_sync(self.loop.pause):
            return self.error(503, self.loop.error or "the chunk in flight did not finish in time")
        return self.json({"is_paused": True})

    async def resume(self, req):
        self.loop.resume()
        return self.json({"is_paused": False})


_STREAM: list = []


def _stream_class():
    """StreamingResponse that notices its client leaving while it waits for the next chunk
    (paused, queued), not only at its next write: the request is then aborted."""
    if _STREAM:
        return _STREAM[0]
    import anyio
    from starlette.responses import StreamingResponse

    class Stream(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                async with anyio.create_task_group() as tg:
                    async def body():
                        try:
                            await self.stream_response(send)
                        except OSError:
                            pass
                        tg.cancel_scope.cancel()
                    tg.start_soon(body)
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()
            finally:
                await self.body_iterator.aclose()
    _STREAM.append(Stream)
    return Stream


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port); port 0 picks a free one. UsageError where it cannot be."""
    from async_rl.errors import UsageError
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _exit_soon() -> None:
    """The loop failed: the process exits with 1 even if the HTTP server's shutdown hangs."""
    time.sleep(FAILED_EXIT_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def serve(cfg, tok, engine, abstract, *, host: str, port: int, log=_stderr) -> int:
    """Serves `engine` (no weights yet) until SIGTERM/SIGINT (0) or a failure of its loop (1)."""
    import uvicorn

    sock = bind(host, port)
    port = sock.getsockname()[1]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    server = None

    def on_failure(line: str) -> None:
        if server is not None:
            server.should_exit = True
        threading.Thread(target=_exit_soon, name="server-exit", daemon=True).start()

    loop = ServerLoop(engine, getattr(tok, "stop_ids", (tok.eos_id,)), log=log, on_failure=on_failure,
                      deterministic=cfg.run.determinism, prefill_rows=cfg.engine.prefill_rows)
    app = Api(loop, engine, weights.engine_like(engine, abstract), weights.fingerprint(cfg, tok),
              max_new_tokens=cfg.rollout.max_new_tokens).app()
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
    server = _server_class()(config, loop, url)
    loop.start()
    try:
        server.run(sockets=[sock])
    finally:
        loop.close()
        sock.close()
    return 1 if loop.error else 0


def _server_class():
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that says where it listens once it does, and on SIGTERM/SIGINT ends
        every stream (finish_reason "abort") and refuses new requests before it shuts down."""

        def __init__(self, config, loop: ServerLoop, url: str):
            super().__init__(config)
            self.serving_loop, self.url, self.aio = loop, url, None

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            self.aio = asyncio.get_running_loop()
            if self.started:
                print(f"serving on {self.url}", flush=True)
            if signals.requested():  # a signal after start-up's check and before uvicorn's handlers
                self.handle_exit(signal.SIGTERM, None)

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            if self.aio is not None:
                self.aio.call_soon_threadsafe(self.serving_loop.shutdown)

    return Server
