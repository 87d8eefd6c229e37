"""`async-rl export` of a LoRA run: the merged Hugging Face directory computes what base +
adapters compute, the PEFT adapter directory holds PEFT's names, layouts and scale (and, where
`peft` is installed, loads onto the base with the same logits), and a changed base is refused."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import cfg
from safetensors.numpy import load_file
from test_export import load_exported, make_model_dir, text_hash_reward  # noqa: F401  (the reward by name)

from async_rl.model import lora
from async_rl.model.transformer import Transformer
from async_rl.run import cli
from async_rl.run.train import train
from async_rl.state.saved_run import open_run, read_lora

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    model_dir = make_model_dir(tmp_path_factory.mktemp("model"))
    run = tmp_path_factory.mktemp("run")
    recs = [{"id": i, "prompt": f"{i}+{2 * i}=", "answer": str(3 * i)} for i in range(8)]
    prompts = run.parent / f"{run.name}.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in recs))
    train(cfg(run, f"model.hf_path={model_dir}", "data.source=jsonl", f"data.path={prompts}", "data.num_records=0",
              "data.id_field=id", "rollout.reward=test_export:text_hash_reward", "rollout.prompts_per_step=4",
              f"learner.lora_rank={RANK}", f"learner.lora_alpha={ALPHA}", "learner.lr=5e-2",
              "learner.warmup_steps=0"))
    return run, model_dir


def _logits(model):
    tok = jnp.asarray([[2, 5, 6, 14, 7, 15, 8, 9]], jnp.int32)
    return np.asarray(model(tok, jnp.arange(8)[None], jnp.ones((1, 8), bool)))


def _ours(run_dir):
    """(run, logits of base + adapters as the learner computes them, base, adapters)."""
    run = open_run(run_dir)
    _, adapters, base = read_lora(run)
    abstract = nnx.eval_shape(lambda: Transformer(run.cfg.model, run.vocab, rngs=nnx.Rngs(0), lora=lora.spec(run.cfg)))
    graphdef = nnx.split(abstract, lora.ADAPTERS, lora.BASE)[0]
    return run, _logits(nnx.merge(graphdef, base, adapters)), base, adapters


def test_merged_export_equals_base_plus_adapters_and_the_peft_files_follow_peft(tmp_path, lora_run):
    run_dir, model_dir = lora_run
    out = tmp_path / "hf"
    assert cli.main(["export", str(run_dir), "--out", str(out)]) == 0
    run, ours, base, adapters = _ours(run_dir)
    assert float(jnp.abs(adapters["layers"]["attn"]["q"]["lora_b"][...]).max()) > 0  # trained
    plain = nnx.split(nnx.eval_shape(lambda: Transformer(run.cfg.model, run.vocab, rngs=nnx.Rngs(0))), nnx.Param)[0]
    merged = _logits(nnx.merge(plain, load_exported(out, run.vocab)))
    np.testing.assert_allclose(merged, ours, atol=1e-4, rtol=0)
    assert np.abs(ours - _logits(nnx.merge(plain, base))).max() > 1e-3  # the adapters move the logits
    # PEFT's layout: lora_A [r, d_in], lora_B [d_out, r]; W + (alpha / r) B A is the merged weight
    doc = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (doc["peft_type"], doc["r"], doc["lora_alpha"]) == ("LORA", RANK, ALPHA)
    assert doc["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    ad = load_file(out / "adapter" / "adapter_model.safetensors")
    key = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    a, b = ad[key.format(1, "A")], ad[key.format(1, "B")]
    d = run.cfg.model.d_model
    assert a.shape == (RANK, d) and b.shape[1] == RANK and len(ad) == 2 * 7 * run.cfg.model.n_layers
    w_base = load_file(model_dir / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"]
    w_out = load_file(out / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_allclose(w_base + ALPHA / RANK * b @ a, w_out, atol=1e-6, rtol=0)


def test_export_refuses_a_changed_base(tmp_path, lora_run, capsys):
    run_dir, model_dir = lora_run
    moved = tmp_path / "model"
    import shutil
    shutil.copytree(model_dir, moved)
    w = moved / "model.safetensors"
    raw = bytearray(w.read_bytes())
    raw[-1] ^= 1  # one bit of the last weight
    w.write_bytes(bytes(raw))
    conf = run_dir / "config.yaml"
    text = conf.read_text()
    try:
        conf.write_text(text.replace(str(model_dir), str(moved)))
        assert cli.main(["export", str(run_dir), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert f"model.hf_path='{moved}': the LoRA adapters in" in err and err.count("\n") == 1
        assert not (tmp_path / "x").exists()
    finally:
        conf.write_text(text)


@pytest.mark.parity
@pytest.mark.skipif(not os.environ.get("ASYNC_RL_PARITY"), reason="run by `make parity`")
def test_peft_loads_the_adapter_onto_the_base_with_our_logits(tmp_path, lora_run):
    peft = pytest.importorskip("peft")
    import torch
    import transformers
    run_dir, model_dir = lora_run
    out = tmp_path / "hf"
    assert cli.main(["export", str(run_dir), "--out", str(out)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, out / "adapter")
    theirs = model(torch.tensor([[2, 5, 6, 14, 7, 15, 8, 9]])).logits.detach().numpy()
    np.testing.assert_allclose(theirs, _ours(run_dir)[1], atol=1e-4, rtol=0)

