"""`UserError`: an error the user caused (config, data, paths, options), shown as one line without a traceback.

Raise it where the user's input is checked, with a message that names the culprit and says what to do.
`erpo.cli.commands` prints it as `erpo COMMAND: MESSAGE` on stderr and exits with `exit_code`; `--debug` or
ERPO_DEBUG=1 shows the traceback instead. Every other exception is a bug of ours and keeps its traceback.
"""
from __future__ import annotations

import signal

INTERRUPTED_EXIT_STATUS = 128 + signal.SIGINT   # 130: what a shell reports for a command ended by Ctrl-C


class UserError(ValueError):
    """Bad user input; a ValueError, so callers that catch ValueError keep working. exit_code: 1, or 2 for
    config and option errors."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class MissingInputError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist (also a FileNotFoundError)."""


class MissingPackageError(UserError, ImportError):
    """An optional package a setting needs is not installed (also an ImportError); the message says what to
    install."""


class Interrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (SIGINT) at a step boundary, after saving what it had; the message says where
    (erpo.train.stop raises it). A KeyboardInterrupt, so code that does not know it treats it as Ctrl-C (the `erpo`
    command: exit INTERRUPTED_EXIT_STATUS, without a line of its own: the run has logged where it stopped)."""
