"""Bytes a compiled program's collectives send per device, read from its optimized HLO text.

XLA's cost analysis counts memory traffic only; a plan also needs the traffic between chips
(FSDP's weight gathers and gradient reduce-scatters, tensor-parallel all-reduces, the expert
axis's row gathers). Each collective is costed as a ring over its replica group of g devices
sends: all-gather g-1 of g output shards; reduce-scatter g-1 shards of its input (g - 1 times
its output); all-reduce 2 (g-1)/g of its buffer; all-to-all (g-1)/g of it; a collective
permute all of it. Loop bodies count once, as in the cost analysis (`compile._loop_cost`
scales them). An async pair counts at its `-start`, which names the groups (its result holds
the operands, then the outputs)."""

from __future__ import annotations

import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"=\s*(?P<type>.*?)\s(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                 r"(?P<phase>-start|-done)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?: \{([^}]*)\})?")


def _arrays(type_text: str) -> list[int]:
    """The byte sizes of the arrays a result type names (scalars, an async op's contexts, left out)."""
    out = []
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype in _DTYPE_BYTES and dims:
            n = 1
            for d in dims.split(","):
                n *= int(d)
            out.append(n * _DTYPE_BYTES[dtype])
    return out


def _group_size(rest: str, devices: int) -> int:
    """Devices per replica group, in each form XLA prints: `{{0,1},{2,3}}`, `[groups,size]<=[...]`,
    and `mesh['a'=2,'b'=4] {'b'}` (the named axes; none named: the whole mesh)."""
    m = _MESH_GROUPS.search(rest)
    if m:
        sizes = {k.strip("'"): int(v) for k, v in (kv.split("=") for kv in m.group(1).split(","))}
        names = [a.strip().strip("'") for a in m.group(2).split(",")] if m.group(2) else list(sizes)
        n = 1
        for a in names:
            n *= sizes[a]
        return n
    m = _IOTA_GROUPS.search(rest)
    if m:
        return int(m.group(2))
    m = _LIST_GROUPS.search(rest)
    if m:
        return len(m.group(1).split(",")) if m.group(1) else devices
    return devices  # no groups named: every device


def sent_bytes(hlo_text: str, devices: int) -> float:
    """Bytes each device sends in the collectives of `hlo_text` (ring estimate, see above)."""
    total = 0.0
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m is None or m.group("phase") == "-done":
            continue
        op, arrays = m.group("op"), _arrays(m.group("type"))
        if m.group("phase") == "-start" and op != "all-reduce":
            arrays = arrays[len(arrays) // 2:]
        size = sum(arrays)
        if op == "collective-permute":  # each device sends its buffer once, whatever the pairs
            total += size
            continue
        g = _group_size(m.group("rest"), devices)
        total += {"all-gather": size * (g - 1) / g, "reduce-scatter": size * (g - 1),
                  "all-reduce": 2 * size * (g - 1) / g, "all-to-all": size * (g - 1) / g}[op]
    return total
