"""Crash tests with the vLLM rollout backend: a training subprocess on a tiny random Qwen2
checkpoint, generating with vLLM, is SIGKILLed at chosen and random moments (inside a
generation chunk, inside a checkpoint write, after a step), restarted each time, and run
to its end; with rollout.partial=true a half-finished sample a checkpoint holds continues
after the restart; held-out prompts are scored on the same vLLM engine every 4 steps.
`async-rl audit` must pass and every prompt be trained once (docs/design.md I1, I5). Each
process starts vLLM anew, which dominates the time (about 15 minutes per sampler on a busy
2-core machine): run by `make soak-vllm`."""
import json
import random
import subprocess
import sys

import pytest
from helpers import rollouts
from test_crash import BASE, _check_run, crash_and_finish
from test_hf import CONFIGS, random_weights, write_checkpoint
from tokenizers import Tokenizer, models, pre_tokenizers

from async_rl.obs.metrics import read_jsonl
from async_rl.rollout.vllm_backend import available

# head_dim 32 (vLLM's CPU attention has no kernel for 16); 96 embedding rows for a 16-word
# tokenizer, so the rows a tokenizer cannot decode must never be sampled
HC = dict(CONFIGS["qwen2"], num_attention_heads=2, num_key_value_heads=1, bos_token_id=2, eos_token_id=3)
WORDS = ["[UNK]", "<pad>", "<s>", "</s>", *"0123456789", "+", "="]
TIMEOUT = 600.0  # seconds for a process to reach a kill point, a step or its end (each starts vLLM)


def vllm_model(root):
    """A tiny random Qwen2 checkpoint with a 16-word tokenizer (digits one token each), written
    under `root`; its directory."""
    model = write_checkpoint(root / "model", HC, random_weights(HC))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "pad_token": "<pad>"}))
    return model


# what a run generates with vLLM on it: eager (no torch.compile: each restart starts sooner)
VLLM = ["engine.backend=vllm", "engine.max_concurrent_decodes=8", "engine.steps_per_call=2",
        "engine.vllm_enforce_eager=true"]


def vllm_run_overrides(root) -> list[str]:
    """A run's overrides for training on `vllm_model` under `root`: 32 addition prompts, 4
    held-out ones evaluated every 4 steps, vLLM eager."""
    model = vllm_model(root)
    data, held = root / "prompts.jsonl", root / "held_out.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": f"{i % 10} + {i // 10} =", "answer": str(i % 10 + i // 10)})
                            + "\n" for i in range(32)))
    held.write_text("".join(json.dumps({"id": 100 + i, "prompt": f"{i} + 9 =", "answer": str(i + 9)}) + "\n"
                            for i in range(4)))
    return [*BASE, f"model.hf_path={model}", "data.source=jsonl", f"data.path={data}", "data.id_field=id",
            "rollout.reward=addition", *VLLM, "rollout.partial=true", "log.rollouts=true",
            "eval.every_steps=4", f"eval.path={held}"]


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    if (why := available()) is not None:
        pytest.skip(why)
    return vllm_run_overrides(tmp_path_factory.mktemp("vllm_crash"))


def _schedule(seed: int) -> list[tuple]:
    """Four kills: inside a generation chunk (samples half-finished), at a random moment
    after a step, inside a checkpoint write, and after a later step's lineage line."""
    rng = random.Random(seed)
    return [("at", "generate:5"), ("random", 3, rng.uniform(0, 0.5)), ("at", "ckpt_write:6"),
            ("random", 9, rng.uniform(0, 0.5))]


@pytest.mark.soak
@pytest.mark.parametrize("sampler", ["in_order", "fifo", "in_order-lora"])
def test_vllm_backend_survives_sigkills_exactly_once(tmp_path, vllm_run, sampler):
    """`-lora`: LoRA adapters published to vLLM as versioned LoRA requests."""
    sampler, _, lora = sampler.partition("-")
    knob = "sampler.max_lookahead=1" if sampler == "in_order" else "sampler.max_staleness=1"
    extra = ["learner.lora_rank=4", "learner.lora_alpha=8", "learner.lr=3e-3"] if lora else []
    run = tmp_path / "run"
    final = crash_and_finish(run, [*vllm_run, f"sampler.name={sampler}", knob, *extra], None,
                             schedule=_schedule(len(sampler)), timeout=TIMEOUT)
    print(f"vllm crash {sampler}: {final['delivered']} SIGKILLs delivered")
    assert final["delivered"] >= 4 and final["reason"] == "data_exhausted"
    _check_run(run, staleness_bound=1)
    r = subprocess.run([sys.executable, "-m", "async_rl", "audit", str(run)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    samples = [s for r in rollouts(run) for s in r["samples"]]
    assert samples and all(t < len(WORDS) for s in samples for t in s["tokens"])  # only decodable ids
    assert all(s["versions"] == sorted(s["versions"]) for s in samples)
    evals = [m for m in read_jsonl(run / "metrics.jsonl") if "eval/accuracy" in m]
    assert evals and evals[-1]["step"] == final["step"]  # scored on the run's vLLM engine
