"""rollouts.jsonl (log.rollouts=true): each trained group's prompt ids and each sample's
behaviour logprobs, so any backend can be checked on the run's own tokens."""

import numpy as np

from async_rl.buffer.ledger import Group, Sample
from async_rl.state.lineage import RunLogs, read_jsonl


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
