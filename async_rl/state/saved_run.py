"""Read-only access to a saved run, for `audit`, `eval` and `export`: nothing in the run is
written, moved or set aside.

Owns: opening a run directory (its config, tokenizer and vocabulary), choosing the step a
reader uses, and reading it verified: the newest committed step whose parameters (or ledger
shards, for audit) check against their digests, with a one-line warning naming the damaged
item of each newer step skipped; `--step N` naming a damaged or missing step is a StepError
(exit 2). A live run's keep-N cleanup may delete a step while it is read: the reader holds the
step by hard-linking its files into a directory beside the run (when it can), and a read that
fails because the step went away is retried on the newest committed step. Does not own: the
layout (layout), the digests and readers (checkpoint), what the commands do with what
they read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from async_rl import config as C
from async_rl.errors import UsageError
from async_rl.state.checkpoint import Checkpointer
from async_rl.state.items import Damaged, json_digest, read_signed_json
from async_rl.state.layout import committed_steps, meta_file, step_dir
from async_rl.store import runfiles, storage

HOLD_PREFIX = ".async-rl-hold-"  # the held copy of a step, beside the run directory
RETRY_S = 60.0  # how long a reader keeps chasing a live run's newest step


class StepError(UsageError):
    """A step that cannot be read as asked (exit 2); nothing was changed."""


@dataclasses.dataclass
class SavedRun:
    run_dir: Path
    cfg: C.Config
    tok: Any
    vocab: int  # the model's vocabulary (config.json's for HF models, else the tokenizer's)

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / runfiles.CHECKPOINTS

    def steps(self) -> list[int]:
        return committed_steps(self.ckpt_dir)


def open_run(run_dir: str | Path) -> SavedRun:
    """A run directory's config and tokenizer; FileNotFoundError when it has no committed step."""
    from async_rl.data.tokenizer import build_tokenizer
    run = _run_path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: no such run directory")
    cfg_path = run / runfiles.CONFIG
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: missing (is {run} a run directory?)")
    try:
        doc = yaml.safe_load(cfg_path.read_bytes()) or {}
    except (yaml.YAMLError, RecursionError) as e:  # not YAML, not UTF-8, nested without end
        raise C.ConfigError(f"{cfg_path}: not valid YAML ({' '.join(str(e).split())[:300]})") from None
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise C.ConfigError(f"{cfg_path}: not a run's config (a mapping of config groups, each a mapping of "
                            "fields); restore it from a copy of the run")
    cfg = C.from_dict(doc)
    if not committed_steps(run / runfiles.CHECKPOINTS):
        raise FileNotFoundError(f"{run / runfiles.CHECKPOINTS}: no committed checkpoint")
    tok = build_tokenizer(cfg.tokenizer, synthetic=cfg.data.char_vocab)
    return SavedRun(run, cfg, tok, cfg.model.vocab_size or tok.vocab_size)


def foreign_code(cfg: C.Config, named: set[str]) -> list[tuple[str, str]]:
    """(field, value) of each value in a saved config that would import or start code that is not
    this project's own (a `module:factory` env, a `module:function` reward, an MCP server command),
    leaving out the fields in `named`: those the user gave on the command line."""
    import shlex

    from async_rl.data.rewards import registered
    from async_rl.env.interface import BUILTIN_ENVS

    def own_module(spec: str) -> bool:
        return spec.partition(":")[0].split(".")[0] == "async_rl"

    r, out = cfg.rollout, []
    if r.env and r.env not in BUILTIN_ENVS and not own_module(r.env):
        out.append(("rollout.env", r.env))
    if r.reward and r.reward not in registered() and not own_module(r.reward):
        out.append(("rollout.reward", r.reward))
    if r.env == "mcp" and not r.mcp_server.strip().startswith(("http://", "https://")):
        try:
            argv = shlex.split(r.mcp_server)
        except ValueError:
            argv = []
        if argv[:2] != ["python", "-m"] or len(argv) < 3 or not own_module(argv[2]):
            out.append(("rollout.mcp_server", r.mcp_server))
    return [(k, v) for k, v in out if k not in named]


def refuse_foreign_code(run: SavedRun, overrides, trust_code: bool) -> None:
    """A saved config is another's input: the code it names runs only when the user names it again
    (an override) or passes --trust-code; otherwise one ConfigError naming the value (exit 2)."""
    named = {o.split("=", 1)[0].strip() for o in overrides if "=" in o}
    found = [] if trust_code else foreign_code(run.cfg, named)
    if found:
        k, v = found[0]
        raise C.ConfigError(f"{run.run_dir / runfiles.CONFIG}: {k}={v!r} would be imported and run; if you trust "
                            f"this run pass --trust-code (or name it yourself: {k}=...); nothing was run")


def _run_path(run_dir):
    """Orbax wants absolute local paths; object-store URLs are used as they are."""
    return storage.run_path(run_dir) if storage.is_remote(run_dir) else Path(run_dir).absolute()


def _clear_stale_holds(parent: Path) -> None:
    """Holds left by a reader that was killed (its process is gone) keep deleted steps' data alive."""
    for p in parent.glob(HOLD_PREFIX + "*"):
        try:
            pid = int(p.name[len(HOLD_PREFIX):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, OSError):
            continue


@contextlib.contextmanager
def _held(ckpt_dir: Path, step: int):
    """A checkpoint directory holding step `step` where keep-N cleanup cannot delete it under
    the reader: hard links to its files in a temporary directory beside the run (no data is
    copied), or the run's own directory where no links can be made there."""
    src, parent = step_dir(ckpt_dir, step), ckpt_dir.parent.parent
    if storage.is_remote(ckpt_dir):  # no links there: a step deleted while read is read again
        yield ckpt_dir
        return
    try:
        _clear_stale_holds(parent)
        root = Path(tempfile.mkdtemp(prefix=f"{HOLD_PREFIX}{os.getpid()}-", dir=parent))
    except OSError:
        yield ckpt_dir
        return
    try:
        dst = step_dir(root, step)
        try:
            for here, _, files in os.walk(src):
                (dst / Path(here).relative_to(src)).mkdir(parents=True, exist_ok=True)
                for f in files:
                    with contextlib.suppress(FileNotFoundError):  # being deleted: the read fails, then retries
                        os.link(Path(here) / f, dst / Path(here).relative_to(src) / f)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            shutil.rmtree(root, ignore_errors=True)
            root = None
            yield ckpt_dir
            return
        if not dst.is_dir():
            raise FileNotFoundError(f"{src}: deleted before it could be read")
        yield root
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


def read_verified(run: SavedRun, read: Callable[[Checkpointer, int], Any], step: int | None = None,
                  warn: Callable[[str], None] = print) -> tuple[int, Any]:
    """(step, read(checkpointer, step)) for `step`, or for the newest committed step that
    verifies; `read` raises Damaged for a step that does not."""
    d = run.ckpt_dir
    listing = lambda: ", ".join(map(str, run.steps())) or "none"  # noqa: E731
    if step is not None:
        if step not in run.steps():
            raise StepError(f"--step {step}: no committed checkpoint step {step} in {d} (steps: {listing()})")
        try:
            with _held(d, step) as where:
                return step, read(Checkpointer(where, keep=0, async_save=False), step)
        except (Damaged, FileNotFoundError) as e:
            why = _why(e)
            if step not in run.steps():
                raise StepError(f"--step {step}: checkpoint step {step} in {d} was deleted while it was read "
                                f"(a live run's checkpoint.keep); steps now: {listing()}") from None
            raise StepError(f"--step {step}: checkpoint step {step} in {d} is damaged ({why}); nothing was "
                            f"changed; choose another step (steps: {listing()})") from None
    damaged: dict[int, str] = {}
    deadline = time.monotonic() + RETRY_S
    while True:
        todo = [s for s in reversed(run.steps()) if s not in damaged]
        if not todo:
            raise FileNotFoundError(f"{d}: no committed checkpoint step verifies"
                                    + (f" (damaged: {', '.join(map(str, sorted(damaged)))})" if damaged else ""))
        s = todo[0]
        try:
            with _held(d, s) as where:
                return s, read(Checkpointer(where, keep=0, async_save=False), s)
        except (Damaged, FileNotFoundError) as e:
            now, why = run.steps(), _why(e)
            if (s not in now or now[-1] > s) and time.monotonic() < deadline:
                continue  # deleted or overtaken by a live run while read: the newest step again
            if s not in now:
                raise FileNotFoundError(f"{d}: checkpoint step {s} was deleted while it was read, and the run's "
                                        f"newer steps kept going the same way for {RETRY_S:.0f} s") from None
            damaged[s] = why
            warn(f"warning: checkpoint step {s} in {d} is damaged ({why}); using an older step (nothing was changed)")


def _why(e: Exception) -> str:
    """The damaged item and what is wrong with it (its path may lie in the held copy)."""
    return f"{e.item}: {e.why}" if isinstance(e, Damaged) else str(e)


def _host_sharding():
    # Restore on the host CPU when the platform has one: a model that fills a run's devices
    # need not fit on one of them.
    import jax
    try:
        dev = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        dev = jax.local_devices()[0]
    return jax.sharding.SingleDeviceSharding(dev)


def step_digest(run: SavedRun, step: int) -> str:
    """The digest of step `step`'s meta, checked against the one it was signed with: the meta holds
    the digests of everything the step holds, so one digest means one set of weights. Raises
    FileNotFoundError (no such committed step) or Damaged."""
    if step not in run.steps():
        raise FileNotFoundError(f"no committed checkpoint step {step} in {run.ckpt_dir} "
                                f"(steps: {', '.join(map(str, run.steps())) or 'none'})")
    return json_digest(read_signed_json("meta", meta_file(step_dir(run.ckpt_dir, step)), "meta_sha256"))


def read_params(run: SavedRun, step: int | None = None, warn: Callable[[str], None] = print) -> tuple[int, Any]:
    """(step, the model parameters of `step` or of the newest step that verifies), on one host
    device; the optimizer, iterator and ledger are not read. A LoRA run's parameters are its
    base with the step's adapters merged in (`read_lora`)."""
    if run.cfg.learner.lora_rank:
        from async_rl.model import lora
        step, adapters, base = read_lora(run, step, warn)
        return step, lora.merged(base, adapters, lora.spec(run.cfg).scale)
    import jax
    from flax import nnx

    from async_rl.model.transformer import Transformer
    abstract = nnx.eval_shape(lambda: Transformer(run.cfg.model, run.vocab, rngs=nnx.Rngs(0)))
    _, aparams = nnx.split(abstract, nnx.Param)
    sh = _host_sharding()
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), aparams)
    return read_verified(run, lambda ck, s: ck.read_params(s, target), step, warn)


def read_lora(run: SavedRun, step: int | None = None, warn: Callable[[str], None] = print) -> tuple[int, Any, Any]:
    """(step, adapters, base) of a LoRA run on one host device: the step's adapters, verified,
    and the base its meta names (model.hf_path, or the random init of run.seed), refused
    (ConfigError, one line) when its digest is not the one the adapters were trained on."""
    import jax
    from flax import nnx

    from async_rl.model import lora
    from async_rl.model.transformer import Transformer
    cfg, sh = run.cfg, _host_sharding()
    spec = lora.spec(cfg)
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, run.vocab, rngs=nnx.Rngs(0), lora=spec))
    _, aadapters, abase = nnx.split(abstract, lora.ADAPTERS, lora.BASE)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), aadapters)
    step, (adapters, meta) = read_verified(run, lambda ck, s: (ck.read_params(s, target), ck.read_meta(s)), step,
                                           warn)
    where = f"{run.ckpt_dir} (step {step})"
    if cfg.model.hf_path:  # its files are digested before anything is loaded
        from async_rl.model import hf
        lora.check_base(meta.get("lora_base"), lora.base_reference(cfg), where)
        return step, adapters, hf.load_params(cfg.model.hf_path, abase, sh)
    with jax.default_device(next(iter(sh.device_set))):  # the learner's random init: run.seed, no adapters
        base = jax.jit(lambda: nnx.state(Transformer(cfg.model, run.vocab, rngs=nnx.Rngs(cfg.run.seed)), nnx.Param))()
    lora.check_base(meta.get("lora_base"), lora.base_reference(cfg, base), where)
    return step, adapters, base


def read_ledgers(run_dir: str | Path, warn: Callable[[str], None]) -> tuple[int, dict, list] | None:
    """(step, meta, every process's ledger shard) of the newest step whose ledger verifies, or None."""
    run = SavedRun(_run_path(run_dir), None, None, 0)
    if not run.steps():
        return None
    try:
        step, (meta, shards) = read_verified(run, lambda ck, s: ck.read_ledgers(s), warn=warn)
    except FileNotFoundError:
        return None
    return step, meta, shards
