"""rollout.env=mcp against a real fastmcp server on loopback, over stdio and streamable HTTP."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastmcp", reason="the tools extra (fastmcp) is not installed: pip install 'async_rl[tools]'")

from helpers import MODEL, free_port, wait_until  # noqa: E402

from async_rl import config as C  # noqa: E402
from async_rl.data.tool_calls import render_call  # noqa: E402
from async_rl.env.interface import EnvError, EnvRunner, StepKey, StepResult, load_env  # noqa: E402
from async_rl.env.mcp import MCPEnv  # noqa: E402

# The service: records every call's tool, arguments and _meta keys (one JSON line each) in the
# file named by its first argument; serves stdio, or HTTP on the port given as the second.
SERVER = '''
import json, os, sys
from fastmcp import Context, FastMCP

mcp = FastMCP("test-tools")
LOG = sys.argv[1]


def record(ctx, tool, args):
    meta = ctx.request_context.meta or {}
    with open(LOG, "a") as f:
        f.write(json.dumps({"tool": tool, "args": args, "idempotency_key": meta.get("idempotency_key"),
                            "step_key": meta.get("step_key"), "pid": os.getpid()}) + "\\n")


@mcp.tool
def lookup(key: str, ctx: Context) -> str:
    """The value stored under key."""
    record(ctx, "lookup", {"key": key})
    return "value-" + key


@mcp.tool
def add(a: int, b: int, ctx: Context) -> int:
    """a + b"""
    record(ctx, "add", {"a": a, "b": b})
    return a + b


@mcp.tool
async def sleepy(seconds: float, ctx: Context) -> str:
    """Answers after `seconds`."""
    import asyncio
    record(ctx, "sleepy", {"seconds": seconds})
    await asyncio.sleep(seconds)
    return "awake"


@mcp.tool
def broken(ctx: Context) -> str:
    """Always fails."""
    record(ctx, "broken", {})
    raise ValueError("the tool broke")


if __name__ == "__main__":
    if len(sys.argv) > 2:
        mcp.run(transport="http", host="127.0.0.1", port=int(sys.argv[2]), show_banner=False, log_level="WARNING")
    else:
        mcp.run(show_banner=False, log_level="WARNING")
'''


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(params=["stdio", "http"])
def server(request, tmp_path):
    """(rollout.mcp_server value, path of the calls log) of a fresh server."""
    script, log = tmp_path / "tools_server.py", tmp_path / "calls.jsonl"
    script.write_text(SERVER)
    log.touch()
    if request.param == "stdio":
        yield f"{sys.executable} {script} {log}", log
        return
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), str(log), str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_until(lambda: proc.poll() is not None or _port_open(port), 60, "the MCP HTTP server listening")
        assert proc.poll() is None, proc.stderr.read().decode()
        yield f"http://127.0.0.1:{port}/mcp", log
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def calls(log):
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def reply(text):
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


def run_steps(runner, steps, timeout=60.0):
    """Submits (key, messages, state) steps; {str(key): result} once all are back."""
    for k, m, s in steps:
        runner.submit(k, m, s)
    got = []
    wait_until(lambda: got.extend(runner.poll()) or len(got) >= len(steps), timeout, "MCP env steps")
    return {str(h.key): r for h, r in got}


def test_tools_called_with_step_keys_in_meta(server):
    spec, log = server
    cfg = C.load(None, [*MODEL, "rollout.env=mcp", f"rollout.mcp_server={spec}", "rollout.env_max_turns=3"])
    env = load_env(cfg.rollout.env, cfg)
    assert isinstance(env, MCPEnv) and env.max_turns == 3
    runner = EnvRunner(env, max_concurrent=4, timeout_s=60)
    k = [StepKey("run-1", p, 0, s, t) for p, s, t in [(3, 0, 0), (3, 1, 0), (4, 0, 1), (5, 0, 0), (6, 2, 0), (7, 0, 2)]]
    steps = [
        (k[0], reply("Checking. " + render_call("lookup", {"key": "k3"})), {}),
        (k[1], reply(render_call("add", {"a": 2, "b": 40}) + render_call("lookup", {"key": "z"})), {"tool_calls": 1}),
        (k[2], reply('<tool_call>{"name": "lookup", "arguments": {"key": </tool_call>'), {}),
        (k[3], reply(render_call("nosuch", {}) + render_call("add", {"a": "x"}) + render_call("broken", {})), {}),
        (k[4], reply("The answer is 42."), {"tool_calls": 2}),
        (k[5], reply(render_call("lookup", {"key": "late"})), {}),  # the last of 3 turns
    ]
    try:
        got = run_steps(runner, steps)
        tools = runner.env.tools
    finally:
        assert runner.close(timeout_s=10) == []
    r = {i: got[str(k[i])] for i in range(6)}
    assert all(isinstance(x, StepResult) for x in r.values()), r
    assert r[0] == StepResult("value-k3", False, {"tool_calls": 1}, None, "tool")
    assert r[1].observation == "42\nvalue-z" and r[1].state == {"tool_calls": 3}
    assert r[2].observation.startswith("error: malformed tool call: not JSON") and not r[2].done
    # a tool's own errors (unknown tool, arguments refused by its schema, a raise) are read back, in call order
    obs = r[3].observation
    assert obs.startswith("error: unknown tool 'nosuch' (tools: add, broken, lookup, sleepy)\nerror: ")
    assert "valid integer" in obs and obs.endswith("the tool broke") and obs.count("error: ") == 3
    assert r[4] == StepResult(None, True, {"tool_calls": 2}, None, "tool")
    assert r[5].done and r[5].observation is None
    assert sorted(t["function"]["name"] for t in tools) == ["add", "broken", "lookup", "sleepy"]
    lookup = next(t["function"] for t in tools if t["function"]["name"] == "lookup")
    assert lookup["parameters"]["required"] == ["key"]
    # the server saw every call it ran once, each with its step's key; none for the steps that
    # called no tool, a malformed or unknown one, or came at the last turn
    seen = sorted((c["idempotency_key"], c["step_key"], c["tool"], json.dumps(c["args"])) for c in calls(log))
    assert seen == sorted([
        (f"{k[0]}#0", str(k[0]), "lookup", '{"key": "k3"}'),
        (f"{k[1]}#0", str(k[1]), "add", '{"a": 2, "b": 40}'),
        (f"{k[1]}#1", str(k[1]), "lookup", '{"key": "z"}'),
        (f"{k[3]}#2", str(k[3]), "broken", "{}"),
    ])
    assert len({c["pid"] for c in calls(log)}) == 1  # one server connection for all the steps


def test_a_step_asked_again_sends_the_same_key(server):
    spec, log = server
    key = StepKey("run-2", 11, 1, 0, 0)
    for _ in range(2):  # as a resumed run would: a new process, a new connection, the same key
        runner = EnvRunner(MCPEnv(spec, max_turns=4), max_concurrent=1, timeout_s=60)
        try:
            (r,) = run_steps(runner, [(key, reply(render_call("lookup", {"key": "a"})), {})]).values()
        finally:
            runner.close(timeout_s=10)
        assert r.observation == "value-a"
        if not spec.startswith("http"):  # closing the env ends its stdio server
            wait_until(lambda: not _alive(calls(log)[-1]["pid"]), 10, "the stdio server's exit")
    assert [c["idempotency_key"] for c in calls(log)] == [f"{key}#0", f"{key}#0"]


def test_a_tool_past_the_timeout_fails_its_step_and_the_connection_goes_on(server):
    spec, log = server
    runner = EnvRunner(MCPEnv(spec), max_concurrent=2, timeout_s=8)  # a stdio server starts in 1-3 s
    slow, fast = StepKey("run-4", 1, 0, 0, 0), StepKey("run-4", 2, 0, 0, 0)
    try:
        (warm,) = run_steps(runner, [(fast, reply(render_call("lookup", {"key": "warm"})), {})]).values()
        assert isinstance(warm, StepResult), warm  # connected
        t0 = time.monotonic()
        got = run_steps(runner, [(slow, reply(render_call("sleepy", {"seconds": 60})), {}),
                                 (fast, reply(render_call("lookup", {"key": "b"})), {})], timeout=30)
        assert time.monotonic() - t0 < 20
        # the next step on the same connection, after the cancelled call
        (after,) = run_steps(runner, [(fast, reply(render_call("lookup", {"key": "c"})), {})]).values()
    finally:
        assert runner.close(timeout_s=10) == []
    assert str(got[str(slow)]) == ("env step did not return within rollout.env_timeout_s=8 s on prompt_id=1 sample=0 turn=0 "
                                   "(key run-4/1/0/0/0)")
    assert got[str(fast)].observation == "value-b" and after.observation == "value-c"


def test_an_unreachable_server_fails_the_step_in_one_line():
    port = free_port()  # nothing listens there
    runner = EnvRunner(MCPEnv(f"http://127.0.0.1:{port}/mcp"), max_concurrent=1, timeout_s=20)
    key = StepKey("run-3", 8, 0, 0, 0)
    t0 = time.monotonic()
    try:
        (r,) = run_steps(runner, [(key, reply(render_call("lookup", {"key": "a"})), {})], timeout=30).values()
    finally:
        runner.close(timeout_s=5)
    assert isinstance(r, EnvError) and "\n" not in str(r) and time.monotonic() - t0 < 25
    assert "prompt_id=8 sample=0 turn=0 (key run-3/8/0/0/0)" in str(r) and f"127.0.0.1:{port}" in str(r)


def test_mcp_needs_a_server_and_a_bad_command_is_one_line():
    with pytest.raises(C.ConfigError, match="rollout.mcp_server"):
        C.load(None, [*MODEL, "rollout.env=mcp"])
    runner = EnvRunner(MCPEnv("/nonexistent/mcp-server --flag"), max_concurrent=1, timeout_s=20)
    try:
        (r,) = run_steps(runner, [(StepKey("r", 1, 0, 0, 0), reply(render_call("x", {})), {})], timeout=30).values()
    finally:
        runner.close(timeout_s=5)
    assert isinstance(r, EnvError) and "\n" not in str(r) and "/nonexistent/mcp-server" in str(r)


@pytest.mark.parametrize("kind", ["nothing listens", "no such command"])
def test_a_server_that_cannot_be_reached_is_refused_at_start_up(tmp_path, capsys, kind):
    """A run whose policy never calls a tool would otherwise finish without ever reaching it."""
    from helpers import FAST

    from async_rl.run.cli import main
    server = f"http://127.0.0.1:{free_port()}/mcp" if kind == "nothing listens" else "/nonexistent/mcp-server --flag"
    t0 = time.monotonic()
    code = main(["train", "--config", "configs/tiny.yaml", f"run.dir={tmp_path / 'run'}", *FAST,
                 "rollout.env=mcp", f"rollout.mcp_server={server}", "rollout.env_timeout_s=20"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"error: rollout.mcp_server={server!r}: cannot connect and list its tools (")
    assert time.monotonic() - t0 < 60


def test_start_up_lists_the_tools_the_server_serves(server):
    spec, _ = server
    cfg = C.load(None, [*MODEL, "rollout.env=mcp", f"rollout.mcp_server={spec}"])
    env = load_env(cfg.rollout.env, cfg)
    assert sorted(t["function"]["name"] for t in env.tools) == ["add", "broken", "lookup", "sleepy"]


def test_the_system_message_lists_the_tools_the_server_serves(tmp_path):
    """`{tools}` in tokenizer.system becomes the server's own list: a tool it adds shows."""
    pytest.importorskip("jinja2")
    from test_tokenizer import CHATML, make_hf_dir

    from async_rl.data.tokenizer import HFTokenizer
    from async_rl.env.interface import use_env_tools
    script, tok_dir = tmp_path / "tools_server.py", tmp_path / "tok"
    script.write_text(SERVER)
    tok_dir.mkdir()
    d = make_hf_dir(tok_dir, CHATML, {"tokenizer_config.json": {"eos_token": "<|im_end|>"}})
    tok = HFTokenizer(str(d), chat=True, system="Tools:\n{tools}\nCall one.")
    with pytest.raises(C.ConfigError, match=r"tokenizer.system: has \{tools\}, but rollout.env lists no tools"):
        tok.chat_text("q")
    cfg = C.load(None, [*MODEL, "rollout.env=mcp", f"rollout.mcp_server={sys.executable} {script} {tmp_path / 'c'}"])
    use_env_tools(tok, load_env(cfg.rollout.env, cfg))
    assert tok.chat_text("q").startswith(
        "<|im_start|>system\nTools:\n- lookup(key: string): The value stored under key.\n"
        "- add(a: integer, b: integer): a + b\n- sleepy(seconds: number): Answers after `seconds`.\n"
        "- broken(): Always fails.\nCall one.<|im_end|>\n")


def test_the_calculator_job_lists_its_tools_from_the_server():
    import yaml

    system = yaml.safe_load(open("configs/smollm2-calculator.yaml"))["tokenizer"]["system"]
    assert "{tools}" in system
    cfg = C.load(None, [*MODEL, "rollout.env=mcp", "rollout.mcp_server=python -m async_rl.env.calculator"])
    from async_rl.data.tool_calls import describe_tools
    assert describe_tools(load_env(cfg.rollout.env, cfg).tools) == (
        '- calculate(expression: string): Evaluate an arithmetic expression, e.g. "23 * 47" or "(120 - 45) / 3".')
