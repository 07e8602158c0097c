"""The `erpo` command line (`erpo = erpo.cli:run`, `python -m erpo`, `python -m erpo.cli`): `main` parses and
dispatches; each subcommand's options and entry point live in a module named after it (eval, plot, compare), shared
options in args; `run` is the process around it. The trainer's dependencies are the `train` extra (the base install is
the loss alone): without them `main` prints one line saying what to install."""
from __future__ import annotations

import atexit
import logging
import os
import sys

TRAIN_EXTRA_HINT = 'pip install "erpo[train]"'


def main(argv: list[str] | None = None) -> int:
    """Run `erpo ARGS` (argv: the arguments after `erpo`; None: sys.argv[1:]); returns the exit status."""
    try:
        from erpo.cli.commands import main as run_command_line  # imports the trainer and its dependencies
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in ("", "erpo", "erpo_kernels"):  # our own module: a bug, not a missing install
            raise
        print(f"erpo: the trainer needs the Python package {missing!r}, which is not installed: "
              f"{TRAIN_EXTRA_HINT}", file=sys.stderr)
        return 1
    return run_command_line(argv)


def run() -> None:
    """The `erpo` process: `main()`, then exit with its status. A rank of a multi-process run (WORLD_SIZE > 1) ends
    without the interpreter's finalization, once its files are closed, logs flushed and exit handlers run: there,
    after a run had finished and written everything, a rank sometimes aborted ("terminate called without an active
    exception", a C++ thread of the communication libraries destroyed while joinable) and the launcher reported
    the whole run failed."""
    status = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


__all__ = ["main", "run"]
