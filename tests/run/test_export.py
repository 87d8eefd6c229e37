"""Real models and data end to end: the tiny config initialised from an HF checkpoint trains on
JSONL and Parquet prompts, each trained exactly once across a stop and resume; `async-rl
export` writes it back as an HF directory that loads bit-identically."""

import json
import os
import zlib

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from flax import nnx
from helpers import cfg, lineage
from test_hf import CONFIGS, random_weights, write_checkpoint
from tokenizers import Tokenizer, models, pre_tokenizers

from async_rl.config import ModelConfig
from async_rl.learner.step import params_fingerprint
from async_rl.model import hf
from async_rl.model.transformer import Transformer
from async_rl.run import cli
from async_rl.run.train import train
from async_rl.state.audit import audit

HC = dict(CONFIGS["qwen2"], bos_token_id=2, eos_token_id=3)


def text_hash_reward(completion: str, answer: str) -> float:
    """Distinct completions get distinct rewards, so every step moves the weights."""
    return zlib.crc32(completion.encode()) % 97 / 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


def make_model_dir(path, weights: dict | None = None):
    """A tiny random Qwen2 checkpoint (or `weights`) with a word-level tokenizer beside it."""
    path = write_checkpoint(path, HC, random_weights(HC) if weights is None else weights)
    words = ["[UNK]", "<pad>", "<s>", "</s>", *"0123456789", "+", "="]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "pad_token": "<pad>"}))
    return path


_CACHE_FLAGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    """The runs of this module compile the same programs; the second and later reuse them.
    `train` turns the persistent cache on for the whole process: turn it off again after."""
    before = {k: getattr(jax.config, k) for k in _CACHE_FLAGS}
    yield f"run.compilation_cache={tmp_path_factory.mktemp('xla')}"
    for k, v in before.items():
        jax.config.update(k, v)
    from jax._src import compilation_cache  # no public API forgets an initialised cache
    compilation_cache.reset_cache()


def stop_and_resume(tmp_path, model_dir, xla_cache, source: str):
    """10 prompts, 4 per step: 2 steps, stop, then a second run in the same run.dir to the end."""
    run = tmp_path / "run"
    recs = [{"id": 100 + i, "prompt": f"{i}+{2 * i}=", "answer": str(3 * i)} for i in range(10)]
    path = tmp_path / f"prompts.{source}"
    if source == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    else:
        pq.write_table(pa.Table.from_pylist(recs), path)
    common = [f"model.hf_path={model_dir}", f"data.source={source}", f"data.path={path}", "data.num_records=0",
              "data.id_field=id", f"rollout.reward={__name__}:text_hash_reward", "rollout.prompts_per_step=4",
              xla_cache]
    first = train(cfg(run, *common, "train.max_steps=2"))
    assert first.step == 2 and first.reason == "max_steps"
    assert sorted(r["step"] for r in lineage(run)) == [1] * 4 + [2] * 4
    second = train(cfg(run, *common, "train.max_steps=0"))
    assert second.step == 3 and second.reason == "data_exhausted"
    assert first.fingerprint != second.fingerprint
    return run, [r["id"] for r in recs], first, second


@pytest.fixture(scope="module")
def jsonl_run(tmp_path_factory, model_dir, xla_cache):
    return stop_and_resume(tmp_path_factory.mktemp("jsonl"), model_dir, xla_cache, "jsonl")


@pytest.mark.parametrize("source", ["jsonl", "parquet"])
def test_file_prompts_exactly_once_across_resume(tmp_path, model_dir, xla_cache, jsonl_run, source):
    run, ids, _, _ = jsonl_run if source == "jsonl" else stop_and_resume(tmp_path, model_dir, xla_cache, source)
    assert sorted(r["prompt_id"] for r in lineage(run)) == ids
    rep = audit(run)
    assert rep["ok"] and rep["finished"] and rep["epochs"][0]["trained_once"] == 10


def test_run_config_resolved_from_the_checkpoint(jsonl_run, model_dir):
    written = yaml.safe_load((jsonl_run[0] / "config.yaml").read_text())
    assert written["tokenizer"]["path"] == str(model_dir)
    m = written["model"]
    got = (m["d_model"], m["n_kv_heads"], m["qkv_bias"], m["rope_theta"], m["learned_positions"])
    assert got == (64, 1, True, 1e6, 0)


def load_exported(out, vocab: int):
    mcfg = hf.model_config_from_hf(out, ModelConfig())
    abstract = nnx.eval_shape(lambda: Transformer(mcfg, vocab, rngs=nnx.Rngs(0)))
    _, aparams = nnx.split(abstract, nnx.Param)
    return hf.load_params(out, aparams, jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def test_export_round_trip_is_bit_identical(tmp_path, jsonl_run, model_dir, capsys):
    run, _, first, second = jsonl_run  # checkpoints at step 2 (end of the first run) and 3
    out = tmp_path / "hf"
    assert cli.main(["export", str(run), "--out", str(out)]) == 0
    assert params_fingerprint(load_exported(out, 96)) == second.fingerprint
    assert hf.model_config_from_hf(out, ModelConfig()) == hf.model_config_from_hf(model_dir, ModelConfig())
    doc = json.loads((out / "config.json").read_text())
    assert (doc["architectures"], doc["bos_token_id"], doc["torch_dtype"]) == (["Qwen2ForCausalLM"], 2, "float32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (model_dir / name).read_bytes()
    assert cli.main(["export", str(run), "--step", "2", "--out", str(tmp_path / "s2")]) == 0
    assert params_fingerprint(load_exported(tmp_path / "s2", 96)) == first.fingerprint
    # usage errors: exit 2 with a message naming what is wrong
    assert cli.main(["export", str(run), "--step", "7", "--out", str(tmp_path / "x")]) == 2
    assert "no committed checkpoint step 7 in" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.yaml").write_text((run / "config.yaml").read_text())
    assert cli.main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err


def test_export_of_a_byte_tokenizer_run_without_hf_source(tmp_path, xla_cache):
    """A run from random init: config.json is built from the model config and the tokenizer's ids;
    a learned position table (no HF equivalent) is refused by name."""
    run = tmp_path / "run"
    res = train(cfg(run, "data.num_records=8", "rollout.prompts_per_step=4", "train.max_steps=1",
                    "model.learned_positions=0", xla_cache))
    out = tmp_path / "hf"
    cwd = os.getcwd()
    os.chdir(tmp_path)  # relative paths, as in the README's example
    try:
        assert cli.main(["export", "run", "--out", "hf"]) == 0
    finally:
        os.chdir(cwd)
    doc = json.loads((out / "config.json").read_text())
    assert (doc["architectures"], doc["vocab_size"], doc["eos_token_id"]) == (["LlamaForCausalLM"], 19, 2)
    assert params_fingerprint(load_exported(out, 19)) == res.fingerprint
    c = yaml.safe_load((run / "config.yaml").read_text())
    c["model"]["learned_positions"] = 16
    (run / "config.yaml").write_text(yaml.safe_dump(c))
    with pytest.raises(ValueError, match="model.learned_positions=16"):
        from async_rl.run.export import export
        export(run, tmp_path / "x")


@pytest.mark.parity
@pytest.mark.skipif(not os.environ.get("ASYNC_RL_PARITY"), reason="run by `make parity`")
def test_exported_run_serves_in_transformers(tmp_path, jsonl_run):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_hf import load, our_logits, sample_inputs
    out = tmp_path / "hf"
    assert cli.main(["export", str(jsonl_run[0]), "--out", str(out)]) == 0
    _, params, graphdef, _ = load(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    tokens, positions = sample_inputs()
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(tokens).long(),
                       position_ids=torch.from_numpy(np.ascontiguousarray(positions)).long()).logits.numpy()
    err = np.abs(our_logits(graphdef, params, tokens, positions) - theirs).max()
    print(f"\nPARITY exported run ({type(model).__name__}) vs transformers: max |ours - HF| = {err:.2e}")
    assert err < 1e-4
