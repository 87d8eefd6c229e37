"""`rollout.env=mcp`: tools served by an MCP server, called as the policy's replies ask.

Owns: the connection to the server (`rollout.mcp_server`: a streamable-HTTP URL, or a command
started as a stdio child of this process), checking at start-up that it answers, listing its tools, calling the ones a reply asks for
with the step key in the request's `_meta`, and turning results and malformed calls into
observations. Does not own: parsing calls (`tool_calls`) or running steps off the trainer's
threads (`interface.EnvRunner`, whose event loop this env's coroutines run on).

Every call of a step carries `_meta = {"idempotency_key": "<step key>#<i>", "step_key": "<step key>"}`
(i: the call's index in the reply), so a server can make side effects idempotent: a step asked
again after a kill sends the same keys. A tool's own error (unknown tool, bad arguments, a raising
tool) is an observation the policy reads; a server that cannot be reached fails the step.
A stdio server dies with this process; a service whose effects must outlive it runs on its own
(HTTP).
"""

from __future__ import annotations

import asyncio
import shlex
import sys
from typing import Any, Optional

from async_rl.config import ConfigError
from async_rl.data.tool_calls import MAX_CALLS, CallError, error_text, last_reply, parse_tool_calls


def _transport(server: str):
    from fastmcp.client.transports import StdioTransport, StreamableHttpTransport

    if server.startswith(("http://", "https://")):
        return StreamableHttpTransport(server)
    argv = shlex.split(server)
    if not argv:
        raise ConfigError("rollout.mcp_server: empty (an http:// URL or a command)")
    if argv[0] == "python":  # the trainer's own interpreter: a server shipped with the package runs in its venv
        argv[0] = sys.executable
    return StdioTransport(argv[0], argv[1:])


class _ConnectCancelled(Exception):
    """The step that was connecting was cancelled: a step waiting for it connects itself."""


def _text(result) -> str:
    parts = []
    for block in result.content or ():
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'non-text')} content]")
    return "\n".join(parts)


def _schemas(listed) -> list[dict]:
    """The server's tools in the OpenAI function format a chat template's `tools` takes."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in listed]


class MCPEnv:
    """Calls the tools of one MCP server; done when a reply calls no tool or at `max_turns`."""

    def __init__(self, server: str, max_turns: int = 4, call_timeout_s: Optional[float] = None):
        try:
            import fastmcp
        except ImportError:
            raise ConfigError("rollout.env=mcp needs fastmcp: pip install 'async_rl[tools]'") from None
        self.server, self.max_turns = server, max_turns
        self._new_client = lambda: fastmcp.Client(_transport(server.strip()), timeout=call_timeout_s)
        self._client = self._new_client()
        self._connected: Optional[asyncio.Future] = None  # resolves to the tool names once connected
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the event loop the connection lives on
        self.tools: list[dict] = []  # the server's tools (OpenAI function format), once connected

    async def _connect(self) -> set[str]:
        # the first step connects; the steps running beside it wait for the same connection,
        # and take over connecting if the step that was connecting is cancelled (its timeout)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None:
                # a new runner's loop (each evaluation runs its own): the old connection's streams
                # belong to a loop that has ended, so calls on it would never return; connect anew
                # (an abandoned stdio child ends when its stdin closes, at the latest with this process)
                self._client, self._connected = self._new_client(), None
            self._loop = loop
        while True:
            if self._connected is None:
                return await self._open()
            try:
                return await asyncio.shield(self._connected)
            except _ConnectCancelled:
                continue

    async def _open(self) -> set[str]:
        fut = self._connected = asyncio.get_running_loop().create_future()
        try:
            await self._client.__aenter__()
            listed = await self._client.list_tools()
        except BaseException as e:
            cancelled = isinstance(e, asyncio.CancelledError)
            err = ConnectionError(f"MCP server {self.server!r}: {type(e).__name__}: {e}")
            fut.set_exception(_ConnectCancelled() if cancelled else err)
            fut.exception()  # retrieved: no "never retrieved" warning if no one else waits
            self._connected = None  # the next step tries again
            if cancelled:
                raise
            raise err from None
        self.tools = _schemas(listed)
        fut.set_result({t.name for t in listed})
        return fut.result()

    def check(self, timeout_s: float) -> list[dict]:
        """Connects, lists the server's tools and disconnects, within `timeout_s`: at start-up, so a
        server that cannot be reached is refused before the run starts (a policy that never calls a
        tool would otherwise never reach it). ConfigError in one line naming the server."""
        async def probe():
            async with self._new_client() as client:
                return await client.list_tools()

        try:
            listed = asyncio.run(asyncio.wait_for(probe(), timeout_s))
        except Exception as e:  # noqa: BLE001 - whatever stops the connection is the server's setting's fault
            why = f"no answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            raise ConfigError(" ".join(f"rollout.mcp_server={self.server!r}: cannot connect and list its tools "
                                       f"({why}); start the server or fix the URL or command".split())) from None
        self.tools = _schemas(listed)
        return self.tools

    async def list_tools(self) -> list[dict]:
        await self._connect()
        return self.tools

    async def _call(self, call, names: set[str], meta: dict[str, Any]) -> str:
        if isinstance(call, CallError):
            return error_text(call)
        if call.name not in names:
            return f"error: unknown tool {call.name!r} (tools: {', '.join(sorted(names))})"
        result = await self._client.call_tool(call.name, call.arguments, raise_on_error=False, meta=meta)
        text = _text(result)
        return f"error: {text}" if result.is_error else text

    async def step(self, key, messages: list[dict], state: dict) -> dict:
        calls = parse_tool_calls(last_reply(messages))
        if not calls or key.turn + 1 >= self.max_turns:
            return {"observation": None, "done": True, "state": state, "reward": None, "role": "tool"}
        names = await self._connect()
        results = await asyncio.gather(*(
            self._call(c, names, {"idempotency_key": f"{key}#{i}", "step_key": str(key)})
            for i, c in enumerate(calls[:MAX_CALLS])))
        if len(calls) > MAX_CALLS:
            results.append(f"error: {len(calls) - MAX_CALLS} more tool calls than the {MAX_CALLS} a reply may make")
        state = {**state, "tool_calls": int(state.get("tool_calls", 0)) + len(calls)}
        return {"observation": "\n".join(results), "done": False, "state": state, "reward": None, "role": "tool"}

    async def aclose(self) -> None:
        if self._connected is not None:
            self._connected = None
            if self._loop is asyncio.get_running_loop():  # a connection on an ended loop cannot be closed from here
                await self._client.close()
