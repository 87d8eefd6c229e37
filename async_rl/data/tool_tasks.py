"""The tool tasks: prompts a policy can only answer by calling a tool, and their built-in envs.

Owns: the table (a value for every key, a pure function of `data.seed` and the key that only
the tool reads), the task's prompts and answers (`data.task=lookup`; `data` streams them), and
`LookupEnv` (`rollout.env=lookup`), which answers a well-formed `lookup` call in-process, with
no server. Does not own: parsing calls (`tool_calls`), running env steps (`interface.EnvRunner`), or
scoring the final reply (`rewards`: the task's reward is `exact_match` on the value).

The prompt shows the exact call to make, so what the policy has to learn is to copy the call,
then copy the value the tool returns; without the tool the value is a guess (one in 10^4).

`recall` is the same table in the synthetic character vocabulary, for the tiny policy: the
prompt is a key and `=`; the first reply is the call (`rollout.env=recall`: the tool reads the
key from the prompt, not from the reply), answered with the key's value and `=`; the second
reply is the answer. What the policy learns is to use the tool's answer; without it the value
is a guess (a tenth of its digits right, on average).
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from async_rl.data.tool_calls import MAX_CALLS, CallError, error_text, last_reply, parse_tool_calls, render_call

TOOL = "lookup"
VALUE_DIGITS = 4  # digits of every value in the table
MAX_KEY_DIGITS = 32  # longer keys are not in the table
_TABLE_SALT = 0x7AB1E  # keeps the table's draws apart from the records' own
_KEY = re.compile(r"[1-9][0-9]*")
# the one tool, as a chat template's `tools` list describes it (OpenAI function format)
TOOL_SCHEMAS = [{
    "type": "function",
    "function": {
        "name": TOOL,
        "description": "The value stored under a key in the table.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "the key, digits"}},
                       "required": ["key"]},
    },
}]


def lookup_value(seed: int, key: str) -> Optional[str]:
    """The table: the value under `key` (digits, no leading zero), None for a key not in it."""
    if not isinstance(key, str) or len(key) > MAX_KEY_DIGITS or not _KEY.fullmatch(key):
        return None
    rng = np.random.default_rng([seed % 2**64, _TABLE_SALT, int(key)])
    return "".join(map(str, rng.integers(0, 10, size=VALUE_DIGITS).tolist()))


def prompt_for(key: str) -> str:
    return f"Look up key {key}: {render_call(TOOL, {'key': key})} Then reply with the value only."


def record(rng: np.random.Generator, seed: int, min_digits: int, max_digits: int) -> tuple[str, str]:
    """(prompt, answer) drawn from `rng`: a key of min_digits..max_digits digits and its value."""
    n = int(rng.integers(min_digits, max_digits + 1))
    key = str(int(rng.integers(10 ** (n - 1) if n > 1 else 1, 10 ** n)))
    return prompt_for(key), lookup_value(seed, key)


def longest_prompts(max_digits: int) -> list[str]:
    return [prompt_for("9" * max_digits)]


def _answer(call, seed: int) -> str:
    if isinstance(call, CallError):
        return error_text(call)
    if call.name != TOOL:
        return f"error: unknown tool {call.name!r} (tools: {TOOL})"
    key = call.arguments.get("key")
    if isinstance(key, int) and not isinstance(key, bool):
        key = str(key)
    if set(call.arguments) != {"key"} or not isinstance(key, str):
        return f"error: {TOOL} takes one argument, key (a string of digits)"
    value = lookup_value(seed, key.strip())
    return value if value is not None else f"error: no key {key!r} in the table"


class LookupEnv:
    """`rollout.env=lookup`: answers each `lookup` call of a reply with the value (a malformed
    call with an error observation); done when a reply calls no tool or at `max_turns`."""

    tools = TOOL_SCHEMAS

    def __init__(self, seed: int, max_turns: int = 4):
        self.seed, self.max_turns = seed, max_turns

    def step(self, key, messages: list[dict], state: dict) -> dict:
        calls = parse_tool_calls(last_reply(messages))
        if not calls or key.turn + 1 >= self.max_turns:
            return {"observation": None, "done": True, "state": state, "reward": None, "role": "tool"}
        results = [_answer(c, self.seed) for c in calls[:MAX_CALLS]]
        if len(calls) > MAX_CALLS:
            results.append(f"error: {len(calls) - MAX_CALLS} more tool calls than the {MAX_CALLS} a reply may make")
        state = {**state, "tool_calls": int(state.get("tool_calls", 0)) + len(calls)}
        return {"observation": "\n".join(results), "done": False, "state": state, "reward": None, "role": "tool"}


# --- recall: the table in the character vocabulary --------------------------------------------

def recall_record(rng: np.random.Generator, seed: int, min_digits: int, max_digits: int) -> tuple[str, str]:
    n = int(rng.integers(min_digits, max_digits + 1))
    key = str(int(rng.integers(10 ** (n - 1) if n > 1 else 1, 10 ** n)))
    return f"{key}=", lookup_value(seed, key)


class RecallEnv:
    """`rollout.env=recall`: the first reply gets the value of the prompt's key and `=`; the
    second ends the episode (the answer, scored by the task's reward)."""

    def __init__(self, seed: int, max_turns: int = 2):
        self.seed, self.max_turns = seed, max_turns

    def step(self, key, messages: list[dict], state: dict) -> dict:
        if key.turn > 0:
            return {"observation": None, "done": True, "state": state}
        value = lookup_value(self.seed, messages[0]["content"].rstrip("="))
        return {"observation": f"{value}=" if value is not None else "-=", "done": False, "state": {"calls": 1}}
