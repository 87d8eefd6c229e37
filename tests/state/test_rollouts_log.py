"""rollouts.jsonl (log.rollouts=true): each trained group's prompt ids and each sample's
behaviour logprobs, so any backend can be checked on the run's own tokens."""

import json

import numpy as np
import pytest

from async_rl.buffer.ledger import Group, Sample
from async_rl.state.lineage import RunLogs, decode_routes, encode_routes, read_jsonl


class _Words:
    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_trained_rows_carry_prompt_tokens_and_behaviour_logprobs(tmp_path):
    logs = RunLogs(tmp_path, rollouts=True, tokenizer=_Words())
    samples = [Sample(tokens=[5, 6, 2], logprobs=[-0.25, -1.5, -0.0078125], versions=[3, 3, 4], done=True, reward=1.0),
               Sample(tokens=[7], logprobs=[np.float32(-2.75)], versions=[4], done=True, reward=0.0)]
    g = Group(ordinal=9, prompt_id=4, epoch=0, prompt="p", answer="a", prompt_tokens=np.array([11, 12, 13], np.int32),
              samples=samples)
    logs.trained(5, [g])
    logs.rollouts.tell()  # flushes
    (row,) = read_jsonl(tmp_path / "rollouts.jsonl")
    assert row["prompt_tokens"] == [11, 12, 13] and row["step"] == 5 and row["ordinal"] == 9
    assert [s["logprobs"] for s in row["samples"]] == [[-0.25, -1.5, -0.0078125], [-2.75]]
    assert [s["tokens"] for s in row["samples"]] == [[5, 6, 2], [7]] and row["samples"][1]["text"] == "w7"
    for n in ("lineage", "drops", "rollouts"):
        getattr(logs, n).close()


def test_routes_are_written_compactly_and_decode_to_the_samples_rows(tmp_path):
    logs = RunLogs(tmp_path, rollouts=True, tokenizer=_Words())
    rows = np.random.default_rng(0).integers(0, 300, (4, 3, 2)).astype(np.uint16)
    samples = [Sample(tokens=[5, 6], logprobs=[-0.5, -0.25], versions=[1, 1], done=True, reward=1.0,
                      routes=[rows[:1], rows[1:]]),
               Sample(tokens=[7], logprobs=[-1.0], versions=[1], done=True, reward=0.0)]
    g = Group(ordinal=1, prompt_id=2, epoch=0, prompt="p", answer="a", prompt_tokens=np.array([11, 12, 13], np.int32),
              samples=samples)
    logs.trained(3, [g])
    logs.rollouts.tell()
    (row,) = read_jsonl(tmp_path / "rollouts.jsonl")
    first, second = row["samples"]
    assert first["routes"]["shape"] == [4, 3, 2] and first["routes"]["dtype"] == "uint16" and "routes" not in second
    back = decode_routes(first["routes"])
    assert back.dtype == np.uint16
    np.testing.assert_array_equal(back, rows)
    small = encode_routes(rows.astype(np.uint8) % 8)
    np.testing.assert_array_equal(decode_routes(json.loads(json.dumps(small))), rows.astype(np.uint8) % 8)
    for bad in ({**small, "b64": small["b64"][:-4]}, {**small, "dtype": "float32"}, {**small, "shape": [4, 6]}):
        with pytest.raises(ValueError):
            decode_routes(bad)
    for n in ("lineage", "drops", "rollouts"):
        getattr(logs, n).close()
