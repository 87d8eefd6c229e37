"""`async-rl plan` for GPU topologies, compiled by the CUDA plugin with no GPU (the
`gpu-plan` extra; skipped where it is not installed): the topology and its figures, the
cost of a GPU program from its HLO, the attention kernel the step compiled with, bad names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from async_rl import config as C
from async_rl.plan import chips
from async_rl.plan import compile as PL
from async_rl.run import cli

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the CUDA compiler plugin: pip install -e '.[gpu-plan]'")


def test_gpu_topologies_have_their_devices_and_published_figures():
    devs, chip = PL.topology("h100:4x8")
    assert len(devs) == 32 and devs[0].device_kind == "NVIDIA H100 80GB HBM3"
    assert [d.process_index for d in devs] == [n for n in range(4) for _ in range(8)]  # nodes stay contiguous
    assert (chip.hbm_bytes, chip.peak_flops, chip.hbm_bandwidth) == (80e9, 989e12, 3.35e12)
    for name in ("h200:8", "a100-80g:8", "b200:8"):
        devs, chip = PL.topology(name)
        assert len(devs) == 8 and chip.name == chips.GPUS[name.split(":")[0]].name


def test_gpu_program_cost_comes_from_its_hlo():
    devs, _ = PL.topology("h100:8")
    mesh = jax.sharding.Mesh(np.array(devs), ("d",))
    x = jax.ShapeDtypeStruct((8 * 256, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
    assert compiled.cost_analysis() is None  # why the plan costs the HLO itself
    flops, nbytes, _ = PL._cost(compiled)
    assert flops == pytest.approx(2 * 256 * 1024 * 1024, rel=0.01)  # one GPU's rows
    assert nbytes >= (256 * 1024 * 2 + 1024 * 1024 + 256 * 1024) * 2


@pytest.mark.soak  # tens of seconds of CUDA compile on 2 cores; `make plan-ci` runs it
def test_gpu_plan_compiles_the_step_with_cudnn_attention():
    cfg = C.load("configs/tiny.yaml", ["model.vocab_size=64", "model.dtype=bfloat16", "model.learned_positions=0",
                                       "mesh.fsdp=8", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
                                       "engine.max_prompt_len=8", "rollout.max_new_tokens=8"])
    rep = PL.plan(cfg, "h100:8", cost=False, engine=False)
    js = rep.as_json()
    assert js["fits"] and js["chip"] == "H100 SXM 80GB" and js["devices"] == 8 and js["mesh"]["fsdp"] == 8
    assert js["attention"] == "cuDNN flash attention (fused)"
    lp = rep.parts["learner"]
    assert 0 < lp.params_bytes < lp.total_bytes < 1e9 and lp.opt_bytes == pytest.approx(2 * lp.params_bytes, rel=0.05)


@pytest.mark.parametrize("name, needle", [("h100:9", "1 to 8 GPUs per node"), ("h100:0x8", "at least one node")])
def test_bad_gpu_topology_exits_2(name, needle, capsys):
    code = cli.main(["plan", "--config", "configs/tiny.yaml", "--topology", name, "--no-cost", "model.vocab_size=16"])
    assert code == 2 and needle in capsys.readouterr().err
