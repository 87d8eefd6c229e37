"""A model's own jinja chat template, compiled and rendered within bounds.

Owns: compiling a `chat_template` in jinja's immutable sandbox (with the options
transformers renders it with) and rendering it bounded in time (`RENDER_TIMEOUT_S` per
compile or prompt) and in output size (`RENDER_MAX_CHARS` characters per prompt), where a
signal can stop it during start-up (`stoppable`); every failure of the template is one
ConfigError naming the file it came from. Does not own: which text is rendered and how it
is encoded (`tokenizer`), or acting on a signal (`signals`, `train`).

The sandbox bounds nothing by itself: a loop over `range(100000)` inside another runs for
hours, and a `'x' * 10**10` allocates 10 GB in one C call. Time: a watchdog thread (one per
process, asleep while nothing renders) raises an exception inside a render that has run past
its deadline, or inside one of a `stoppable` scope once its stop predicate holds
(`PyThreadState_SetAsyncExc`: delivered at the rendering thread's next bytecode, and
every template runs as Python bytecode). Size: the rendered pieces are counted as they are
generated; `*` and `**`, and any call or filter given an integer argument above the bound
(`'x'.ljust(n)`, `center(n)`), are refused before they run. Not bounded: one C call on
inputs each within the bound (`replace` of every character of a long string by another long
one) still allocates what it makes before its result is counted.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from async_rl.config import ConfigError
from async_rl.signals import Stopped

RENDER_TIMEOUT_S = 5.0  # one compile or one prompt's render; a chat template takes well under a millisecond
RENDER_MAX_CHARS = 1 << 20  # characters of one rendered prompt (far more than a prompt's tokens need)
_POLL_S = 0.02  # how often the watchdog looks at the renders in progress, seconds


class _Interrupt(BaseException):
    """Raised inside a render by the watchdog; a BaseException, so no `except Exception` in
    jinja's code or the template's calls swallows it."""


class _TooLarge(Exception):
    pass


class _Watch:
    __slots__ = ("tid", "deadline", "stop", "why")

    def __init__(self, tid: int, deadline: float, stop: Callable[[], bool] | None):
        self.tid, self.deadline, self.stop = tid, deadline, stop
        self.why: str | None = None  # "time" or "signal" once the watchdog has interrupted it


def _raise_in(tid: int, exc) -> None:
    """Schedules `exc` in thread `tid` (None withdraws one scheduled and not yet raised)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(exc) if exc else None)


class _Watchdog:
    def __init__(self):
        self._lock = threading.Lock()
        self._active: dict[int, _Watch] = {}  # rendering thread -> its render
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def enter(self, w: _Watch) -> None:
        with self._lock:
            self._active[w.tid] = w
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="chat-template-watchdog", daemon=True)
                self._thread.start()
        self._wake.set()

    def leave(self, w: _Watch) -> None:
        """Idempotent; after it, nothing is raised in the thread for this render."""
        with self._lock:
            if self._active.get(w.tid) is w:
                del self._active[w.tid]
            if w.why is not None:
                _raise_in(w.tid, None)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                time.sleep(_POLL_S)
                with self._lock:
                    if not self._active:
                        break
                    now = time.monotonic()
                    for w in self._active.values():
                        if w.why is None and now > w.deadline:
                            w.why = "time"
                        elif w.why is None and w.stop is not None and w.stop():
                            w.why = "signal"
                        else:
                            continue
                        _raise_in(w.tid, _Interrupt)


_watchdog = _Watchdog()
_scope = threading.local()


@contextmanager
def stoppable(should_stop: Callable[[], bool]):
    """Renders in this thread, inside the block, end with `signals.Stopped` once
    `should_stop()` holds (checked before each render and every _POLL_S during one)."""
    old = getattr(_scope, "stop", None)
    _scope.stop = should_stop
    try:
        yield
    finally:
        _scope.stop = old


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def _check_ints(args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        if type(a) is int and abs(a) > RENDER_MAX_CHARS:
            raise _TooLarge(f"an argument of {a}")


def _bounded_filter(f):
    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
    def filt(*args, **kwargs):
        _check_ints(args, kwargs)
        return f(*args, **kwargs)
    return filt


def _environment():
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if type(n) is int and hasattr(seq, "__len__") and abs(n) * len(seq) > RENDER_MAX_CHARS:
                        raise _TooLarge(f"'*' of {len(seq)} items by {n}")
            elif type(left) is int and type(right) is int and right * max(abs(left).bit_length() - 1, 0) > 1 << 16:
                raise _TooLarge(f"'**' of {left} by {right}")
            return super().call_binop(context, operator, left, right)

        def call(self, context, obj, *args, **kwargs):
            _check_ints(args, kwargs)
            return super().call(context, obj, *args, **kwargs)

    def raise_exception(msg):
        raise TemplateError(msg)

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    env.filters = {k: _bounded_filter(f) for k, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    return env


class ChatTemplate:
    """`template(text)`: the prompt text as the model's chat format (one user message and the
    assistant's turn to follow). `where` names the file the source came from, in errors."""

    def __init__(self, source: str, where: Path, specials: dict[str, str]):
        self.where, self._specials = where, specials
        env = _environment()
        self._template = self._bounded(lambda: env.from_string(source), "does not compile")

    def __call__(self, text: str) -> str:
        return self._bounded(lambda: self._render(text), "failed to render a prompt")

    def messages(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """A conversation in the model's chat format (a multi-turn episode's observations)."""
        return self._bounded(lambda: self._render_messages(messages, add_generation_prompt),
                             "failed to render an episode's messages")

    def _render(self, text: str) -> str:
        return self._render_messages([{"role": "user", "content": text}], True)

    def _render_messages(self, messages: list[dict], add_generation_prompt: bool) -> str:
        out, n = [], 0
        for piece in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                             **self._specials):
            n += len(piece)
            if n > RENDER_MAX_CHARS:
                raise _TooLarge("its output")
            out.append(piece)
        return "".join(out)

    def _bounded(self, fn, what: str):
        stop = getattr(_scope, "stop", None)
        if stop is not None and stop():
            raise Stopped("a signal stopped start-up")
        w = _Watch(threading.get_ident(), time.monotonic() + RENDER_TIMEOUT_S, stop)
        try:
            try:
                _watchdog.enter(w)
                return fn()
            finally:
                _watchdog.leave(w)
        except _Interrupt:
            _watchdog.leave(w)  # in case it was raised inside leave() itself
            if w.why == "signal":
                raise Stopped("a signal stopped start-up") from None
            raise ConfigError(f"{self.where}: chat_template {what}: still running after {RENDER_TIMEOUT_S:g} s "
                              "(a loop that does not end?)") from None
        except _TooLarge as e:
            raise ConfigError(f"{self.where}: chat_template {what}: {e} would be more than the "
                              f"{RENDER_MAX_CHARS} characters a prompt may render to") from None
        except Exception as e:  # noqa: BLE001 - whatever a template raises is the template's fault
            raise ConfigError(f"{self.where}: chat_template {what} ({_one_line(e)})") from None
