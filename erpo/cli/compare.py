"""`erpo compare`: train several algorithms over several seeds and tabulate mean and spread of their metrics.

    erpo compare [--config FILE] [--algorithms erpo grpo] [--seeds 1 2 3] [--max-steps N] [--window 20]
                 [--output-dir runs/compare] [--set key=value ...]
                 [--eval-history [--eval-temperatures quick] [--eval-k 8] [--eval-benchmarks synthetic]]

Each (algorithm, seed) trains into OUTPUT_DIR/ALGORITHM-seedSEED; a finished run with the same resolved config is
reused and an unfinished one resumed from its newest checkpoint, so an interrupted comparison continues where it
stopped. OUTPUT_DIR/comparison.md and .json then hold,
per algorithm, the mean and standard deviation over seeds of reward, accuracy and Query-KL averaged over the first
and the last `window` optimizer steps, each seed's values, and the paired difference of every other algorithm from
the first one (same seed: same prompts and rollout seeds), with the machine, date, commit and command.

With --eval-history, every run's history (its start and each checkpoint it kept: trainer.save_steps,
trainer.keep_every) is then evaluated over a temperature grid as `erpo eval --model ALGORITHM-seedSEED=RUN_DIR@all`
does, into OUTPUT_DIR/history/ (history.md: accuracy by step x temperature per run; accuracy_over_steps.png); its
sample cache makes a repeated or interrupted comparison evaluate only what is missing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from erpo.cli.args import config_from_args
from erpo.cli.eval import add_eval_arguments, parse_temperatures, run_eval
from erpo.errors import UserError
from erpo.presets import PRESETS

log = logging.getLogger("erpo")

DEFAULT_OUTPUT_DIR = "runs/compare"
HISTORY_DIR = "history"   # OUTPUT_DIR/history: the evaluation of the runs' histories (--eval-history)
METRICS = (("reward", "reward"), ("accuracy", "accuracy"), ("qkl", "Query-KL"))   # (metrics.jsonl key, title)


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    """Register `erpo compare` options (besides --config, --output-dir and --set)."""
    p.add_argument("--algorithms", nargs="+", choices=sorted(PRESETS), default=["erpo", "grpo"],
                   help="algorithms to compare; differences are taken from the first (default: erpo grpo)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="trainer.seed values (default: 1 2 3)")
    p.add_argument("--max-steps", type=int, help="rollout steps of every run (trainer.max_steps)")
    p.add_argument("--window", type=int, default=20,
                   help="average each metric over the first and the last N optimizer steps (default: 20)")
    p.add_argument("--eval-history", action="store_true",
                   help="after training, evaluate every run's kept checkpoints (trainer.keep_every) over a "
                        "temperature grid into OUTPUT_DIR/history (as erpo eval --model RUN_DIR@all)")
    p.add_argument("--eval-temperatures", default="quick",
                   help="--eval-history: temperatures, comma-separated or a named grid of erpo eval (default: quick)")
    p.add_argument("--eval-k", type=int, default=8, help="--eval-history: samples per problem (default: 8)")
    p.add_argument("--eval-benchmarks", default="synthetic",
                   help="--eval-history: benchmark specs as erpo eval --benchmarks, e.g. synthetic,heldout "
                        "(default: synthetic)")


def check_history_arguments(args: argparse.Namespace) -> None:
    """The --eval-* options, checked before any training (a UserError, exit status 2)."""
    # the evaluation (torch, the models) loads when the command runs, not when the parser is built
    from erpo.eval.evaluate import check_eval_arguments
    from erpo.eval.problem_sets import load_benchmarks
    try:
        check_eval_arguments(k=args.eval_k, temperatures=parse_temperatures(args.eval_temperatures,
                                                                           "--eval-temperatures"),
                             pass_ks=None, batch_size=1, top_p=1.0,
                             names={"k": "--eval-k", "temperatures": "--eval-temperatures"})
        load_benchmarks([s for s in args.eval_benchmarks.split(",") if s.strip()])
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise UserError(f"--eval-history: {exc}", exit_code=2) from exc


def evaluate_histories(args: argparse.Namespace, run_dirs: dict[str, str], root: str, max_new_tokens: int) -> None:
    """`erpo eval --model NAME=RUN_DIR@all ...` over every run (`run_dirs`: name -> run dir) into ROOT/history, with
    the runs' own response budget (rollout.max_new_tokens)."""
    from erpo.eval.model_specs import RUN_HISTORY_SUFFIX
    parser = argparse.ArgumentParser(prog="erpo compare --eval-history")
    add_eval_arguments(parser)
    run_eval(parser.parse_args([
        "--model", ",".join(f"{name}={run_dir}{RUN_HISTORY_SUFFIX}" for name, run_dir in run_dirs.items()),
        "--output-dir", os.path.join(root, HISTORY_DIR), "--temperatures", args.eval_temperatures,
        "--k", str(args.eval_k), "--benchmarks", args.eval_benchmarks, "--max-new-tokens", str(max_new_tokens)]))


def window_means(records: list[dict], window: int) -> dict[str, float | None]:
    """`{"KEY first", "KEY last"}` -> mean of metric KEY over the first / last `window` records that log it, and
    "steps": how many optimizer steps the run logged."""
    out: dict[str, float | None] = {"steps": len(records)}
    for key, _ in METRICS:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        n = min(window, len(values))
        out[f"{key} first"] = statistics.fmean(values[:n]) if n else None
        out[f"{key} last"] = statistics.fmean(values[-n:]) if n else None
    return out


def overlap_note(window: int, steps: list[int]) -> str:
    """What a reader of a short run's table must know: the first and last windows are the same steps, or overlap."""
    if steps[0] <= window:
        return f" (no more than --window {window}: its first and last windows are the same steps, the whole run)"
    if steps[0] < 2 * window:
        return f" (fewer than 2 x --window {window}: its first and last windows overlap)"
    return ""


def _spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def machine_description() -> str:
    """CPU model, core count, GPU (if any) and torch version: where the numbers were measured."""
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {gpu}, torch {torch.__version__}"


def code_commit() -> str:
    """`git describe` of the erpo source tree (with -dirty for uncommitted changes), or "unknown"."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=here, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def render(results: dict, algorithms: list[str], seeds: list[int], window: int, header: dict) -> str:
    """comparison.md: header lines, the mean ± std table, the paired differences and each seed's values."""
    steps = sorted({results[a][s]["steps"] for a in algorithms for s in seeds})
    span = min(window, steps[0]) if len(steps) == 1 else None   # the steps each window averages, when one number
    label = f"{span}" if span is not None else f"≤ {window}"
    columns = [(f"{key} {side}", f"{title}, {side} {label} steps") for key, title in METRICS
               for side in ("first", "last")]
    lines = ["# erpo compare", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    logged = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]} to {steps[-1]}"
    lines += [f"Mean ± standard deviation over {len(seeds)} seeds of each run's average over its first / last "
              f"{label} optimizer steps; each run logged {logged} optimizer steps" + overlap_note(window, steps) + ".",
              ""]
    lines += ["| algorithm | " + " | ".join(t for _, t in columns) + " |", "|---|" + ":---:|" * len(columns)]
    for a in algorithms:
        cells = [_spread([results[a][s][c] for s in seeds]) if all(results[a][s][c] is not None for s in seeds)
                 else "n/a" for c, _ in columns]
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    base = algorithms[0]
    if len(algorithms) > 1:
        lines += ["", f"Paired differences ({base} minus each other algorithm, same seed): mean ± standard error "
                      f"over seeds, and in how many seeds {base} is higher.", ""]
        lines += ["| difference | " + " | ".join(t for _, t in columns) + " |", "|---|" + ":---:|" * len(columns)]
        for other in algorithms[1:]:
            cells = []
            for c, _ in columns:
                diffs = [results[base][s][c] - results[other][s][c] for s in seeds
                         if results[base][s][c] is not None and results[other][s][c] is not None]
                if not diffs:
                    cells.append("n/a")
                    continue
                se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
                cells.append(f"{statistics.fmean(diffs):+.4f} ± {se:.4f} ({sum(d > 0 for d in diffs)}/{len(diffs)})")
            lines.append(f"| {base} - {other} | " + " | ".join(cells) + " |")
    lines += ["", "Each run:", "", "| run | steps | " + " | ".join(t for _, t in columns) + " | wall time (s) |",
              "|---|" + ":---:|" * (len(columns) + 2)]
    for a in algorithms:
        for s in seeds:
            row = results[a][s]
            cells = ["n/a" if row[c] is None else f"{row[c]:.4f}" for c, _ in columns]
            wall = "reused" if row["wall_s"] is None else f"{row['wall_s']:.0f}"   # a resumed run: its last part
            lines.append(f"| {a} seed {s} | {row['steps']} | " + " | ".join(cells) + f" | {wall} |")
    return "\n".join(lines) + "\n"


def run_finished(run_dir: str) -> bool:
    """Whether the training run in `run_dir` ended (its final/ model written), not stopped or crashed midway."""
    return os.path.isfile(os.path.join(run_dir, "final", "config.json"))


def run_compare(args: argparse.Namespace) -> dict[str, str]:
    """Entry point of `erpo compare`: train the missing runs, write comparison.md / .json, print the table, then
    (--eval-history) evaluate the runs' histories. Returns the comparison's paths ({} when a signal stopped a run:
    nothing is tabulated)."""
    # the trainer (torch, the models) and matplotlib load when the command runs, not when the parser is built
    from erpo import distributed
    from erpo.config import dump_yaml
    from erpo.plotting import read_metrics
    from erpo.train import loop as trainer
    from erpo.train.checkpoint import CheckpointManager
    if args.window < 1:
        raise UserError(f"--window must be >= 1, got {args.window}", exit_code=2)
    if args.eval_history:
        check_history_arguments(args)
    algorithms, seeds = list(dict.fromkeys(args.algorithms)), list(dict.fromkeys(args.seeds))
    root = args.output_dir or DEFAULT_OUTPUT_DIR
    results: dict[str, dict[int, dict]] = {a: {} for a in algorithms}
    run_dirs = {}
    for a in algorithms:
        for s in seeds:
            run_dir = run_dirs[f"{a}-seed{s}"] = os.path.join(root, f"{a}-seed{s}")
            cfg = config_from_args(args, (f"algorithm.name={a}", f"trainer.seed={s}", f"output_dir={run_dir}"))
            config_file = os.path.join(run_dir, "config.yaml")
            finished = run_finished(run_dir)
            wall = None
            if finished and Path(config_file).read_text() == dump_yaml(cfg):
                log.info("erpo compare: %s seed %d: reusing the finished run %s", a, s, run_dir)
            elif finished:
                raise UserError(f"{run_dir}: holds a finished run with another config ({config_file}); use another "
                                "--output-dir, or delete that run")
            else:
                resume = CheckpointManager(run_dir, keep_last=None).latest() is not None
                log.info("erpo compare: %s %s seed %d -> %s", "resuming" if resume else "training", a, s, run_dir)
                started = time.time()
                try:
                    trainer.train(cfg, resume=resume)
                finally:
                    distributed.destroy_distributed()
                if not run_finished(run_dir):   # a SIGTERM (preemption) stopped it at a step boundary: stop here too
                    log.warning("erpo compare: %s seed %d stopped unfinished (a signal); the finished runs and this "
                                "run's newest checkpoint are kept: the same command continues", a, s)
                    return {}
                wall = time.time() - started
            results[a][s] = {**window_means(read_metrics(os.path.join(run_dir, "metrics.jsonl")), args.window),
                             "wall_s": wall}
    header = {"date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
              "machine": machine_description(), "commit": code_commit(),
              "command": getattr(args, "command_line", None) or "erpo compare",
              "runs": f"{root}/ALGORITHM-seedSEED"}
    text = render(results, algorithms, seeds, args.window, header)
    paths = {"md": os.path.join(root, "comparison.md"), "json": os.path.join(root, "comparison.json")}
    os.makedirs(root, exist_ok=True)
    with open(paths["md"], "w", encoding="utf-8") as handle:
        handle.write(text)
    with open(paths["json"], "w", encoding="utf-8") as handle:
        json.dump({"header": header, "window": args.window,
                   "runs": {a: {str(s): results[a][s] for s in seeds} for a in algorithms}}, handle, indent=1)
    print(text)
    for path in paths.values():
        print(path)
    if args.eval_history:
        evaluate_histories(args, run_dirs, root, cfg.rollout.max_new_tokens)   # the same in every run
    return paths
