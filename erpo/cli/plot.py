"""`erpo plot`: its options and entry point (the figures are erpo.plotting, which with matplotlib loads when the
command runs)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from erpo.errors import UserError


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``erpo plot`` options on a (sub)parser."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="training output dirs holding metrics.jsonl (several are overlaid)")
    parser.add_argument("--output", "-o", default=None,
                        help="PNG path (default: RUN_DIR/plots/training_dynamics.png for one run, "
                             "./training_dynamics.png for several)")
    parser.add_argument("--labels", default=None, help="comma-separated legend names, one per run")
    parser.add_argument("--smooth", type=float, default=0.0,
                        help="EMA smoothing weight in [0, 1), debiased as in TensorBoard (default 0: raw)")


def run_plot(args: argparse.Namespace) -> None:
    """Entry point of ``erpo plot``: draw the training-dynamics PNG and print its path.

    Bad arguments or unreadable metrics are a UserError: ``erpo plot: <message>`` (status 1).
    """
    from erpo.plotting import plot_runs
    output = args.output
    if output is None:
        output = (os.path.join(args.run_dirs[0], "plots", "training_dynamics.png") if len(args.run_dirs) == 1
                  else "training_dynamics.png")
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    try:
        print(plot_runs(list(args.run_dirs), output, labels=labels, smooth=args.smooth))
    except OSError as exc:
        written = Path(output).absolute()
        if exc.filename is not None and Path(exc.filename).absolute() in (written, *written.parents):
            # the PNG or a folder above it: name the option, not only the OS's words
            raise UserError(f"--output {output}: cannot write it ({exc.strerror}: {exc.filename})") from exc
        raise UserError(str(exc)) from exc
    except ValueError as exc:
        raise UserError(str(exc)) from exc
