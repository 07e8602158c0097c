"""The `erpo` command line: train, precompute-ref, eval, plot, compare.

    erpo train [--config FILE] [--output-dir DIR] [--max-steps N] [--algorithm NAME] [--seed S]
               [--zero-stage K] [--save-steps N] [--resume] [--force] [--set key=value ...]
    erpo precompute-ref [--config FILE] [--output-dir DIR] [--overwrite] [--set key=value ...]
    erpo eval ...   (erpo.cli.eval)       erpo plot ...   (erpo.cli.plot)      erpo compare ...   (erpo.cli.compare)

`erpo train` with no --config runs the built-in tiny default (CPU, a few minutes). A user's mistake (erpo.errors.
UserError) is one line on stderr and exit status 1 (2 for config and option errors); `--debug` or ERPO_DEBUG=1
shows its traceback. An option the parser refuses is one line too, exit status 2 (OneLineErrorParser). Building the
parser loads no trainer, torch or matplotlib: each command's modules load when it runs.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import threading
from typing import NoReturn

from erpo import __version__
from erpo.cli import missing_package_line
from erpo.cli.args import add_config_arguments, add_debug_argument, add_local_rank_argument, config_from_args
from erpo.cli.compare import add_compare_arguments
from erpo.cli.eval import add_eval_arguments
from erpo.cli.plot import add_plot_arguments
from erpo.errors import INTERRUPTED_EXIT_STATUS, TERMINATED_EXIT_STATUS, Interrupted, Terminated, UserError
from erpo.presets import PRESETS

log = logging.getLogger("erpo")

# What a command interrupted outside a training step's boundary keeps (docs/training.md, "Ctrl-C").
INTERRUPTED_KEEPS = {
    "train": "the checkpoints saved so far are kept (--resume continues from the newest)",
    "compare": "finished runs and each run's newest checkpoint are kept (the same command continues)",
    "eval": "the samples made so far are cached (the same command continues)",
}


def stop_line(command: str, stop: KeyboardInterrupt) -> str:
    """The one line of a command that Ctrl-C or SIGTERM (Terminated) stopped at once: what it stopped (where an
    `erpo.errors.stopped_at_once_is` block named it) or what the command keeps."""
    how = "stopped (SIGTERM)" if isinstance(stop, Terminated) else "interrupted (Ctrl-C)"
    if hasattr(stop, "stopped_work"):
        return f"erpo {command}: {how} during {stop.stopped_work}"
    return f"erpo {command}: {how}; {INTERRUPTED_KEEPS.get(command, '')}".rstrip("; ")


def _terminate(signum, frame) -> NoReturn:
    raise Terminated()


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser (and its subcommands' parsers) whose errors are one line on stderr, exit status 2 as
    argparse's: `erpo train: error: unrecognized arguments: --lr-foo (see erpo train --help)`, not the whole usage
    block before it."""

    def error(self, message: str, see: tuple[str, ...] = ()) -> NoReturn:
        """`see`: the other commands whose --help the line points to, after this parser's."""
        helps = ", ".join(f"{prog} --help" for prog in (self.prog, *see))
        self.exit(2, f"{self.prog}: error: {message} (see {helps})\n")


def build_parser() -> argparse.ArgumentParser:
    """The `erpo` parser; no option may be abbreviated (`--max-step` is an error, not `--max-steps`); an error is one
    line (OneLineErrorParser)."""
    parser = OneLineErrorParser(prog="erpo", description="ERPO: Environment-Regularized Policy Optimization",
                                allow_abbrev=False)
    add_local_rank_argument(parser)
    add_debug_argument(parser, default=False)
    parser.add_argument("--version", action="version", version=f"erpo {__version__}")
    # not required here: without a command, main() names an unknown option before naming COMMAND missing
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add_command(name: str, help: str, epilog: str | None = None) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help, epilog=epilog, allow_abbrev=False)
        add_debug_argument(command)
        return command

    train = add_command("train", help="train a policy with ERPO (or a baseline)",
                        epilog="Every config key (--set), reward functions (reward.functions: called as TRL's "
                               "GRPOTrainer calls them, trainer_state included; a sample no function scores gets "
                               "advantage 0, as TRL) and the metrics.jsonl keys (TRL's reward and completions/* "
                               "metrics): docs/training.md.")
    add_config_arguments(train)
    train.add_argument("--max-steps", type=int, help="rollout steps (trainer.max_steps)")
    train.add_argument("--algorithm", choices=sorted(PRESETS), help="algorithm.name")
    train.add_argument("--seed", type=int, help="trainer.seed")
    train.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage (trainer.zero_stage)")
    train.add_argument("--save-steps", type=int, help="checkpoint every N rollout steps (trainer.save_steps)")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the output dir")
    train.add_argument("--force", action="store_true",
                       help="take over the output dir's lock (run.lock) even if its holder on another machine may be "
                            "alive; only when that run is surely dead")
    add_local_rank_argument(train)

    pre = add_command("precompute-ref", help="cache ell_theta0(q) and w(q) for every training prompt")
    add_config_arguments(pre)
    pre.add_argument("--overwrite", action="store_true", help="rebuild the cache even if it exists")
    add_local_rank_argument(pre)

    compare = add_command("compare", help="train several algorithms over several seeds; table of mean and spread")
    add_config_arguments(compare, output_help="parent of the runs (OUTPUT_DIR/ALGORITHM-seedSEED) and of "
                                              "comparison.md (default: runs/compare)")
    add_compare_arguments(compare)
    add_eval_arguments(add_command("eval", help="evaluate models over temperatures (Avg@k, Pass@k)"))
    add_plot_arguments(add_command("plot", help="plot training runs' metrics.jsonl"))
    parser.commands = sub.choices   # subcommand name -> its parser (for its error line)
    return parser


def quiet_third_party_output() -> None:
    """Hide what users did not ask for: HF's weight loading / shard writing bars, the second copy of each
    huggingface_hub warning (its own handler and the root logger's), and DeepSpeed's "Setting accelerator to CPU"
    notice on a machine without CUDA. Our progress bar, our log lines and the libraries' warnings stay. Imports
    torch and huggingface_hub, not transformers: transformers takes its bars' setting from huggingface_hub's when it
    loads (its `utils.logging`), and is told here only when it is loaded already."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")   # said, not auto-detected: DeepSpeed has nothing to warn about
    logging.getLogger("huggingface_hub").propagate = False
    try:
        from huggingface_hub.utils import disable_progress_bars  # a lazy module: its tqdm loads here
    except ImportError:
        return
    disable_progress_bars()
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed subcommand; returns the exit status."""
    if args.command in ("train", "precompute-ref"):
        # what the config alone decides is checked before the trainer's modules load (transformers' modeling code:
        # seconds of imports), so that a mistake there is one line at once
        cfg = config_from_args(args)
        if args.command == "train":
            from erpo.train.preflight import check_run
            checked = check_run(cfg, resume=args.resume)
        else:
            from erpo.reference.cache_path import checked_cache_path
            cache_path = checked_cache_path(cfg)
        from erpo import distributed
        from erpo.config import run_summary
        from erpo.reference.setup import precompute_reference
        from erpo.storage_errors import stop_on_storage_failure
        from erpo.train import loop
        try:
            if args.command == "train":   # a refused read or write (metrics, export) is one line, as a save's is
                with stop_on_storage_failure("a file operation", cfg.output_dir,
                                             advice="fix the storage (space, permissions), then run again; --resume "
                                                    "continues from the newest checkpoint"):
                    loop.train(cfg, resume=args.resume, force=args.force, checked=checked)
            else:   # its summary once its modules have loaded (train logs its own, once its output dir is checked)
                log.info("erpo %s: %s", args.command, run_summary(cfg))
                _, path, _ = precompute_reference(cfg, overwrite=args.overwrite, cache_path=cache_path)
                print(path)
        finally:
            distributed.destroy_distributed()  # every rank, also after an error (a live group can abort at exit)
        return 0
    if args.command == "compare":
        from erpo.cli.compare import run_compare
        run_compare(args)
        return 0
    if args.command == "eval":
        from erpo.cli.eval import run_eval
        run_eval(args)
        return 0
    from erpo.cli.plot import run_plot
    run_plot(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    # before any command imports matplotlib (plot, compare, eval's tables): its INFO lines, such as a fresh
    # machine's "generated new fontManager", would otherwise be the first line a user sees
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:   # `erpo --versoin`: the unknown option is the culprit, not the command it hid
        parser.error(f"unrecognized arguments: {' '.join(unknown)}" if unknown
                     else "the following arguments are required: COMMAND")
    if unknown:   # each under the parser it was meant for: the top level's before the command, else the command's
        before = argv[:argv.index(args.command)] if args.command in argv else []
        early = [word for word in unknown if word in before]
        late = [word for word in unknown if word not in early]
        command = parser.commands[args.command]
        if early and late:   # every one of them, in one line
            parser.error(f"unrecognized arguments: {' '.join(early)}, and {command.prog}'s {' '.join(late)}",
                         see=(command.prog,))
        (parser if early else command).error(f"unrecognized arguments: {' '.join(early or late)}")
    args.command_line = shlex.join(["erpo", *argv])
    # A command runs (torch loads now). What it sets for itself and the libraries it calls is put back after it:
    # main() called from Python (a notebook, a test) leaves the process's environment as it found it.
    from erpo.process_state import variables_as_found
    with variables_as_found(["LOCAL_RANK", "DS_ACCELERATOR"]):
        return run_parsed(args)


def run_parsed(args: argparse.Namespace) -> int:
    """Run the command `args` (parsed, its command line in `args.command_line`) as the `erpo` process does: the
    user's errors, a missing package and a stop in one line on stderr; returns the exit status."""
    if hasattr(args, "local_rank"):
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    debug = args.debug or os.environ.get("ERPO_DEBUG", "").strip() not in ("", "0")
    if not debug:
        quiet_third_party_output()
    # SIGTERM stops a command at once as Ctrl-C does, in one line (Python's default ends the process silently, with
    # no cleanup); a training loop's GracefulStop takes the first one there and finishes the step. The main thread
    # only: where signals are delivered and handlers may be set.
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main_thread else None
    try:
        return run_command(args)
    except UserError as exc:
        if debug:
            raise
        print(f"erpo {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        line = missing_package_line(args.command, exc)
        if debug or line is None:
            raise
        print(line, file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:   # Ctrl-C, SIGTERM: one line (a run stopped at a step boundary has logged its own)
        if debug:
            raise
        if not isinstance(exc, Interrupted):
            print(stop_line(args.command, exc), file=sys.stderr)
        return TERMINATED_EXIT_STATUS if isinstance(exc, Terminated) else INTERRUPTED_EXIT_STATUS
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
