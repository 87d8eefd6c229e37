"""Multi-turn episodes on ledger samples: the token stream, the messages an env reads, budgets,
and an episode kept whole through the checkpoint's snapshot and the journal."""
import numpy as np
import pytest

from async_rl import config as C
from async_rl.buffer.journal_format import encode_episode, prompt_crc, read_segment
from async_rl.buffer.ledger import OBSERVATION, Ledger, Sample
from async_rl.data.tokenizer import ByteTokenizer, CharTokenizer
from async_rl.env.interface import EnvError, StepKey, StepResult
from async_rl.learner.batch import Row, build_batch
from async_rl.rollout.episode import CUT_MARK, Episodes

TOK = CharTokenizer()
EOS = TOK.eos_id


def _group(led: Ledger, prompt="123="):
    with led.lock:
        return led.add({"prompt_id": 7, "epoch": 0, "prompt": prompt, "answer": "9", "prompt_tokens":
                        TOK.encode_prompt(prompt)}, None)


def _episodes(**kw):
    return Episodes(run="r1", tokenizer=TOK, **{"max_turns": 3, "max_new_tokens": 20, **kw})


def _reply(s: Sample, text: str, version: int = 0) -> None:
    ids = TOK.encode(text) + [EOS]
    s.tokens += ids
    s.logprobs += [-0.5] * len(ids)
    s.versions += [version] * len(ids)


def test_observations_enter_the_stream_masked_and_the_messages_follow_the_turns():
    led, ep = Ledger(2), _episodes()
    g = _group(led)
    s = g.samples[1]
    _reply(s, "*1")
    key = ep.key(g, 1, s)
    assert (key.prompt_id, key.sample, key.turn, str(key)) == (7, 1, 0, "r1/7/0/1/0")
    a = ep.apply(s, key, StepResult("42=", False, {"n": 1}))
    assert not a.ended and a.tokens == 3
    assert s.versions[-3:] == [OBSERVATION] * 3 and s.logprobs[-3:] == [0.0] * 3
    assert s.turns == [{"key": "r1/7/0/1/0", "observation": "42=", "role": "tool", "at": 3, "n": 3}]
    _reply(s, "42", version=1)
    assert ep.messages(g, s) == [{"role": "user", "content": "123="}, {"role": "assistant", "content": "*1"},
                                 {"role": "tool", "content": "42="}, {"role": "assistant", "content": "42"}]
    assert ep.final_reply(s) == "42" and ep.key(g, 1, s).turn == 1
    a = ep.apply(s, ep.key(g, 1, s), StepResult(None, True, {"n": 1}, reward=0.5))
    assert a.ended and s.env_reward == 0.5 and ep.final_reply(s) == "42"  # the last step feeds nothing
    # trained: the assistant's tokens only
    batch = build_batch([Row(g.prompt_tokens, np.array(s.tokens), np.array(s.logprobs), np.array(s.versions), 1.0)],
                        n_rows=1, prompt_len=8, max_new=20, pad_id=0)
    assert batch.mask_BxN[0, :len(s.tokens)].tolist() == [v >= 0 for v in s.versions]
    assert g.min_version == 0


def test_an_episode_ends_at_max_turns_and_when_no_token_is_left():
    led = Ledger(1)
    g = _group(led)
    ep = _episodes(max_turns=1)
    s = g.samples[0]
    _reply(s, "*")
    assert ep.apply(s, ep.key(g, 0, s), StepResult("1=", False, {})).ended
    assert s.turns[-1]["n"] == 0 and s.turns[-1]["observation"] == "1="  # recorded, not fed
    g2 = _group(led)
    ep = _episodes(max_new_tokens=5)
    s = g2.samples[0]
    _reply(s, "*")  # 2 tokens; 3 of observation would leave none for a reply
    assert ep.apply(s, ep.key(g2, 0, s), StepResult("12=", False, {})).ended


def test_turn_budget_and_unencodable_observations():
    led = Ledger(1)
    g = _group(led)
    ep = _episodes(turn_max_tokens=4)
    s = g.samples[0]
    assert ep.budget(s) == 4
    _reply(s, "*")
    ep.apply(s, ep.key(g, 0, s), StepResult("5=", False, {}))
    assert ep.budget(s) == 4  # a new turn
    s.tokens.append(TOK.encode("5")[0])
    assert ep.budget(s) == 3
    with pytest.raises(EnvError, match="cannot encode.*prompt_id=7 sample=0 turn=1"):
        ep.apply(s, ep.key(g, 0, s).__class__("r1", 7, 0, 0, 1), StepResult("x!", False, {}))


def test_snapshot_keeps_episodes_and_old_snapshots_still_load():
    led, ep = Ledger(2), _episodes()
    g = _group(led)
    s = g.samples[0]
    _reply(s, "*")
    ep.apply(s, ep.key(g, 0, s), StepResult("77=", False, {"calls": [1, "a"]}))
    _reply(s, "77")
    s.awaiting = True  # the second step was running at the cut
    snap = led.snapshot()
    snap.validate()
    back = Ledger.from_snapshot(snap).groups[g.ordinal].samples
    assert back[0].tokens == s.tokens and back[0].versions == s.versions
    assert (back[0].turns, back[0].env_state, back[0].awaiting) == (s.turns, {"calls": [1, "a"]}, True)
    assert back[1].episode is None
    single = Ledger(2)
    _group(single)
    arrays = single.snapshot().arrays
    assert "episode_lens" not in arrays  # single-turn checkpoints are as before


def test_journal_records_an_episodes_progress(tmp_path):
    from async_rl.store.applog import AppendLog
    led, ep = Ledger(1), _episodes()
    g = _group(led)
    s = g.samples[0]
    _reply(s, "*")
    ep.apply(s, ep.key(g, 0, s), StepResult("8=", False, {"k": 1}))
    crc = prompt_crc(g.prompt_tokens)
    log = AppendLog(tmp_path / "1.jrn", new=True)
    log.write(encode_episode(g, 0, s, None, crc))
    _reply(s, "8")
    ep.apply(s, ep.key(g, 0, s), StepResult(None, True, {"k": 2}))
    log.write(encode_episode(g, 0, s, 0.75, crc))
    log.close()
    progress, final = read_segment(tmp_path / "1.jrn").entries
    assert not progress.done and np.isnan(progress.reward) and progress.turns == 1
    assert progress.episode["state"] == {"k": 1} and progress.vmin == 0
    assert final.done and final.reward == 0.75 and final.turns == 2
    assert final.versions.tolist() == s.versions


def test_step_keys_parse_back():
    k = StepKey("a/b", 1, 2, 3, 4)
    assert StepKey.parse(str(k)) == k


def test_the_messages_begin_each_reply_with_the_prefix_its_prompt_ended_with():
    class Prefixed(CharTokenizer):
        first_reply_prefix, reply_prefix = "*", "="

    led = Ledger(1)
    g = _group(led)
    ep = Episodes(run="r1", tokenizer=Prefixed(), max_turns=3, max_new_tokens=20)
    s = g.samples[0]
    _reply(s, "1")
    assert ep.messages(g, s)[-1] == {"role": "assistant", "content": "*1"}
    ep.apply(s, ep.key(g, 0, s), StepResult("42", False, {}))
    _reply(s, "42")
    assert [m["content"] for m in ep.messages(g, s)] == ["123=", "*1", "42", "=42"]


@pytest.mark.parametrize("reward", [1e200, -2e6])
def test_an_env_reward_out_of_range_is_refused_before_it_is_recorded(reward):
    led, ep = Ledger(2), _episodes(reward_max_abs=1e6)
    g = _group(led)
    s = g.samples[1]
    _reply(s, "42")
    before = (list(s.tokens), list(s.turns), s.env_reward)
    with pytest.raises(EnvError) as e:
        ep.apply(s, ep.key(g, 1, s), StepResult(None, True, {"n": 1}, reward=reward))
    msg = str(e.value)
    assert "\n" not in msg and "prompt_id=7" in msg and "sample 1" in msg and repr(reward) in msg, msg
    assert "rollout.reward_max_abs=1e+06" in msg, msg
    assert (s.tokens, s.turns, s.env_reward, s.done) == (*before, False)


def test_a_huge_observation_is_cut_to_the_caps_marked_and_counted_in_the_budget():
    led = Ledger(1)
    g = _group(led)
    ep = _episodes(max_new_tokens=200, max_observation_chars=100, max_observation_tokens=64)
    s = g.samples[0]
    _reply(s, "*")
    a = ep.apply(s, ep.key(g, 0, s), StepResult("1" * 10_000_000, False, {}))
    t = s.turns[-1]
    # chars first (100), then tokens (the char tokenizer has no letters for the mark: the cut alone)
    assert len(t["observation"]) <= 64 and t["observation"] == "1" * len(t["observation"])
    assert (a.ended, a.tokens, a.cut, t["cut"]) == (False, t["n"], 10_000_000 - t["n"], a.cut)
    assert len(s.tokens) == 2 + t["n"] and ep.budget(s) == 200 - len(s.tokens)  # the budget counts them
    # a step that ends the episode stores its observation cut too (it is kept, not fed)
    a = ep.apply(s, ep.key(g, 0, s), StepResult("2" * 5000, True, {}))
    assert (a.ended, a.tokens, len(s.turns[-1]["observation"]), s.turns[-1]["cut"]) == (True, 0, 100, 4900)


def test_the_cut_is_marked_where_the_vocabulary_can_spell_it():
    led = Ledger(1)
    g = _group(led)
    ep = Episodes(run="r1", tokenizer=ByteTokenizer(), max_turns=3, max_new_tokens=10_000, max_observation_chars=1000,
                  max_observation_tokens=200)
    s = g.samples[0]
    s.tokens += [65, 66]
    a = ep.apply(s, ep.key(g, 0, s), StepResult("é" * 5000, False, {}))  # 2 bytes a character
    obs = s.turns[-1]["observation"]
    kept = obs.split("\n")[0]
    assert obs == kept + CUT_MARK.format(5000 - len(kept)) and a.cut == 5000 - len(kept)
    assert 0 < a.tokens <= 200 and a.tokens == len(obs.encode())
    assert Episodes.of(C.RolloutConfig(max_observation_chars=123, max_observation_tokens=77), run="r", tokenizer=TOK,
                       max_turns=2).max_chars == 123


def test_cut_observations_are_counted_in_the_step_metrics():
    from async_rl.obs.metrics import Rates
    from async_rl.rollout.pump import PumpStats
    row = Rates().take(PumpStats(env_submitted=5, env_steps=4, env_cut=2), None)
    assert (row["rollout/env_steps"], row["rollout/env_observations_cut"]) == (4, 2)
