"""Test setup: 4 forced CPU devices (sharding tests need several; 8 on 2 cores can hang
XLA rendezvous), CPU platform, quiet libraries, and one XLA compilation cache shared by
the training subprocesses of a session (restarts then pay restore, not recompilation)."""
import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("ASYNC_RL_TEST_XLA_CACHE", tempfile.mkdtemp(prefix="async_rl_xla_"))
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def xla_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("xla_cache")


def pytest_collection_modifyitems(config, items):
    """Long tests first (a stable sort keeps the rest in file order): with the suite split
    over workers (`make test`), the last test to finish is then a short one."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
