"""The `erpo` command line (`erpo = erpo.cli:main`, `python -m erpo`, `python -m erpo.cli`): `main` parses and
dispatches; each subcommand's options and entry point live in a module named after it (eval, plot, compare), shared
options in args."""
from erpo.cli.commands import main

__all__ = ["main"]
