"""Every error the package raises for a user derives from one of the two kinds in `errors`, whose
exit codes the command line uses (2: usage, config, data or checkpoint input; 1: a run failure)."""
import importlib
import inspect
import pkgutil

import async_rl
from async_rl.errors import RunFailure, UsageError

# control flow inside the package, never shown to a user
# internal: raised and answered inside their module (a 400, a server taken down, a 503)
INTERNAL = {"Stopped", "Conflict", "GaveUp", "Damaged", "_Interrupt", "_TooLarge", "_ConnectCancelled", "_Garbage", "LoadFailed",
            "BadRequest", "TransferError"}


def test_every_error_class_has_a_kind():
    loose = []
    for m in pkgutil.walk_packages(async_rl.__path__, "async_rl."):
        if m.name.endswith("__main__"):
            continue
        try:
            mod = importlib.import_module(m.name)
        except ImportError:  # an optional extra
            continue
        for name, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ != mod.__name__ or not issubclass(cls, BaseException) or name in INTERNAL:
                continue
            if not issubclass(cls, (UsageError, RunFailure)):
                loose.append(f"{mod.__name__}.{name}")
    assert not loose, loose


def test_the_kinds_carry_their_exit_codes():
    from async_rl.config import ConfigError
    from async_rl.state.checkpoint import CheckpointError, NonFiniteError
    from async_rl.store.remote_io import StorageError
    assert ConfigError("x").exit_code == CheckpointError("x").exit_code == 2
    assert NonFiniteError("x").exit_code == StorageError("p", "why").exit_code == 1
