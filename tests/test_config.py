import re
import subprocess
import sys

import pytest
from helpers import MODEL

from async_rl import config as C
from async_rl.run.cli import main


def test_yaml_and_overrides_parse_to_declared_types(tmp_path):
    cfg = C.load("configs/tiny.yaml", ["learner.lr=3e-4", "sampler.max_lookahead=2", "checkpoint.async=false",
                                       "run.determinism=yes", "data.shuffle=0"])
    assert cfg.learner.lr == pytest.approx(3e-4) and isinstance(cfg.learner.lr, float)
    assert cfg.sampler.max_lookahead == 2 and cfg.checkpoint.async_ is False
    assert cfg.run.determinism is True and cfg.data.shuffle is False
    # round trip through the YAML a run writes
    assert C.from_dict(C.to_dict(cfg)) == cfg


def test_optional_field_accepts_none():
    cfg = C.load(None, [*MODEL, "sampler.name=fifo", "sampler.max_staleness=2"])
    assert cfg.sampler.max_staleness == 2
    assert C.load(None, [*MODEL, "sampler.max_staleness=none"]).sampler.max_staleness is None


@pytest.mark.parametrize("override, needle", [
    ("rollout.samples_per_prompt=0", "rollout.samples_per_prompt"),
    ("learner.lrr=1", "learner.lrr"),
    ("nosuch.key=1", "nosuch"),
    ("learner.lr=fast", "learner.lr"),
    ("train.max_steps=1.5", "train.max_steps"),
    ("run.determinism=maybe", "run.determinism"),
    ("sampler.name=lifo", "sampler.name"),
    ("sampler.max_staleness=3", "sampler.max_staleness"),
    ("model.n_kv_heads=3", "model.n_kv_heads"),
    ("mesh.fsdp=0", "mesh.fsdp"),
    ("engine.steps_per_call=1000000000", "engine.steps_per_call=1000000000: must be <= engine.max_prompt_len"),
    ("rollout.env_timeout_s=0", "rollout.env_timeout_s=0.0: must be > 0"),
    ("rollout.env_max_concurrent=0", "rollout.env_max_concurrent=0: must be > 0"),
    ("rollout.env_max_turns=0", "rollout.env_max_turns=0: must be > 0"),
    ("rollout.env=mcp", "rollout.mcp_server='': required for rollout.env=mcp"),
    ("data.task=lookups", "data.task='lookups': must be one of reverse, addition, word_problem, lookup"),
])
def test_bad_override_names_the_key(override, needle):
    with pytest.raises(C.ConfigError, match=needle.replace(".", r"\.")):
        C.load("configs/tiny.yaml", [override])


def test_unknown_yaml_key_rejected(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("learner:\n  lr: 1e-3\n  momentum: 0.9\n")
    with pytest.raises(C.ConfigError, match="learner.momentum"):
        C.load(str(p))


@pytest.mark.parametrize("argv, needle", [
    (["train", "--config", "configs/tiny.yaml", "rollout.samples_per_prompt=0"], "rollout.samples_per_prompt"),
    (["train", "--config", "configs/tiny.yaml", "foo.bar=1"], "foo"),
    (["train", "--config", "configs/tiny.yaml", "learner.lr=abc"], "learner.lr"),
    (["train", "--config", "nope.yaml"], "nope.yaml"),
])
def test_cli_config_errors_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_mesh_that_does_not_divide_devices_exits_2(tmp_path):
    # 4 forced devices (conftest): a 3-way fsdp axis cannot tile them; refused before compiling
    cmd = [sys.executable, "-m", "async_rl", "train", "--config", "configs/tiny.yaml",
           f"run.dir={tmp_path}/run", "mesh.fsdp=3"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "mesh.fsdp=3" in r.stderr and "Traceback" not in r.stderr


def test_help_lists_config_groups():
    for argv in (["--help"], ["train", "--help"]):
        r = subprocess.run([sys.executable, "-m", "async_rl", *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0
        for g in C.GROUPS:
            assert g in r.stdout
    assert "learner.lr" in r.stdout and "peak learning rate" in r.stdout


def test_own_yaml_for_a_real_model_gets_safe_defaults(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("run:\n  dir: runs/mine\nmodel:\n  hf_path: /models/some-llama\n"
                 "data:\n  source: jsonl\n  path: train.jsonl\nrollout:\n  reward: math_answer\n")
    cfg = C.load(str(p))
    assert cfg.learner.lr <= 1e-5  # a pretrained model's scale, not the tiny task's 1e-3
    assert cfg.engine.max_prompt_len >= 256 and cfg.rollout.max_new_tokens >= 256
    tiny = C.load("configs/tiny.yaml")  # the tiny task keeps its own values in its preset
    assert tiny.learner.lr == pytest.approx(1e-3) and tiny.model.d_model == 64 and tiny.run.dir == "runs/tiny"


def test_qwen_preset_is_sized_for_one_accelerator():
    cfg = C.load("configs/qwen2.5-0.5b.yaml")
    r = cfg.rollout
    assert r.prompts_per_step >= 16 and r.samples_per_prompt >= 8
    assert cfg.engine.max_concurrent_decodes >= 2 * r.prompts_per_step * r.samples_per_prompt  # two steps in flight
    assert cfg.eval.every_steps > 0 and cfg.eval.path and cfg.eval.num_records > 0


@pytest.mark.parametrize("yaml_text, needle", [
    ("run:\n  dir: {run}\nmodel:\n  d_model: 32\n  n_layers: 1\n  n_heads: 2\n  d_ff: 64\n", "model.n_kv_heads"),
    ("model:\n  d_model: 32\n  n_layers: 1\n  n_heads: 2\n  n_kv_heads: 2\n  d_ff: 64\n", "run.dir"),
])
def test_missing_required_field_is_a_one_line_exit_2(tmp_path, capsys, yaml_text, needle):
    p = tmp_path / "mine.yaml"
    p.write_text(yaml_text.format(run=tmp_path / "run"))
    assert main(["train", "--config", str(p), "log.progress=false"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "required" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, needle", [
    ("learner.lr=inf", "learner.lr='inf': must be a finite number"),
    ("learner.lr=nan", "learner.lr='nan': must be a finite number"),
    ("rollout.reward_timeout_s=-inf", "rollout.reward_timeout_s='-inf': must be a finite number"),
    ("learner.clip_eps=1e400", "learner.clip_eps='1e400': must be a finite number"),
    ("data.num_records=99999999999999999999999", "data.num_records='99999999999999999999999': outside the 64-bit"),
    ("run.seed=-9223372036854775809", "run.seed='-9223372036854775809': outside the 64-bit"),
])
def test_non_finite_floats_and_integers_past_64_bits_are_refused_at_parse_time(tmp_path, capsys, override, needle):
    with pytest.raises(C.ConfigError, match=re.escape(needle)):
        C.load("configs/tiny.yaml", [override])
    group, rest = override.split(".", 1)
    key, value = rest.split("=", 1)
    p = tmp_path / "c.yaml"  # YAML's own spellings (.inf, .nan) and numbers reach the same check
    p.write_text(f"{group}:\n  {key}: {dict(inf='.inf', nan='.nan').get(value, value)}\n")
    with pytest.raises(C.ConfigError, match=re.escape(f"{group}.{key}=")):
        C.load(str(p))
    assert C.load("configs/tiny.yaml", ["run.seed=-9223372036854775808"]).run.seed == -(1 << 63)
    assert main(["train", "--config", "configs/tiny.yaml", f"run.dir={tmp_path / 'run'}", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {needle}") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("content, needle", [
    (b"run:\n  seed: 1\n# caf\xe9\n", "not UTF-8 text (invalid continuation byte at byte 20)"),
    (b"run: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested too deeply to be a config"),
    (b"run:\n  seed: [1\n", "not valid YAML (while parsing a flow sequence"),
])
def test_a_config_file_that_cannot_be_read_is_one_line(tmp_path, capsys, content, needle):
    p = tmp_path / "c.yaml"
    p.write_bytes(content)
    assert main(["train", "--config", str(p), f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --config={str(p)!r}: {needle}") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, needle", [
    (["engine.kv_layout=pages"], "engine.kv_layout='pages': must be one of slots, paged"),
    (["engine.kv_layout=paged", "engine.page_size=4", "engine.kv_pool_tokens=16"],
     "engine.kv_pool_tokens=16: must hold one sequence of max_prompt_len + max_new_tokens plus a page (20 tokens)"),
    (["engine.kv_layout=paged", "engine.page_size=4", "engine.kv_pool_tokens=100", "run.determinism=true"],
     "engine.kv_pool_tokens=100: run.determinism needs a pool that never evicts (1280 tokens, or 0)"),
])
def test_a_paged_pool_too_small_is_refused_with_its_size(overrides, needle):
    with pytest.raises(C.ConfigError, match=re.escape(needle)):
        C.load("configs/tiny.yaml", overrides)
