"""The lookup task: records only the tool can answer, and its in-process env."""
import pytest
from helpers import MODEL, wait_until

from async_rl import config as C
from async_rl.data.dataset import build_dataset, make_iterator, synthetic_record
from async_rl.data.rewards import reward_for_config
from async_rl.data.tokenizer import ByteTokenizer
from async_rl.data.tool_calls import parse_tool_calls, render_call
from async_rl.data.tool_tasks import VALUE_DIGITS, LookupEnv, lookup_value
from async_rl.env.interface import EnvRunner, StepKey, StepResult, load_env


def cfg_of(*overrides):
    return C.load(None, [*MODEL, "data.task=lookup", "engine.max_prompt_len=128", *overrides])


def episode(prompt, reply):
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]


def test_records_are_deterministic_and_the_answer_is_the_tables_value():
    recs = [synthetic_record("lookup", 3, i, 3, 5) for i in range(200)]
    assert recs == [synthetic_record("lookup", 3, i, 3, 5) for i in range(200)]
    keys = set()
    for r in recs:
        (call,) = parse_tool_calls(r["prompt"])  # the prompt shows the call to make
        key = call.arguments["key"]
        keys.add(key)
        assert 3 <= len(key) <= 5 and r["answer"] == lookup_value(3, key)
        assert len(r["answer"]) == VALUE_DIGITS and r["answer"] not in r["prompt"]
    assert len(keys) > 150
    # the table depends on the seed: another run's values are other values
    assert sum(lookup_value(4, k) != lookup_value(3, k) for k in keys) > 0.9 * len(keys)


def test_table_refuses_keys_it_does_not_hold():
    assert lookup_value(0, "123") is not None
    for bad in ("", "0123", "12a", "-5", "1" * 40, 123, "１２３"):
        assert lookup_value(0, bad) is None


def test_dataset_reward_and_char_vocab():
    cfg = cfg_of("data.num_records=20")
    assert not cfg.data.char_vocab  # JSON in the prompt: byte text, not the digit vocabulary
    assert reward_for_config(cfg)[0] == "exact_match"
    tok = ByteTokenizer()
    recs = list(make_iterator(build_dataset(cfg, tok)))
    assert sorted(r["prompt_id"] for r in recs) == list(range(20))
    for r in recs:
        assert tok.decode(r["prompt_tokens"]) == r["prompt"] and r["prompt"].startswith("Look up key ")
        assert r["answer"] == synthetic_record("lookup", cfg.data.seed, r["prompt_id"], 3, 6)["answer"]
    with pytest.raises(C.ConfigError, match="engine.max_prompt_len=40: data.task=lookup"):
        build_dataset(cfg_of("engine.max_prompt_len=40"), ByteTokenizer())


def test_env_answers_a_well_formed_call_with_the_value():
    rec = synthetic_record("lookup", 11, 5, 3, 6)
    key = parse_tool_calls(rec["prompt"])[0].arguments["key"]
    env = LookupEnv(seed=11, max_turns=3)
    out = env.step(StepKey("r", 5, 0, 0, 0), episode(rec["prompt"], render_call("lookup", {"key": key})), {})
    r = StepResult.check(out, StepKey("r", 5, 0, 0, 0))
    assert r == StepResult(rec["answer"], False, {"tool_calls": 1}, None, "tool")
    # the final reply calls no tool: done, and rollout.reward (exact_match) scores it
    out = env.step(StepKey("r", 5, 0, 0, 1), [*episode(rec["prompt"], "x"), {"role": "tool", "content": r.observation},
                                              {"role": "assistant", "content": rec["answer"]}], r.state)
    assert out["done"] and out["observation"] is None and out["state"] == {"tool_calls": 1}
    fn = reward_for_config(cfg_of())[1]
    assert fn(rec["answer"], rec["answer"]) == 1.0 and fn("1234 " + rec["answer"], rec["answer"]) == 0.0


@pytest.mark.parametrize("reply, needle", [
    ('<tool_call>{"name": "lookup", "arguments": {"key": "12"</tool_call>', "error: malformed tool call: not JSON"),
    ('<tool_call>{"name": "search", "arguments": {"q": "12"}}</tool_call>', "error: unknown tool 'search' (tools: lookup)"),
    ('<tool_call>{"name": "lookup", "arguments": {"k": "12"}}</tool_call>', "error: lookup takes one argument, key"),
    ('<tool_call>{"name": "lookup", "arguments": {"key": "x1"}}</tool_call>', "error: no key 'x1' in the table"),
])
def test_env_turns_bad_calls_into_error_observations(reply, needle):
    out = LookupEnv(seed=0).step(StepKey("r", 1, 0, 0, 0), episode("q", reply), {})
    assert out["observation"] == needle or out["observation"].startswith(needle)
    assert out["done"] is False


def test_env_answers_each_call_and_stops_at_max_turns():
    env = LookupEnv(seed=2, max_turns=2)
    reply = render_call("lookup", {"key": "123"}) + render_call("lookup", {"key": 456})
    out = env.step(StepKey("r", 1, 0, 0, 0), episode("q", reply), {"tool_calls": 3})
    assert out["observation"] == f"{lookup_value(2, '123')}\n{lookup_value(2, '456')}" and out["state"] == {"tool_calls": 5}
    out = env.step(StepKey("r", 1, 0, 0, 1), episode("q", reply), {})
    assert out["done"] and out["observation"] is None  # the last turn: no call is run
    many = render_call("lookup", {"key": "1"}) * 10
    obs = env.step(StepKey("r", 1, 0, 0, 0), episode("q", many), {})["observation"].split("\n")
    assert len(obs) == 9 and obs[-1] == "error: 2 more tool calls than the 8 a reply may make"


def test_lookup_env_through_the_runner_from_config():
    cfg = cfg_of("rollout.env=lookup", "data.seed=5")
    runner = EnvRunner(load_env(cfg.rollout.env, cfg), max_concurrent=cfg.rollout.env_max_concurrent,
                       timeout_s=cfg.rollout.env_timeout_s)
    try:
        h = runner.submit(StepKey("r", 0, 0, 0, 0), episode("q", render_call("lookup", {"key": "77"})), {})
        got = []
        wait_until(lambda: got.extend(runner.poll()) or got, 10, "the lookup step")
    finally:
        runner.close()
    assert got[0][0] is h and got[0][1].observation == lookup_value(5, "77")
