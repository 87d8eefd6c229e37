"""SIGTERM/SIGINT from the first instant of a process: stop at the next safe point.

Owns: the handlers and the record of a received signal. The CLI installs them before it
imports anything heavy, so a signal during imports, restore or compilation is kept and
acted on once `train` reaches a safe point (before it changes run.dir: exit 0 saying
nothing was changed; while training: save at the next step boundary, exit 0). A second
signal exits at once; the last committed checkpoint stays intact. Does not own: what a
safe point does (train).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

_active: "Signals | None" = None


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Signals:
    def __init__(self):
        self.received: str | None = None
        self.log = _stderr
        self._old: dict = {}
        self._users = 0

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            self.log(f"{name} again: exiting now; the last committed checkpoint is intact")
            os._exit(128 + signum)
        self.received = name
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


def reassert() -> None:
    """Installs this process's handlers again where a library replaced them behind Python's back
    (a C++ `sigaction`, e.g. a preemption notifier), so a signal is still ours to act on."""
    if _active is not None and threading.current_thread() is threading.main_thread():
        for sig in _active._old:
            signal.signal(sig, _active._handle)


def release(s: Signals) -> None:
    """Undoes one `install`; the last one restores the previous handlers."""
    global _active
    s._users -= 1
    if s._users > 0 or s is not _active:
        return
    for sig, old in s._old.items():
        signal.signal(sig, old)
    _active = None
