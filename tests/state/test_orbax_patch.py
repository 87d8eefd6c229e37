"""The absl filter drops only Orbax's records of one failed save (the run reports it once)."""

import logging

import pytest
from orbax.checkpoint._src.metadata import checkpoint as orbax_metadata

from async_rl.state import orbax_patch


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def absl_records():
    orbax_patch.uninstall()  # an earlier test's checkpointer may have installed it
    keep, log = _Keep(), logging.getLogger("absl")
    log.addHandler(keep)
    yield keep.records
    log.removeHandler(keep)
    orbax_patch.uninstall()


def _failing_store(tmp_path):
    """Orbax's own non-blocking metadata store, whose file cannot be written (a file in its way)."""
    (tmp_path / "blocked").write_text("")
    return orbax_metadata.metadata_store(enable_write=True, blocking_write=False), tmp_path / "blocked" / "m"


@pytest.mark.parametrize("call", ["write", "update"])
def test_failed_metadata_writes_dropped_only_when_installed(tmp_path, absl_records, call):
    def fail():
        store, path = _failing_store(tmp_path)
        getattr(store, call)(path, **({"metadata": {"a": 1}} if call == "write" else {"init_timestamp_nsecs": 1}))
        with pytest.raises(Exception):
            store.wait_until_finished()
        store.close()
        return [r for r in absl_records if "Failed to" in str(r.msg) and r.levelno == logging.ERROR]

    assert len(fail()) == 1  # Orbax logs it
    orbax_patch.install()
    assert len(fail()) == 1  # and, installed, the second failure is not logged again


def test_other_orbax_errors_still_logged(absl_records):
    orbax_patch.install()
    logging.getLogger("absl").handle(logging.LogRecord(
        "absl", logging.ERROR, orbax_metadata.__file__, 1, "Something else failed: %s", ("x",), None))
    assert [r.getMessage() for r in absl_records] == ["Something else failed: x"]


def test_a_storage_call_the_runs_bound_gave_up_on_is_not_logged_twice(tmp_path, absl_records, monkeypatch):
    """Orbax swallows a failed read of a step's metadata and logs it; where the failure is the
    run's own storage bound giving up (which the run reports in its one line), the record goes."""
    from etils import epath

    from async_rl.store.remote_io import StorageError
    orbax_patch.install()
    store = orbax_metadata.metadata_store(enable_write=False)
    path = tmp_path / "_CHECKPOINT_METADATA"
    path.write_text("{}")

    def read(err):
        def fail(self, *a, **k):
            raise err
        monkeypatch.setattr(type(epath.Path(path)), "read_text", fail)
        return store.read(path)

    assert read(StorageError("gs://b/run/x", "no answer within 15 s", "read")) is None
    assert not [r for r in absl_records if "Failed to read" in str(r.msg)]
    assert read(OSError("disk gone")) is None
    assert [r.levelno for r in absl_records if "Failed to read" in str(r.msg)] == [logging.ERROR]
