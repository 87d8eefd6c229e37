"""`async-rl plan` on forced CPU devices (no libtpu needed): memory per chip from the compiled
step, loop iterations counted in the cost, the fit verdict, exit codes and --json; with
libtpu installed, also the decode step as the TPU compiler lays it out."""

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

from async_rl import config as C
from async_rl.learner.step import Learner
from async_rl.model import flops, sharding
from async_rl.plan import chips
from async_rl.plan import compile as PL
from async_rl.run import cli

BASE = ["model.vocab_size=64", "model.learned_positions=0", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "engine.max_prompt_len=8", "rollout.max_new_tokens=8", "mesh.fsdp=4",
        "model.n_layers=3", "engine.steps_per_call=2"]  # a call of several decode steps, each a copy of the layers


def cfg_of(*extra):
    return C.load("configs/tiny.yaml", BASE + list(extra))


def test_memory_is_the_compiled_steps_and_state_is_split_over_fsdp():
    cfg = cfg_of()
    rep = PL.plan(cfg, "cpu:4", cost=False)
    lp = rep.parts["learner"]
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(
        Learner(cfg, 64, sharding.learner_mesh(jax.devices()[:4], cfg.mesh)).abstract_params))
    # fp32 parameters split 4 ways (a few small ones, e.g. norm scales of odd size, may stay whole)
    assert n_params * 4 / 4 <= lp.params_bytes <= n_params * 4 / 4 * 1.1
    assert lp.opt_bytes == pytest.approx(2 * lp.params_bytes, rel=0.01)  # Adam's two moments
    assert lp.fits and lp.total_bytes >= lp.params_bytes + lp.opt_bytes + lp.temp_bytes
    assert rep.mesh == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1}


def ids(mesh) -> list:
    return [d.id for d in mesh.devices.flat]


def test_plan_compiles_the_runs_meshes_on_forced_host_devices():
    # the learner beside 2 engine devices: the run's learner mesh has 2 devices, so must the plan's
    from async_rl.rollout.engine import engine_mesh
    cfg = cfg_of("mesh.engine_devices=2", "mesh.fsdp=2", "engine.tensor=2", "model.n_layers=1")
    rep = PL.plan(cfg, "cpu:4", cost=False)
    run = sharding.make_devices(cfg.mesh)
    assert ids(rep.parts["learner"].mesh) == ids(run.learner) == [0, 1]
    assert ids(rep.parts["engine"].mesh) == ids(engine_mesh(run.engine, 2)) == [2, 3]
    assert rep.mesh == {"data": 1, "fsdp": 2, "expert": 1, "tensor": 1} and rep.as_json()["engine_mesh"] == {"data": 1, "tensor": 2}


def test_model_flops_and_parameters_are_the_models():
    for extra in ([], ["model.tie_embeddings=false", "model.qkv_bias=true", "model.head_dim=32"]):
        m = cfg_of(*extra).model
        hd, counts = m.resolved_head_dim, flops.param_counts(m, 64)
        matmul = m.n_layers * (m.d_model * hd * 2 * (m.n_heads + m.n_kv_heads) + 3 * m.d_model * m.d_ff)
        bias = m.n_layers * hd * (m.n_heads + 2 * m.n_kv_heads) * m.qkv_bias
        assert counts.matmul == matmul and counts.trunk == matmul + bias + 2 * m.n_layers * m.d_model
        assert counts.total == counts.trunk + 64 * m.d_model * (2 - m.tie_embeddings) + m.d_model
    cfg = cfg_of("learner.kl_coef=0.1", "learner.ppo_epochs=2")  # 2 updates of 3 passes, 2 reference forwards
    rows, T, N, m = 16, 16, 8, cfg.model
    per_pass = (2 * flops.param_counts(m, 64).matmul * rows * T + 2 * m.d_model * 64 * rows * N
                + 2 * m.n_layers * m.n_heads * m.resolved_head_dim * T * T * rows)
    assert sum(flops.step_flops(cfg, 64).values()) == pytest.approx((2 * 3 + 1 + 2) * per_pass)  # and pi_prox's


@pytest.mark.slow
def test_cost_counts_every_loop_iteration(monkeypatch):
    # XLA counts a loop body once; the plan's cost must match a compile with every loop
    # (layers, micro-batches, logit chunks) unrolled
    monkeypatch.setattr(Learner, "layer_unroll", staticmethod(lambda platform, n_layers=0: 1))  # scan layers, as on TPU
    cfg = cfg_of("learner.micro_batch_rows=8", "learner.logits_chunk=4", "learner.remat=block")
    mesh = sharding.learner_mesh(jax.devices()[:4], cfg.mesh)
    counted = []  # XLA's own cost of the scanned step the plan compiled (each loop body once)
    loop_cost = PL._loop_cost
    monkeypatch.setattr(PL, "_loop_cost", lambda c, l, m, xla, t=None: (counted.append(xla), loop_cost(c, l, m, xla, t))[1])
    part = PL.learner_part(cfg, 64, mesh, chips.NOMINAL_CPU)
    _, _, _, _, _, lowered = PL._lower(cfg, 64, mesh, unroll=True)
    xla_flops, nbytes, sent = PL._cost(lowered.compile())
    assert part.flops == pytest.approx(xla_flops, rel=0.05)
    assert part.sent_bytes == pytest.approx(sent, rel=0.05)  # the collectives' bytes scaled alike
    assert counted[0][0] < 0.7 * xla_flops  # what XLA alone says of the scanned step
    assert part.model_flops == pytest.approx(sum(flops.step_flops(cfg, 64).values()) / 4)


def test_not_fitting_exits_1_and_names_knobs(capsys):
    code = cli.main(["plan", "--config", "configs/tiny.yaml", "--topology", "cpu:4", "--hbm-gib", "0.0001",
                     "--no-cost", "--no-engine", *BASE])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT" in out and "learner.remat=block" in out
    knobs = out.split("try: ")[1].split()
    assert len(knobs) == len(set(knobs)) and "mesh.data=1" not in knobs  # fsdp already spans every chip


def test_json_has_the_fields_and_estimates(capsys):
    # the learner's fields (the engine's: test_engine_part_splits_weights_and_cache_and_counts_every_layer)
    code = cli.main(["plan", "--config", "configs/tiny.yaml", "--topology", "cpu:4", "--json", "--no-engine", *BASE])
    rep = json.loads(capsys.readouterr().out)
    assert code == 0 and rep["fits"] is True
    for k in ("hbm_bytes", "learner_bytes_per_chip", "flops_per_chip", "bytes_accessed_per_chip", "est_step_s",
              "est_mfu"):
        assert rep[k] > 0, k
    assert rep["est_step_s"] == pytest.approx(max(rep["flops_per_chip"] / rep["peak_flops_per_chip"],
                                                  rep["bytes_accessed_per_chip"] / rep["hbm_bandwidth_per_chip"]))


@pytest.mark.parametrize("topology, extra, needle", [
    ("cpu:64", [], "only 4 CPU devices"),
    ("cpu:4", ["mesh.fsdp=3"], "mesh.data"),
    ("cpu:4", ["mesh.engine_devices=1", "mesh.fsdp=1"], "over the 3 data-parallel shards"),
    ("cpu:4", ["mesh.engine_devices=4"], "mesh.engine_devices=4"),
    ("cpu:4", ["model.vocab_size=0"], "model.vocab_size"),
])
def test_bad_input_exits_2(topology, extra, needle, capsys):
    code = cli.main(["plan", "--config", "configs/tiny.yaml", "--topology", topology, *BASE, *extra])
    assert code == 2 and needle in capsys.readouterr().err


@pytest.mark.slow
def test_engine_part_splits_weights_and_cache_and_counts_every_layer(monkeypatch):
    cfg = cfg_of("engine.tensor=2", "engine.max_concurrent_decodes=8", "model.n_kv_heads=2")
    # the learner's part without its cost compiles (test_cost_counts_every_loop_iteration checks those)
    learner_part = PL.learner_part
    monkeypatch.setattr(PL, "learner_part", lambda *a, cost=True, **kw: learner_part(*a, cost=False, **kw))
    rep = PL.plan(cfg, "cpu:4")
    ep = rep.parts["engine"]
    m, width = cfg.model, 8 + 8
    cache = 2 * m.n_layers * 8 * width * m.n_kv_heads * m.resolved_head_dim * 4  # fp32 k and v
    assert ep.fits and ep.kv_bytes == cache // 4  # slots over data 2, kv heads over tensor 2
    assert ep.total_bytes >= ep.params_bytes + ep.kv_bytes
    eng, params, state = PL._engine(cfg, 64, jax.devices()[:4], unroll=True)
    # the plan counts a call of engine.steps_per_call steps, per step
    nbytes = PL._cost(PL._decode_call(eng).lower(params, state).compile())[1] / eng.steps_per_call
    assert eng.steps_per_call == cfg.engine.steps_per_call > 1
    assert ep.bytes_accessed == pytest.approx(nbytes, rel=0.05)
    js = rep.as_json()
    assert js["engine_bytes_per_chip"] == ep.total_bytes and js["engine_bytes_accessed_per_decode_step"] > 0
    # 4 chips, 8 slots: a step reads 4 chips' bytes for 8 tokens; the CPU "HBM" holds many more slots
    assert js["engine_bytes_accessed_per_token"] == pytest.approx(ep.bytes_accessed * 4 / 8)
    free = rep.chip.hbm_bytes - ep.total_bytes - rep.parts["learner"].resident_bytes  # the chips are shared
    assert js["engine_max_sequences"] == 8 + int(free * 8 // ep.kv_bytes) > 8


@pytest.mark.slow
def test_a_paged_engine_counts_a_sample_by_the_pages_it_holds(monkeypatch):
    """The paged pool: a sample of the configured lengths takes its completion's pages and one
    prompt page of its own; its prompt's whole pages are shared by its group of 4."""
    cfg = cfg_of("engine.kv_layout=paged", "engine.page_size=4", "engine.max_concurrent_decodes=8")
    learner_part = PL.learner_part
    monkeypatch.setattr(PL, "learner_part", lambda *a, cost=True, **kw: learner_part(*a, cost=False, **kw))
    rep = PL.plan(cfg, "cpu:4")
    ep = rep.parts["engine"]
    m = cfg.model
    assert ep.fits and ep.kv_tokens == (8 * (16 // 4 + 1) + 1) * 4  # a page per slot spare, and the null page
    assert ep.kv_bytes == 2 * m.n_layers * m.n_kv_heads * ep.kv_tokens * m.resolved_head_dim * 4  # fp32, not split
    assert ep.seq_tokens == 4 * (2 + 2 / 4) < 16  # a slot would take all 16 columns
    free = rep.chip.hbm_bytes - ep.total_bytes - rep.parts["learner"].resident_bytes
    most = rep.as_json()["engine_max_sequences"]
    assert most == int((ep.kv_tokens + free * ep.kv_tokens // ep.kv_bytes) // ep.seq_tokens) > 8
    assert "KV per chip a sample of these lengths" in PL.format_engine(rep, ep)[-1]


def test_tpu_decode_reads_the_q_and_k_kernels_where_they_lie():
    # Compiled for a TPU (needs libtpu): with RoPE's half-rotation folded into the q and k
    # kernels, every decode step wrote a transposed copy of both (1.31x / 1.52x the bytes of
    # weights + KV cache on the 8B plan). 8B attention widths, small MLP and vocabulary.
    try:
        devices, _ = PL.topology("v5e:2x2")
    except C.ConfigError as e:
        pytest.skip(str(e))
    cfg = C.load("configs/tiny.yaml", [
        "model.vocab_size=1024", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8", "model.head_dim=128",
        "model.d_ff=1024", "model.n_layers=2", "model.dtype=bfloat16", "model.learned_positions=0", "engine.tensor=4",
        "engine.max_concurrent_decodes=8", "engine.max_prompt_len=16", "rollout.max_new_tokens=48"])
    eng, params, state = PL._engine(cfg, 1024, devices)
    hlo = eng._decoder(eng.width, False).lower(params, state).compile().as_text()
    assert "convolution" in hlo or "dot" in hlo  # really the compiled decode
    # a layer's q kernel on a chip is [1, 4096, 32 * 128 / 4], its k kernel [1, 4096, 8 * 128 / 4]
    copies = re.findall(r"= bf16\[1,4096,(?:1024|256)\]\S* (?:copy|transpose)\(", hlo)
    assert not copies, copies


def test_tpu_multi_step_decode_writes_the_cache_once_per_call():
    # Compiled for a TPU (needs libtpu): with a head dim under 128 lanes (Qwen2.5's 64) the
    # compiler lays the cache out columns-minor and copies it to another layout and back to
    # write a column; a call of K steps now writes its K new columns once (`model.Recent`).
    try:
        devices, _ = PL.topology("v5e:2x2")
    except C.ConfigError as e:
        pytest.skip(str(e))
    per_step = {}
    for k in (1, 8):
        cfg = C.load("configs/tiny.yaml", [
            "model.vocab_size=1024", "model.d_model=896", "model.n_heads=14", "model.n_kv_heads=2",
            "model.head_dim=64", "model.d_ff=1024", "model.n_layers=2", "model.dtype=bfloat16",
            "model.learned_positions=0", "engine.max_concurrent_decodes=64", "engine.max_prompt_len=256",
            "rollout.max_new_tokens=768", f"engine.steps_per_call={k}"])
        eng, params, state = PL._engine(cfg, 1024, devices, unroll=True)
        assert eng.recent  # on TPU by default
        per_step[k] = PL._cost(PL._decode_call(eng).lower(params, state).compile())[1] / k
    kv = 2 * 2 * 16 * 2 * 1024 * 64 * 2  # k and v, 2 layers, 16 slots per chip, bf16
    assert per_step[1] > 4 * kv  # the per-token relayout this guards against
    assert per_step[8] < per_step[1] / 2.5, per_step


def test_tpu_plan_and_run_lay_the_torus_out_alike():
    # Compiled for a TPU (needs libtpu): 4 hosts of 4 chips. Tensor groups are lines of
    # neighbouring chips (host order alone would not make them), and the plan compiles the
    # meshes the run's first process builds: the learner over every host, its engine over its own.
    from async_rl.rollout.engine import engine_mesh
    try:
        devices, _ = PL.topology("v5e:4x4")
    except C.ConfigError as e:
        pytest.skip(str(e))
    cfg = cfg_of("mesh.fsdp=1", "mesh.tensor=4", "engine.tensor=4", "rollout.prompts_per_step=8", "model.n_layers=1")
    run = sharding.split_devices(devices, cfg.mesh, process=0)
    rep = PL.plan(cfg, "v5e:4x4", cost=False)
    assert ids(rep.parts["learner"].mesh) == ids(run.learner) and run.learner.shape["tensor"] == 4
    assert ids(rep.parts["engine"].mesh) == ids(engine_mesh(run.engine, 4))
    assert {d.process_index for d in rep.parts["engine"].mesh.devices.flat} == {0}
    hops = lambda a, b: sum(abs(i - j) for i, j in zip(a.coords, b.coords))
    assert all(hops(g[i], g[i + 1]) == 1 for g in run.learner.devices.reshape(-1, 4) for i in range(3))
    # over two slices, each holds a block of the data axis
    from jax.experimental import topologies
    two = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4", num_slices=2).devices
    grid = sharding.learner_mesh(two, C.MeshConfig(fsdp=4, tensor=2)).devices
    assert [{d.slice_index for d in grid[i].flat} for i in range(2)] == [{0}, {1}]


@pytest.mark.soak  # two processes and a TPU compile: `make soak` runs it once `make plan-ci` put libtpu in .venv
def test_tpu_plan_while_a_train_runs(tmp_path):
    """libtpu's host-wide lockfile: a CPU train does not load libtpu, and `plan` loads it
    without the lock, so a plan succeeds while a train runs in the same environment."""
    import importlib.util
    import os
    import subprocess
    import sys
    import time

    from helpers import cli_args, kill9
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("needs libtpu (the [tpu] extra)")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        train = subprocess.Popen(cli_args(tmp_path / "run", "data.num_records=4000", "rollout.prompts_per_step=4"),
                                 stdout=f, stderr=f, env=dict(env, ASYNC_RL_DELAY="step:0.2", PYTHONUNBUFFERED="1"))
    try:
        # jax has chosen its backends once the learner compiles: from then on libtpu would hold the lock
        end = time.monotonic() + 300
        while "learner: compiling" not in log.read_text() and train.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert "learner: compiling" in log.read_text() and train.poll() is None, log.read_text()[-2000:]
        plan = subprocess.run([sys.executable, "-m", "async_rl", "plan", "--config", "configs/tiny.yaml",
                               "--topology", "v5e:2x2", "--no-cost", "model.vocab_size=32"],
                              capture_output=True, text=True, timeout=500, env=env)
        assert train.poll() is None, "the train ended before the plan did"
    finally:
        assert kill9(train)
    assert plan.returncode in (0, 1), plan.stderr[-2000:]  # 1: does not fit; 2 would be the lock's error
    assert "lockfile" not in plan.stderr and "fits" in plan.stdout, plan.stdout[-2000:]


@pytest.mark.parametrize("family", [pytest.param(["model.qk_norm=true", "model.head_dim=24"], marks=pytest.mark.soak),
                                    ["model.qk_norm=true", "model.gemma=true", "model.sliding_window=4",
                                     "model.global_every=3", "model.rope_local_theta=10000",
                                     "model.query_pre_attn_scalar=20"],
                                    ["model.qk_norm=true", "model.n_experts=4", "model.n_experts_per_token=2",
                                     "model.d_ff_expert=32"],
                                    ["model.qk_norm=true", "model.n_experts=4", "model.n_experts_per_token=2",
                                     "model.d_ff_expert=32", "mesh.fsdp=2", "mesh.expert=2"]],
                         ids=["qwen3", "gemma3", "qwen3_moe", "qwen3_moe_expert_parallel"])
def test_plan_compiles_qwen3_and_gemma3_steps(family):
    """The learner step and the engine's decode of each new family compile on a 4-way FSDP
    mesh (per-layer window choice inside the scan, q/k norm scales replicated), and an MoE
    model's on fsdp 2 x expert 2."""
    cfg = cfg_of(*family)
    rep = PL.plan(cfg, "cpu:4", cost=False)
    assert rep.parts["learner"].fits and rep.parts["engine"].fits
    assert rep.mesh == {"data": 1, "fsdp": 4 // cfg.mesh.expert, "expert": cfg.mesh.expert, "tensor": 1}


@pytest.mark.parametrize("path, n_params", [("configs/plan/qwen3-30b-a3b.yaml", 30_532_122_624),
                                            ("configs/plan/qwen3-8b.yaml", 8_190_735_360),
                                            ("configs/plan/gemma3-4b.yaml", 3_880_263_168)])
def test_plan_presets_have_the_published_shapes(path, n_params):
    """Qwen3-8B's published count; Gemma 3 4B's text model (embeddings 262208 x 2560, tied)
    is its 4.3B less the 0.42B vision tower; Qwen3-30B-A3B's 30.5B (3.3B active)."""
    from flax import nnx

    from async_rl.model.transformer import Transformer
    m = C.load(path).model
    model = nnx.eval_shape(lambda: Transformer(m, m.vocab_size, rngs=nnx.Rngs(0)))
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param))) == n_params
    assert m.local_layers().count(False) == (m.n_layers // m.global_every if m.global_every else m.n_layers)
    if m.moe:
        c = flops.param_counts(m, m.vocab_size)
        assert 3.3e9 < c.matmul + c.embed + c.head + c.other < 3.4e9  # active: k of E experts (Qwen: 3.3B)


def test_tpu_moe_experts_run_megablox_on_each_device_and_are_counted_by_formula():
    # Compiled for a TPU (needs libtpu): XLA's gradient of ragged_dot for the weights computes
    # every expert on every row there (E / k times the work); megablox's tgmm does not.
    try:
        PL.topology("v5e:2x2")
    except C.ConfigError as e:
        pytest.skip(str(e))
    cfg = cfg_of("model.qk_norm=true", "model.n_experts=32", "model.n_experts_per_token=2", "model.d_ff_expert=256",
                 "model.d_model=128", "model.dtype=bfloat16", "mesh.fsdp=2", "mesh.tensor=2")
    lp = PL.plan(cfg, "v5e:2x2", engine=False).parts["learner"]
    assert lp.attention.startswith("splash")  # its kernels by formula too
    assert lp.kernel_flops == pytest.approx((flops.expert_kernel_flops(cfg) + flops.kernel_flops(cfg, backward=7)) / 4)
    assert lp.flops - lp.kernel_flops < 3 * lp.model_flops  # the expanded gradient alone would be 8x the experts'


def test_tpu_expert_parallel_plan_holds_a_share_of_the_experts_and_computes_the_same_work():
    # Compiled for a TPU (needs libtpu): megablox inside the expert axis's shard_map
    try:
        PL.topology("v5e:2x2")
    except C.ConfigError as e:
        pytest.skip(str(e))
    moe = ("model.qk_norm=true", "model.n_experts=32", "model.n_experts_per_token=2", "model.d_ff_expert=256",
           "model.d_model=128", "model.dtype=bfloat16")
    fsdp, ep = (PL.plan(cfg_of(*moe, *mesh), "v5e:2x2", engine=False).parts["learner"]
                for mesh in (["mesh.fsdp=4"], ["mesh.fsdp=2", "mesh.expert=2"]))
    assert ep.kernel_flops == pytest.approx(fsdp.kernel_flops)  # the same pairs, split another way
    m = cfg_of(*moe).model
    experts = 3 * m.n_layers * m.n_experts * m.d_model * m.d_ff_expert * 4  # fp32 master weights
    # experts split 4 ways either way; the rest over fsdp only: 2 ways with the expert axis
    rest = flops.param_count(m, 64) * 4 - experts
    assert ep.params_bytes == pytest.approx(experts / 4 + rest / 2, rel=0.02)
    assert fsdp.params_bytes == pytest.approx((experts + rest) / 4, rel=0.02)


def test_sliding_window_layers_count_only_the_pairs_they_attend():
    base = ["model.qk_norm=true", "model.gemma=true", "model.global_every=3"]
    cfg = cfg_of(*base, "model.sliding_window=4")  # T = 16: layers 0, 1 local, 2 global
    T, m = 16, cfg.model
    assert flops.attended_pairs(m, T) == T * T / 2 + 2 * (4 * T - 4 * 4 / 2)
    assert flops.attended_pairs(m, T, causal=False) == 3 * T * T  # the masked square costs it all
    wide = cfg_of(*base, "model.sliding_window=64")  # a window past the row: every layer causal
    assert flops.attended_pairs(wide.model, T) == 3 * T * T / 2
    assert flops.step_flops(cfg, 64)["attention"] < flops.step_flops(wide, 64)["attention"]
    assert flops.kernel_flops(cfg) < flops.kernel_flops(wide)


@pytest.mark.slow
def test_a_distillation_teacher_is_planned_its_parameters_and_its_forward_pass(monkeypatch, tmp_path):
    """learner.teacher may be a directory holding only an HF config.json (a teacher too large to
    download for a plan): its parameters are counted per chip and its forward pass in the cost."""
    from async_rl.model import hf
    from async_rl.state.teacher import resolve
    monkeypatch.setattr(Learner, "layer_unroll", staticmethod(lambda platform, n_layers=0: 1))
    student = cfg_of()
    big = dataclasses.replace(student.model, d_model=64, n_heads=4, n_kv_heads=4, d_ff=256, n_layers=4)
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config(big, 64, "float32")))
    cfg = cfg_of("learner.distill=reverse_kl", f"learner.teacher={tmp_path}", "learner.micro_batch_rows=8")
    spec = resolve(cfg, None)
    assert (spec.model.d_model, spec.model.n_layers, spec.vocab) == (64, 4, 64)
    mesh = sharding.learner_mesh(jax.devices()[:4], cfg.mesh)
    part = PL.learner_part(cfg, 64, mesh, chips.NOMINAL_CPU, teacher=spec)
    alone = PL.learner_part(cfg_of("learner.micro_batch_rows=8"), 64, mesh, chips.NOMINAL_CPU, cost=False)
    assert part.teacher_bytes == pytest.approx(flops.param_count(big, 64) * 4 / 4, rel=0.02)  # over fsdp 4
    assert part.params_bytes == alone.params_bytes
    teacher_flops = sum(flops.pass_flops(cfg, big, 64).values()) / 4
    assert part.model_flops == pytest.approx(alone.model_flops + teacher_flops)
    *_, lowered = PL._lower(cfg, 64, mesh, unroll=True, teacher_spec=spec)
    assert part.flops == pytest.approx(PL._cost(lowered.compile())[0], rel=0.05)
