"""The two kinds of error a command ends with, and their exit codes. Every error async_rl raises
for a user to read derives from one of them; the command line maps by kind, printing one line.

- `UsageError` (exit 2): the command, its config, its data or a checkpoint it was pointed at is
  not usable as asked; nothing was written, or nothing that was saved is touched.
- `RunFailure` (exit 1): a run that started could not go on (a store that stopped answering, a
  lost lease, non-finite values, a failed save, a failing reward function or peer process); the
  last committed checkpoint is intact and the same command resumes from it.
"""


class UsageError(ValueError):
    exit_code = 2


class RunFailure(RuntimeError):
    exit_code = 1
