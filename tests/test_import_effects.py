"""Importing async_rl changes nothing outside it: no patched library function, logger filter or
handler, sys hook, exit hook, signal handler, environment variable, gc or fsspec setting.
Patches are installed by the code that needs them (`orbax_patch.install`, `remote_io.ensure`)."""
import json
import os
import subprocess
import sys

import pytest

PROBE = r'''
import atexit, gc, json, logging, os, pkgutil, signal, sys, importlib
import fsspec.asyn, fsspec.config
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

def snapshot():
    loggers = {"": logging.getLogger()} | {n: l for n, l in logging.Logger.manager.loggerDict.items()
                                          if isinstance(l, logging.Logger)}
    return {
        "ts_build": repr(ts_utils.build_kvstore_tspec),
        "fsspec_sync": repr(fsspec.asyn.sync),
        "fsspec_conf": repr(fsspec.config.conf),
        "loggers": {n: [repr(f) for f in l.filters] + [repr(h) for h in l.handlers] + [l.level, l.propagate]
                    for n, l in loggers.items() if l.filters or l.handlers or n in ("absl", "asyncio", "gcsfs")},
        "hooks": [repr(sys.unraisablehook), repr(sys.excepthook), repr(sys.displayhook)],
        "atexit": atexit._ncallbacks(),
        "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)},
        "env": dict(os.environ),
        "gc": [gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()],
        "switch": sys.getswitchinterval(),
    }

import jax, orbax.checkpoint, grain  # the libraries themselves may set things at import: not ours
before = snapshot()
import async_rl
skipped = []
for m in pkgutil.walk_packages(async_rl.__path__, "async_rl."):
    if m.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(m.name)
    except ImportError as e:  # an optional extra that is not installed
        skipped.append(f"{m.name}: {e}")
after = snapshot()
changed = {k: {"before": before[k], "after": after[k]} for k in before if before[k] != after[k]}
for k in ("env", "signals", "loggers"):
    if k in changed:
        b, a = before[k], after[k]
        changed[k] = {n: [b.get(n), a.get(n)] for n in set(b) | set(a) if b.get(n) != a.get(n)}
print(json.dumps({"changed": changed, "skipped": skipped}, default=str))
'''


def test_importing_every_module_changes_nothing_outside_the_package():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["changed"] == {}, json.dumps(got["changed"], indent=1)[:4000]
    assert all("vllm" in s for s in got["skipped"]), got["skipped"]


def test_the_orbax_patch_is_installed_and_removed_explicitly():
    import logging

    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    from async_rl.state import orbax_patch
    orbax_patch.uninstall()
    own, filters = ts_utils.build_kvstore_tspec, list(logging.getLogger("absl").filters)
    orbax_patch.install()
    try:
        assert ts_utils.build_kvstore_tspec is not own
        assert len(logging.getLogger("absl").filters) == len(filters) + 1
        orbax_patch.install()  # idempotent
        assert len(logging.getLogger("absl").filters) == len(filters) + 1
    finally:
        orbax_patch.uninstall()
    assert ts_utils.build_kvstore_tspec is own and logging.getLogger("absl").filters == filters


def test_a_command_called_in_process_leaves_the_environment_as_it_found_it(tmp_path, monkeypatch):
    """`train` on an object store sets tensorstore's stall bounds for its run (and `plan` or a
    command off a TPU host JAX's platforms); called in-process (a notebook, a test), the command
    puts the caller's environment back when it returns."""
    pytest.importorskip("s3fs")
    from async_rl.run.cli import main
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing answers there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    before = dict(os.environ)
    code = main(["train", "--config", "configs/tiny.yaml", "run.dir=s3://no-such-bucket/run",
                 "run.storage_timeout_s=2", "log.progress=false"])
    assert code != 0 and dict(os.environ) == before
