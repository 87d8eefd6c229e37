"""The run directory's map: the one module that names every file and folder of `run.dir`.

Owns: the name of each thing a run keeps in its directory, for one process index where there
is one per process (process 0 keeps the plain name, process i > 0 adds `.p<i>`), and the
globs and patterns that find them again (history, manifests, per-process logs, journal
segments). Every other module asks here, joining a single name (`run_dir / runfiles.FINAL`)
or calling a function where a name depends on a process index or step; none spells a name
(tests/store/test_runfiles.py checks). Does not own: what the files hold, or the inside of a checkpoint step (Orbax's
names, `state.layout`). Functions take and return the path object of `storage.run_path`, so a
local directory and an object-store prefix are joined alike.

See docs/design.md, "The run directory".
"""

from __future__ import annotations

import re

# ---- the table: name -> what it holds --------------------------------------------------
CONFIG = "config.yaml"  # the resolved config of the run (written when a session takes the run)
DATA = "data.json"  # the data manifest: prompt ids per epoch, epochs, records (the audit's expectation)
FINAL = "final.json"  # how the run ended (step, reason, complete epochs); absent while it goes on
REWARD_PLOT = "reward.png"  # mean reward per step, drawn at the end (log.plot)
WANDB_STATE = "wandb.json"  # the W&B run id and the last step it holds (log.wandb)
WANDB = "wandb"  # W&B's own folder of session files
WANDB_TMP = "wandb/tmp"  # W&B's temporary files and caches of the session (emptied at each start)
TB = "tb"  # TensorBoard event files
CHECKPOINTS = "checkpoints"  # Orbax's step folders (state.layout names what is inside)
DAMAGED = "damaged"  # checkpoint steps that failed verification, set aside as step_<n>_<time>
PREVIOUS = "previous"  # earlier histories moved aside by run.resume=restart, one <time> folder each
JOURNAL = "journal"  # the rollout journal: one folder p<i> per process of <seq>.jrn segments
MARKER = ".checkpointed"  # a checkpoint of the run was committed once: its logs are history from then
RESTARTING = ".restarting"  # a restart in progress: names the folder the history is moving into
LOCK = ".lock"  # the run lock (flock file, or the lease object on an object store), + .p<i>
RUN_ID = "run_id"  # the run's identity, random, made at its first start: env step keys name it
ENV_ERRORS = "env_errors"  # the full traceback of each env step that raised, one file per step key
ENV_IDENTITY = "env.json"  # the code of rollout.env and rollout.reward the run's episodes were made with
PROBE = ".probe-"  # the object a start-up check writes and deletes at once, + <host>-<pid>
FLEET_WEIGHTS = "fleet_weights"  # engine.backend=remote: the newest weights versions the servers load, the session tag
VLLM_LORA = ".vllm_lora"  # engine.backend=vllm with LoRA: the adapter folders vLLM loads, emptied at each start
# the append-only logs of one process, cut back to a checkpoint's sizes on resume (I5)
LOGS = {
    "lineage": "one line per consumed group (trained, or filtered)",
    "metrics": "one row of metrics per step",
    "drops": "every rollout or group not trained, with its reason (I4)",
    "rollouts": "every trained sample's tokens (log.rollouts)",
}

# ---- patterns ------------------------------------------------------------------------
LOG_SUFFIX = ".jsonl"
PER_PROCESS_LOG = re.compile(r"(lineage|drops|rollouts|metrics)(?:\.p(\d+))?\.jsonl")
# every env step a process asked for (multi-turn episodes), never cut back: what the world saw
ENV_REQUESTS = "env_requests"
HISTORY = tuple(f"{kind}*{LOG_SUFFIX}" for kind in (*LOGS, ENV_REQUESTS))  # a fresh start never truncates these
HISTORY_DIRS = (CHECKPOINTS, DAMAGED, TB, JOURNAL, WANDB, ENV_ERRORS)
MANIFESTS = (CONFIG, DATA, FINAL, REWARD_PLOT, ENV_IDENTITY, MARKER, WANDB_STATE, RUN_ID)  # moved aside with the history
JOURNAL_SEGMENT = re.compile(r"(\d+)\.jrn")
JOURNAL_PROCESS = re.compile(r"p(\d+)")
JOURNAL_PROCESS_GLOB = "p*"


def _suffix(i: int) -> str:
    return f".p{i}" if i else ""


def log_name(kind: str, i: int = 0) -> str:
    """`lineage.jsonl` for process 0, `lineage.p3.jsonl` for process 3 (likewise drops, rollouts, metrics)."""
    assert kind in LOGS, kind
    return f"{kind}{_suffix(i)}{LOG_SUFFIX}"


def log_glob(kind: str) -> str:
    """The logs of `kind` of every process index."""
    assert kind in LOGS, kind
    return f"{kind}*{LOG_SUFFIX}"


def log(run_dir, kind: str, i: int = 0):
    return run_dir / log_name(kind, i)


def lineage(run_dir, i: int = 0):
    return log(run_dir, "lineage", i)


def drops(run_dir, i: int = 0):
    return log(run_dir, "drops", i)


def rollouts(run_dir, i: int = 0):
    return log(run_dir, "rollouts", i)


def metrics(run_dir, i: int = 0):
    return log(run_dir, "metrics", i)


def env_requests(run_dir, i: int = 0):
    return run_dir / f"{ENV_REQUESTS}{_suffix(i)}{LOG_SUFFIX}"


def env_requests_glob() -> str:
    return f"{ENV_REQUESTS}*{LOG_SUFFIX}"


def process_of_log(name: str, kind: str | None = None) -> int:
    """The process index of per-process log file `name` (of `kind` when given), -1 for another file."""
    m = PER_PROCESS_LOG.fullmatch(name)
    if not m or (kind is not None and m.group(1) != kind):
        return -1
    return int(m.group(2) or 0)


def env_error(run_dir, key: str):
    """Where the traceback of the env step with key `key` (its str) is kept."""
    return run_dir / ENV_ERRORS / (key.replace("/", "_") + ".txt")


def lock(run_dir, i: int = 0):
    return run_dir / f"{LOCK}{_suffix(i)}"


def lock_process(lock_path) -> int:
    """The process index a lock file (`lock(run_dir, i)`) belongs to."""
    rest = lock_path.name[len(LOCK):]
    return int(rest[2:]) if rest else 0


def probe(run_dir, host: str, pid: int):
    return run_dir / f"{PROBE}{host}-{pid}"


def damaged_step(run_dir, step: int, when: int):
    """Where a checkpoint step that failed verification is set aside (`when`: epoch seconds)."""
    return run_dir / DAMAGED / f"step_{step}_{when}"


def vllm_lora_dir(run_dir, i: int = 0):
    """Process i's folder of PEFT adapter directories for its vLLM engine (local run.dir only)."""
    return run_dir / f"{VLLM_LORA}{_suffix(i)}"


def journal_dir(run_dir, i: int):
    """Process i's journal folder."""
    return run_dir / JOURNAL / f"p{i}"


def journal_segment(directory, seq: int):
    """Segment `seq` of a process's journal folder."""
    return directory / f"{seq:08d}.jrn"
