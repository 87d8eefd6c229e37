"""Bad input is refused before anything is written: a config whose sizes no host holds, a prompt
record that is not text, a model's chat template that fails or never ends, Hugging Face weights
that cannot be loaded. Each is one `error:` line on stderr (no traceback), exit 2 (a SIGTERM:
exit 0, "stopped before changing anything"), and run.dir is not created, or stays
byte-identical where it held a run. The CLI runs in-process where no signal is involved."""

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from helpers import FAST, cli_args, handles_sigterm, tree_digest, wait_until
from test_export import HC, make_model_dir
from test_hf import random_weights
from test_tokenizer import CHATML, make_hf_dir

from async_rl.run.cli import main

PROMPTS = [{"prompt": f"{i}+{i + 1}=", "answer": str(2 * i + 1)} for i in range(8)]


def train_cli(capsys, run_dir, *overrides) -> tuple[int, str]:
    code = main(["train", "--config", "configs/tiny.yaml", f"run.dir={run_dir}", *FAST, *overrides])
    return code, capsys.readouterr().err


def the_error(err: str) -> str:
    """The one error line of a run's stderr (the lines before it say what start-up did)."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def chat_tokenizer(path, template: str):
    path.mkdir()
    return make_hf_dir(path, CHATML, {"tokenizer_config.json": {"eos_token": "<|im_end|>", "chat_template": template}})


def prompt_file(path, rows=PROMPTS):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def file_run(path, *more) -> list[str]:
    return ["data.source=jsonl", f"data.path={path}", "data.num_records=0", "rollout.prompts_per_step=2",
            "rollout.reward=exact_match", "model.learned_positions=0", "engine.max_prompt_len=48", *more]


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.prompts_per_step=1000000000"], "rollout.prompts_per_step=1000000000: a step's batch (4000000000 rows"),
    (["data.num_records=100000000000000"], "data.num_records=100000000000000: the index of the record ids needs"),
    (["eval.every_steps=1", "eval.num_records=1000000000000"], "eval.num_records=1000000000000: the held-out records"),
])
def test_sizes_no_host_holds_are_refused_before_anything_is_written(tmp_path, capsys, overrides, needle):
    code, err = train_cli(capsys, tmp_path / "run", *overrides)
    line = the_error(err)
    assert code == 2 and line.startswith(f"error: {needle}") and "of host memory" in line, line
    assert not (tmp_path / "run").exists()


def test_a_record_that_is_not_text_is_one_line_naming_file_and_line(tmp_path, capsys):
    data = prompt_file(tmp_path / "p.jsonl", [*PROMPTS[:3], '{"prompt": "1\\ud800=", "answer": "1"}', *PROMPTS[3:]])
    code, err = train_cli(capsys, tmp_path / "run", *file_run(data))
    assert code == 2 and the_error(err).startswith(
        f"error: {data}: line 4: field 'prompt' holds a lone surrogate ('\\ud800' at character 1)"), err[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_chat_template_that_fails_writes_nothing(tmp_path, capsys):
    tok = chat_tokenizer(tmp_path / "tok", "{{ raise_exception('System role not supported') }}")
    run = tmp_path / "run"
    code, err = train_cli(capsys, run, *file_run(prompt_file(tmp_path / "p.jsonl"), f"tokenizer.path={tok}",
                                                 "tokenizer.chat=true"))
    assert code == 2 and the_error(err) == (f"error: {tok / 'tokenizer_config.json'}: chat_template failed to render "
                                            "a prompt (TemplateError: System role not supported)")
    assert not run.exists()


def test_sigterm_while_a_chat_template_never_ends_stops_start_up(tmp_path):
    """One SIGTERM stops start-up inside the render (within the watchdog's poll, not the render's
    time bound, which would exit 2), exit 0, nothing written."""
    from test_tokenizer import NEVER_ENDS
    tok = chat_tokenizer(tmp_path / "tok", NEVER_ENDS)
    run = tmp_path / "run"
    args = cli_args(run, *file_run(prompt_file(tmp_path / "p.jsonl"), f"tokenizer.path={tok}", "tokenizer.chat=true"))
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_until(lambda: handles_sigterm(p.pid) or p.poll() is not None, 60, "SIGTERM handler")
        time.sleep(1.0)  # mostly into the render by now; earlier, it is stopped before the render starts
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        rc, err = p.wait(timeout=120), p.stderr.read()
        took = time.monotonic() - t0
    finally:
        p.kill()
    assert rc == 0, err[-2000:]
    assert "SIGTERM during start-up: stopped before changing anything" in err and "Traceback" not in err
    # exit 0 with that line: the SIGTERM stopped it (the render's own 5 s bound exits 2); bounded
    # loosely, a loaded host is slow to deliver and handle the signal
    assert took < 30, took
    assert not run.exists()


@pytest.mark.parametrize("damage, needle", [
    ("torch_only", "no *.safetensors files (and no model.safetensors.index.json); pytorch_model.bin are PyTorch"),
    ("misshaped", "tensor 'model.layers.1.mlp.up_proj.weight' in {model}/model.safetensors: shape [128, 32]"),
])
def test_hf_weights_that_cannot_be_loaded_leave_no_trace(tmp_path, capsys, damage, needle):
    w = random_weights(HC)
    if damage == "misshaped":
        w["model.layers.1.mlp.up_proj.weight"] = np.zeros((128, 32), np.float32)
    model = make_model_dir(tmp_path / "model", w)
    if damage == "torch_only":
        (model / "model.safetensors").rename(model / "pytorch_model.bin")
    data = prompt_file(tmp_path / "p.jsonl", [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(8)])
    run = tmp_path / "run"
    code, err = train_cli(capsys, run, *file_run(data, f"model.hf_path={model}"))
    line = the_error(err)
    assert code == 2 and needle.format(model=model) in line, line
    assert not run.exists()  # no .lock, config.yaml, data.json or checkpoints/
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    before = tree_digest(run)
    code, err = train_cli(capsys, run, *file_run(data, f"model.hf_path={model}"))
    assert code == 2 and tree_digest(run) == before and sorted(os.listdir(run)) == ["notes.txt"]


@pytest.mark.slow
def test_non_finite_starting_weights_name_no_checkpoint(tmp_path, capsys):
    w = random_weights(HC)
    w["model.norm.weight"][3] = np.nan
    model = make_model_dir(tmp_path / "model", w)
    data = prompt_file(tmp_path / "p.jsonl", [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(8)])
    code, err = train_cli(capsys, tmp_path / "run", *file_run(data, f"model.hf_path={model}", "train.max_steps=1"))
    line = the_error(err)
    assert code == 1 and line.startswith("error: step 1: learner/") and "training diverged; the starting weights " \
        "already give it (model.hf_path may hold NaN or inf); its update was not applied and the step not saved " \
        "(no checkpoint was committed)" in line, line
