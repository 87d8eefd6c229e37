"""The distillation teacher (`learner.distill`): a frozen model whose logprobs of the student's
sampled tokens give every completion token an advantage of its own.

Owns: resolving `learner.teacher` (a run directory, read at its newest verified step, or a
Hugging Face model directory) into the teacher's architecture; refusing, in one line naming
both, a teacher whose tokenizer is not the student's; and loading its parameters onto the
learner's mesh (parameters only: no optimizer state, never differentiated); the learner is
handed the `Teacher`. Does not own: the advantage and loss (`learner.step`, `losses`), reading
checkpoints (`saved_run`) or HF files (`hf`).

Exactly once (docs/design.md, I1): a sample does not carry its teacher logprobs. The step that
trains a sample computes them from the frozen teacher and the sample's tokens, so a resumed run
recomputes them bit-identically (same teacher step, same tokens, same compiled program). For that
every checkpoint records which teacher it was trained with (`Teacher.reference`: a run's step
and that step's signed meta digest, or an HF directory's files digest), and a resume reads that
teacher again (`Teacher.pin`: the recorded step, not the teacher run's newest) or is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx

from async_rl.config import Config, ConfigError, ModelConfig
from async_rl.data.tokenizer import HFTokenizer, vocabulary
from async_rl.model import sharding
from async_rl.model.transformer import Transformer
from async_rl.state.items import Damaged
from async_rl.store import runfiles


@dataclasses.dataclass(frozen=True)
class TeacherSpec:
    path: str  # learner.teacher as given
    kind: str  # run | hf
    model: ModelConfig  # the teacher's architecture; its parameters held in its compute dtype (forward only)
    vocab: int  # the teacher's embedding rows
    step: int | None = None  # a run teacher: the step whose weights are read (set by `load`)

    def describe(self) -> str:
        m = self.model
        at = f" step {self.step}" if self.step is not None else ""
        return (f"{self.kind} {self.path}{at}: {m.n_layers} layers x d_model {m.d_model}, {m.n_heads} heads, "
                f"d_ff {m.d_ff}")


def _refuse(path: str, why: str) -> ConfigError:
    return ConfigError(f"learner.teacher={path!r}: {why}")


def resolve(cfg: Config, tok) -> TeacherSpec | None:
    """The teacher `learner.teacher` names (None without distillation), its files' configs read
    and its vocabulary checked against the student's tokenizer `tok`; nothing large is read.
    `tok` None (`async-rl plan`): only the architecture, from a run's config.yaml or an HF
    directory's config.json alone (no tokenizer, no weights needed)."""
    if cfg.learner.distill == "none":
        return None
    path = cfg.learner.teacher
    where = Path(path).expanduser()
    if not where.is_dir():
        raise _refuse(path, "no such directory (a run directory or a Hugging Face model directory)")
    if (where / runfiles.CONFIG).is_file():
        from async_rl.state.saved_run import open_run
        try:
            run = open_run(where)
        except FileNotFoundError as e:
            raise _refuse(path, f"not a run with a saved step ({e})") from None
        spec, teacher_tok = TeacherSpec(path, "run", run.cfg.model, run.vocab), run.tok
    elif (where / "config.json").is_file():
        from async_rl.model import hf
        model = hf.model_config_from_hf(where, dataclasses.replace(cfg.model, hf_path=str(where)))
        spec, teacher_tok = TeacherSpec(path, "hf", model, model.vocab_size), None
        if tok is not None:
            if not (where / "tokenizer.json").is_file():
                raise _refuse(path, "no tokenizer.json there (its vocabulary must be checked against the student's)")
            teacher_tok = HFTokenizer(str(where))
    else:
        raise _refuse(path, f"neither a run directory ({runfiles.CONFIG}) nor a Hugging Face model (config.json)")
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, param_dtype=spec.model.dtype))
    if tok is not None and vocabulary(teacher_tok) != vocabulary(tok):
        raise _refuse(path, f"its tokenizer {teacher_tok!r} is not the student's {tok!r}: distillation compares "
                            "the two models' logprobs of the same token ids")
    return spec


class Teacher:
    """The teacher on the learner's mesh: its graphdef, shardings and (loaded once) parameters."""

    def __init__(self, spec: TeacherSpec, mesh, n_tokens: int = 0):
        self.spec, self.mesh = spec, mesh
        abstract = nnx.eval_shape(lambda: Transformer(spec.model, spec.vocab, rngs=nnx.Rngs(0), n_tokens=n_tokens))
        self.graphdef, self.abstract = nnx.split(abstract, nnx.Param)
        self.shardings = sharding.param_shardings(self.abstract, mesh)
        self._params = None
        self._ref: dict | None = None

    def params(self, log=print) -> nnx.State:
        """The parameters, read (and verified) once: a teacher whose weights cannot be read is
        refused (ConfigError, one line); `run.build.choose_start` reads them before the run writes."""
        if self._params is None:
            from async_rl.errors import UsageError
            try:
                self._params = self._load(log)
            except (FileNotFoundError, Damaged, UsageError) as e:  # no step verifies, a file missing or damaged
                raise _refuse(self.spec.path, f"its weights cannot be read ({' '.join(str(e).split())[:300]}); "
                                              "nothing was changed") from None
        return self._params

    def _load(self, log) -> nnx.State:
        spec = self.spec
        if spec.kind == "hf":
            from async_rl.model import hf
            params = hf.load_params(spec.path, self.abstract, self.shardings)
            if self._ref is None:  # read here, at the start, not inside the first save
                self._ref = self._hf_reference()
        else:
            from async_rl.state.saved_run import open_run, read_params, step_digest
            run = open_run(spec.path)
            step, host = read_params(run, spec.step, warn=log)  # a resume's pinned step, else the newest
            self.spec = spec = dataclasses.replace(spec, step=step)
            if self._ref is None:
                self._ref = {"kind": "run", "path": spec.path, "step": step, "digest": step_digest(run, step)}
            params = jax.tree.map(lambda x, a, s: jax.device_put(x.astype(a.dtype), s), host, self.abstract,
                                  self.shardings)
        log(f"teacher: {spec.describe()}")
        return params

    def reference(self, log=print) -> dict:
        """What a checkpoint records of the teacher its steps were trained with (read with the
        teacher's parameters, which a save before the first step reads first)."""
        if self._ref is None:
            self.params(log)
        return self._ref

    def _hf_reference(self) -> dict:
        from async_rl.model.lora import files_digest
        return {"kind": "hf", "path": self.spec.path, "digest": files_digest(self.spec.path)}

    def pin(self, saved: dict | None, where: str, log=print) -> None:
        """A resume of the checkpoint `where`, which recorded `saved` (its `reference`; None
        before distillation was on): a run teacher is read at the recorded step; a teacher that
        is not the recorded one (another digest, kind, or a step its run no longer holds) is
        refused (ConfigError, one line, nothing read or written). A moved teacher is accepted."""
        if not saved:
            return
        spec, was = self.spec, f"{saved.get('kind')} {saved.get('path')!r}"
        if saved.get("kind") != spec.kind:
            raise self._changed(where, f"{was}, a{'n' if spec.kind == 'hf' else ''} {spec.kind} directory now")
        from async_rl.state.saved_run import open_run, step_digest
        was += f" step {saved['step']}" if spec.kind == "run" else ""
        try:
            now = (self._hf_reference() if spec.kind == "hf" else
                   {"kind": "run", "path": spec.path, "step": int(saved["step"]),
                    "digest": step_digest(open_run(spec.path), int(saved["step"]))})
        except (OSError, Damaged) as e:  # gone, unreadable or damaged since
            raise self._changed(where, f"{was}, which {spec.path!r} no longer holds whole "
                                       f"({' '.join(str(e).split())[:160]})") from None
        if now["digest"] != saved.get("digest"):
            raise self._changed(where, f"{was} (digest {saved.get('digest')}); this teacher's digest is {now['digest']}")
        if spec.kind == "run":
            self.spec = dataclasses.replace(spec, step=now["step"])
        self._ref = now
        if saved.get("path") != spec.path:
            log(f"teacher: {spec.path} holds the teacher {where} was trained with, at {saved.get('path')} then")

    def _changed(self, where: str, what: str) -> ConfigError:
        return _refuse(self.spec.path, f"the checkpoint in {where} was trained with the teacher {what}; a resume "
                                       "recomputes its samples' teacher logprobs, so restore that teacher or use a new "
                                       "run.dir (nothing was changed)")
