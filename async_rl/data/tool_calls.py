"""Tool calls in a model's reply, and tool results fed back to it.

Owns: parsing the Qwen/Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(several per reply possible), where a malformed call is a `CallError` value, never an exception
(an env turns it into an error observation the policy learns from); rendering results as chat
`tool` messages, and as raw text for a policy without a chat template; describing an env's tools
in a prompt (`describe_tools`, what `{tools}` in `tokenizer.system` becomes). Does not own: running
tools (`mcp`, `tool_tasks`) or a chat template's own rendering of messages (`tokenizer`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Union

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
MAX_CALLS = 8  # calls per reply that are run; more are answered with an error
_QUOTE_CHARS = 200  # characters of a malformed call quoted back to the policy


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class CallError:
    """A `<tool_call>` that could not be read; `reason` says why, for the error observation."""
    text: str  # what stood between the tags (or after an unclosed opening tag)
    reason: str


Parsed = Union[ToolCall, CallError]


def _parse_one(body: str) -> Parsed:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return CallError(body, f"not JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict):
        return CallError(body, f"a JSON {type(obj).__name__}, not an object with name and arguments")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return CallError(body, "no tool name (want {\"name\": ..., \"arguments\": {...}})")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return CallError(body, "arguments is a string that is not a JSON object")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return CallError(body, f"arguments is a JSON {type(args).__name__}, not an object")
    return ToolCall(name.strip(), args)


def parse_tool_calls(reply: str) -> list[Parsed]:
    """Every `<tool_call>` of `reply` in order, each a ToolCall or a CallError; [] when the
    reply calls no tool. An opening tag without its closing one is a CallError."""
    out: list[Parsed] = []
    end = 0
    for m in _CALL.finditer(reply):
        out.append(_parse_one(m.group(1).strip()))
        end = m.end()
    rest = reply.find(OPEN, end)
    if rest >= 0:
        out.append(CallError(reply[rest + len(OPEN):].strip(), f"{OPEN} without {CLOSE}"))
    return out


def error_text(err: CallError) -> str:
    """What the policy reads back for a malformed call."""
    quoted = err.text if len(err.text) <= _QUOTE_CHARS else err.text[:_QUOTE_CHARS] + "..."
    return f"error: malformed tool call: {err.reason}: {quoted}"


def tool_message(content: str, role: str = "tool") -> dict:
    """A tool result as a chat message (for a chat template)."""
    return {"role": role, "content": content}


def render_raw(results: list[str]) -> str:
    """Tool results as raw text, for a policy without a chat template: each in
    `<tool_response>` tags on lines of their own, as Qwen's template renders tool messages."""
    return "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results) + "\n"


def describe_tools(tools: list[dict]) -> str:
    """An env's tools (OpenAI function format, as an MCP server lists them) one line each:
    `- name(arg: type, ...): description`."""
    lines = []
    for t in tools:
        f = t.get("function", t)
        props = (f.get("parameters") or {}).get("properties") or {}
        args = ", ".join(f"{k}: {v.get('type', 'any') if isinstance(v, dict) else 'any'}" for k, v in props.items())
        desc = " ".join(str(f.get("description") or "").split())
        lines.append(f"- {f.get('name')}({args})" + (f": {desc}" if desc else ""))
    return "\n".join(lines)


def render_call(name: str, arguments: dict) -> str:
    """The text of one well-formed call (what a policy is to write; also for prompts and tests)."""
    return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CLOSE}"


def last_reply(messages: list[dict]) -> str:
    """The text of the assistant reply an env step answers (the episode's last message)."""
    if not messages or messages[-1].get("role") != "assistant":
        role = messages[-1].get("role") if messages else None
        raise ValueError(f"an env step answers an assistant reply; the episode ends with role {role!r}")
    content = messages[-1].get("content")
    if not isinstance(content, str):
        raise ValueError(f"the assistant reply's content is a {type(content).__name__}, not str")
    return content
