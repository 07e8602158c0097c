"""The `erpo` command line (`erpo = erpo.cli:run`, `python -m erpo`, `python -m erpo.cli`): `main` parses and
dispatches; each subcommand's options and entry point live in a module named after it (eval, plot, compare), shared
options in args; `run` is the process around it. The trainer's dependencies are the `train` extra (the base install is
the loss alone): without them `erpo --help` still works, and a command that needs them says in one line to install
the extra (`missing_package_line`)."""
from __future__ import annotations

import atexit
import logging
import os
import re
import sys

from erpo.errors import INTERRUPTED_EXIT_STATUS

TRAIN_EXTRA = "train"
TRAIN_EXTRA_HINT = f'pip install "erpo[{TRAIN_EXTRA}]"'


def _train_extra_distributions() -> set[str]:
    """The distributions of erpo's `train` extra, as its installed metadata lists them (empty without metadata).
    Read with the standard library alone: the light install has no `packaging`."""
    from importlib import metadata
    try:
        requires = metadata.requires("erpo") or []
    except metadata.PackageNotFoundError:
        return set()
    return {re.match(r"[A-Za-z0-9._-]+", line).group(0).lower() for line in requires
            if f'extra == "{TRAIN_EXTRA}"' in line}


def is_train_extra_module(module: str) -> bool:
    """Whether a missing import `module` is the train extra's: one of its distributions is not installed (the
    light install), or `module` belongs to one of them (a broken install)."""
    from importlib import metadata
    wanted = _train_extra_distributions()
    for name in wanted:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            return True
    owners = metadata.packages_distributions().get(module.split(".")[0], [])
    return any(owner.lower().replace("_", "-") in wanted for owner in owners)


def missing_package_line(command: str, exc: ModuleNotFoundError) -> str | None:
    """The one line for `erpo COMMAND` stopped by `exc`: the extra to install when the module is the train extra's,
    else the module; None when the module is erpo's own (a bug: the traceback is what helps)."""
    missing = (exc.name or "").split(".")[0]
    if missing in ("", "erpo", "erpo_kernels"):
        return None
    if is_train_extra_module(missing):
        return f"erpo {command} needs the trainer's packages (the {TRAIN_EXTRA!r} extra): {TRAIN_EXTRA_HINT}"
    return f"erpo {command} needs the Python module {missing!r}, which is not installed"


def main(argv: list[str] | None = None) -> int:
    """Run `erpo ARGS` (argv: the arguments after `erpo`; None: sys.argv[1:]); returns the exit status."""
    from erpo.cli.commands import main as run_command_line  # the parser: the trainer loads when a command runs
    return run_command_line(argv)


def run() -> None:
    """The `erpo` process: `main()`, then exit with its status. A rank of a multi-process run (WORLD_SIZE > 1) ends
    without the interpreter's finalization, once its files are closed, logs flushed and exit handlers run: there,
    after a run had finished and written everything, a rank sometimes aborted ("terminate called without an active
    exception", a C++ thread of the communication libraries destroyed while joinable) and the launcher reported
    the whole run failed."""
    try:
        status = main()
    except KeyboardInterrupt:   # Ctrl-C before a command runs (Python still importing torch): one line, not a traceback
        print("erpo: interrupted (Ctrl-C)", file=sys.stderr)
        status = INTERRUPTED_EXIT_STATUS
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


__all__ = ["main", "run"]
