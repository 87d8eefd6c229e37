"""Prompt streams: synthetic records, prompt files, bad records, sharding, epochs, and the
iterator state (mid-epoch, on an epoch boundary, exhausted)."""

import json
import threading
from collections import Counter

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import MODEL

from async_rl import config
from async_rl.config import ConfigError
from async_rl.data.dataset import DataError, build_dataset, make_iterator, synthetic_record
from async_rl.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def cfg_of(*overrides):
    return config.load(None, [*MODEL, "engine.max_prompt_len=16", *overrides])


def drain(it):
    return list(it)


def ids_by_epoch(records):
    out = {}
    for r in records:
        out.setdefault(r["epoch"], []).append(r["prompt_id"])
    return out


# --- synthetic records ------------------------------------------------------------------

@pytest.mark.parametrize("task", ["reverse", "addition"])
def test_synthetic_records_are_deterministic_and_correct(task):
    cfg = cfg_of(f"data.task={task}", "data.num_records=50", "data.num_epochs=2", "data.seed=7",
                 "data.min_digits=2", "data.max_digits=5")
    recs = drain(make_iterator(build_dataset(cfg, TOK)))
    again = drain(make_iterator(build_dataset(cfg, TOK)))
    by_id = {}
    for r, r2 in zip(recs, again):
        assert r["prompt_id"] == r2["prompt_id"] and r["prompt"] == r2["prompt"]
        # the same id is the same record in every epoch
        prev = by_id.setdefault(r["prompt_id"], (r["prompt"], r["answer"]))
        assert prev == (r["prompt"], r["answer"])
        assert r["prompt_tokens"].dtype == np.int32
        assert TOK.decode(r["prompt_tokens"]) == r["prompt"]
        body = r["prompt"][:-1]
        assert r["prompt"].endswith("=")
        if task == "reverse":
            assert 2 <= len(body) <= 5 and body.isdigit() and r["answer"] == body[::-1]
        else:
            a, b = body.split("+")
            assert all(2 <= len(x) <= 5 and x[0] != "0" for x in (a, b))
            assert r["answer"] == str(int(a) + int(b))
    assert len(by_id) == 50
    other_seed = synthetic_record(task, 8, 3, 2, 5)
    assert synthetic_record(task, 7, 3, 2, 5) == {"prompt_id": 3, "prompt": by_id[3][0], "answer": by_id[3][1]}
    assert len({synthetic_record(task, 7, i, 2, 5)["prompt"] for i in range(50)}) > 40
    assert other_seed != synthetic_record(task, 7, 3, 2, 5)


def test_word_problems_are_deterministic_and_answered_by_math_answer():
    from async_rl.data.rewards import math_answer_reward, task_reward
    cfg = cfg_of("data.task=word_problem", "data.num_records=300", "data.min_digits=1", "data.max_digits=2",
                 "engine.max_prompt_len=160")
    recs = drain(make_iterator(build_dataset(cfg, TOK)))
    assert [r["prompt"] for r in recs] == [r["prompt"] for r in drain(make_iterator(build_dataset(cfg, TOK)))]
    ops = Counter()
    for r in recs:
        nums = [int(x) for x in r["prompt"].replace("?", " ").replace(".", " ").split() if x.isdigit()]
        a, b = nums
        assert 1 <= a <= 99 and 1 <= b <= 99 and r["prompt"].endswith("Answer with a single number.")
        op = "+" if int(r["answer"]) == a + b else "-" if int(r["answer"]) == a - b else "*"
        assert r["answer"] == str({"+": a + b, "-": a - b, "*": a * b}[op])
        ops[op] += 1
        assert math_answer_reward(f"So the answer is {r['answer']}.", r["answer"]) == 1.0
        assert math_answer_reward(f"So the answer is {int(r['answer']) + 1}.", r["answer"]) == 0.0
    assert min(ops.values()) > 30 and task_reward("word_problem") == "math_answer"
    assert len({r["prompt"] for r in recs}) > 290
    with pytest.raises(ConfigError, match=r"engine.max_prompt_len=40: data.task=word_problem"):
        build_dataset(cfg_of("data.task=word_problem", "engine.max_prompt_len=40"), TOK)


def test_sequences_are_arithmetic_and_scored_on_the_first_number():
    from async_rl.data.rewards import first_number_reward, task_reward
    cfg = cfg_of("data.task=sequence", "data.num_records=200", "data.min_digits=1", "data.max_digits=2",
                 "engine.max_prompt_len=32")
    assert not cfg.data.char_vocab
    recs = drain(make_iterator(build_dataset(cfg, TOK)))
    assert [r["prompt"] for r in recs] == [r["prompt"] for r in drain(make_iterator(build_dataset(cfg, TOK)))]
    steps = Counter()
    for r in recs:
        assert r["prompt"].endswith(",")
        terms = [int(x) for x in r["prompt"].rstrip(",").split(", ")] + [int(r["answer"])]
        diffs = {b - a for a, b in zip(terms, terms[1:])}
        assert len(terms) == 5 and 1 <= terms[0] <= 99 and len(diffs) == 1 and 2 <= min(diffs) <= 9
        steps[diffs.pop()] += 1
        nxt = int(r["answer"]) + terms[1] - terms[0]
        assert first_number_reward(f" {r['answer']}, {nxt}, {nxt + 1}", r["answer"]) == 1.0
        assert first_number_reward(f" {nxt}, {r['answer']}", r["answer"]) == 0.0  # only the first counts
    assert len(steps) == 8 and task_reward("sequence") == "first_number"
    assert first_number_reward(" none", "7") == 0.0
    with pytest.raises(ConfigError, match=r"engine.max_prompt_len=16: data.task=sequence"):
        build_dataset(cfg_of("data.task=sequence", "data.min_digits=1", "data.max_digits=2"), TOK)


def test_synthetic_prompt_too_long_is_a_config_error():
    cfg = cfg_of("data.task=addition", "data.max_digits=8", "engine.max_prompt_len=16")
    with pytest.raises(ConfigError, match=r"engine.max_prompt_len=16.*19 tokens"):
        build_dataset(cfg, TOK)
    pd = build_dataset(cfg_of("data.task=addition", "data.max_digits=8", "engine.max_prompt_len=19",
                              "data.num_records=8"), TOK)
    assert pd.max_prompt_len == 19


# --- epochs, shuffling, sharding --------------------------------------------------------

def test_every_id_once_per_epoch_and_epochs_reshuffle():
    cfg = cfg_of("data.num_records=64", "data.num_epochs=3", "data.shuffle=true")
    pd = build_dataset(cfg, TOK)
    assert len(pd.dataset) == pd.total_records == 192
    recs = drain(make_iterator(pd))
    epochs = ids_by_epoch(recs)
    assert sorted(epochs) == [0, 1, 2]
    for order in epochs.values():
        assert sorted(order) == list(range(64))
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert epochs[0] != list(range(64))
    np.testing.assert_array_equal(pd.prompt_ids, np.arange(64))


def test_no_shuffle_keeps_order_every_epoch():
    pd = build_dataset(cfg_of("data.num_records=10", "data.num_epochs=2", "data.shuffle=false"), TOK)
    epochs = ids_by_epoch(drain(make_iterator(pd)))
    assert epochs == {0: list(range(10)), 1: list(range(10))}


def test_shuffle_depends_on_seed_only():
    a = ids_by_epoch(drain(make_iterator(build_dataset(cfg_of("data.num_records=30", "data.seed=1"), TOK))))
    b = ids_by_epoch(drain(make_iterator(build_dataset(cfg_of("data.num_records=30", "data.seed=1"), TOK))))
    c = ids_by_epoch(drain(make_iterator(build_dataset(cfg_of("data.num_records=30", "data.seed=2"), TOK))))
    assert a == b and a != c


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_shards_are_disjoint_cover_everything_and_stay_put(count):
    cfg = cfg_of("data.num_records=10", "data.num_epochs=2")
    seen = Counter()
    for i in range(count):
        pd = build_dataset(cfg, TOK, process_index=i, process_count=count)
        epochs = ids_by_epoch(drain(make_iterator(pd)))
        assert set(epochs[0]) == set(epochs[1])  # the same records every epoch
        assert len(epochs[0]) == pd.records_per_epoch
        np.testing.assert_array_equal(pd.prompt_ids, np.arange(10))
        seen.update(epochs[0])
    assert seen == Counter(range(10))


def test_more_processes_than_records():
    with pytest.raises(DataError, match="3 records cannot be split over 4"):
        build_dataset(cfg_of("data.num_records=3"), TOK, process_index=0, process_count=4)


# --- iterator state ---------------------------------------------------------------------

@pytest.mark.parametrize("cut", [0, 5, 10, 17, 20])  # start, mid-epoch, boundary, mid, end
def test_state_round_trip(cut):
    cfg = cfg_of("data.num_records=10", "data.num_epochs=2")
    full = drain(make_iterator(build_dataset(cfg, TOK)))
    it = make_iterator(build_dataset(cfg, TOK))
    head = [next(it) for _ in range(cut)]
    state = json.loads(json.dumps(it.get_state()))
    assert state["next_index"] == cut
    resumed = make_iterator(build_dataset(cfg, TOK))  # as after a restart
    resumed.set_state(state)
    tail = drain(resumed)
    assert [r["prompt_id"] for r in head + tail] == [r["prompt_id"] for r in full]
    assert [r["epoch"] for r in head + tail] == [r["epoch"] for r in full]
    assert resumed.exhausted


def test_exhausted_state_restores_exhausted():
    cfg = cfg_of("data.num_records=6", "data.num_epochs=1")
    it = make_iterator(build_dataset(cfg, TOK))
    assert len(drain(it)) == 6
    with pytest.raises(StopIteration):
        next(it)
    state = it.get_state()  # captured after StopIteration
    assert state["next_index"] == 6
    fresh = make_iterator(build_dataset(cfg, TOK))
    fresh.set_state(json.loads(json.dumps(state)))
    assert fresh.exhausted
    with pytest.raises(StopIteration):
        next(fresh)
    assert fresh.get_state() == state


def test_state_exactly_at_end_before_stop_iteration():
    cfg = cfg_of("data.num_records=4")
    it = make_iterator(build_dataset(cfg, TOK))
    for _ in range(4):
        next(it)
    state = it.get_state()  # last record handed out, StopIteration not yet seen
    fresh = make_iterator(build_dataset(cfg, TOK))
    fresh.set_state(state)
    with pytest.raises(StopIteration):
        next(fresh)


def test_state_refuses_another_stream():
    it = make_iterator(build_dataset(cfg_of("data.num_records=10"), TOK, process_index=0, process_count=2))
    next(it)
    state = it.get_state()
    other = make_iterator(build_dataset(cfg_of("data.num_records=10"), TOK, process_index=1, process_count=2))
    with pytest.raises(DataError, match="another stream"):
        other.set_state(state)
    more = make_iterator(build_dataset(cfg_of("data.num_records=12"), TOK, process_index=0, process_count=2))
    with pytest.raises(DataError, match="another stream"):
        more.set_state(state)
    plain = make_iterator(build_dataset(cfg_of("data.num_records=10"), TOK, process_index=0, process_count=2))
    plain.set_state({"next_index": 1})  # a bare grain state is accepted
    assert next(plain)["prompt_id"] == next(it)["prompt_id"]
    with pytest.raises(DataError, match="outside"):
        plain.set_state({"next_index": 99})


def test_a_prompt_file_with_ids_edited_in_place_names_the_first_changed_line(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": f"a{i}", "uid": 100 + i} for i in range(6)]
    p = write_jsonl(tmp_path / "p.jsonl", rows)
    c = file_cfg(p, "data.id_field=uid", "data.shuffle=false")
    it = make_iterator(build_dataset(c, TOK))
    next(it)
    state = it.get_state()
    write_jsonl(p, [rows[0], rows[2], rows[1], *rows[3:]])  # two lines swapped: same ids, same size
    with pytest.raises(DataError, match=r"p\.jsonl: the prompt file changed since the checkpoint was written: "
                                        r"line 2 \(prompt_id 102\) differs from what was trained"):
        make_iterator(build_dataset(c, TOK)).set_state(state)
    write_jsonl(p, [*rows, {"prompt": "q6", "answer": "a6", "uid": 106}])  # grown: another stream
    with pytest.raises(DataError, match="another stream"):
        make_iterator(build_dataset(c, TOK)).set_state(state)


def test_more_epochs_on_resume_continues_the_stream():
    it = make_iterator(build_dataset(cfg_of("data.num_records=5", "data.num_epochs=1"), TOK))
    first = drain(it)
    longer = make_iterator(build_dataset(cfg_of("data.num_records=5", "data.num_epochs=2"), TOK))
    longer.set_state(it.get_state())
    rest = drain(longer)
    assert [r["epoch"] for r in rest] == [1] * 5
    assert sorted(r["prompt_id"] for r in rest) == sorted(r["prompt_id"] for r in first)


class CountingTokenizer(ByteTokenizer):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def encode_prompt(self, prompt):
        self.calls += 1
        return super().encode_prompt(prompt)


def test_iterator_reads_nothing_ahead_and_starts_no_threads():
    tok = CountingTokenizer()
    pd = build_dataset(cfg_of("data.num_records=50"), tok)
    threads = threading.active_count()
    at_build = tok.calls
    it = make_iterator(pd)
    for k in range(1, 6):
        next(it)
        assert tok.calls - at_build == k
        assert it.get_state()["next_index"] == k
    assert threading.active_count() == threads


def test_grain_checkpoint_handler_round_trip(tmp_path):
    from etils import epath

    cfg = cfg_of("data.num_records=8")
    it = make_iterator(build_dataset(cfg, TOK))
    [next(it) for _ in range(3)]
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(epath.Path(tmp_path), item=it)
    fresh = make_iterator(build_dataset(cfg, TOK))
    handler.restore(epath.Path(tmp_path), item=fresh)
    assert fresh.get_state() == it.get_state()
    assert next(fresh)["prompt_id"] == next(it)["prompt_id"]


class FiveIsLong(ByteTokenizer):
    """Digit 5 costs 13 tokens, so the all-9s worst case underestimates the length."""

    def encode_prompt(self, prompt):
        ids = super().encode_prompt(prompt)
        return np.concatenate([ids] + [ids[:1]] * 12 * prompt.count("5"))


def test_prompt_too_long_in_stream_stops_without_advancing():
    pd = build_dataset(cfg_of("data.num_records=40", "data.shuffle=false"), FiveIsLong())
    it = make_iterator(pd)
    with pytest.raises(DataError, match="engine.max_prompt_len=16"):
        while True:
            before = it.get_state()
            next(it)
    assert it.get_state() == before and before["next_index"] < 40


# --- prompt files -----------------------------------------------------------------------

def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def file_cfg(path, *overrides, source="jsonl"):
    return cfg_of(f"data.source={source}", f"data.path={path}", "data.num_records=0",
                  "engine.max_prompt_len=32", *overrides)


def test_jsonl_loads(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "answer": f"a{i}"} for i in range(7)])
    with open(p, "a") as f:
        f.write("\n")  # a trailing blank line is not a record
    pd = build_dataset(file_cfg(p, "data.num_epochs=2"), TOK)
    recs = drain(make_iterator(pd))
    assert pd.records_per_epoch == 7 and len(recs) == 14 and not pd.bad_records
    for r in recs:
        assert r["prompt"] == f"q{r['prompt_id']}" and r["answer"] == f"a{r['prompt_id']}"
        assert TOK.decode(r["prompt_tokens"]) == r["prompt"]
    assert pd.max_prompt_len == 3  # BOS + "q6"


def test_jsonl_custom_fields_ids_and_first_n(tmp_path):
    rows = [{"question": f"q{i}", "solution": 10 * i, "uid": 100 + i} for i in range(6)]
    p = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = file_cfg(p, "data.prompt_field=question", "data.answer_field=solution", "data.id_field=uid",
                   "data.num_records=4", "data.shuffle=false")
    pd = build_dataset(cfg, TOK)
    recs = drain(make_iterator(pd))
    assert [r["prompt_id"] for r in recs] == [100, 101, 102, 103]
    assert recs[2]["answer"] == "20"  # numeric answers become strings
    np.testing.assert_array_equal(pd.prompt_ids, [100, 101, 102, 103])
    with pytest.raises(DataError, match="data.num_records=10.*only 6"):
        build_dataset(file_cfg(p, "data.prompt_field=question", "data.answer_field=solution",
                               "data.num_records=10"), TOK)


def test_parquet_loads(tmp_path):
    p = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": [5, 3, 9], "prompt": ["x", "yy", "zzz"], "answer": ["1", "2", "3"],
                             "solution": ["long"] * 3}), p)
    pd = build_dataset(file_cfg(p, "data.id_field=id", "data.shuffle=false", source="parquet"), TOK)
    recs = drain(make_iterator(pd))
    assert [(r["prompt_id"], r["prompt"], r["answer"]) for r in recs] == [(5, "x", "1"), (3, "yy", "2"),
                                                                         (9, "zzz", "3")]
    np.testing.assert_array_equal(pd.prompt_ids, [3, 5, 9])
    assert pd.max_prompt_len == 4


BAD_JSONL = [
    {"prompt": "ok0", "answer": "a"},  # line 1
    {"answer": "a"},  # line 2: missing prompt
    "{not json",  # line 3
    {"prompt": 7, "answer": "a"},  # line 4: non-string prompt
    {"prompt": "x" * 40, "answer": "a"},  # line 5: too long
    {"prompt": "ok5", "answer": "a"},  # line 6
    '["a", "list"]',  # line 7
    {"prompt": "ok7", "answer": ["a"]},  # line 8: answer is a list
    {"prompt": "   ", "answer": "a"},  # line 9: empty
    {"prompt": "ok9", "answer": None},  # line 10: null answer
]


def test_bad_records_error_names_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", BAD_JSONL)
    with pytest.raises(DataError, match=r"bad\.jsonl: line 2: missing field 'prompt'"):
        build_dataset(file_cfg(p), TOK)


@pytest.mark.parametrize("row, pattern", [
    ("{not json", "line 1: not valid JSON"),
    ({"prompt": 7, "answer": "a"}, "line 1: field 'prompt' is int, expected a string"),
    ({"prompt": "x" * 40, "answer": "a"}, "line 1: prompt is 41 tokens, longer than engine.max_prompt_len=32"),
    ({"prompt": "p", "answer": "a", "uid": "7"}, "line 1: field 'uid' is '7', expected a non-negative integer"),
    ({"prompt": "p", "answer": "a"}, "line 1: missing field 'uid'"),
])
def test_each_bad_record_kind_in_error_mode(tmp_path, row, pattern):
    p = write_jsonl(tmp_path / "one.jsonl", [row])
    with pytest.raises(DataError, match=pattern):
        build_dataset(file_cfg(p, "data.id_field=uid" if "uid" in pattern else "data.seed=0"), TOK)


def test_bad_records_skip_counts_every_one(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", BAD_JSONL)
    with open(p, "ab") as f:
        f.write(b'{"prompt": "\xff\xfe", "answer": "a"}\n')  # line 11: not UTF-8
    pd = build_dataset(file_cfg(p, "data.on_bad_record=skip", "data.shuffle=false"), TOK)
    assert [line for line, _ in pd.bad_records] == [2, 3, 4, 5, 7, 8, 9, 10, 11]
    reasons = dict(pd.bad_records)
    assert "missing field 'prompt'" in reasons[2] and "not valid JSON" in reasons[3]
    assert "longer than engine.max_prompt_len" in reasons[5] and "null" in reasons[10]
    assert "not UTF-8" in reasons[11]
    recs = drain(make_iterator(pd))
    # ids are row numbers, so a fixed bad row would not renumber the good ones
    assert [(r["prompt_id"], r["prompt"]) for r in recs] == [(0, "ok0"), (5, "ok5")]


# records that once escaped as tracebacks: a lone surrogate (JSON's \\ud800 escape) in a prompt or
# an answer, a line nested deeper than Python recurses, an integer of more digits than it converts
UNREADABLE_JSONL = [
    '{"prompt": "12\\ud800=", "answer": "21"}',
    '{"prompt": "12=", "answer": "2\\udc001"}',
    '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "1"}',
    '{"prompt": "1=", "answer": ' + "1" * 5000 + "}",
]
UNREADABLE_WHY = ["field 'prompt' holds a lone surrogate ('\\ud800' at character 2), which is not text",
                  "field 'answer' holds a lone surrogate ('\\udc00' at character 1), which is not text",
                  "JSON nested too deeply to be read", "not readable JSON (Exceeds the limit (4300 digits)"]


@pytest.mark.parametrize("i", range(len(UNREADABLE_JSONL)))
def test_unreadable_records_follow_on_bad_record(tmp_path, i):
    p = write_jsonl(tmp_path / "u.jsonl", [{"prompt": "ok", "answer": "1"}, UNREADABLE_JSONL[i],
                                           {"prompt": "ok2", "answer": "2"}])
    with pytest.raises(DataError) as e:
        build_dataset(file_cfg(p), TOK)
    assert str(e.value).startswith(f"{p}: line 2: {UNREADABLE_WHY[i]}") and "\n" not in str(e.value)
    pd = build_dataset(file_cfg(p, "data.on_bad_record=skip", "data.shuffle=false"), TOK)
    assert len(pd.bad_records) == 1 and pd.bad_records[0].line == 2
    assert pd.bad_records[0].reason.startswith(UNREADABLE_WHY[i])
    assert [r["prompt_id"] for r in drain(make_iterator(pd))] == [0, 2]


def test_all_records_bad_is_an_error(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"answer": "a"}])
    with pytest.raises(DataError, match="no valid records"):
        build_dataset(file_cfg(p, "data.on_bad_record=skip"), TOK)


def test_duplicate_ids_name_both_lines(tmp_path):
    rows = [{"prompt": "a", "answer": "1", "uid": 1}, {"prompt": "b", "answer": "1", "uid": 2},
            {"prompt": "c", "answer": "1", "uid": 1}]
    p = write_jsonl(tmp_path / "dup.jsonl", rows)
    for mode in ("error", "skip"):
        with pytest.raises(DataError, match=r"dup\.jsonl: duplicate uid 1 at line 1 and line 3"):
            build_dataset(file_cfg(p, "data.id_field=uid", f"data.on_bad_record={mode}"), TOK)


def test_parquet_bad_rows(tmp_path):
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["ok", None, "x" * 40, "fine"], "answer": ["1", "2", "3", "4"]}), p)
    with pytest.raises(DataError, match=r"bad\.parquet: row 1: field 'prompt' is null"):
        build_dataset(file_cfg(p, source="parquet"), TOK)
    pd = build_dataset(file_cfg(p, "data.on_bad_record=skip", "data.shuffle=false", source="parquet"), TOK)
    assert [row for row, _ in pd.bad_records] == [1, 2]
    assert [r["prompt_id"] for r in drain(make_iterator(pd))] == [0, 3]
    with pytest.raises(DataError, match="row 0: missing field 'question'"):
        build_dataset(file_cfg(p, "data.prompt_field=question", source="parquet"), TOK)


def test_missing_or_unreadable_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        build_dataset(file_cfg(tmp_path / "nope.jsonl"), TOK)
    with pytest.raises(DataError, match="is a directory; expected a JSONL file"):
        build_dataset(file_cfg(tmp_path), TOK)
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(DataError, match="junk.parquet: cannot read as Parquet"):
        build_dataset(file_cfg(junk, source="parquet"), TOK)
