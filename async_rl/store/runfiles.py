"""The run directory's map: the one place that names the files and folders of `run.dir`.

Every other module asks here for a name and joins it to the run's path (`run_dir / runfiles.CONFIG`,
`runfiles.log("lineage", i)`), so the layout can be read in one table (also in
docs/design.md, "Run directory"). Process 0 writes the plain names; process i > 0 of a multi-process
run writes `<name>.p<i>.jsonl` and `.lock.p<i>` beside them. Inside `checkpoints/` the layout is
`ckpt_layout`'s; inside `journal/`, the journal's.
"""

from __future__ import annotations

import re

CONFIG = "config.yaml"  # the resolved config of the run's latest start
DATA = "data.json"  # the prompt ids the run expects per epoch (read by the audit)
FINAL = "final.json"  # at a clean end: step, parameter fingerprint, completed epochs
PLOT = "reward.png"  # training reward and held-out accuracy per step
MARKER = ".checkpointed"  # written once a checkpoint covered the logs: the run has history
WANDB_STATE = "wandb.json"  # the job's W&B run id and the newest step a clean stop handed over
WANDB_DIR = "wandb"  # W&B's own files (offline runs)
CHECKPOINTS = "checkpoints"  # one Orbax step per folder `<step>/` (ckpt_layout)
JOURNAL = "journal"  # the rollout journal, one folder per process `p<i>/` (journal_store)
TB = "tb"  # TensorBoard event files
DAMAGED = "damaged"  # checkpoint steps that failed to verify, set aside as `step_<n>_<time>/`
PREVIOUS = "previous"  # earlier histories moved aside by run.resume=restart, one `<time>/` each

# the append-only logs, one per process: lineage (trained groups), drops (what was not trained
# and why), rollouts (log.rollouts=true) and metrics (one row per step)
LOGS = ("lineage", "drops", "rollouts", "metrics")
PROCESS_LOG = re.compile(r"(lineage|drops|rollouts|metrics)\.p(\d+)\.jsonl")  # the logs of process i > 0
HISTORY_GLOBS = tuple(f"{k}*.jsonl" for k in LOGS)
HISTORY_DIRS = (CHECKPOINTS, DAMAGED, TB, JOURNAL, WANDB_DIR)
MANIFESTS = (CONFIG, DATA, FINAL, PLOT, MARKER, WANDB_STATE)
LOCK = ".lock"  # the run lock (local) or lease (object store) of process 0


def suffix(process_index: int) -> str:
    """What process `i`'s files add to process 0's names."""
    return f".p{process_index}" if process_index else ""


def log(kind: str, process_index: int = 0) -> str:
    """The file name of one of the `LOGS` for a process."""
    assert kind in LOGS, kind
    return f"{kind}{suffix(process_index)}.jsonl"


def lock(process_index: int = 0) -> str:
    """The lock (or lease) file of a process."""
    return LOCK + suffix(process_index)


def process_of(name: str, kind: str) -> int:
    """The process index whose `kind` log `name` is, or -1 when it is not one."""
    if name == log(kind):
        return 0
    m = PROCESS_LOG.fullmatch(name)
    return int(m.group(2)) if m and m.group(1) == kind else -1
