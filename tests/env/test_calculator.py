"""The calculator MCP server shipped with the package: its evaluator (exact, bounded, no eval())
and the server itself over stdio, as `rollout.env=mcp` starts it."""
import asyncio
import json

import pytest

from async_rl.env.calculator import MAX_CHARS, CalcError, evaluate


@pytest.mark.parametrize("expr, want", [
    ("23 * 47", "1081"), ("(120 - 45) / 3", "25"), ("10 / 4", "2.5"), ("1 / 3", "0.333333333333"),
    ("0.1 + 0.2", "0.3"), ("-7 // 2", "-4"), ("17 % 5", "2"), ("2 ** 10", "1024"), ("2 ** -2", "0.25"),
    ("12 × 3 ÷ 4", "9"), (" +5 - -5 ", "10"), ("999 * 999 - 1", "998000"),
])
def test_the_evaluator_computes_exactly(expr, want):
    assert evaluate(expr) == want


@pytest.mark.parametrize("expr, needle", [
    ("__import__('os').system('true')", "unsupported: Call"), ("x + 1", "unsupported: Name"),
    ("'a' * 3", "unsupported: Constant"), ("[1] * 3", "unsupported: List"), ("1 < 2", "unsupported: Compare"),
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("9 ** 9 ** 9", "exponent above"), ("10 ** 61", "more than 60 digits"), ("2 ** 0.5", "whole-number exponents"),
    ("1e308 * 10", "more than 60 digits"), ("1 +", "cannot parse"), ("", "empty"), ("1" * (MAX_CHARS + 1), "longer than"),
    ("True + 1", "unsupported: Constant"),
])
def test_the_evaluator_refuses_in_one_line(expr, needle):
    with pytest.raises(CalcError, match=needle) as e:
        evaluate(expr)
    assert "\n" not in str(e.value)


def test_the_server_answers_over_stdio_and_logs_each_call(tmp_path):
    pytest.importorskip("fastmcp", reason="the tools extra (fastmcp) is not installed")
    from async_rl.env.interface import StepKey
    from async_rl.env.mcp import MCPEnv

    log = tmp_path / "calls.jsonl"
    env = MCPEnv(f"python -m async_rl.env.calculator --log {log}", max_turns=3)
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "%s"}}</tool_call>'
    reply = call % "23 * 47" + call % "1 / 0" + '<tool_call>{"name": "calculate", "arguments": {"x": 1}}</tool_call>'

    async def run():
        try:
            return await env.step(StepKey("r", 3, 0, 1, 0), [{"role": "user", "content": "q"},
                                                             {"role": "assistant", "content": reply}], {})
        finally:
            await env.aclose()

    out = asyncio.run(run())
    lines = out["observation"].splitlines()
    assert lines[:2] == ["1081", "error: division by zero"] and lines[2].startswith("error: ")
    assert [t["function"]["name"] for t in env.tools] == ["calculate"]
    logged = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x["expression"], x["result"], x["idempotency_key"]) for x in logged] == [
        ("23 * 47", "1081", "r/3/0/1/0#0"), ("1 / 0", "error: division by zero", "r/3/0/1/0#1")]


def test_an_env_used_from_a_new_event_loop_connects_anew(tmp_path):
    # each evaluation runs its steps on a runner of its own: a connection made on an earlier
    # loop (now closed) must not be used, or the step would never return
    pytest.importorskip("fastmcp", reason="the tools extra (fastmcp) is not installed")
    from async_rl.env.interface import StepKey
    from async_rl.env.mcp import MCPEnv

    env = MCPEnv("python -m async_rl.env.calculator", max_turns=3)
    reply = '<tool_call>{"name": "calculate", "arguments": {"expression": "6 * 7"}}</tool_call>'
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}]

    async def one(turn):
        return await asyncio.wait_for(env.step(StepKey("r", 1, 0, 0, turn), messages, {}), 60)

    assert asyncio.run(one(0))["observation"] == "42"
    assert asyncio.run(one(1))["observation"] == "42"
    asyncio.run(env.aclose())
