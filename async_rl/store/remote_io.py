"""Every call to an object store: bounded in time, named in one line when it fails.

Owns: the bound on how long one storage operation may go without an answer
(`run.storage_timeout_s`): every fsspec call (ours, etils.epath's and Orbax's, on gcsfs and
s3fs) runs under it as a deadline, and the clients' own timeouts and retries are set from it
(s3fs/botocore, gcsfs, google-cloud-storage for the lease, tensorstore for Orbax's arrays);
telling a storage failure (refused, reset, timed out, 5xx after retries, no credentials)
from an answer (not found, exists, denied: those stay the exceptions they are); naming it as
a `StorageError` (path, operation, cause); and giving up at once where waiting is pointless:
a stalled call when the run was asked to stop (SIGTERM), and every call once the run is
ending on a storage failure (`abandon`). Does not own: which calls are made (storage and its
callers), or what a failure stops (train, cli).

See docs/design.md, "Run directories on object storage".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import threading
import time

from async_rl.errors import RunFailure

DEFAULT_TIMEOUT_S = 300.0
STALL_S = 5.0  # a call unanswered this long counts as a stall once the run is asked to stop
_CONN_ERRNOS = {errno.ECONNREFUSED: "connection refused", errno.ECONNRESET: "connection reset",
                errno.ETIMEDOUT: "timed out", errno.EPIPE: "connection broken", errno.EHOSTUNREACH: "host unreachable",
                errno.ENETUNREACH: "network unreachable", errno.ECONNABORTED: "connection aborted"}
_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "UNAUTHENTICATED")  # tensorstore's absl status codes


class StorageError(RunFailure):
    """A storage operation that failed or did not answer: names the path, what was done and why.
    `hint` says what to fix before running the same command again."""

    def __init__(self, path, why: str, what: str = "write", hint: str = ""):
        self.path, self.why, self.what = str(path), why, what
        self.hint = hint or "check the store's endpoint, network and credentials"
        super().__init__(f"{self.path}: {what} failed ({why})")


class _State:
    configured = False
    settings = 0  # how many times the bound was set: a filesystem made under an earlier one is made again
    timeout_s = DEFAULT_TIMEOUT_S
    abandoned: str | None = None  # why every call now fails at once
    failing_since: float | None = None  # the first call to fail unanswered since the store last answered
    last_retry = ""  # the last error a client retried on
    last_failure = ""  # why the last call failed unanswered
    inflight: dict[int, float] = {}
    lock = threading.Lock()


_S = _State()
_local = threading.local()
_USER_ENV = {k for k in os.environ if k.startswith("TENSORSTORE_CURL_")}  # set before this process touched them
_calls = itertools.count()


def configure(timeout_s: float) -> None:
    """Sets the bound for this process's calls (a run's `run.storage_timeout_s`), and the
    clients' settings derived from it for the filesystems made from now on."""
    _S.timeout_s, _S.abandoned, _S.failing_since = float(timeout_s), None, None
    # tensorstore (Orbax's arrays) reads these once, at its first request: without them a
    # stalled request waits for the OS to drop the connection. A value the user set wins.
    per_try = per_request_s(_S.timeout_s)
    for k, v in (("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(max(1, int(per_try)))),
                 ("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")):
        if k not in _USER_ENV:
            os.environ[k] = v
    _apply()
    _S.settings += 1


def settings() -> int:
    """Which setting of the bound is current: the filesystems a caller keeps are made again
    when it changes (their clients read the timeouts when they are made)."""
    return _S.settings


def ensure() -> None:
    """The bound and the clients' settings, before this process's first object-store call."""
    if not _S.configured:
        _apply()


def _apply() -> None:
    per_try = per_request_s(_S.timeout_s)
    _install()  # refuses another fsspec: then nothing counts as configured, and the next call refuses too
    _S.configured = True
    import aiohttp
    import fsspec.config
    conf = fsspec.config.conf
    # s3fs: botocore's timeouts per attempt, few attempts (the deadline bounds the whole call)
    conf.setdefault("s3", {})["config_kwargs"] = {"connect_timeout": min(10.0, per_try), "read_timeout": per_try,
                                                   "retries": {"max_attempts": 2, "mode": "standard"}}
    # gcsfs passes no timeout of its own to aiohttp: without one a stalled request never ends
    conf.setdefault("gs", {}).update(requests_timeout=aiohttp.ClientTimeout(
        total=None, sock_connect=min(10.0, per_try), sock_read=per_try))


def timeout_s() -> float:
    return getattr(_local, "limit", None) or _S.timeout_s


def per_request_s(bound: float | None = None) -> float:
    """One request's own timeout: a third of the bound (this thread's), so a retry or two
    still fit in it."""
    return max(2.0, min(60.0, (bound or timeout_s()) / 3))


def tensorstore_retries() -> dict:
    """tensorstore's retry policy for a kvstore (its default retries 32 times)."""
    return {"max_retries": 3, "initial_delay": "1s", "max_delay": f"{max(1, int(per_request_s()))}s"}


@contextlib.contextmanager
def limit(seconds: float):
    """Calls made by this thread inside the block get at most `seconds` (start-up probes)."""
    old = getattr(_local, "limit", None)
    _local.limit = min(seconds, _S.timeout_s)
    try:
        yield
    finally:
        _local.limit = old


def abandon(why: str) -> None:
    """The run is ending on a storage failure: every call (in flight or new) fails at once."""
    _S.abandoned = _S.abandoned or why


def abandoned() -> bool:
    return _S.abandoned is not None


def stalled() -> bool:
    """A call has gone unanswered for STALL_S, or the last one failed unanswered."""
    return _S.abandoned is not None or _S.failing_since is not None or unanswered_s() >= STALL_S


def unanswered_s() -> float:
    """How long the store has gone without answering: since the oldest call still in flight
    started, or since the first call failed unanswered after its last answer (0: it answers)."""
    now = time.monotonic()
    with _S.lock:
        oldest = min(_S.inflight.values(), default=now)
    return now - min(oldest, _S.failing_since or now)


class GaveUp(Exception):
    """A wait given up (`wait_bounded`); the thread it waited on is left running."""


def wait_bounded(fn, name: str, cap_s: float):
    """Runs `fn` on a thread of its own and returns its result (or raises its exception), for a
    library call that may wait where no code of ours can give it up (Orbax on tensorstore's
    requests, in C++). Gives up (GaveUp naming why) at once on a store the run abandoned,
    within seconds of a stop request while the store stalls, once the store has not answered
    for the bound, and after `cap_s` in any case; the thread is then left running
    (`signals.left_running`: the process exits without waiting for it)."""
    from async_rl import signals
    box: list = []
    done = threading.Event()

    def run():
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box.append((False, e))
        finally:
            done.set()
    threading.Thread(target=run, name=name, daemon=True).start()
    t0 = time.monotonic()
    while not done.wait(0.5):
        waited, why = time.monotonic() - t0, None
        if _S.abandoned and waited >= 1:
            why = f"not waited for: {_S.abandoned}"
        elif waited >= 1 and stalled() and signals.requested():
            why = f"the store did not answer for {unanswered_s():.0f} s, and the run was asked to stop"
        elif unanswered_s() >= _S.timeout_s:
            seen = (_S.last_failure if _S.failing_since else "") or _S.last_retry
            last = f" (last error: {seen})" if seen else ""
            why = f"the store did not answer for {unanswered_s():.0f} s{last}"
        elif waited >= cap_s:
            why = f"not finished after {waited:.0f} s"
        if why:
            signals.left_running(name)
            raise GaveUp(why)
    ok, got = box[0]
    if ok:
        return got
    raise got


def _stop_requested() -> bool:
    from async_rl import signals
    return signals.requested()


def watch_stop(where, log, grace_s: float = 2 * STALL_S) -> threading.Event:
    """The backstop for a stop request while the store stalls. A stalled call of ours is given
    up within STALL_S of the request (`_sync`); a thread waiting inside a library instead (the
    main thread in Orbax's save, on tensorstore's requests in C++, where no code of ours runs)
    is not. Where the run is still running `grace_s` after the request and the store is still
    stalled, the process exits with one line (exit 1): a save would need the store, and the
    last committed step is intact. Set the returned event when the run ends."""
    from async_rl import signals
    done = threading.Event()

    def run():
        while not done.wait(1):
            if signals.requested_for() >= grace_s and stalled():
                log(f"error: {where}: the store did not answer for {signals.requested_for():.0f} s after the run was "
                    "asked to stop; exiting without saving, the last committed checkpoint step is intact: check the "
                    "store's endpoint, network and credentials and run the same command to resume")
                os._exit(1)
    threading.Thread(target=run, name="stop-watch", daemon=True).start()
    return done


# ---- telling failures from answers ------------------------------------------------------


def cause(e: BaseException | None) -> str | None:
    """A short cause where `e` (or what it was raised from) is the store failing to answer,
    or no credentials; None where the store answered (not found, exists, denied) or `e` is
    not about storage."""
    seen = 0
    while e is not None and seen < 10:
        why = _one(e)
        if why:
            return why
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _one(e: BaseException) -> str | None:
    if isinstance(e, StorageError):
        return e.why
    name, mod, msg = type(e).__name__, type(e).__module__, str(e).splitlines()[0][:200] if str(e) else ""
    if mod.startswith("botocore"):
        if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            return f"no credentials: {msg}"
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                    "ProxyConnectionError", "HTTPClientError"):
            return msg
        status = (getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
        if name == "ClientError" and isinstance(status, int) and status >= 500:
            return f"server error {status}: {msg}"
    if mod.startswith("google.auth") and name in ("DefaultCredentialsError", "RefreshError", "TransportError"):
        return f"no credentials: {msg}" if name != "TransportError" else msg
    if mod.startswith("google.api_core"):
        if name == "RetryError":
            return cause(getattr(e, "cause", None)) or msg
        code = getattr(e, "code", None)
        if isinstance(code, int) and code >= 500:
            return f"server error {code}: {msg}"
    if mod.startswith("gcsfs") and name == "HttpError" and isinstance(getattr(e, "code", None), int):
        if e.code >= 500 or e.code == 429:
            return f"server error {e.code}: {msg}"
        if e.code == 401:
            return f"no credentials accepted: {msg}"
    if mod.startswith("aiohttp") and name in ("ServerDisconnectedError", "ClientPayloadError", "ServerTimeoutError",
                                              "ConnectionTimeoutError", "SocketTimeoutError"):
        return msg or name
    if mod.startswith("requests") and name in ("ConnectionError", "Timeout", "ConnectTimeout", "ReadTimeout",
                                               "ChunkedEncodingError", "ProxyError"):
        return cause(e.__context__) or msg
    if isinstance(e, OSError) and e.errno in _CONN_ERRNOS:
        return f"{_CONN_ERRNOS[e.errno]}: {msg}" if msg else _CONN_ERRNOS[e.errno]
    if isinstance(e, TimeoutError) or name == "FSTimeoutError":
        return f"timed out: {msg}" if msg else "timed out"
    if msg.startswith(_STATUS):
        return msg
    return None


@contextlib.contextmanager
def named(path, what: str):
    """Raises a storage failure inside the block as StorageError(path, what, cause)."""
    key, t0 = next(_calls), time.monotonic()
    with _S.lock:
        _S.inflight[key] = t0
    try:
        yield
        _S.failing_since, _S.last_retry = None, ""
    except StorageError as e:
        _S.failing_since, _S.last_failure = _S.failing_since or time.monotonic(), e.why
        raise
    except Exception as e:
        why = cause(e)
        if why is None:
            _S.failing_since = None  # an answer
            raise
        _S.failing_since, _S.last_failure = _S.failing_since or time.monotonic(), why
        raise StorageError(path, why, what) from None
    finally:
        with _S.lock:
            _S.inflight.pop(key, None)


# ---- every fsspec call, bounded -----------------------------------------------------------

_WHAT = {"pipe_file": "write", "cat_file": "read", "rm_file": "delete", "rm": "delete", "ls": "listing",
         "find": "listing", "info": "read", "exists": "read", "isdir": "read", "isfile": "read", "mkdir": "write",
         "makedirs": "write", "copy": "copy", "cp_file": "copy", "put_file": "write", "get_file": "read",
         "cat": "read", "pipe": "write", "call_s3": "request", "expand_path": "listing", "glob": "listing",
         "initiate_upload": "write", "simple_upload": "write", "upload_chunk": "write"}


def _describe_call(func, args, kwargs) -> tuple[str, str]:
    """(path, operation) of an fsspec call, for the error that names it."""
    from fsspec.asyn import AsyncFileSystem
    name = getattr(func, "__name__", "call").lstrip("_")
    fs = args[0] if args and isinstance(args[0], AsyncFileSystem) else getattr(func, "__self__", None)
    if not isinstance(fs, AsyncFileSystem):
        fs = None
    rest = args[1:] if args and args[0] is fs else args
    proto = fs.protocol if fs is not None else ""
    proto = proto[0] if isinstance(proto, (tuple, list)) else proto
    if "Bucket" in kwargs:
        path = f"{kwargs['Bucket']}/{kwargs.get('Key', '')}".rstrip("/")
    elif name in ("initiate_upload", "simple_upload") and len(rest) >= 2:  # gcsfs's writes: (bucket, key)
        path = f"{rest[0]}/{rest[1]}"
    else:
        first = rest[0] if rest else kwargs.get("path", "")
        path = first[0] if isinstance(first, list) and first else first
        path = path if isinstance(path, str) else ""
    if path and "://" not in path and proto:
        path = f"{proto}://{path}"
    return path or f"{proto or 'the'} store", _WHAT.get(name, name)


async def _runner(event, func, args, kwargs, result, timeout):
    try:  # the coroutine is made here: a call given up before it started leaves none unawaited
        result[0] = await asyncio.wait_for(func(*args, **kwargs), timeout=timeout)
    except Exception as ex:  # noqa: BLE001 - handed to the waiting thread
        result[0] = ex
    finally:
        event.set()


def _sync(loop, func, *args, timeout=None, **kwargs):
    """fsspec's `sync` (run a coroutine on its IO loop and wait) with this process's bound as
    the deadline, a storage failure raised as StorageError, and a stalled call given up when
    the run is asked to stop or abandons the store. A call given its own timeout (fsspec's
    and the clients' clean-up, e.g. closing a session) keeps fsspec's behaviour."""
    if loop is None or loop.is_closed():
        raise RuntimeError("Loop is not running")
    try:
        if asyncio.events.get_running_loop() is loop:
            raise NotImplementedError("Calling sync() from within a running loop")
    except RuntimeError:
        pass
    if timeout:
        return _fsspec_sync(loop, func, *args, timeout=timeout, **kwargs)
    path, what = _describe_call(func, args, kwargs)
    if _S.abandoned:
        raise StorageError(path, _S.abandoned, what)
    bound = timeout_s()
    result, event = [None], threading.Event()
    with named(path, what):
        fut = asyncio.run_coroutine_threadsafe(_runner(event, func, args, kwargs, result, bound), loop)
        t0 = time.monotonic()
        while not event.wait(1):
            waited = time.monotonic() - t0
            if _S.abandoned or (waited >= STALL_S and _stop_requested()):
                fut.cancel()
                why = _S.abandoned or f"no answer for {waited:.0f} s, and the run was asked to stop"
                raise StorageError(path, why, what)
        got = result[0]
        if isinstance(got, asyncio.TimeoutError) and time.monotonic() - t0 >= bound - 1:
            last = f"; last error: {_S.last_retry}" if _S.last_retry else ""
            raise StorageError(path, f"no answer within {bound:.0f} s{last}", what)
        if isinstance(got, BaseException):
            raise got
        return got


class _Retries(logging.Filter):
    """gcsfs logs each retry and its final failure with a traceback; we name the failure in one
    line, so its records are kept only as the last error seen (for a timeout's message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception" in record.getMessage():
            _S.last_retry = record.getMessage().split("exception: ", 1)[-1][:200]
        return False


_fsspec_sync = None
FSSPEC_VERSION = "2026.9.0"  # the fsspec whose `sync` `_sync` stands in for (its signature and behaviour)


def _install() -> None:
    """Installed at this process's first object-store call (`ensure`), never at import;
    `uninstall` puts fsspec's own back."""
    global _fsspec_sync
    import fsspec
    import fsspec.asyn
    if fsspec.__version__ != FSSPEC_VERSION:
        from async_rl.config import ConfigError
        raise ConfigError(f"fsspec {fsspec.__version__} is installed; async_rl's storage bound is written for "
                          f"{FSSPEC_VERSION} (pip install -c constraints.txt -e '.[gcs,s3]')")
    if fsspec.asyn.sync is not _sync:
        _fsspec_sync = fsspec.asyn.sync
        fsspec.asyn.sync = _sync
    log = logging.getLogger("gcsfs")
    if not any(isinstance(f, _Retries) for f in log.filters):
        log.addFilter(_Retries())
        log.setLevel(logging.DEBUG)
        log.propagate = False


def uninstall() -> None:
    """Puts back fsspec's `sync` and the gcsfs logger as they were before `_install`."""
    import fsspec.asyn
    if _fsspec_sync is not None and fsspec.asyn.sync is _sync:
        fsspec.asyn.sync = _fsspec_sync
    log = logging.getLogger("gcsfs")
    for f in [f for f in log.filters if isinstance(f, _Retries)]:
        log.removeFilter(f)
    _S.configured = False
