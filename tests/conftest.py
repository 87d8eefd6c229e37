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
# tests import shared pieces of other wings' test modules (test_hf's checkpoints, test_crash's
# helpers): every wing's folder is importable whichever is collected first
for _wing in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir()
                    and any(p.glob("test_*.py"))):
    sys.path.insert(1, str(_wing))


@pytest.fixture(scope="session")
def xla_cache() -> Path:
    """The session's one cache (set above, before xdist starts its workers, so they inherit it;
    helpers.FAST names it too): in-process runs and subprocesses on every worker reuse each
    other's programs instead of each worker compiling the same shapes into a cache of its own."""
    return Path(os.environ["ASYNC_RL_TEST_XLA_CACHE"])


@pytest.fixture(scope="module")
def compile_cache(xla_cache):
    """The session's cache for this module's own compilations: a module that builds the same
    engine programs test after test (each engine its own jit) reads them back instead of
    compiling again. Not session-wide: modules that close over large weights would write them
    into every entry. Put back as it was afterwards, as a run puts the caller's settings back.
    Capped as the runs that share the folder are: an uncapped writer's entries have no access
    time, and the capped runs' writes would fail on them (compiling again in every process)."""
    from async_rl.config import RunConfig
    from async_rl.run.build import compilation_cache
    with compilation_cache(str(xla_cache), RunConfig().compilation_cache_max_gb):
        yield


def pytest_collection_modifyitems(config, items):
    """Long tests first (a stable sort keeps the rest in file order): with the suite split
    over workers (`make test`), the last test to finish is then a short one."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory):
    """fake-gcs-server on loopback for the whole session (tensorstore reads its URL once per
    process); the clients' standard variables point at it."""
    from objstore import GCS_ENV, environ, gcs_server
    with gcs_server(tmp_path_factory.mktemp("fake_gcs")) as url, environ(GCS_ENV(url)):
        yield url


@pytest.fixture(scope="session")
def s3_endpoint():
    from objstore import S3_ENV, environ, s3_server
    with s3_server() as url, environ(S3_ENV(url)):
        yield url


@pytest.fixture(params=["gs", "s3"])
def bucket(request) -> str:
    """A fresh, empty bucket on a real local server: `gs://...` or `s3://...`."""
    from objstore import new_bucket
    request.getfixturevalue("gcs_endpoint" if request.param == "gs" else "s3_endpoint")
    return new_bucket(request.param)


_skipped: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped[report.nodeid] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""


def pytest_sessionfinish(session, exitstatus):
    """With ASYNC_RL_SKIP_ALLOWLIST (tests/skips.txt; CI sets it), a skipped test the list does not
    name fails the run: a test that silently stops running is a test lost."""
    import fnmatch
    allow_file = os.environ.get("ASYNC_RL_SKIP_ALLOWLIST")
    if not allow_file or hasattr(session.config, "workerinput"):  # xdist workers report to the controller
        return
    patterns = [line.split()[0] for line in Path(allow_file).read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    unexpected = {t: why for t, why in _skipped.items() if not any(fnmatch.fnmatchcase(t, p) for p in patterns)}
    if unexpected:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"{len(unexpected)} skipped tests are not in {allow_file}:"]
        lines += [f"  {t}: {why}" for t, why in sorted(unexpected.items())]
        if tr is not None:
            tr.ensure_newline()
        (tr.write_line if tr else print)("\n".join(lines))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
