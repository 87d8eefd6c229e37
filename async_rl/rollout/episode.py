"""Multi-turn episodes on the ledger's samples: what the pump asks when a sample is an episode.

Owns: the step key of a sample's next env step, the chat messages an env step reads (the
prompt, then each assistant reply and observation, cut out of the sample's token stream),
turning an observation into the tokens that enter the stream (through the model's chat
template, or as raw text without one), the token budget of the next assistant turn, the
text `rollout.reward` scores (the final reply), and applying a recorded step to a sample.
Does not own: running steps (`interface.EnvRunner`), when steps are submitted or results
taken (the pump), or keeping samples across kills (ledger, checkpoint, journal).

A sample's tokens alternate: assistant tokens (versions >= 0, trained) and observation tokens
(version `ledger.OBSERVATION`, logprob 0, never trained). `Sample.turns[i]` records env step i:
its key, observation, role, and where its tokens sit (`at`, `n`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from async_rl.buffer.ledger import OBSERVATION, Group, Sample
from async_rl.data.rewards import refused
from async_rl.data.tokenizer import completion_text
from async_rl.env.interface import EnvError, StepKey, StepResult
from async_rl.rollout.interface import Start
from async_rl.rollout.scheduler import Fill, Scheduler

# what replaces the end of an observation cut to the caps (the policy reads that it was cut)
CUT_MARK = "\n[observation truncated: {} characters cut]"


@dataclass
class Applied:
    """What recording one env step did to its sample."""
    ended: bool  # the episode is over (the env said done, max_turns, or no tokens left)
    tokens: int  # observation tokens appended
    cut: int = 0  # characters cut from the observation (rollout.max_observation_chars/_tokens)


class Episodes:
    """The episode rules of one run: its env's max_turns, the token budgets, the tokenizer, and
    the caps on one observation (an env's text is cut to them, marked, before it is stored)."""

    def __init__(self, *, run: str, tokenizer, max_turns: int, max_new_tokens: int, turn_max_tokens: int = 0,
                 reward_max_abs: float = 1e6, max_observation_chars: int = 16_384,
                 max_observation_tokens: int = 2048):
        self.run, self.tok, self.max_turns = run, tokenizer, max_turns
        self.reward_max_abs = reward_max_abs  # an env's reward beyond it fails the run before it is recorded
        self.N, self.turn_max = max_new_tokens, turn_max_tokens
        self.max_chars, self.max_tokens = max_observation_chars, max_observation_tokens
        self._chat = getattr(tokenizer, "render_observation", None)  # HF tokenizers (chat format or raw)
        self._stops = frozenset(getattr(tokenizer, "stop_ids", (tokenizer.eos_id,)))
        try:  # a vocabulary without the mark's letters (the char tokenizer) gets the cut alone
            tokenizer.encode(CUT_MARK.format(1))
            self._mark = CUT_MARK
        except Exception:  # noqa: BLE001 - any tokenizer's refusal means the same
            self._mark = ""

    @classmethod
    def of(cls, r, **kw) -> "Episodes":
        """The rules `rollout` config `r` sets, with run, tokenizer and max_turns in `kw`."""
        return cls(max_new_tokens=r.max_new_tokens, turn_max_tokens=r.turn_max_tokens,
                   max_observation_chars=r.max_observation_chars, max_observation_tokens=r.max_observation_tokens,
                   reward_max_abs=r.reward_max_abs, **kw)

    def key(self, g: Group, si: int, s: Sample) -> StepKey:
        return StepKey(self.run, g.prompt_id, g.epoch, si, len(s.turns))

    @staticmethod
    def reply_start(s: Sample) -> int:
        """Index of the current (or last) assistant reply's first token: after the last
        observation fed (the step that ended an episode feeds none)."""
        return max((t["at"] + t["n"] for t in s.turns if t["n"]), default=0)

    def budget(self, s: Sample) -> int:
        """Tokens the sample's next start may generate (its current turn's, within the episode's)."""
        left = self.N - len(s.tokens)
        if self.turn_max:
            left = min(left, self.turn_max - (len(s.tokens) - self.reply_start(s)))
        return left

    def final_reply(self, s: Sample) -> str:
        """What `rollout.reward` scores: the last assistant reply (before its stop token)."""
        return completion_text(self.tok, s.tokens[self.reply_start(s):])

    def messages(self, g: Group, s: Sample) -> list[dict]:
        """The episode so far as chat messages, ending with the assistant reply just finished."""
        out, pos = [{"role": "user", "content": g.prompt}], 0
        # a reply's text begins with the prefix its prompt ended with (a forced call's opening)
        prefix = [getattr(self.tok, "first_reply_prefix", ""), getattr(self.tok, "reply_prefix", "")]
        for i, t in enumerate(s.turns):
            out.append({"role": "assistant",
                        "content": prefix[min(i, 1)] + completion_text(self.tok, s.tokens[pos:t["at"]])})
            if t["n"]:
                out.append({"role": t["role"], "content": t["observation"]})
            pos = t["at"] + t["n"]
        out.append({"role": "assistant",
                    "content": prefix[min(len(s.turns), 1)] + completion_text(self.tok, s.tokens[pos:])})
        return out

    def observation_tokens(self, text: str, role: str, key: StepKey, closed: bool = True) -> list[int]:
        try:
            if self._chat is not None:
                return list(self._chat(text, role, closed))
            return list(self.tok.encode(text))
        except Exception as e:  # noqa: BLE001 - what the env returned cannot be tokenised: its fault, named
            raise EnvError(" ".join(f"env step returned an observation the tokenizer cannot encode "
                                    f"({type(e).__name__}: {e}) on {key.where()}".split())) from None

    def capped(self, raw: str, role: str, key: StepKey, closed: bool, encode: bool) -> tuple[str, list[int], int]:
        """The observation as stored, its tokens (none unless `encode`) and the characters cut:
        text beyond max_observation_chars is cut and marked; then, while its tokens are more
        than max_observation_tokens, the text is shortened in proportion and marked (a few encodes)."""
        def cut(keep: int) -> str:
            return raw if keep >= len(raw) else raw[:keep] + self._mark.format(len(raw) - keep)

        keep = len(raw)
        if keep > self.max_chars:
            keep = max(0, self.max_chars - len(self._mark.format(keep)))
        text = cut(keep)
        if not encode:
            return text, [], len(raw) - keep
        ids = self.observation_tokens(text, role, key, closed)
        for _ in range(8):
            if len(ids) <= self.max_tokens or keep == 0:
                break
            keep = int(keep * self.max_tokens / len(ids) * 0.9)
            text = cut(keep)
            ids = self.observation_tokens(text, role, key, closed)
        return text, ids[:self.max_tokens], len(raw) - keep  # the template's markers past the cap, at worst

    def apply(self, s: Sample, key: StepKey, r: StepResult) -> Applied:
        """Records step `key`'s result on its sample (under the ledger lock): the observation's
        tokens appended (masked) unless the episode ends here. The episode ends when the env
        says so, at max_turns assistant turns, or when no token would be left for a reply (an
        observation's tokens count against rollout.max_new_tokens like a reply's); an
        observation not fed is still recorded, with n = 0. An observation is kept cut to the
        caps (`capped`), and its turn records `cut`, the characters cut."""
        if r.reward is not None and (why := refused(r.reward, self.reward_max_abs)) is not None:
            raise EnvError(" ".join(f"env step returned reward {why} on {key.where()} sample {key.sample}; nothing "
                                    "of it was recorded: fix the env, then run the same command to resume".split()))
        raw = r.observation or ""
        closed = bool(s.tokens) and s.tokens[-1] in self._stops
        obs, ids, cut = self.capped(raw, r.role, key, closed, encode=not r.done)
        ended = r.done or key.turn + 1 >= self.max_turns or len(s.tokens) + len(ids) >= self.N
        if ended:
            ids = []
        turn = {"key": str(key), "observation": obs, "role": r.role, "at": len(s.tokens), "n": len(ids)}
        if cut:
            turn["cut"] = cut
        s.turns.append(turn)
        s.tokens.extend(ids)
        s.logprobs.extend([0.0] * len(ids))
        s.versions.extend([OBSERVATION] * len(ids))
        s.env_state = r.state
        if r.reward is not None:
            s.env_reward = r.reward
        s.awaiting = False
        return Applied(ended, len(ids), cut)


@dataclass(eq=False)
class _Episode:
    """One evaluation episode: what `Episodes` reads of a group, and its one sample."""
    prompt: str
    prompt_id: int
    epoch: int
    prompt_tokens: object
    ordinal: int
    sample: int
    s: Sample


class EpisodeRequests:
    """Evaluation's scheduler source with an env: every (prompt, sample) as a multi-turn episode.
    An ended turn's env step runs on `runner` while other slots generate; its result continues
    the episode in a free slot (the engine prefills what the episode has). `run` returns the
    episodes' samples indexed [prompt][sample]."""

    def __init__(self, prompts, texts, prompt_ids, *, samples: int, ordinals, episodes: Episodes, runner,
                 epoch: int):
        self.eps, self.runner = episodes, runner
        self.rows = [[_Episode(texts[i], int(prompt_ids[i]), epoch, prompts[i], ordinals[i], j, Sample())
                      for j in range(samples)] for i in range(len(prompts))]
        self.waiting = [e for per in self.rows for e in per][::-1]
        self._steps: dict[int, _Episode] = {}

    def fill(self, free: list[int], busy: bool) -> Fill:
        for h, res in self.runner.poll():
            e = self._steps.pop(h.seq)
            if isinstance(res, EnvError):
                raise res
            if self.eps.apply(e.s, h.key, res).ended:
                e.s.done = True
            else:
                self.waiting.append(e)
        starts, occ = [], []
        for slot in free[:len(self.waiting)]:
            e = self.waiting.pop()
            starts.append(Start(slot, e.ordinal, e.sample, e.prompt_tokens, tuple(e.s.tokens), self.eps.budget(e.s)))
            occ.append(e)
        if not starts and not busy and self._steps:
            time.sleep(0.002)  # only env steps are running: wait for one
        return Fill(starts, occ)

    def record(self, pieces, version: int) -> None:
        for p in pieces:
            e = p.occupant
            e.s.tokens += p.tokens
            e.s.logprobs += p.logprobs
            e.s.versions += p.versions
            if p.ended:
                if len(e.s.tokens) >= self.eps.N:
                    e.s.done = True
                else:
                    h = self.runner.submit(self.eps.key(e, e.sample, e.s), self.eps.messages(e, e.s), e.s.env_state)
                    self._steps[h.seq] = e

    def collected(self, calls: int) -> None:
        pass

    def release(self, occupants: list) -> None:
        self.waiting.extend(occupants)  # continued from their recorded tokens

    def run(self, rollout, stops) -> list[list[Sample]]:
        sched = Scheduler(rollout, self, stops)
        sched.run(lambda: not self.waiting and not self._steps and sched.idle)
        return [[e.s for e in per] for per in self.rows]
