"""Collective bytes a compiled program sends, read from its HLO (async_rl/plan/collectives.py):
each replica-group form XLA prints, the ring costs, and a plan's figures against the gradient
all-reduce a data-parallel step must do."""

import pytest
from test_plan import cfg_of

from async_rl.model import flops
from async_rl.plan import collectives
from async_rl.plan import compile as PL

LINES = {
    # 4 KiB output gathered over groups of 2: half of it sent
    "%ag = bf16[32,64]{1,0} all-gather(bf16[16,64]{1,0} %x), replica_groups={{0,1},{2,3}}, dimensions={0}": 2048,
    # an all-reduce of two f32[128] over 4 (iota groups [1,4]): 2 x 3/4 of 1 KiB
    "%ar = (f32[128]{0}, f32[128]{0}) all-reduce(%a, %b), replica_groups=[1,4]<=[4], to_apply=%add": 1536,
    # reduce-scatter to f32[8] over the mesh's named axes 2 x 2: 3 shards of 32 B
    "%rs = f32[8]{0} reduce-scatter(f32[32]{0} %g), replica_groups=mesh['a'=1,'b'=2,'c'=2] {'b','c'}": 96,
    # async: counted at the start, by its outputs (the second half of the tuple); -done not again
    "%s = (bf16[8,64]{1,0}, bf16[16,64]{1,0}) all-gather-start(%y), replica_groups=mesh['a'=2,'b'=2] {'a'}": 1024,
    "%d = bf16[16,64]{1,0} all-gather-done(%s)": 0,
    "%cp = f32[16]{0} collective-permute(%z), source_target_pairs={{0,1},{1,0}}": 64,
    # a group of one sends nothing
    "%one = f32[64]{0} all-reduce(%w), replica_groups=mesh['a'=4,'b'=1] {'b'}, to_apply=%add": 0,
    "%add.1 = f32[64]{0} add(%p, %q)": 0,
}


@pytest.mark.parametrize("line, sent", LINES.items())
def test_each_collective_form_is_costed_as_a_ring(line, sent):
    assert collectives.sent_bytes(line, 4) == pytest.approx(sent)


def test_a_data_parallel_plan_sends_its_gradient_all_reduce_and_fsdp_sends_more():
    """Pure data parallelism must all-reduce every gradient once per update (2 x 3/4 of the fp32
    parameters over 4 devices, ring); FSDP gathers each layer's weights in the passes besides."""
    data = PL.plan(cfg_of("mesh.fsdp=1"), "cpu:4", engine=False).parts["learner"]
    fsdp = PL.plan(cfg_of(), "cpu:4", engine=False).parts["learner"]
    cfg = cfg_of()
    grads = 4 * flops.param_count(cfg.model, cfg.model.vocab_size)  # fp32
    assert data.sent_bytes >= 0.9 * 1.5 * grads
    assert fsdp.sent_bytes > data.sent_bytes


def test_expert_parallelism_sends_rows_where_fsdp_gathers_every_expert():
    """With the experts split over an expert axis a device gathers its group's rows (here 64
    tokens of 128 features per device) instead of every expert's weights (32 x 3 x 128 x 256
    per layer and pass)."""
    moe = ("model.qk_norm=true", "model.n_experts=32", "model.n_experts_per_token=2", "model.d_ff_expert=256",
           "model.d_model=128")
    fsdp = PL.plan(cfg_of(*moe), "cpu:4", engine=False).parts["learner"]
    ep = PL.plan(cfg_of(*moe, "mesh.fsdp=2", "mesh.expert=2"), "cpu:4", engine=False).parts["learner"]
    assert ep.sent_bytes < 0.75 * fsdp.sent_bytes, (ep.sent_bytes, fsdp.sent_bytes)
