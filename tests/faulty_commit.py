"""Orbax's local commit (the rename of a step's temporary directory), failing with ENOSPC for
the steps `ASYNC_RL_FAULT=enospc:commit:<step>` names: the crash tests' stand-in for a full
disk. A run uses it where `ASYNC_RL_FAULT_COMMIT=faulty_commit:FaultyCommit` (`faults.commit_class`)."""
from pathlib import Path

import orbax.checkpoint as ocp

from async_rl import faults
from async_rl.state.layout import is_step_name


class FaultyCommit(ocp.path.atomicity.AtomicRenameTemporaryPath):
    async def finalize(self, *args, **kwargs):
        name = Path(str(self.get_final())).name
        if is_step_name(name):  # the step directory, not one of its items
            faults.raise_enospc("commit", int(name))
        return await super().finalize(*args, **kwargs)
