"""Weights & Biases (offline): a job killed with SIGKILL and resumed is one W&B run with one
history row per step. Skipped where the wandb extra is not installed."""

import json
import struct
import time

import pytest

wandb = pytest.importorskip("wandb")

from helpers import kill9, read_stderr, run_cli, spawn  # noqa: E402

OV = ["data.num_records=24", "rollout.prompts_per_step=2", "checkpoint.every_steps=4", "checkpoint.async=false",
      "log.wandb=true", "log.wandb_project=async_rl_test", "log.wandb_tags=ci,offline", "eval.every_steps=0"]


def _records(run_file):
    """The protobuf records of a .wandb file: wandb's transaction log (LevelDB log framing: a
    7-byte file header, 32 KiB blocks of records with a 7-byte header each, a record split
    over blocks as FIRST, MIDDLE..., LAST)."""
    from wandb.proto import wandb_internal_pb2
    data = run_file.read_bytes()
    block, hdr = 32768, 7
    ident, magic, version = struct.unpack("<4sHB", data[:hdr])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), run_file
    pos, parts = hdr, []
    while pos + hdr <= len(data):
        if block - pos % block < hdr:  # the rest of a block too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + hdr])
        if kind == 0 and length == 0:
            break
        parts.append(data[pos + hdr:pos + hdr + length])
        pos += hdr + length
        if kind in (1, 4):  # FULL or LAST
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(b"".join(parts))
            parts = []
            yield rec


def _history(run_file):
    """The history rows of one offline run file (with their "_step")."""
    rows = []
    for rec in _records(run_file):
        if rec.WhichOneof("record_type") == "history":
            row = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item}
            if rec.history.HasField("step"):
                row.setdefault("_step", rec.history.step.num)
            rows.append(row)
    return rows


@pytest.mark.soak  # two training sessions
def test_a_killed_and_resumed_job_is_one_wandb_run_with_one_row_per_step(tmp_path, xla_cache, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    p = spawn(tmp_path, *OV, cache=xla_cache, delay="step:0.3")
    state = tmp_path / "wandb.json"
    end = time.monotonic() + 600
    while time.monotonic() < end and p.poll() is None:  # past the step-4 checkpoint, before the next
        if state.is_file() and json.loads(state.read_text())["last_step"] >= 6:
            break
        time.sleep(0.05)
    first = json.loads(state.read_text())
    assert kill9(p), read_stderr(p)[-2000:]  # the kill is what ended session 1
    assert first["last_step"] >= 6
    r = run_cli(tmp_path, *OV, cache=xla_cache, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"wandb: run {first['id']} (resumed" in r.stderr
    final = json.loads((tmp_path / "final.json").read_text())
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # two sessions ...
    files = [f for d in runs for f in d.glob("run-*.wandb")]
    assert {f.stem for f in files} == {f"run-{first['id']}"}  # ... of one run
    steps = [row["_step"] for f in files for row in _history(f)]
    assert sorted(steps) == list(range(1, final["step"] + 1))  # every step once, re-run steps not again
    rows = [row for f in files for row in _history(f)]
    assert all("rollout/reward_mean" in row and "learner/clip_frac_high" in row for row in rows)
    # the resolved config is the run's config
    cfg_files = list(runs[-1].glob("files/config.yaml"))
    if cfg_files:
        assert "async_rl_test" in cfg_files[0].read_text()
