"""Held-out evaluation: score the current policy on prompts the run never trains on.

Owns: the eval set (a prompt file given by `eval.path`, or for synthetic tasks prompt ids
disjoint from the training ids, leaving out any prompt whose text a training record has),
generating completions with given weights on an engine of its own (greedy for pass@1,
sampled at `engine.temperature` for pass@k), scoring them with the run's reward, and the
`async-rl eval RUN_DIR` command. Does not own: the training stream (eval prompts never enter
the ledger, the lineage or the pump's engine, so exactly-once accounting is untouched),
when to evaluate (train), or writing metrics (metrics).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from async_rl import config as C
from async_rl.data import dataset as data_mod
from async_rl.data import rewards
from async_rl.data.tokenizer import completion_text
from async_rl.rollout import backends
from async_rl.rollout.decoding import generate_all
from async_rl.rollout.engine import Engine

# Synthetic eval prompt ids start here: far above any training id (0 .. num_records-1).
SYNTHETIC_EVAL_BASE = 1 << 40
EVAL_ORDINAL_BASE = 1 << 30  # the engine's int32 sampling-key ordinals of eval prompts


@dataclass
class EvalSet:
    prompt_ids: list[int]
    prompts: list[np.ndarray]  # encoded prompt tokens
    answers: list[str]
    source: str  # for messages: "held-out synthetic:reverse" or the file
    texts: list[str] = dataclasses.field(default_factory=list)  # the prompts' text (an env reads it)


def build_eval_set(cfg: C.Config, tok) -> EvalSet:
    e, d = cfg.eval, cfg.data
    if e.path:
        file_cfg = C.replace(cfg, data={"source": "parquet" if e.path.endswith(".parquet") else "jsonl",
                                        "path": e.path, "num_records": 0})
        records, _, _ = data_mod.load_prompt_file(file_cfg, tok)
        records = records[:e.num_records or None]  # at most eval.num_records, in file order
        source = e.path
    else:
        if d.source != "synthetic":
            raise C.ConfigError(f"eval.every_steps={e.every_steps}: eval.path is required for data.source={d.source}")
        train_prompts = {data_mod.synthetic_record(d.task, d.seed, i, d.min_digits, d.max_digits)["prompt"]
                         for i in range(d.num_records)}
        records, pid = [], SYNTHETIC_EVAL_BASE
        while len(records) < e.num_records and pid < SYNTHETIC_EVAL_BASE + 100 * e.num_records:
            rec = data_mod.synthetic_record(d.task, d.seed, pid, d.min_digits, d.max_digits)
            if rec["prompt"] not in train_prompts:  # held out in content, not only in id
                records.append(rec)
            pid += 1
        source = f"held-out synthetic:{d.task}"
    return EvalSet(prompt_ids=[int(r["prompt_id"]) for r in records],
                   prompts=[tok.encode_prompt(r["prompt"]) for r in records],
                   answers=[str(r["answer"]) for r in records], source=source,
                   texts=[str(r["prompt"]) for r in records])


class Evaluator:
    """Scores weights on the eval set: on a view of the run's vLLM engine (`rollout`: the same
    weights and KV cache as training rollouts, no second copy), on a vLLM engine of its own
    (`engine.backend=vllm` without one: `async-rl eval`), or on a built-in engine of its own
    (same devices as generation)."""

    def __init__(self, cfg: C.Config, graphdef, vocab_size: int, tok, reward_fn, devices=None, rollout=None,
                 eval_set: EvalSet | None = None, episodes=None):
        """`eval_set`: the held-out prompts, when already built (train builds them before it writes).
        `episodes`: (rollout.episode.Episodes, the env object) to score multi-turn episodes."""
        self.cfg, self.tok, self.reward_fn, self.episodes = cfg, tok, reward_fn, episodes
        self.set = eval_set if eval_set is not None else build_eval_set(cfg, tok)
        self.k = cfg.eval.samples_per_prompt
        greedy = self.k == 1
        slots = min(cfg.engine.max_concurrent_decodes, max(1, len(self.set.prompts) * self.k))
        e = cfg.engine
        sampling = dict(temperature=0.0, top_k=0, top_p=1.0) if greedy else dict(
            temperature=e.temperature, top_k=e.top_k, top_p=e.top_p)
        self._stops = tuple(getattr(tok, "stop_ids", (tok.eos_id,)))
        self.on_run_engine = rollout is not None  # scores what that engine runs (the caller loads it)
        if rollout is not None:
            self.backend = rollout.view(slots, **sampling)
        else:
            self.backend = backends.for_eval(cfg, graphdef, vocab_size, self._stops, tok.vocab_size, slots=slots,
                                             sampling=sampling, devices=devices)

    def describe(self) -> str:
        how = "greedy, pass@1" if self.k == 1 else f"{self.k} samples at T={self.cfg.engine.temperature}, pass@{self.k}"
        where = ("; on the run's vLLM engine" if self.on_run_engine
                 else "; on vLLM" if not isinstance(self.backend, Engine) else "")
        return f"{len(self.set.prompts)} prompts ({self.set.source}; {how}{where})"

    def __call__(self, params, step: int = 0) -> dict[str, float]:
        """`eval/*` metrics of `params` (any layout: they are put on the engine's devices);
        `step` names the env steps of multi-turn episodes (their keys' epoch)."""
        if not self.set.prompts:
            return {}
        return self.summarise(*self.score(params, step))

    def score(self, params, step: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(reward, completion tokens) of every sample, each [prompts, samples]."""
        # sampling keys come from (seed, ordinal, sample, position): give eval prompts ordinals of
        # their own, far from the training stream's
        ordinals = [EVAL_ORDINAL_BASE + i for i in range(len(self.set.prompts))]
        if isinstance(self.backend, Engine):
            params = self.backend.load_params(params)
        elif not self.on_run_engine:
            self.backend.swap(params, 0)
        if self.episodes is not None:
            return self._score_episodes(params, ordinals, step)
        comps = generate_all(self.backend, params, self.set.prompts, samples=self.k, eos_id=self._stops,
                             ordinals=ordinals, max_new_tokens=self.cfg.rollout.max_new_tokens)
        scores = np.array([[self._score(c.tokens, ans) for c in per] for per, ans in zip(comps, self.set.answers)])
        return scores, np.array([[len(c.tokens) for c in per] for per in comps])

    def _score_episodes(self, params, ordinals, step: int) -> tuple[np.ndarray, np.ndarray]:
        from async_rl.env.guards import state_limits
        from async_rl.env.interface import EnvRunner
        from async_rl.rollout.decoding import rollout_for
        from async_rl.rollout.episode import EpisodeRequests
        eps, env = self.episodes
        r = self.cfg.rollout
        runner = EnvRunner(env, max_concurrent=r.env_max_concurrent, timeout_s=r.env_timeout_s, name="eval-env",
                           limits=state_limits(r))
        try:
            out = EpisodeRequests(self.set.prompts, self.set.texts, self.set.prompt_ids, samples=self.k,
                                  ordinals=ordinals, episodes=eps, runner=runner,
                                  epoch=step).run(rollout_for(self.backend, params), self._stops)
        finally:
            runner.close()
        scores = np.array([[s.env_reward if s.env_reward is not None else
                            float(self.reward_fn(eps.final_reply(s), ans)) for s in per]
                           for per, ans in zip(out, self.set.answers)])
        return scores, np.array([[len(s.tokens) for s in per] for per in out])

    def summarise(self, scores: np.ndarray, n_tokens: np.ndarray) -> dict[str, float]:
        """`eval/*` metrics of some prompts' rows of `score`'s result."""
        correct = scores >= self.cfg.eval.correct_threshold
        out = {"eval/reward_mean": float(scores.mean()), "eval/accuracy": float(correct.mean()),
               "eval/completion_tokens": float(n_tokens.mean())}
        if self.k > 1:
            out[f"eval/pass@{self.k}"] = float(correct.any(axis=1).mean())
        return out

    def _score(self, tokens: np.ndarray, answer: str) -> float:
        return float(self.reward_fn(completion_text(self.tok, tokens.tolist()), answer))


def make_evaluator(cfg: C.Config, graphdef, vocab_size: int, tok, devices=None, rollout=None,
                   eval_set: EvalSet | None = None, run_dir=None, env=None, read_only: bool = False
                   ) -> Evaluator | None:
    """`env` (or, when None, `rollout.env` loaded here) with `run_dir`, whose identity names the
    env steps: evaluation runs multi-turn episodes."""
    if not cfg.eval.every_steps:
        return None
    _, reward_fn = rewards.reward_for_config(cfg, held_out=True)
    episodes = None
    if cfg.rollout.env:
        from async_rl.env.interface import load_env, use_env_tools
        from async_rl.rollout.episode import Episodes
        from async_rl.store import rundir
        env = env if env is not None else load_env(cfg.rollout.env, cfg)
        use_env_tools(tok, env)
        episodes = (Episodes.of(cfg.rollout, run=f"{rundir.run_identity(run_dir, create=not read_only)}/eval",
                                tokenizer=tok, max_turns=env.max_turns), env)
    return Evaluator(cfg, graphdef, vocab_size, tok, reward_fn, devices=devices, rollout=rollout, eval_set=eval_set,
                     episodes=episodes)


def eval_slots(cfg: C.Config) -> int:
    """Slots an evaluator needs at most (room kept for it in a shared vLLM engine)."""
    return cfg.engine.max_concurrent_decodes if cfg.eval.every_steps else 0


def eval_run(run_dir: str | Path, step: int | None = None, overrides: list[str] = (),
             warn=print, trust_code: bool = False) -> tuple[int, dict, str]:
    """`async-rl eval`: (step, metrics, description) of a saved step of a run (by default the
    newest that verifies), read-only. Multi-turn episodes' env-step keys name that step."""
    step, ev, params = open_eval(run_dir, step, overrides, warn, trust_code=trust_code)
    return step, ev(params, step), ev.describe()


def open_eval(run_dir: str | Path, step: int | None = None, overrides: list[str] = (),
              warn=print, trust_code: bool = False) -> tuple[int, Evaluator, object]:
    """(step, evaluator, parameters) of a saved step of a run, as `eval_run` scores it. The run's
    own env, reward or MCP server command is code: run only with `trust_code` or named in `overrides`."""
    from flax import nnx

    from async_rl.model.transformer import Transformer
    from async_rl.state.saved_run import open_run, read_params, refuse_foreign_code
    run = open_run(run_dir)
    refuse_foreign_code(run, overrides, trust_code)
    cfg, tok, vocab = C.with_overrides(run.cfg, overrides), run.tok, run.vocab
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, every_steps=cfg.eval.every_steps or 1))
    backends.prepare(cfg)  # before JAX takes a device
    step, params = read_params(dataclasses.replace(run, cfg=cfg), step, warn=warn)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, vocab, rngs=nnx.Rngs(0),
                                                              n_tokens=tok.vocab_size)), nnx.Param)[0]
    return step, make_evaluator(cfg, graphdef, vocab, tok, run_dir=run.run_dir, read_only=True), params
