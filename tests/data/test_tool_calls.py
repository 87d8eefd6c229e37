"""Parsing tool calls in the Qwen/Hermes format, and rendering tool results."""
import pytest

from async_rl.data.tool_calls import (
    CallError,
    ToolCall,
    error_text,
    last_reply,
    parse_tool_calls,
    render_call,
    render_raw,
    tool_message,
)


def test_one_call_and_several_calls_in_order():
    reply = 'Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "42"}}\n</tool_call>'
    assert parse_tool_calls(reply) == [ToolCall("lookup", {"key": "42"})]
    two = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
           '<tool_call>{"name": "mul", "arguments": {"a": 3, "b": [4]}}</tool_call>')
    assert parse_tool_calls(two) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("mul", {"a": 3, "b": [4]})]


def test_no_call_is_an_empty_list():
    assert parse_tool_calls("The answer is 7.") == []
    assert parse_tool_calls("") == []


def test_arguments_as_a_json_string_or_missing():
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == [ToolCall("f", {"x": 1})]
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


@pytest.mark.parametrize("reply, reason", [
    ('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', "not JSON"),
    ("<tool_call>[1, 2]</tool_call>", "a JSON list"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no tool name"),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "no tool name"),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "arguments is a JSON list"),
    ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', "arguments is a string that is not a JSON object"),
    ('<tool_call>{"name": "f", "arguments": {}}', "<tool_call> without </tool_call>"),
])
def test_malformed_calls_are_values_not_exceptions(reply, reason):
    (err,) = parse_tool_calls(reply)
    assert isinstance(err, CallError) and reason in err.reason
    text = error_text(err)
    assert text.startswith("error: malformed tool call: ") and reason in text


def test_a_malformed_call_beside_good_ones_keeps_its_place():
    reply = ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>'
             '<tool_call>{"name": "b", "arguments": {}}</tool_call><tool_call>{"name": "c"')
    got = parse_tool_calls(reply)
    assert [type(g).__name__ for g in got] == ["ToolCall", "CallError", "ToolCall", "CallError"]
    assert got[0].name == "a" and got[2].name == "b" and got[3].text == '{"name": "c"'


def test_error_text_quotes_a_long_call_shortened():
    (err,) = parse_tool_calls("<tool_call>" + "x" * 1000 + "</tool_call>")
    assert len(error_text(err)) < 300 and error_text(err).endswith("...")


def test_rendering_results_and_calls():
    assert tool_message("7") == {"role": "tool", "content": "7"}
    assert tool_message("hi", role="user") == {"role": "user", "content": "hi"}
    assert render_raw(["7"]) == "\n<tool_response>\n7\n</tool_response>\n"
    assert render_raw(["1", "2"]).count("<tool_response>") == 2
    call = render_call("lookup", {"key": "42"})
    assert call == '<tool_call>{"name": "lookup", "arguments": {"key": "42"}}</tool_call>'
    assert parse_tool_calls(call) == [ToolCall("lookup", {"key": "42"})]


def test_last_reply_must_be_the_assistants():
    assert last_reply([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == "a"
    with pytest.raises(ValueError, match="ends with role 'user'"):
        last_reply([{"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match="ends with role None"):
        last_reply([])
