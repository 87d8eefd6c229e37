"""Resuming a run on another shape: another number of processes, other devices, another mesh.

Owns: turning a checkpoint written by N processes into this process's share for M
(`restore_data`): the data partition's next generation (`data.Partition`: the records no
old process had drawn from the epochs they had started are dealt out, later epochs are
sharded M ways), every old ledger shard's groups dealt to the new processes (renumbered
and, under in_order, restamped to a step no later than their old one), the log sizes each
new process starts from, and the record of each re-partition that later checkpoints carry
(`generations`: the audit checks each old generation against it, and `cut_inactive_logs`
cuts the logs of processes that no longer exist back to it); announcing a changed mesh or
device count (`mesh_line`). Does not own: reading the checkpoint (checkpoint), the
partition arithmetic (data), the ledger's form (ledger), or resharding the model and
optimizer state (Orbax, restoring onto the learner's target shardings in checkpoint).

See docs/design.md, "Elastic resume".
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import jax

from async_rl.buffer.ledger import Group, Ledger, LedgerSnapshot
from async_rl.data import dataset as data_mod
from async_rl.state.checkpoint import Restored, saved_processes
from async_rl.store import runfiles, storage

_COUNTERS = ("trained_groups", "trained_tokens", "regenerated_groups", "regenerated_tokens")
_PROCESS_LOG = runfiles.PROCESS_LOG


def restore_data(parts, restored: Restored, log) -> None:
    """Points `parts.pd` and `parts.iterator` at the checkpoint's partition and restores the
    iterator; on another process count, re-partitions first and replaces `restored.ledger`
    and `restored.iterator_state` with this process's share. Reads only."""
    meta = restored.meta
    gens = list(meta.get("generations") or [])
    saved = meta.get("partition")
    part = data_mod.Partition.from_json(saved) if saved else data_mod.Partition(int(meta.get("processes", 1)))
    if restored.shards is not None:
        part, gen = _repartition(parts, restored, part, gens, log)
        gens.append(gen)
    if part != parts.pd.partition:
        parts.pd = parts.pd.for_partition(part, jax.process_index())
        parts.iterator = data_mod.make_iterator(parts.pd)
    parts.generations = gens
    parts.iterator.set_state(restored.iterator_state)  # a changed data file is refused here
    line = mesh_line(meta, parts)
    if line:
        log(line)


def _repartition(parts, restored: Restored, parent: data_mod.Partition, gens: list, log):
    """The child partition and the generation record; sets this process's share in `restored`."""
    cfg, step, q, m = parts.cfg, restored.step, jax.process_index(), jax.process_count()
    snaps = [snap for snap, _ in restored.shards]
    nexts = []
    for p, (_, it_state) in enumerate(restored.shards):
        old = data_mod.make_iterator(parts.pd.for_partition(parent, p))
        old.set_state(it_state)  # the data must still be the stream each old process drew from
        nexts.append(old.next_index)
    child = parts.pd.repartition(parent, nexts, m)
    pps = cfg.rollout.prompts_per_step
    owners, order = deal([Ledger.from_snapshot(s) for s in snaps], m, pps, cfg.sampler.name == "in_order")
    frozen_before = gens[-1]["frozen_logs"] if gens else {}
    start_logs = [snaps[i].header.get("logs", {}) if i < len(snaps) else frozen_before.get(str(i), {})
                  for i in range(m)]
    frozen = {str(i): snaps[i].header.get("logs", {}) for i in range(m, len(snaps))}
    frozen.update({k: v for k, v in frozen_before.items() if int(k) >= m and k not in frozen})
    mine = [g for (p, g), owner in zip(order, owners) if owner == q]
    restored.ledger = new_ledger(mine, snaps, q, step, pps // m, cfg.sampler.name == "in_order",
                                  start_logs[q])
    parts.pd = parts.pd.for_partition(child, q)
    parts.iterator = data_mod.make_iterator(parts.pd)
    restored.iterator_state = parts.iterator.get_state()
    dealt = Counter(owners)
    log(_line(parts, child, restored, order, owners, len(snaps), q, m))
    return child, {"generation": child.generation, "step": step, "from": len(snaps), "to": m,
                   "shards": [{"next_ordinal": int(s.header["next_ordinal"]),
                               "held": [int(o) for o in s.arrays["group_ints"][:, 0]],
                               "lineage_bytes": int(s.header.get("logs", {}).get("lineage_bytes", -1))}
                              for s in snaps],
                   "dealt": [dealt.get(i, 0) for i in range(m)], "frozen_logs": frozen}


def deal(ledgers: list[Ledger], processes: int, prompts_per_step: int, in_order: bool):
    """Deals every group of the old shards to `processes` new ones: returns (new owner of each,
    [(old process, group)] in dealing order). Groups are ordered by stamp (in_order) or by
    draw (ordinal), interleaving the old processes, and cut into steps of `prompts_per_step`,
    each split in equal parts: the k-th group goes to process (k % pps) // (pps / processes).
    Under in_order the k-th group trains at new step base + k // pps + 1, which is never
    later than its old stamp: at most pps groups had each stamp, so no token becomes staler
    than the lookahead allowed."""
    order = [(p, g) for p, led in enumerate(ledgers) for g in led.groups.values()]
    if in_order:
        order.sort(key=lambda pg: (pg[1].target_step or 0, pg[0], pg[1].ordinal))
    else:
        order.sort(key=lambda pg: (pg[1].ordinal, pg[0]))
    per = prompts_per_step // processes
    return [(k % prompts_per_step) // per for k in range(len(order))], order


def new_ledger(groups: list[Group], snaps: list[LedgerSnapshot], q: int, step: int, per: int,
                in_order: bool, logs: dict) -> LedgerSnapshot:
    """Process q's new ledger: its dealt groups renumbered from 0 in dealing order, the ordinal
    space starting at `step`; process 0 carries the old shards' counters."""
    led = Ledger(int(snaps[0].header["samples_per_prompt"]))
    led.base_step = step
    for j, g in enumerate(groups):
        new = step + j // per + 1 if in_order else None
        assert new is None or new <= g.target_step, (g.target_step, new)
        g.ordinal, g.target_step = j, new
        led.groups[j] = g
    led.next_ordinal = len(groups)
    if q == 0:
        for k in _COUNTERS:
            setattr(led, k, sum(int(s.header.get(k, 0)) for s in snaps))
        for s in snaps:
            for reason, n in s.header["dropped"].items():
                led.dropped[reason] = led.dropped.get(reason, 0) + int(n)
    snap = led.snapshot()
    snap.header["logs"] = dict(logs)
    return snap


def _line(parts, child, restored, order, owners, n, q, m) -> str:
    from_groups = Counter(p for (p, _), owner in zip(order, owners) if owner == q)
    rem, origin = parts.pd.remainder(child)
    mine = list(range(q, len(rem), m))
    epochs = sorted({int(rem[i][1]) for i in mine})
    from_rem = Counter(int(origin[i]) for i in mine)

    def by(c: Counter) -> str:
        return ", ".join(f"process {p}: {k}" for p, k in sorted(c.items()))
    rest = (f"from epoch {child.epoch0} on it draws records {q}::{m} of each epoch"
            if child.epoch0 < parts.cfg.data.num_epochs else "every epoch was started already, none is sharded anew")
    return (f"resharded from {n} to {m} processes at step {restored.step}: this process takes "
            f"{sum(from_groups.values())} ledger groups" + (f" ({by(from_groups)})" if from_groups else "")
            + f" and {len(mine)} undrawn records" + (f" of epoch {', '.join(map(str, epochs))}" if epochs else "")
            + (f" ({by(from_rem)})" if from_rem else "") + f"; {rest}. The remaining prompts are drawn in "
            "another order than an unchanged run's; each is still trained once per epoch")


def meta_doc(parts) -> dict:
    """What each checkpoint records about the run's shape (see `restore_data`, `mesh_line`)."""
    return {"partition": parts.pd.partition.to_json(), "generations": parts.generations, "mesh": mesh_doc(parts)}


def mesh_doc(parts) -> dict:
    return {"learner": {k: int(v) for k, v in parts.learner.mesh.shape.items()}, "processes": jax.process_count(),
            "local_devices": jax.local_device_count(), "engine_devices": int(parts.engine.mesh.devices.size)}


def _describe(doc: dict) -> str:
    axes = " ".join(f"{k}={v}" for k, v in doc["learner"].items())
    return (f"{axes} over {doc['processes']} process(es) x {doc['local_devices']} devices "
            f"(engine: {doc['engine_devices']} per process)")


def mesh_line(meta: dict, parts) -> str | None:
    """One line when the mesh or the devices differ from the checkpoint's, else None."""
    saved, now = meta.get("mesh"), mesh_doc(parts)
    if not saved or saved == now:
        return None
    return (f"mesh changed since step {meta.get('step')}: {_describe(saved)} -> {_describe(now)}; the model and "
            "optimizer state were resharded onto it"
            + ("; bit-identity with an unchanged run holds only on the same devices" if parts.cfg.run.determinism
               else ""))


def cut_inactive_logs(run_dir: Path, generations: list, processes: int) -> int:
    """Cuts the logs of process indices >= `processes` back to what the run's history holds
    there (their size when their process last existed, from the last re-partition; nothing
    for an index no checkpointed generation had): lines a killed attempt with more processes
    wrote come back from the ledger. Returns the bytes cut."""
    frozen = generations[-1]["frozen_logs"] if generations else {}
    cut = 0
    for path in storage.glob(run_dir, "*.p*.jsonl"):
        m = _PROCESS_LOG.fullmatch(path.name)
        if not m or int(m.group(2)) < processes:
            continue
        sizes = frozen.get(m.group(2))
        want = 0 if sizes is None else sizes.get(f"{m.group(1)}_bytes")
        if want is not None:
            cut += storage.cut_log(path, int(want))
    return cut


def count_note(run_dir: Path) -> str:
    """For an error about the process count: the count the run's newest checkpoint was written by."""
    got = saved_processes(storage.run_path(run_dir) / runfiles.CHECKPOINTS)
    return f"; checkpoint step {got[0]} in {run_dir} was written by {got[1]} process(es)" if got else ""
