"""`erpo compare`: train several algorithms over several seeds and tabulate mean and spread of their metrics.

    erpo compare [--config FILE] [--algorithms erpo grpo] [--seeds 1 2 3] [--max-steps N] [--window 20]
                 [--output-dir runs/compare] [--set key=value ...]

Each (algorithm, seed) trains into OUTPUT_DIR/ALGORITHM-seedSEED; a finished run with the same resolved config is
reused and an unfinished one resumed from its newest checkpoint, so an interrupted comparison continues where it
stopped. OUTPUT_DIR/comparison.md and .json then hold,
per algorithm, the mean and standard deviation over seeds of reward, accuracy and Query-KL averaged over the first
and the last `window` optimizer steps, each seed's values, and the paired difference of every other algorithm from
the first one (same seed: same prompts and rollout seeds), with the machine, date, commit and command.
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

from erpo import distributed
from erpo.cli.args import config_from_args
from erpo.config import PRESETS, dump_yaml
from erpo.errors import UserError
from erpo.plotting import read_metrics
from erpo.train import loop as trainer
from erpo.train.checkpoint import CheckpointManager

log = logging.getLogger("erpo")

DEFAULT_OUTPUT_DIR = "runs/compare"
METRICS = (("reward", "reward"), ("accuracy", "accuracy"), ("qkl", "Query-KL"))   # (metrics.jsonl key, title)


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    """Register `erpo compare` options (besides --config, --output-dir and --set)."""
    p.add_argument("--algorithms", nargs="+", choices=sorted(PRESETS), default=["erpo", "grpo"],
                   help="algorithms to compare; differences are taken from the first (default: erpo grpo)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="trainer.seed values (default: 1 2 3)")
    p.add_argument("--max-steps", type=int, help="rollout steps of every run (trainer.max_steps)")
    p.add_argument("--window", type=int, default=20,
                   help="average each metric over the first and the last N optimizer steps (default: 20)")


def window_means(records: list[dict], window: int) -> dict[str, float | None]:
    """`{"KEY first", "KEY last"}` -> mean of metric KEY over the first / last `window` records that log it."""
    out = {}
    for key, _ in METRICS:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        n = min(window, len(values))
        out[f"{key} first"] = statistics.fmean(values[:n]) if n else None
        out[f"{key} last"] = statistics.fmean(values[-n:]) if n else None
    return out


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
    columns = [(f"{key} {side}", f"{title}, {side} {window} steps") for key, title in METRICS
               for side in ("first", "last")]
    lines = ["# erpo compare", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines += [f"Mean ± standard deviation over {len(seeds)} seeds of each run's average over its first / last "
              f"{window} optimizer steps.", ""]
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
    lines += ["", "Each run:", "", "| run | " + " | ".join(t for _, t in columns) + " | wall time (s) |",
              "|---|" + ":---:|" * (len(columns) + 1)]
    for a in algorithms:
        for s in seeds:
            row = results[a][s]
            cells = ["n/a" if row[c] is None else f"{row[c]:.4f}" for c, _ in columns]
            wall = "reused" if row["wall_s"] is None else f"{row['wall_s']:.0f}"   # a resumed run: its last part
            lines.append(f"| {a} seed {s} | " + " | ".join(cells) + f" | {wall} |")
    return "\n".join(lines) + "\n"


def run_compare(args: argparse.Namespace) -> dict[str, str]:
    """Entry point of `erpo compare`: train the missing runs, write comparison.md / .json, print the table.
    Returns their paths."""
    if args.window < 1:
        raise UserError(f"--window must be >= 1, got {args.window}", exit_code=2)
    algorithms, seeds = list(dict.fromkeys(args.algorithms)), list(dict.fromkeys(args.seeds))
    root = args.output_dir or DEFAULT_OUTPUT_DIR
    results: dict[str, dict[int, dict]] = {a: {} for a in algorithms}
    for a in algorithms:
        for s in seeds:
            run_dir = os.path.join(root, f"{a}-seed{s}")
            cfg = config_from_args(args, (f"algorithm.name={a}", f"trainer.seed={s}", f"output_dir={run_dir}"))
            config_file = os.path.join(run_dir, "config.yaml")
            finished = os.path.isfile(os.path.join(run_dir, "final", "config.json"))
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
    return paths
