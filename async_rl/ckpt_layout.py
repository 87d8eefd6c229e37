"""Where a checkpoint step's files lie: the one place that knows the on-disk layout.

Owns: listing committed steps as Orbax's CheckpointManager lists them (its standard step-name
format; a step is committed once Orbax renames its temporary directory to the step's name),
the items of a step, the meta document's file, each process's file-name prefix (the ledger
item's `<prefix>.json`/`.bin` are checkpoint's own format), and the data item's per-process
file (Grain's handler writes one JSON per process). Does not own: writing, reading or
verifying those files (checkpoint, saved_run).
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp
from etils import epath

ITEMS = ("state", "data", "ledger", "meta")  # the Composite items of every step
_NAMES = ocp.path.step.standard_name_format()  # the CheckpointManager's default, which train uses


def committed_steps(ckpt_dir: str | Path) -> list[int]:
    """Committed steps in `ckpt_dir`, oldest first (temporaries and stray names left out)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    try:
        return sorted(m.step for m in _NAMES.find_all(epath.Path(d.absolute())))
    except FileNotFoundError:  # removed while listed
        return []


def is_step_name(name: str) -> bool:
    """Whether `name` is a step directory's final name (not one of its items)."""
    return name.isascii() and name.isdecimal() and _NAMES.build_name(int(name)) == name


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / _NAMES.build_name(step)


def item_dir(ckpt_dir: str | Path, step: int, item: str) -> Path:
    assert item in ITEMS, item
    return step_dir(ckpt_dir, step) / item


def meta_file(step_path: Path) -> Path:
    """The JSON meta document (Orbax's JsonSave writes its item as `metadata`)."""
    return Path(step_path) / "meta" / "metadata"


def process_prefix(index: int, count: int) -> str:
    return f"process_{index}-of-{count}"


def iterator_file(step_path: Path, index: int, count: int) -> Path:
    """One process's iterator state, as Grain's checkpoint handler names it."""
    return Path(step_path) / "data" / f"{process_prefix(index, count)}.json"
