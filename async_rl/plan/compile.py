"""`async-rl plan`: a run's learner step compiled ahead of time for a TPU or GPU topology, on any host.

Owns: topology names -> compile-only devices and their chip (libtpu's topology descriptions;
GPU names via plan_gpu; `cpu:N` for forced host devices), compiling the step from abstract
arrays (no parameter is ever allocated), reading XLA's memory analysis and cost model, the
estimates made from them, and knobs to try when the step does not fit. Does not own: the
step (learner), the meshes (sharding splits and lays the topology's devices out exactly as
it does a run's), the chip figures (chips), model FLOPs (flops), the config (config),
printing (cli).

What the numbers are:
  memory   XLA's own accounting of the compiled step per chip: arguments (parameters,
           optimizer state, the batch), temporaries, outputs not aliased to donated inputs.
           Exact for the program that would run, up to runtime fragmentation.
  FLOPs    XLA's cost model counts a loop body once, whatever its trip count. So a layer's
           and a logits chunk's costs are compiled on their own and added for every
           iteration beyond the counted one (see `_loop_cost`): the numbers are XLA's, the
           multiplication is ours. Pallas kernels (splash) and cuDNN's fused attention are
           opaque to it: their FLOPs are added from the causal attention formula, their HBM
           traffic is not (K/V blocks are re-read once per query block: hundreds of FLOPs per
           byte). GPU programs are costed through plan_gpu.hlo_cost.
  time     an estimate: max(FLOPs / peak, bytes accessed / HBM bandwidth), i.e. a roofline
           with perfect overlap and no collective cost. MFU bound = model FLOPs
           (`flops.step_flops`: 6 x parameters x tokens + causal attention, per update pass;
           no recomputation) / (estimated time x peak). Not a measurement.

The engine part compiles the engine's decode call (`engine.steps_per_call` steps, as the
pump runs it) and one prefill for one process's engine: as in the run, each process of the
topology (a TPU host, a GPU node) runs its own over its share of the devices (its last
`mesh.engine_devices`, or all of them), mesh data x engine.tensor,
`engine.max_concurrent_decodes` slots split over data, weights and KV heads over tensor.
Its memory is the decode call's arguments (weights in the compute dtype, the KV cache)
plus the larger of decode's and prefill's temporaries; its bytes accessed per decode step
(a call's over its steps) come from layer-count differencing (2 and 3 layers, unrolled)
since XLA counts a scanned layer once, and are set beside the bytes that must be read:
weights plus the cache's columns (all of them: the widest window). With
`mesh.engine_devices=0` engine and learner share the chips, so each must fit beside the
other's resident state (weights and cache; parameters and optimizer state).
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from async_rl import config as C
from async_rl.model import flops, sharding
from async_rl.plan import collectives
from async_rl.plan import gpu as plan_gpu
from async_rl.plan.chips import NOMINAL_CPU, TPUS, Chip, GiB


def topology(name: str) -> tuple[list, Chip]:
    """(devices, chip) for "v5e:2x4"-style names (libtpu's topologies), "h100:8" (plan_gpu) or "cpu:N"."""
    if plan_gpu.is_gpu(name):
        return plan_gpu.topology(name)
    m = re.fullmatch(r"cpu:(\d+)", name)
    if m:
        n, devs = int(m.group(1)), jax.devices("cpu")
        if n > len(devs):
            raise C.ConfigError(f"--topology={name}: only {len(devs)} CPU devices (set XLA_FLAGS="
                                f"--xla_force_host_platform_device_count={n} before starting)")
        return devs[:n], NOMINAL_CPU
    try:
        from jax.experimental import topologies
        desc = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as e:  # no libtpu, or a name libtpu does not know
        why = str(e).splitlines()[0][:200]
        raise C.ConfigError(f"--topology={name}: cannot describe this TPU topology ({why}); names look like "
                            "v5e:2x4, v5p:4x4x2, v6e:4x4, and need libtpu: pip install -e '.[tpu]'; GPU "
                            "names: h100:8, h200:8, a100-80g:8, b200:8, h100:4x8") from None
    devs = list(desc.devices)
    chip = TPUS.get(devs[0].device_kind)
    if chip is None:
        raise C.ConfigError(f"--topology={name}: no figures for device kind {devs[0].device_kind!r}")
    return devs, chip


@dataclass
class Part:
    """One compiled program's per-chip figures (bytes, FLOPs; seconds where stated)."""
    name: str
    fits: bool
    compile_s: float
    params_bytes: int = 0
    opt_bytes: int = 0
    batch_bytes: int = 0
    temp_bytes: int = 0
    other_bytes: int = 0  # outputs not aliased to donated inputs, generated code
    total_bytes: int = 0
    flops: float = 0.0  # XLA cost model, every loop iteration counted, plus kernel FLOPs
    kernel_flops: float = 0.0  # of which: fused attention and MoE expert kernels, from the formula
    bytes_accessed: float = 0.0
    sent_bytes: float = 0.0  # bytes a chip sends in collectives per step (or decode step): a ring estimate
    model_flops: float = 0.0
    error: str = ""
    teacher_bytes: int = 0  # learner: a distillation teacher's parameters on a chip (learner.distill)
    kv_bytes: int = 0  # engine: the KV cache's share on a chip
    sequences: int = 0  # engine: the sequences its KV cache holds at once (slots)
    kv_tokens: int = 0  # engine: tokens its KV cache has room for (slots x width, or a pool's pages x page size)
    seq_tokens: float = 0.0  # engine: tokens of that room a sample of the configured lengths takes (group prompts shared)
    resident_bytes: int = 0  # what stays allocated between this program's runs (state)
    attention: str = ""  # learner: the attention kernel in the compiled step
    experts: str = ""  # learner: the MoE experts' grouped matmul ("" for a dense model)
    mesh: Mesh | None = None  # the devices it was compiled for, as the run lays them out


@dataclass
class Report:
    config: str
    topology: str
    chip: Chip
    devices: int
    mesh: dict
    parts: dict = field(default_factory=dict)
    knobs: list = field(default_factory=list)  # overrides to try when something does not fit

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.parts.values())

    def estimates(self) -> dict:
        lp = self.parts.get("learner")
        if lp is None or not lp.fits or not lp.flops:
            return {"est_step_s": None, "est_mfu": None, "bound": None}
        t_flops, t_bytes = lp.flops / self.chip.peak_flops, lp.bytes_accessed / self.chip.hbm_bandwidth
        step = max(t_flops, t_bytes)
        return {"est_step_s": step, "est_mfu": lp.model_flops / (step * self.chip.peak_flops),
                "bound": "compute" if t_flops >= t_bytes else "memory"}

    def engine_capacity(self) -> tuple[int | None, float | None]:
        """(sequences of the configured lengths one engine could hold at once: its slots plus what
        the HBM left on its chips holds at the same KV bytes per sequence; bytes read per
        generated token at its slots, summed over its chips), None where not known."""
        ep, lp = self.parts.get("engine"), self.parts.get("learner")
        if ep is None or ep.error or not ep.sequences or not ep.kv_bytes or not ep.seq_tokens:
            return None, None
        free = self.chip.hbm_bytes - ep.total_bytes - (lp.resident_bytes if lp is not None else 0)
        room = ep.kv_tokens + max(0, free) * ep.kv_tokens // ep.kv_bytes
        most = int(room // ep.seq_tokens)
        chips = ep.mesh.size if ep.mesh is not None else 1
        return most, (ep.bytes_accessed * chips / ep.sequences if ep.bytes_accessed else None)

    def as_json(self) -> dict:
        lp = self.parts.get("learner")
        out = {"fits": self.fits, "config": self.config, "topology": self.topology, "chip": self.chip.name,
               "devices": self.devices, "mesh": self.mesh, "hbm_bytes": self.chip.hbm_bytes,
               "peak_flops_per_chip": self.chip.peak_flops, "hbm_bandwidth_per_chip": self.chip.hbm_bandwidth}
        if lp is not None:
            out.update(learner_bytes_per_chip=lp.total_bytes, learner_params_bytes_per_chip=lp.params_bytes,
                       learner_opt_bytes_per_chip=lp.opt_bytes, learner_temp_bytes_per_chip=lp.temp_bytes,
                       flops_per_chip=lp.flops, kernel_flops_per_chip=lp.kernel_flops,
                       bytes_accessed_per_chip=lp.bytes_accessed, collective_bytes_sent_per_chip=lp.sent_bytes,
                       model_flops_per_chip=lp.model_flops,
                       learner_compile_s=lp.compile_s, learner_error=lp.error or None,
                       attention=lp.attention or None, experts=lp.experts or None)
        ep = self.parts.get("engine")
        if ep is not None:
            out.update(engine_mesh=dict(ep.mesh.shape) if ep.mesh is not None else None,
                       engine_bytes_per_chip=ep.total_bytes, engine_params_bytes_per_chip=ep.params_bytes,
                       engine_kv_bytes_per_chip=ep.kv_bytes, engine_temp_bytes_per_chip=ep.temp_bytes,
                       engine_bytes_accessed_per_decode_step=ep.bytes_accessed,
                       engine_collective_bytes_sent_per_decode_step=ep.sent_bytes,
                       engine_decode_read_ratio=(ep.bytes_accessed / (ep.params_bytes + ep.kv_bytes)
                                                 if ep.bytes_accessed else None),
                       engine_compile_s=ep.compile_s, engine_error=ep.error or None)
            out["engine_max_sequences"], out["engine_bytes_accessed_per_token"] = self.engine_capacity()
        out.update(self.estimates())
        out["knobs"] = self.knobs
        return out


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest shard)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape)
        total += int(np.prod(shape)) * jnp.dtype(a.dtype).itemsize
    return total


def _abstract_batch(learner, rows: int, width: int, new: int) -> dict:
    shapes = {"tokens_BxT": ((rows, width), jnp.int32), "positions_BxT": ((rows, width), jnp.int32),
              "valid_BxT": ((rows, width), jnp.bool_), "completion_BxN": ((rows, new), jnp.int32),
              "behav_logp_BxN": ((rows, new), jnp.float32), "mask_BxN": ((rows, new), jnp.bool_),
              "rewards_B": ((rows,), jnp.float32), "row_valid_B": ((rows,), jnp.bool_),
              "truncated_B": ((rows,), jnp.bool_)}
    m = learner.cfg.model
    if learner.cfg.learner.routing_replay:  # the engine's experts per column (learner.batch)
        shapes["routes_BxTxLxK"] = ((rows, width, m.n_layers, m.n_experts_per_token), jnp.int16)
    sh = learner._batch_shardings()
    return {k: jax.ShapeDtypeStruct(s, dt, sharding=sh[k]) for k, (s, dt) in shapes.items()}


def _lower(cfg: C.Config, vocab: int, mesh: Mesh, unroll: bool, teacher_spec=None):
    """(learner, abstract state, second argument, batch, teacher parameters or None, lowered step)."""
    from async_rl.learner.step import Learner
    from async_rl.state.teacher import Teacher
    t = Teacher(teacher_spec, mesh) if teacher_spec is not None else None
    learner = Learner(cfg, vocab, mesh, log=lambda _: None, unroll=unroll, teacher=t)
    state = learner.abstract_state()
    ref = state["params"] if learner.use_ref else None
    if learner.lora is not None:  # the frozen base goes where the reference would
        ref = _placed(learner.abstract_base, learner.base_sh)
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    batch = _abstract_batch(learner, rows, cfg.engine.max_prompt_len + cfg.rollout.max_new_tokens,
                            cfg.rollout.max_new_tokens)
    if t is None:
        return learner, state, ref, batch, None, learner._step.lower(state, ref, batch)
    tp = _placed(t.abstract, t.shardings)
    return learner, state, ref, batch, tp, learner._step.lower(state, ref, batch, tp)


_OOM = re.compile(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)", re.S)


def _oom_bytes(msg: str) -> int | None:
    m = _OOM.search(msg)
    if not m:
        return None
    unit = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": GiB, "T": 1 << 40}
    return int(float(m.group(1)) * unit[m.group(2)])


def _cost(compiled) -> tuple[float, float, float]:
    """(FLOPs, bytes accessed, bytes sent in collectives) per device; loop bodies count once."""
    text = compiled.as_text()
    parts = re.search(r"num_partitions=(\d+)", text)
    sent = collectives.sent_bytes(text, int(parts.group(1)) if parts else 1)
    ca = compiled.cost_analysis()
    if not ca:  # compiled for a GPU description: no cost analysis of its own
        return (*plan_gpu.hlo_cost(compiled), sent)
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0)), sent


def peak_bytes(ma) -> int:
    """A compiled step's peak memory per device from XLA's memory analysis: its arguments, its
    temporaries and the outputs that do not reuse a donated argument's buffer."""
    return ma.argument_size_in_bytes + ma.temp_size_in_bytes + max(ma.output_size_in_bytes - ma.alias_size_in_bytes, 0)


def learner_part(cfg: C.Config, vocab: int, mesh: Mesh, chip: Chip, cost: bool = True, teacher=None) -> Part:
    """Compiles the step (with learner.distill's `teacher`, a `TeacherSpec`, its forward pass and
    its parameters); on success also the two cost twins (unless `cost` is False)."""
    learner, state, ref, batch, tparams, lowered = _lower(cfg, vocab, mesh, unroll=False, teacher_spec=teacher)
    t_bytes = _shard_bytes(tparams) if tparams is not None else 0
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # the compiler's out-of-memory (or another refusal), reported as such
        msg = str(e)
        need = _oom_bytes(msg)
        return Part("learner", False, time.perf_counter() - t0, params_bytes=_shard_bytes(state["params"]),
                    opt_bytes=_shard_bytes(state["opt"]), total_bytes=need or 0, teacher_bytes=t_bytes,
                    error=msg.splitlines()[0][:400] if need is None else f"needs {need / GiB:.2f} GiB per chip",
                    mesh=mesh)
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    params, opt, batch_b = _shard_bytes(state["params"]), _shard_bytes(state["opt"]), _shard_bytes(batch)
    args = ma.argument_size_in_bytes
    other = max(ma.output_size_in_bytes - ma.alias_size_in_bytes, 0)
    total = peak_bytes(ma)
    part = Part("learner", total <= chip.hbm_bytes, compile_s, params_bytes=params, opt_bytes=opt,
                batch_bytes=batch_b, temp_bytes=ma.temp_size_in_bytes, other_bytes=other + args - params - opt
                - batch_b - t_bytes - (_shard_bytes(ref) if ref is not None else 0), total_bytes=total, mesh=mesh,
                teacher_bytes=t_bytes)
    part.model_flops = sum(flops.step_flops(cfg, vocab, teacher=teacher).values()) / mesh.size
    part.attention = attention_used(learner, compiled)
    if cfg.model.moe:
        part.experts = "megablox (Pallas TPU kernels)" if learner.attn.platform == "tpu" else \
            f"XLA ragged_dot (every expert on every row on this platform: {cfg.model.n_experts}x a grouped matmul's work)"
    if cost:
        part.flops, part.bytes_accessed, part.sent_bytes = (float(v) for v in _loop_cost(cfg, learner, mesh, np.array(_cost(compiled)),
                                                                        teacher))
        if part.attention.startswith(("splash", "cuDNN")):
            part.kernel_flops = flops.kernel_flops(cfg, backward=7 if learner.attn.impl == "splash" else 5,
                                                   teacher=teacher) / mesh.size
        if learner.attn.platform == "tpu":  # the MoE experts' megablox kernels
            part.kernel_flops += flops.expert_kernel_flops(cfg) / mesh.size
        part.flops += part.kernel_flops
    return part


def attention_used(learner, compiled) -> str:
    """The attention the compiled step runs, as the report names it."""
    impl = learner.attn.impl
    if impl == "splash":
        return "splash (Pallas TPU kernel)"
    if impl == "cudnn" and plan_gpu.uses_cudnn_attention(compiled):
        return "cuDNN flash attention (fused)"
    if impl == "cudnn":  # auto on GPU falls back when cuDNN refuses the shape or is not installed
        return "blockwise XLA attention (cuDNN's fused attention was not available to the compiler)"
    return {"blockwise": "blockwise XLA attention", "xla": "XLA attention (whole score matrix)"}.get(impl, impl)


def _loop_cost(cfg: C.Config, learner, mesh: Mesh, counted: np.ndarray, teacher=None) -> np.ndarray:
    """Per-chip (FLOPs, bytes accessed) of the step with every loop iteration counted.

    `counted` is XLA's cost of the compiled step, where each loop body counts once: one
    layer, one logits chunk, one micro-batch, one update. The layer and the chunk are
    nearly all of a step, so their costs are compiled on their own at one micro-batch's
    shape (a layer: 2 layers minus 1, unrolled, forward and backward with the step's remat
    and kernel) and added for every iteration the step runs beyond the one counted. What
    is not scaled (embedding, loss, accumulation: once per micro-batch) is small. A teacher's
    forward pass (once over the step's rows, in micro-batches) is scaled the same way."""
    lc, m = cfg.learner, cfg.model
    rows, N = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt, learner.N
    per_update = rows // lc.minibatches
    R = lc.micro_batch_rows if lc.micro_batch_rows and lc.micro_batch_rows < per_update else per_update
    k, u = per_update // R, lc.ppo_epochs * lc.minibatches
    chunk = lc.logits_chunk if lc.logits_chunk and lc.logits_chunk < N else N
    n_c = -(-N // chunk)
    seen = m.n_layers if learner._layer_unroll is True else 1  # layers XLA saw in the counted body
    layer_fb, chunk_fb = _layer_cost(cfg, learner, mesh, R, grad=True), _chunk_cost(cfg, learner, mesh, R, chunk, True)
    total = counted + (u * k * m.n_layers - seen) * layer_fb + (u * k * n_c - 1) * chunk_fb
    fwd_passes = [u * k] * (lc.kl_coef > 0)  # the reference model, once per micro-batch
    if u > 1 and lc.is_correction != "none":  # pi_prox, over all rows, in micro-batches
        fwd_passes.append(rows // R)
    if fwd_passes:
        layer_f, chunk_f = _layer_cost(cfg, learner, mesh, R, grad=False), _chunk_cost(cfg, learner, mesh, R, chunk,
                                                                                         False)
        for n in fwd_passes:
            total = total + (n * m.n_layers - seen) * layer_f + (n * n_c - 1) * chunk_f
    if teacher is not None:
        tc, t_layers = dataclasses.replace(cfg, model=teacher.model), teacher.model.n_layers
        t_seen = t_layers if learner._layer_unroll is True else 1
        layer_t, chunk_t = _layer_cost(tc, learner, mesh, R, grad=False), _chunk_cost(tc, learner, mesh, R, chunk, False)
        total = total + (rows // R * t_layers - t_seen) * layer_t + (rows // R * n_c - 1) * chunk_t
    return total


def _abstract(shape, dtype, sh):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)


def _placed(abstract, shardings):
    """An abstract tree with each leaf given its sharding (a lowering's argument)."""
    return jax.tree.map(lambda a, s: _abstract(a.shape, a.dtype, s), abstract, shardings)


def _model_at(cfg: C.Config, learner, layers: int):
    from flax import nnx

    from async_rl.model.transformer import Transformer
    mc = dataclasses.replace(cfg.model, n_layers=layers)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(mc, learner.vocab_size, rngs=nnx.Rngs(0))),
                                 nnx.Param)
    return graphdef, _placed(params, sharding.param_shardings(params, learner.mesh))


def _layer_cost(cfg: C.Config, learner, mesh: Mesh, rows: int, grad: bool) -> np.ndarray:
    from flax import nnx
    T = learner.P + learner.N
    batch = sharding.batch_sharding(mesh, 2)
    args = (_abstract((rows, T), jnp.int32, batch), _abstract((rows, T), jnp.int32, batch),
            _abstract((rows, T), jnp.bool_, batch))

    def cost(layers: int) -> np.ndarray:
        graphdef, params = _model_at(cfg, learner, layers)

        def f(p, tokens, positions, valid):
            x = nnx.merge(graphdef, p).hidden(tokens, positions, valid, attn=learner.attn, remat=cfg.learner.remat,
                                              unroll=True, gather=learner.gather)
            return x.astype(jnp.float32).sum()

        return np.array(_cost(jax.jit(jax.grad(f) if grad else f).lower(params, *args).compile()))

    return cost(2) - cost(1)


def _chunk_cost(cfg: C.Config, learner, mesh: Mesh, rows: int, chunk: int, grad: bool) -> np.ndarray:
    from flax import nnx

    from async_rl.learner import losses
    graphdef, params = _model_at(cfg, learner, 1)
    x = _abstract((rows, chunk, cfg.model.d_model), jnp.dtype(cfg.model.dtype), sharding.batch_sharding(mesh, 3))
    tok = _abstract((rows, chunk), jnp.int32, sharding.batch_sharding(mesh, 2))

    def f(p, x, tok):
        one = lambda x: losses.completion_logprobs(nnx.merge(graphdef, p).logits, x, tok, 1.0)
        logp, ent = jax.checkpoint(one)(x) if grad else one(x)
        return (logp + ent).sum()

    fn = jax.grad(f, argnums=(0, 1)) if grad else f
    return np.array(_cost(jax.jit(fn).lower(params, x, tok).compile()))


def _engine(cfg: C.Config, vocab: int, devices: list, layers: int | None = None, unroll: bool | int = 1):
    from flax import nnx

    from async_rl.model import lora
    from async_rl.model.transformer import Transformer
    from async_rl.rollout.backends import make_engine
    mc = cfg.model if layers is None else dataclasses.replace(cfg.model, n_layers=layers)
    # with LoRA the engine runs the base and the adapters beside it (LoRAParam is a Param)
    abstract = nnx.eval_shape(lambda: Transformer(mc, vocab, rngs=nnx.Rngs(0), lora=lora.spec(cfg)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    eng = make_engine(cfg, graphdef, vocab, devices=devices, model_cfg=mc, seed=0, unroll=unroll, windows=True)
    sh = eng.param_shardings(params)
    params = jax.tree.map(lambda v, s: v.replace(_abstract(v.shape, eng.param_dtype(v), s.get_value())), params, sh,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    state = jax.tree.map(lambda a, s: _abstract(a.shape, a.dtype, s), jax.eval_shape(eng._init_impl),
                         eng._state_sharding)
    return eng, params, state


def _engine_prefill(eng, params):
    """One prompt of max_prompt_len tokens (the pump's single prefill)."""
    rep = eng._replicated
    p = eng.max_prompt_len
    args = (_abstract((1, p), jnp.int32, rep), _abstract((1, p), jnp.int32, rep), _abstract((1, p), jnp.bool_, rep),
            _abstract((1,), jnp.int32, rep), _abstract((), jnp.int32, rep))
    return eng._prefill.lower(params, *args).compile()


def _decode_call(eng):
    """The jitted decode of one call at the widest window (a paged engine: its widest page
    table), with the forward pass after its last token (a call in the middle of a sample)."""
    return eng._decoder(eng.windows[-1], eng.steps_per_call > 1)


def _decode_extra(eng) -> list:
    """The decode's arguments after the state: a paged engine's page table, every slot's widest."""
    return [_abstract((eng.max_concurrent_decodes, eng.windows[-1]), jnp.int32, eng._replicated)] * eng._decode_extra


def engine_part(cfg: C.Config, vocab: int, devices: list, chip: Chip, cost: bool = True) -> Part:
    """The engine's decode call (widest window) and a prefill, compiled for `devices`."""
    eng, params, state = _engine(cfg, vocab, devices)
    t0 = time.perf_counter()
    try:
        decode = _decode_call(eng).lower(params, state, *_decode_extra(eng)).compile()
        prefill = _engine_prefill(eng, params)
    except Exception as e:
        msg = str(e)
        need = _oom_bytes(msg)
        return Part("engine", False, time.perf_counter() - t0, params_bytes=_shard_bytes(params),
                    kv_bytes=_shard_bytes(state.cache), total_bytes=need or 0,
                    error=msg.splitlines()[0][:400] if need is None else f"needs {need / GiB:.2f} GiB per chip",
                    mesh=eng.mesh)
    compile_s = time.perf_counter() - t0
    dm, pm = decode.memory_analysis(), prefill.memory_analysis()
    w, kv, st = _shard_bytes(params), _shard_bytes(state.cache), _shard_bytes(state)
    temp = max(dm.temp_size_in_bytes, pm.temp_size_in_bytes + pm.output_size_in_bytes)
    total = dm.argument_size_in_bytes + temp + max(dm.output_size_in_bytes - dm.alias_size_in_bytes, 0)
    part = Part("engine", total <= chip.hbm_bytes, compile_s, params_bytes=w, temp_bytes=temp,
                other_bytes=total - w - st - temp, total_bytes=total, kv_bytes=kv, resident_bytes=w + st, mesh=eng.mesh,
                sequences=eng.max_concurrent_decodes, kv_tokens=eng.kv_tokens(),
                seq_tokens=eng.tokens_per_sample(cfg.rollout.samples_per_prompt))
    if cost:
        # 2 and 3 layers: with 1, fusion differs enough to skew the per-layer difference
        two, three = (np.array(_cost(_decode_call(eng_l).lower(p_l, s_l, *_decode_extra(eng_l)).compile()))
                      / eng_l.steps_per_call
                      for eng_l, p_l, s_l in (_engine(cfg, vocab, devices, n, unroll=True) for n in (2, 3)))
        part.flops, part.bytes_accessed, part.sent_bytes = (float(v) for v in two + (cfg.model.n_layers - 2) * (three - two))
    return part


def suggest(cfg: C.Config, part: Part, chip: Chip, mesh: Mesh) -> list[str]:
    """Overrides likely to bring the learner under the chip's HBM (to verify with another plan)."""
    lc, out = cfg.learner, []
    shards = sharding.batch_shards(mesh)
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt // lc.minibatches
    state = part.params_bytes + part.opt_bytes
    if lc.remat == "none":
        out.append("learner.remat=block")
    if not lc.logits_chunk or lc.logits_chunk > 256:
        out.append(f"learner.logits_chunk={min(256, cfg.rollout.max_new_tokens)}")
    budget = chip.hbm_bytes * 0.9 - state - part.batch_bytes
    micro = lc.micro_batch_rows or rows
    if part.total_bytes > chip.hbm_bytes and budget > 0:
        act = max(part.total_bytes - state - part.batch_bytes, 1)
        want = int(micro * budget / act) // shards * shards
        if shards <= want < micro:
            while rows % want:
                want -= shards
            out.append(f"learner.micro_batch_rows={want}")
    if state > chip.hbm_bytes / 3 and mesh.shape["data"] > 1:
        out.append(f"mesh.fsdp={mesh.shape['fsdp'] * mesh.shape['data']} mesh.data=1")
        if cfg.model.param_dtype == "float32":
            out.append("model.param_dtype=bfloat16")
    if lc.micro_batch_rows and lc.micro_batch_rows > shards and f"learner.micro_batch_rows={shards}" not in out:
        out.append(f"learner.micro_batch_rows={shards}")
    return out


def plan(cfg: C.Config, topology_name: str, *, config_name: str = "", hbm_gib: float | None = None,
         cost: bool = True, engine: bool = True) -> Report:
    devices, chip = topology(topology_name)
    if hbm_gib:
        chip = dataclasses.replace(chip, hbm_bytes=int(hbm_gib * GiB))
    split = sharding.split_devices(devices, cfg.mesh)  # as the run splits and lays them out
    mesh, rows = split.learner, cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    if rows % sharding.batch_shards(mesh):
        raise C.ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}: prompts_per_step x "
                            f"samples_per_prompt ({rows}) must divide evenly over the {sharding.batch_shards(mesh)} "
                            "data-parallel shards (mesh data x fsdp x expert)")
    vocab = cfg.model.vocab_size
    if not vocab:
        raise C.ConfigError("model.vocab_size=0: plan needs the vocabulary size (set it, or model.hf_path)")
    rep = Report(config_name, topology_name, chip, len(devices), dict(mesh.shape))
    from async_rl.state.teacher import resolve
    rep.parts["learner"] = part = learner_part(cfg, vocab, mesh, chip, cost=cost, teacher=resolve(cfg, None))
    if engine:  # each process runs one engine over its share: the first process's stands for all
        rep.parts["engine"] = ep = engine_part(cfg, vocab, split.engine, chip, cost=cost)
        if split.shared and part.fits and ep.fits:  # shared chips: each beside the other's resident state
            part.resident_bytes = part.params_bytes + part.opt_bytes
            part.fits = part.total_bytes + ep.resident_bytes <= chip.hbm_bytes
            ep.fits = ep.total_bytes + part.resident_bytes <= chip.hbm_bytes
    if not part.fits:
        rep.knobs = suggest(cfg, part, chip, mesh)
    return rep


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if abs(x) >= scale:
            return f"{x / scale:,.1f} {prefix}{unit}"
    return f"{x:,.0f} {unit}"


def _shape(mesh: Mesh) -> str:
    return " x ".join(f"{k} {v}" for k, v in mesh.shape.items())


def format_report(rep: Report) -> str:
    g = lambda b: f"{b / GiB:8.2f} GiB"
    lp = rep.parts["learner"]
    lines = [f"plan: {rep.config or 'config'} on {rep.topology}: {rep.devices} x {rep.chip.name}, "
             f"mesh {' x '.join(f'{k} {v}' for k, v in rep.mesh.items())}",
             f"learner step, per chip (XLA memory analysis; compiled in {lp.compile_s:.1f} s"
             + (f"; attention: {lp.attention}" if lp.attention else "")
             + (f"; MoE experts: {lp.experts}" if lp.experts else "") + "):",
             f"  parameters       {g(lp.params_bytes)}", f"  optimizer state  {g(lp.opt_bytes)}"]
    if lp.teacher_bytes:
        lines.append(f"  teacher          {g(lp.teacher_bytes)}  (learner.distill: parameters only)")
    if lp.error:
        lines.append(f"  total            {g(lp.total_bytes)}  ({lp.error})" if lp.total_bytes else f"  {lp.error}")
    else:
        lines += [f"  batch            {g(lp.batch_bytes)}", f"  temporaries      {g(lp.temp_bytes)}",
                  f"  other            {g(lp.other_bytes)}", f"  total            {g(lp.total_bytes)}"]
    lines.append(f"  of HBM           {g(rep.chip.hbm_bytes)}  -> {'fits' if lp.fits else 'DOES NOT FIT'}")
    est = rep.estimates()
    if lp.flops:
        lines += [f"cost model, per chip: {_si(lp.flops, 'FLOP')} (of which {_si(lp.kernel_flops, 'FLOP')} in "
                  f"fused kernels, by formula), {_si(lp.bytes_accessed, 'B')} accessed; model "
                  f"{_si(lp.model_flops, 'FLOP')}",
                  f"  at {rep.chip.peak_flops / 1e12:.0f} TFLOP/s and {rep.chip.hbm_bandwidth / 1e9:,.0f} GB/s "
                  f"(published): compute {lp.flops / rep.chip.peak_flops:.2f} s, memory "
                  f"{lp.bytes_accessed / rep.chip.hbm_bandwidth:.2f} s",
                  f"  collectives: {_si(lp.sent_bytes, 'B')} sent per chip (ring estimate; not in the estimate below)"]
    if lp.flops and rep.mesh.get("expert", 1) > 1 and lp.experts.startswith("megablox"):
        lines.append(f"  (megablox states its cost for every row its expert group gathers: up to mesh.expert = "
                     f"{rep.mesh['expert']} x the pairs it computes, so these are upper bounds)")
    if est["est_step_s"]:
        lines.append(f"ESTIMATE (roofline, no collectives): step {est['est_step_s']:.2f} s, {est['bound']}-bound, "
                     f"MFU bound {est['est_mfu']:.0%}")
    ep = rep.parts.get("engine")
    if ep is not None:
        lines += format_engine(rep, ep)
    if rep.knobs:
        lines.append("does not fit; try: " + " ".join(rep.knobs))
    return "\n".join(lines)


def format_engine(rep: Report, ep: Part) -> list[str]:
    g = lambda b: f"{b / GiB:8.2f} GiB"
    where = f"one per process, mesh {_shape(ep.mesh)}, " if ep.mesh is not None else ""
    lines = [f"engine decode + prefill, {where}per chip (compiled in {ep.compile_s:.1f} s):",
             f"  weights          {g(ep.params_bytes)}", f"  KV cache         {g(ep.kv_bytes)}"]
    if ep.error:
        lines.append(f"  {ep.error}")
    else:
        lines += [f"  temporaries      {g(ep.temp_bytes)}", f"  other            {g(ep.other_bytes)}",
                  f"  total            {g(ep.total_bytes)}"]
    shared = " (beside the learner's state)" if "learner" in rep.parts and rep.parts["learner"].resident_bytes else ""
    lines.append(f"  of HBM           {g(rep.chip.hbm_bytes)}  -> {'fits' if ep.fits else 'DOES NOT FIT'}{shared}")
    if ep.bytes_accessed:
        need = ep.params_bytes + ep.kv_bytes
        lines.append(f"  decode step: {_si(ep.bytes_accessed, 'B')} accessed = {ep.bytes_accessed / need:.2f}x "
                     f"(weights + KV cache); at {rep.chip.hbm_bandwidth / 1e9:,.0f} GB/s: "
                     f"{ep.bytes_accessed / rep.chip.hbm_bandwidth * 1e3:.1f} ms")
    most, per_token = rep.engine_capacity()
    if most is not None:
        lines.append(f"  sequences: {ep.sequences} slots, {_si(ep.kv_bytes * ep.seq_tokens / ep.kv_tokens, 'B')} KV per "
                     "chip a sample of these lengths; "
                     f"at most {most} fit these lengths" + (f"; {_si(per_token, 'B')} read per generated token "
                                                            "(all chips)" if per_token else ""))
    return lines
