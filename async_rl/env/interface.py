"""Environments of multi-turn episodes: the interface users write, and running their steps.

Owns: loading `rollout.env` (a built-in name or `module:factory`) into an env object, the
step key (`StepKey`: run, prompt id, epoch, sample, turn, and its stable string), checking what
a step returns (`StepResult`), and `EnvRunner`, which runs steps off the caller's thread, many at
once, each under a timeout, with results collected by polling. Does not own: parsing tool calls
(`tool_calls`), the built-in envs (`tool_tasks`, `mcp`), or keeping an episode's state
across kills (the trainer's ledger, checkpoint and journal; see docs/envs-and-tools.md).

An env object has `max_turns` (assistant turns per episode) and
`step(key, messages, state) -> {"observation", "done", "state", "reward", "role"}`, a plain
function or a coroutine function. Plain steps run on a pool of daemon threads; coroutine steps
on one event-loop thread. Nothing a step does can block the caller: `poll()` never waits, a step
past its timeout is reported as failed (its thread, if stuck, is left behind), and `close()`
waits a bounded time.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import math
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from async_rl.config import ConfigError
from async_rl.data.rewards import as_real
from async_rl.env.guards import StateLimits, state_depth
from async_rl.errors import RunFailure
from async_rl.usercode import load_callable

ROLES = ("tool", "user")
_RESULT_KEYS = frozenset({"observation", "done", "state", "reward", "role"})


class EnvError(RunFailure):
    """An env step that raised, ran past its timeout or returned a bad result: one line naming
    the prompt, the turn and the key. The trainer raises it on its main loop, failing the run."""


@dataclass(frozen=True)
class StepKey:
    """Names one env step; the same step asked again after a kill gets an equal key."""
    run: str  # the run's identity (its directory's lineage id)
    prompt_id: int
    epoch: int
    sample: int  # index of the sample within its prompt's group
    turn: int  # 0-based: the step after the episode's (turn + 1)-th assistant reply

    def __str__(self) -> str:
        return f"{self.run}/{self.prompt_id}/{self.epoch}/{self.sample}/{self.turn}"

    @classmethod
    def parse(cls, text: str) -> "StepKey":
        """The key whose `str` is `text` (the run part may itself hold '/')."""
        parts = text.rsplit("/", 4)
        try:
            if len(parts) != 5 or not parts[0]:
                raise ValueError
            return cls(parts[0], *(int(p) for p in parts[1:]))
        except ValueError:
            raise ValueError(f"not an env step key: {text!r} (want run/prompt_id/epoch/sample/turn)") from None

    def where(self) -> str:
        return f"prompt_id={self.prompt_id} sample={self.sample} turn={self.turn} (key {self})"


@dataclass(frozen=True)
class StepResult:
    observation: Optional[str]  # text fed back to the policy; None only when done
    done: bool
    state: dict  # JSON-serialisable, given back to the episode's next step exactly
    reward: Optional[float] = None  # a final reward from the env wins over rollout.reward
    role: str = "tool"  # the observation's chat role: tool | user

    @classmethod
    def check(cls, raw: Any, key: StepKey, limits: StateLimits = StateLimits()) -> "StepResult":
        """`raw` (what env.step returned) as a StepResult, or an EnvError saying what is wrong."""
        def bad(why: str) -> EnvError:
            return EnvError(_one_line(f"env step returned {why} on {key.where()}"))

        if inspect.isawaitable(raw):
            if inspect.iscoroutine(raw):
                raw.close()  # never awaited: close it so Python does not warn about it
            raise bad("an awaitable from a plain function (declare step with `async def`)")
        if not isinstance(raw, dict):
            raise bad(f"a {type(raw).__name__}, not a dict")
        extra = sorted(map(str, set(raw) - _RESULT_KEYS))
        if extra:
            raise bad(f"unknown key(s) {', '.join(extra)} (keys: {', '.join(sorted(_RESULT_KEYS))})")
        missing = [k for k in ("observation", "done", "state") if k not in raw]
        if missing:
            raise bad(f"no {', '.join(missing)}")
        obs, done, state = raw["observation"], raw["done"], raw["state"]
        if obs is not None and not isinstance(obs, str):
            raise bad(f"observation of type {type(obs).__name__} (must be str or None)")
        if not isinstance(done, bool):
            raise bad(f"done={done!r} (must be a bool)")
        if obs is None and not done:
            raise bad("observation None while not done (an episode goes on only with an observation)")
        if not isinstance(state, dict):
            raise bad(f"state of type {type(state).__name__} (must be a dict)")
        depth = state_depth(state, limits.max_depth)
        if depth > limits.max_depth:
            raise bad(f"a state nested more than {limits.max_depth} levels deep "
                      f"(limit rollout.env_state_max_depth={limits.max_depth}; keep the state flat or raise the limit)")
        try:
            # the state is saved and restored as JSON: it must come back equal, or a resumed
            # episode would continue with another state than the one it had
            text = json.dumps(state, allow_nan=False)
            same = json.loads(text) == state
        except (TypeError, ValueError) as e:
            raise bad(f"a state that is not JSON ({e})") from None
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limits.max_bytes:
            raise bad(f"a state of {size} bytes as JSON (limit rollout.env_state_max_bytes={limits.max_bytes}; "
                      "keep large data out of the state or raise the limit)")
        if not same:
            raise bad("a state that does not survive a JSON round trip unchanged (tuples, non-str keys?)")
        reward = raw.get("reward")
        if reward is not None:
            r = as_real(reward)
            if r is None or not math.isfinite(r):
                raise bad(f"reward={reward!r} (must be a finite real number or None)")
            reward = float(r)
        role = raw.get("role", "tool")
        if role not in ROLES:
            raise bad(f"role={role!r} (must be one of {', '.join(ROLES)})")
        return cls(obs, done, state, reward, role)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _raiser(e: BaseException):
    def call():
        raise e
    return call


# --- loading rollout.env ------------------------------------------------------------------

def _builtin(name: str, cfg):
    if cfg is None:
        raise ConfigError(f"rollout.env={name!r}: a built-in env needs the run's config")
    if name == "lookup":
        from async_rl.data.tool_tasks import LookupEnv
        return LookupEnv(seed=cfg.data.seed, max_turns=cfg.rollout.env_max_turns)
    if name == "recall":
        from async_rl.data.tool_tasks import RecallEnv
        return RecallEnv(seed=cfg.data.seed, max_turns=cfg.rollout.env_max_turns)
    from async_rl.env.mcp import MCPEnv
    env = MCPEnv(cfg.rollout.mcp_server, max_turns=cfg.rollout.env_max_turns)
    env.check(cfg.rollout.env_timeout_s)  # a server that cannot be reached is refused now, not at a first call
    return env


BUILTIN_ENVS = ("lookup", "recall", "mcp")


def load_env(spec: str, cfg=None):
    """The env object `rollout.env=spec` names, or None for "" (single-turn episodes).
    A built-in name is built from `cfg` (the run's Config); `module:factory` is called with no
    arguments. Every way it can be wrong is one ConfigError naming the spec."""
    if not spec:
        return None
    what = f"rollout.env={spec!r}"
    if spec in BUILTIN_ENVS:
        env = _builtin(spec, cfg)
    else:
        mod_name, sep, attr = spec.partition(":")
        if not sep or not mod_name or not attr:
            raise ConfigError(f"{what}: want a built-in env ({', '.join(BUILTIN_ENVS)}) or module:factory")
        factory = load_callable(what, spec)
        try:
            env = factory()
        except Exception as e:
            raise ConfigError(f"{what}: the factory raised {type(e).__name__}: {_one_line(e)}") from None
    turns = getattr(env, "max_turns", None)
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ConfigError(f"{what}: the env object ({type(env).__name__}) needs max_turns, an int >= 1 "
                          f"(has {turns!r})")
    if not callable(getattr(env, "step", None)):
        raise ConfigError(f"{what}: the env object ({type(env).__name__}) has no callable step(key, messages, state)")
    return env


def use_env_tools(tok, env) -> None:
    """Gives the tokenizer the env's tools (an MCP env's as its server listed them at start-up)."""
    if env is not None and hasattr(tok, "use_tools"):
        tok.use_tools(getattr(env, "tools", None))


# --- running steps --------------------------------------------------------------------------

@dataclass(eq=False)
class StepHandle:
    """One submitted step; `poll` hands it back with its result."""
    key: StepKey
    seq: int
    started: Optional[float] = field(default=None, repr=False)  # monotonic time it began running
    finished: bool = field(default=False, repr=False)
    future: Any = field(default=None, repr=False)  # the loop's future (coroutine steps)


class EnvRunner:
    """Runs `env.step` calls off the caller's thread, at most `max_concurrent` at once, each
    bounded by `timeout_s` from the moment it starts running. `submit` returns at once; `poll`
    returns the steps finished since the last poll, each with its StepResult or its EnvError."""

    def __init__(self, env, *, max_concurrent: int, timeout_s: float, name: str = "env", on_done=None,
                 limits: StateLimits = StateLimits(), keep_traceback=None):
        if max_concurrent < 1 or not timeout_s > 0:
            raise ValueError(f"max_concurrent={max_concurrent} must be >= 1 and timeout_s={timeout_s} > 0")
        self.env, self.max_concurrent, self.timeout_s, self.name = env, max_concurrent, timeout_s, name
        self.on_done = on_done  # called (no arguments, outside the runner's lock) when a step finishes
        self.limits = limits
        # keep_traceback(key, text) -> where it was written (named in the step's one-line error)
        self.keep_traceback = keep_traceback
        self.is_async = inspect.iscoroutinefunction(env.step)
        self._lock = threading.Lock()
        self._done: list[tuple[StepHandle, StepResult | EnvError]] = []
        self._running: dict[int, StepHandle] = {}  # seq -> handle, submitted and not finished
        self._seq = itertools.count()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        if self.is_async:
            ready = threading.Event()
            t = threading.Thread(target=self._run_loop, args=(ready,), name=f"{name}-loop", daemon=True)
            t.start()
            self._threads.append(t)
            if not ready.wait(30):
                raise RuntimeError("the env's event loop thread did not start within 30 s")

    @property
    def in_flight(self) -> int:
        """Steps submitted and not yet handed back by `poll`."""
        with self._lock:
            return len(self._running) + len(self._done)

    def submit(self, key: StepKey, messages: list[dict], state: dict) -> StepHandle:
        """Starts (or queues) one step; the messages and state are copied, so the caller may
        change its own afterwards."""
        if self._closed:
            raise RuntimeError("EnvRunner.submit after close")
        messages = [dict(m) for m in messages]
        state = json.loads(json.dumps(state))
        with self._lock:
            h = StepHandle(key, next(self._seq))
            self._running[h.seq] = h
        if self.is_async:
            h.future = asyncio.run_coroutine_threadsafe(self._run_async(h, messages, state), self._loop)
        else:
            self._jobs.put((h, messages, state))
            if len(self._threads) < self.max_concurrent:  # workers start as steps need them
                t = threading.Thread(target=self._worker, name=f"{self.name}-{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)
        return h

    def poll(self) -> list[tuple[StepHandle, StepResult | EnvError]]:
        """Steps finished since the last call, and steps past their timeout (as EnvErrors), in
        the order they finished. Never waits."""
        now = time.monotonic()
        with self._lock:
            for h in list(self._running.values()):
                if h.started is not None and now - h.started > self.timeout_s:
                    self._finish_locked(h, EnvError(
                        f"env step did not return within rollout.env_timeout_s={self.timeout_s:g} s on {h.key.where()}"))
                    if h.future is not None:
                        h.future.cancel()
            out, self._done = self._done, []
        return out

    def close(self, timeout_s: float = 5.0) -> list[str]:
        """Stops the workers and the loop, waiting at most `timeout_s` in all; returns the names
        of threads left running (inside a step that does not return)."""
        self._closed = True
        end = time.monotonic() + timeout_s
        for _ in self._threads:
            self._jobs.put(None)
        if self._loop is not None and self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(max(0.0, end - time.monotonic()))
            except Exception:  # noqa: BLE001 - a closing env failing or hanging must not stop the close
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
        left = []
        for t in self._threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
            if t.is_alive():
                left.append(t.name)
        return left

    # ---- on the runner's threads ------------------------------------------------------------

    def _finish(self, h: StepHandle, result) -> None:
        with self._lock:
            self._finish_locked(h, result)
        if self.on_done is not None:
            self.on_done()

    def _finish_locked(self, h: StepHandle, result) -> None:
        if h.finished:  # timed out already: a late result is dropped
            return
        h.finished = True
        self._running.pop(h.seq, None)
        self._done.append((h, result))

    def _outcome(self, h: StepHandle, call):
        """The step's StepResult or EnvError; never raises (a result that breaks the checks
        themselves must still reach the caller as this step's failure, not kill a thread)."""
        try:
            raw = call()
        except Exception as e:
            return EnvError(_one_line(f"env step raised {type(e).__name__}: {e} on {h.key.where()}")
                            + self._traceback_note(h.key, e))
        try:
            return StepResult.check(raw, h.key, self.limits)
        except EnvError as e:
            return e
        except Exception as e:  # noqa: BLE001 - e.g. RecursionError from a state the limits did not foresee
            return EnvError(_one_line(f"env step returned a result that could not be checked "
                                      f"({type(e).__name__}: {e}) on {h.key.where()}"))

    def _traceback_note(self, key: StepKey, e: BaseException) -> str:
        if self.keep_traceback is None:
            return ""
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        try:
            return f"; traceback in {self.keep_traceback(key, text)}"
        except Exception as w:  # noqa: BLE001 - the step's own error is what the line is about
            return _one_line(f"; traceback not kept ({type(w).__name__}: {w})")

    def _worker(self) -> None:
        while (job := self._jobs.get()) is not None:
            h, messages, state = job
            h.started = time.monotonic()
            try:
                out = self._outcome(h, lambda: self.env.step(h.key, messages, state))
            except BaseException as e:  # noqa: BLE001 - the caller must hear of it, not time out
                out = EnvError(_one_line(f"env step failed ({type(e).__name__}: {e}) on {h.key.where()}"))
            self._finish(h, out)

    def _run_loop(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._slots = asyncio.Semaphore(self.max_concurrent)
        self._loop.call_soon(ready.set)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _run_async(self, h: StepHandle, messages, state) -> None:
        async with self._slots:
            h.started = time.monotonic()
            try:
                raw = await asyncio.wait_for(self.env.step(h.key, messages, state), self.timeout_s)
            except Exception as e:
                if isinstance(e, TimeoutError) and time.monotonic() - h.started >= self.timeout_s:
                    return  # wait_for's own timeout: poll reports it, as it does a plain step's
                self._finish(h, self._outcome(h, _raiser(e)))
                return
        self._finish(h, self._outcome(h, lambda: raw))

    async def _shutdown(self) -> None:
        close = getattr(self.env, "aclose", None)
        if close is not None:
            await close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
