"""The audit checks a run's whole history: tampered, truncated, reordered or restarted logs
FAIL (or are exit-2 errors naming the line), clean ones PASS (docs/design.md, I5)."""
import json
import shutil

import pytest
from helpers import cfg, read_ledger

from async_rl.run.cli import main
from async_rl.run.train import train
from async_rl.state.audit import AuditError, audit


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished run (2 epochs) and a stopped one (max_steps), trained once for the module."""
    root = tmp_path_factory.mktemp("audit")
    base = ["data.num_records=12", "rollout.prompts_per_step=4", "checkpoint.every_steps=2"]
    train(cfg(root / "finished", *base, "data.num_epochs=2"))
    train(cfg(root / "stopped", *base, "train.max_steps=2"))
    return root


def _copy(runs, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(runs / name, dst)
    return dst


def _lines(run):
    return (run / "lineage.jsonl").read_text().splitlines(keepends=True)


def _write(run, lines):
    (run / "lineage.jsonl").write_text("".join(lines))


def test_clean_runs_pass(runs):
    for name in ("finished", "stopped"):
        rep = audit(runs / name)
        assert rep["ok"] and not rep["problems"], rep
    assert audit(runs / "finished")["epochs"][1]["complete"]


def test_a_deleted_line_in_a_finished_run_fails(runs, tmp_path):
    run = _copy(runs, "finished", tmp_path)
    _write(run, _lines(run)[:5] + _lines(run)[6:])
    rep = audit(run)
    assert not rep["ok"] and any("neither in the log nor in its ledger" in p for p in rep["problems"])


def test_a_deleted_line_and_final_json_fail(runs, tmp_path):
    run = _copy(runs, "finished", tmp_path)
    _write(run, _lines(run)[:-1])
    (run / "final.json").unlink()
    rep = audit(run)
    assert not rep["ok"]
    assert rep["epochs"][1]["complete"] and rep["epochs"][1]["missing"]  # the checkpoint says the data ended


def test_a_deleted_line_in_a_stopped_run_fails(runs, tmp_path):
    run = _copy(runs, "stopped", tmp_path)
    _write(run, _lines(run)[:2] + _lines(run)[3:])
    rep = audit(run)
    assert not rep["ok"] and any("neither in the log" in p for p in rep["problems"]), rep["problems"]


def test_a_step_without_lines_fails(runs, tmp_path):
    run = _copy(runs, "finished", tmp_path)
    _write(run, [ln for ln in _lines(run) if json.loads(ln)["step"] != 2])
    rep = audit(run)
    assert not rep["ok"] and any("steps with no lineage line: 2" in p for p in rep["problems"])


def test_lines_out_of_order_fail(runs, tmp_path):
    run = _copy(runs, "finished", tmp_path)
    lines = _lines(run)
    lines[0], lines[-1] = lines[-1], lines[0]
    _write(run, lines)
    rep = audit(run)
    assert not rep["ok"] and any("after step" in p for p in rep["problems"])


def test_a_history_restarted_from_scratch_fails(runs, tmp_path):
    # what a silent fresh start over an old log would leave: step 1 again after the end
    run = _copy(runs, "stopped", tmp_path)
    lines = _lines(run)
    _write(run, lines + [ln for ln in lines if json.loads(ln)["step"] == 1])
    rep = audit(run)
    assert not rep["ok"] and any("restarted from scratch" in p for p in rep["problems"])


@pytest.mark.parametrize("bad, needle", [("{not json\n", "not a JSON line"),
                                         ('{"step": 1, "epoch": 0, "ordinal": 99}\n', "'prompt_id'")])
def test_malformed_line_is_an_error_naming_the_line(runs, tmp_path, capsys, bad, needle):
    run = _copy(runs, "stopped", tmp_path)
    lines = _lines(run)
    _write(run, lines[:3] + [bad] + lines[3:])
    with pytest.raises(AuditError, match=f"lineage.jsonl:4: .*{needle}"):
        audit(run)
    assert main(["audit", str(run)]) == 2
    err = capsys.readouterr().err
    assert "lineage.jsonl:4" in err and err.count("\n") == 1


def test_lines_after_the_checkpoint_are_reported_not_failed(runs, tmp_path):
    # a killed run: it wrote step 3's lines after its newest checkpoint (step 2 here)
    run = _copy(runs, "stopped", tmp_path)
    (run / "final.json").unlink()
    led = read_ledger(run, 2)
    assert len(led.groups) == 4
    extra = [json.dumps({"step": 3, "prompt_id": g.prompt_id, "epoch": g.epoch, "ordinal": g.ordinal,
                         "versions": [2]}) + "\n" for g in led.groups.values()]
    _write(run, _lines(run) + extra)
    rep = audit(run)
    assert rep["ok"] and rep["lines_after_checkpoint"] == 4, rep


def test_lines_of_groups_drawn_after_the_checkpoint_are_a_pending_cut(runs, tmp_path, capsys):
    # a killed run trains groups drawn after its newest checkpoint's cut too (ordinal >= next)
    run = _copy(runs, "stopped", tmp_path)
    (run / "final.json").unlink()
    nxt = read_ledger(run, 2).next_ordinal
    extra = [json.dumps({"step": 3, "prompt_id": 100 + k, "epoch": 0, "ordinal": nxt + k, "versions": [2]}) + "\n"
             for k in range(2)]
    _write(run, _lines(run) + extra)
    rep = audit(run)
    assert rep["lines_after_checkpoint"] == 2 and rep["pending_cut_steps"] == [3, 3], rep
    assert not rep["problems"], rep["problems"]
    # one trained before the cut, written again after it: a real problem
    first = json.loads(_lines(run)[0])
    _write(run, _lines(run) + [json.dumps(dict(first, step=4)) + "\n"])
    assert not audit(run)["ok"]


def test_a_deleted_ledger_of_the_newest_step_is_not_a_fail(runs, tmp_path, capsys):
    # that step cannot be resumed from: the previous one is checked, its later lines a pending cut
    run = _copy(runs, "stopped", tmp_path)
    train(cfg(run, "data.num_records=12", "rollout.prompts_per_step=4", "checkpoint.every_steps=2",
              "train.max_steps=3"))
    shutil.rmtree(run / "checkpoints" / "3" / "ledger")
    (run / "final.json").unlink()
    rep = audit(run)
    assert rep["ok"] and rep["checkpoint_step"] == 2 and rep["lines_after_checkpoint"] == 4, rep["problems"]
    assert any("checkpoint step 3" in n and "ledger" in n for n in rep["notes"]), rep["notes"]
    assert main(["audit", str(run)]) == 0
    out = capsys.readouterr().out
    assert "pending cut: 4 lines of step 3" in out and "PASS" in out


@pytest.mark.soak
def test_a_live_then_killed_run_audits_as_pending_cut(tmp_path, xla_cache, capsys):
    """Lines written after the newest checkpoint are what a resume cuts ("pending cut"), not a
    FAIL, while the run lives, once it is killed, and with the newest step's ledger deleted
    (that step cannot be resumed from: the one before it is checked)."""
    import shutil as sh

    from helpers import checkpoint_steps, kill9, spawn, wait_for_step
    run = tmp_path / "run"
    ov = ["data.num_records=200", "rollout.prompts_per_step=4", "checkpoint.every_steps=2", "checkpoint.keep=3"]
    proc = spawn(run, *ov, cache=xla_cache, delay="step:0.2")
    try:
        assert wait_for_step(run, 7, proc)
        live = audit(run)  # as it trains
    finally:
        assert kill9(proc), "the run ended before it was killed"
    assert live["ok"] and live["checkpoint_step"] >= 2, live["problems"]
    rep = audit(run)
    assert rep["ok"] and rep["lines_after_checkpoint"] > 0, rep["problems"]
    assert rep["pending_cut_steps"][0] > rep["checkpoint_step"]
    assert main(["audit", str(run)]) == 0
    out = capsys.readouterr().out
    assert "pending cut:" in out and "PASS" in out
    steps = checkpoint_steps(run)
    assert len(steps) >= 2
    sh.rmtree(run / "checkpoints" / str(steps[-1]) / "ledger")
    rep = audit(run)
    assert rep["ok"] and rep["checkpoint_step"] == steps[-2], rep["problems"]
    assert any(f"checkpoint step {steps[-1]}" in n and "ledger" in n for n in rep["notes"]), rep["notes"]
    # a resume uses that step too and cuts exactly the pending lines
    said: list[str] = []
    res = train(cfg(run, *ov, "train.max_steps=12", f"run.compilation_cache={xla_cache}"), log=said.append)
    assert res.exit_code == 0 and res.step == 12
    assert any(f"resumed step {steps[-2]}" in x for x in said), said
    rep = audit(run)
    assert rep["ok"] and rep["lines_after_checkpoint"] == 0, rep["problems"]


def test_pass_line_says_what_was_checked(runs, capsys):
    assert main(["audit", str(runs / "stopped")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == \
        "PASS: no epoch completed yet: 8 of 12 prompts of epoch 0 trained once so far, none twice"
    assert main(["audit", str(runs / "finished")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "PASS: every prompt of epochs 0, 1 trained exactly once"
