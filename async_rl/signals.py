"""SIGTERM/SIGINT from the first instant of a process: stop at the next safe point.

Owns: the handlers and the record of a received signal. The CLI installs them before it
imports anything heavy, so a signal during imports, restore or compilation is kept and
acted on once `train` reaches a safe point (before it changes run.dir: exit 0 saying
nothing was changed; while training: save at the next step boundary, exit 0). A second
signal exits at once; the last committed checkpoint stays intact. Once the command has ended
and the process is on its way out (`release(..., exiting=code)`), a signal changes nothing: the
process exits with the command's code (a second signal: at once, with that code). Does not own:
what a safe point does (train).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

_active: "Signals | None" = None


class Stopped(Exception):
    """A signal stopped start-up inside work that would not reach a safe point soon (a chat
    template's render); raised before anything in run.dir was changed."""


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Signals:
    def __init__(self):
        self.received: str | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self.log = _stderr
        self._old: dict = {}
        self._users = 0

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            self.log(f"{name} again: exiting now; the last committed checkpoint is intact")
            os._exit(128 + signum)
        self.received, self.received_at = name, time.monotonic()
        self.log(f"{name}: stopping at the next safe point (a second signal exits at once)")


def install(log=None) -> Signals:
    """The process's handlers (installed on first use, from the main thread only)."""
    global _active
    if _active is None:
        _active = Signals()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                _active._old[sig] = signal.signal(sig, _active._handle)
    _active._users += 1
    if log is not None:
        _active.log = log
    return _active


def requested() -> bool:
    """Was this process asked to stop (a SIGTERM/SIGINT kept by the installed handlers)?"""
    return _active is not None and _active.received is not None


def requested_for() -> float:
    """Seconds since this process was asked to stop (0 where it was not)."""
    at = _active.received_at if _active is not None else None
    return 0.0 if at is None else time.monotonic() - at


def reassert() -> None:
    """Installs this process's handlers again where a library replaced them behind Python's back
    (a C++ `sigaction`, e.g. a preemption notifier), so a signal is still ours to act on."""
    if _active is not None and threading.current_thread() is threading.main_thread():
        for sig in _active._old:
            signal.signal(sig, _active._handle)


def release(s: Signals, exiting: int | None = None) -> None:
    """Undoes one `install`; the last one restores the previous handlers, or with `exiting` (the
    process exits next, with that code) installs ones that let it exit with that code."""
    global _active
    s._users -= 1
    if s._users > 0 or s is not _active:
        return
    for sig, old in s._old.items():
        signal.signal(sig, old if exiting is None else _Exiting(exiting, s.log))
    if exiting is not None:
        _exiting.extend(s._old)
    _active = None


_exiting: list = []  # signals handled by _Exiting
_left_running: list[str] = []  # threads that did not stop, maybe inside a compile or device call


def left_running(name: str) -> None:
    """Records a thread that did not stop when asked (see `exit_if_left_running`)."""
    _left_running.append(name)


def exit_if_left_running(code: int) -> None:
    """Exits with `code` at once, without finalizing the interpreter, where a thread was left
    running: Python ends such a thread mid-call while it finalizes, and one inside XLA's C++
    (a compile, a device call) then aborts the process ("exception not rethrown") after the
    run ended cleanly. Everything the run writes is closed by then."""
    if _left_running:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def register_exit_hook() -> None:
    """Called by the command line before it imports any library that registers exit hooks, so
    this one runs after all of them (idempotent)."""
    if not _hook_registered:
        atexit.register(_ignore_while_finalizing)
        _hook_registered.append(True)


_hook_registered: list = []


def _ignore_while_finalizing() -> None:
    """Python puts its handlers back to the default while it finalizes: a late signal is ignored instead."""
    for sig in _exiting:
        signal.signal(sig, signal.SIG_IGN)


class _Exiting:
    """A signal while the process exits after its command ended: the work is saved; exit with its code."""

    def __init__(self, code: int, log):
        self.code, self.log, self.seen = code, log, False

    def __call__(self, signum, frame) -> None:
        if self.seen:
            os._exit(self.code)
        self.seen = True
        self.log(f"{signal.Signals(signum).name} while exiting: the run has ended; exiting with code {self.code}")
