"""The long-horizon tiny experiment's summary (docs/tiny_comparison.md, "Long training over temperatures").

    python -m bench.long_horizon --runs RUNS_DIR --history EVAL_DIR/history.csv --out OUT_DIR

RUNS_DIR holds one training run per (algorithm, seed), named ALG-sSEED (its metrics.jsonl is read); history.csv is
what `erpo eval --model ALG-sSEED=RUNS_DIR/ALG-sSEED@all ...` wrote for them (one call, or several into one output
directory and a last one over all runs). Writes to OUT_DIR:
- `long_horizon.md`: per algorithm and kept step, the mean over seeds (and the min-max) of Avg@k at temperatures
  <= 1.0 and 1.2-1.5 (each the mean over that range's temperatures), then of the Query-KL and the entropy, each
  averaged over the WINDOW rollout steps ending at that step;
- `long_horizon_accuracy.png`: accuracy over steps, one panel per algorithm, one line per temperature (means over
  seeds; `erpo.plotting.plot_history`);
- `long_horizon_drift.png`: Query-KL (log scale) and entropy over steps, one line per algorithm (mean over seeds,
  the band: min-max).
Runs may stand at different steps (an unfinished pilot): a step is averaged over the seeds that reached it, a cell
says "(n/N seeds)" when some have not, and "-" when none has.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from erpo.plotting import plot_history  # noqa: E402

RUN_NAME = re.compile(r"^(?P<algorithm>.+)-s(?P<seed>\d+)$")
RANGES = ("<=1.0", "1.2-1.5")
WINDOW = 50   # rollout steps averaged for the Query-KL and entropy at a kept step


def algorithm_of(run: str) -> str:
    match = RUN_NAME.match(run)
    if match is None:
        raise ValueError(f"run {run!r} is not named ALG-sSEED")
    return match["algorithm"]


def spread(values: list[float], seeds: int | None = None) -> str:
    """'mean (min-max)' of the seeds' values, with '(n/SEEDS seeds)' when fewer than `seeds` have one; '-' for none."""
    if not values:
        return "-"
    shown = f"{sum(values) / len(values):.3f} ({min(values):.3f}-{max(values):.3f})"
    return shown if seeds is None or len(values) == seeds else f"{shown} ({len(values)}/{seeds} seeds)"


def read_history(path: str, metric: str) -> dict[str, dict[str, dict[int, float]]]:
    """{run: {temperature or range: {step: metric}}} from history.csv."""
    out: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    with open(path, encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            out[row["run"]][row["temperature"]][int(row["step"])] = float(row[metric])
    return out


def windowed(runs_dir: str, run: str, key: str, steps: list[int]) -> dict[int, float]:
    """{step: mean of `key` over the WINDOW rollout steps ending at step} from the run's metrics.jsonl, for the
    steps the run has logged."""
    values = {}
    with open(os.path.join(runs_dir, run, "metrics.jsonl"), encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if record.get(key) is not None:
                values[int(record["step"])] = float(record[key])
    last = max(values, default=0)
    return {s: sum(v for t, v in values.items() if s - WINDOW < t <= s) / WINDOW for s in steps if 0 < s <= last}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True)
    parser.add_argument("--history", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--metric", default="avg@16")
    args = parser.parse_args(argv)
    history = read_history(args.history, args.metric)
    by_algorithm: dict[str, list[str]] = defaultdict(list)
    for run in history:
        by_algorithm[algorithm_of(run)].append(run)
    steps = sorted({s for run in history.values() for points in run.values() for s in points})
    temperatures = sorted({t for run in history.values() for t in run if t not in RANGES and t != "all"}, key=float)
    os.makedirs(args.out, exist_ok=True)

    lines = [f"{args.metric} over kept steps: mean over seeds (min-max); seeds per algorithm: "
             + ", ".join(f"{a} {len(r)}" for a, r in by_algorithm.items()), ""]
    for name in RANGES:
        lines += [f"### {args.metric}, temperatures {name}", "", "| step | " + " | ".join(by_algorithm) + " |",
                  "|---|" + ":---:|" * len(by_algorithm)]
        for step in steps:
            cells = [spread([history[r][name][step] for r in runs if step in history[r][name]], len(runs))
                     for runs in by_algorithm.values()]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        lines.append("")
    drift = {key: {run: windowed(args.runs, run, key, steps) for runs in by_algorithm.values() for run in runs}
             for key in ("qkl", "entropy")}
    for key in drift:
        lines += [f"### {key}, mean over the {WINDOW} rollout steps ending at the step", "",
                  "| step | " + " | ".join(by_algorithm) + " |", "|---|" + ":---:|" * len(by_algorithm)]
        for step in steps[1:]:
            cells = [spread([drift[key][r][step] for r in runs if step in drift[key][r]], len(runs))
                     for runs in by_algorithm.values()]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        lines.append("")
    Path(args.out, "long_horizon.md").write_text("\n".join(lines), encoding="utf-8")

    curves = {alg: {float(t): {s: sum(v) / len(v) for s in steps
                               if (v := [history[r][t][s] for r in runs if s in history[r][t]])}
                    for t in temperatures} for alg, runs in by_algorithm.items()}
    plot_history(curves, os.path.join(args.out, "long_horizon_accuracy.png"),
                 metric=f"{args.metric}, mean over seeds")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key in zip(axes, drift):
        for alg, runs in by_algorithm.items():
            xs = [s for s in steps[1:] if any(s in drift[key][r] for r in runs)]
            per_seed = [[drift[key][r][s] for r in runs if s in drift[key][r]] for s in xs]
            ax.plot(xs, [sum(v) / len(v) for v in per_seed], marker="o", markersize=3, label=alg)
            ax.fill_between(xs, [min(v) for v in per_seed], [max(v) for v in per_seed], alpha=0.2)
        ax.set_title(f"{key} (mean of {WINDOW} steps; band: seeds' min-max)")
        ax.set_xlabel("training step (rollout steps)")
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "long_horizon_drift.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
