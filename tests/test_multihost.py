"""A real multi-process job on one machine: two training processes joined through
jax.distributed (loopback), each with its own Grain shard, pump, engine and ledger shard,
one SPMD learner across both; killed and resumed, every prompt still trained once."""
import json

from async_rl.audit import audit
from helpers import run_multi

# synchronous saves: the kill at step 5 must find step 4's checkpoint committed
BASE = ["data.num_records=25", "rollout.prompts_per_step=4", "checkpoint.every_steps=2", "data.shuffle=false",
        "checkpoint.async=false"]


def _rows(run_dir):
    rows = []
    for p in sorted(run_dir.glob("lineage*.jsonl")):
        rows += [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    return rows


def test_two_processes_stop_kill_resume_exactly_once(tmp_path):
    r = run_multi(tmp_path, *BASE, "train.max_steps=3")
    assert all(x.returncode == 0 for x in r), r[0].stderr[-3000:] + r[1].stderr[-3000:]
    assert (tmp_path / "lineage.p1.jsonl").exists()
    assert sorted({x["step"] for x in _rows(tmp_path)}) == [1, 2, 3]
    # SIGKILL process 0 right after step 5's lineage; process 1 is stuck in a collective and killed too
    r = run_multi(tmp_path, *BASE, kill_at="step:5")
    assert r[0].returncode == -9
    r = run_multi(tmp_path, *BASE)
    assert all(x.returncode == 0 for x in r), r[0].stderr[-3000:] + r[1].stderr[-3000:]
    assert "resumed step 4" in r[0].stderr and "resumed step 4" in r[1].stderr
    rows = _rows(tmp_path)
    # 25 records over 2 shards (13 + 12): 7 steps of 2 groups per process, the last ones short
    assert sorted(x["prompt_id"] for x in rows) == list(range(25))
    assert max(x["step"] for x in rows) == 7
    rep = audit(tmp_path)
    assert rep["ok"], rep
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["reason"] == "data_exhausted" and final["complete_epochs"] == [0]
