"""`UserError`: an error the user caused (config, data, paths, options), shown as one line without a traceback.

Raise it where the user's input is checked, with a message that names the culprit and says what to do.
`erpo.cli.commands` prints it as `erpo COMMAND: MESSAGE` on stderr and exits with `exit_code`; `--debug` or
ERPO_DEBUG=1 shows the traceback instead. Every other exception is a bug of ours and keeps its traceback.
"""
from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator, Mapping

INTERRUPTED_EXIT_STATUS = 128 + signal.SIGINT   # 130: what a shell reports for a command ended by Ctrl-C
TERMINATED_EXIT_STATUS = 128 + signal.SIGTERM   # 143: ... and by SIGTERM


class UserError(ValueError):
    """Bad user input; a ValueError, so callers that catch ValueError keep working. exit_code: 1, or 2 for
    config and option errors."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def setting_name(names: Mapping[str, str] | None, keyword: str) -> str:
    """The setting a function takes as `keyword`, as its caller's user spelled it, for an error message:
    `names[keyword]` where the caller gave it (`erpo eval`'s `--gpu-memory-utilization`, the trainer's
    `rollout.gpu_memory_utilization`), else the keyword itself (a call from Python)."""
    return (names or {}).get(keyword, keyword)


def setting_value(names: Mapping[str, str] | None, keyword: str, value: object) -> str:
    """The setting `keyword` with its `value` as its caller's user wrote it: `--engine vllm` for an option,
    `engine=vllm` for a keyword (or `rollout.engine=vllm` for a config key)."""
    name = setting_name(names, keyword)
    return f"{name} {value}" if name.startswith("--") else f"{name}={value}"


class MissingInputError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist (also a FileNotFoundError)."""


class MissingPackageError(UserError, ImportError):
    """An optional package a setting needs is not installed (also an ImportError); the message says what to
    install."""


class Interrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (SIGINT) at a step boundary, after saving what it had; the message says where
    (erpo.train.stop raises it). A KeyboardInterrupt, so code that does not know it treats it as Ctrl-C (the `erpo`
    command: exit INTERRUPTED_EXIT_STATUS, without a line of its own: the run has logged where it stopped)."""


class Terminated(KeyboardInterrupt):
    """A command stopped at once by SIGTERM: outside a training loop (the SFT warm start, the reference cache, an
    evaluation), or a second SIGTERM inside one (whose first finishes the step: erpo.train.stop). `erpo.cli` raises it
    from its SIGTERM handler; a KeyboardInterrupt, so it unwinds as Ctrl-C does (temporary files removed, locks
    released) and the `erpo` command prints one line, exit TERMINATED_EXIT_STATUS."""


@contextlib.contextmanager
def stopped_at_once_is(what: str) -> Iterator[None]:
    """A Ctrl-C or SIGTERM that stops the command at once inside this block stopped `what` (the work and what to do
    next, e.g. "the SFT warm start; nothing was cached (the same command runs it again)"): the `erpo` command's one
    line says so. The innermost block names it."""
    try:
        yield
    except KeyboardInterrupt as stop:
        if not isinstance(stop, Interrupted) and not hasattr(stop, "stopped_work"):
            stop.stopped_work = what
        raise
