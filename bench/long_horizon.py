"""The long-horizon tiny experiment's summary (docs/tiny_comparison.md, "Long training over temperatures").

    python -m bench.long_horizon --runs RUNS_DIR --history EVAL_DIR/history.csv --out OUT_DIR [--metric avg@16]
        [--paired erpo grpo] [--late-from STEP]
    python -m bench.long_horizon --records RECORDS_DIR [--set train] --out OUT_DIR [...]

RUNS_DIR holds one training run per (algorithm, seed), named ALG-sSEED (its metrics.jsonl is read); history.csv is
what `erpo eval --model ALG-sSEED=RUNS_DIR/ALG-sSEED@all ...` wrote for them (one call, or several into one output
directory and a last one over all runs). RECORDS_DIR instead is a folder of `bench.pilot_records` (bench/run_record.py):
the runs' records from any number of sessions and machines, each with its rows of the --set's history. Writes to
OUT_DIR:
- `long_horizon.md`: the runs, each with the commit and machine it trained on and when (from the pilot's
  journal.jsonl in RUNS_DIR, or the record's; "-" where there is none); then per algorithm and kept step, the mean
  over seeds (and the min-max) of Avg@k at temperatures <= 1.0 and 1.2-1.5 (each the mean over that range's
  temperatures), then of the Query-KL and the entropy, each averaged over the WINDOW rollout steps ending at that
  step; then, when both algorithms of --paired (A B) have runs,
  A minus B on the same seed at each temperature range and kept step (and, with --late-from, over each seed's mean of
  the kept steps from STEP on, one pre-declared number per seed): each seed's difference, their mean and standard
  error, how many seeds favour A, and the exact sign-flip and paired t p-values (bench/paired.py);
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
import os
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.paired import paired_summary  # noqa: E402
from bench.run_record import history_name, provenance, record_histories, run_journal, step_values  # noqa: E402
from erpo.plotting import plot_history  # noqa: E402

RUN_NAME = re.compile(r"^(?P<algorithm>.+)-s(?P<seed>\d+)$")
RANGES = ("<=1.0", "1.2-1.5")
WINDOW = 50   # rollout steps averaged for the Query-KL and entropy at a kept step


def split_run(run: str) -> tuple[str, int]:
    """(algorithm, seed) of a run named ALG-sSEED."""
    match = RUN_NAME.match(run)
    if match is None:
        raise ValueError(f"run {run!r} is not named ALG-sSEED")
    return match["algorithm"], int(match["seed"])


def spread(values: list[float], seeds: int | None = None) -> str:
    """'mean (min-max)' of the seeds' values, with '(n/SEEDS seeds)' when fewer than `seeds` have one; '-' for none."""
    if not values:
        return "-"
    shown = f"{sum(values) / len(values):.3f} ({min(values):.3f}-{max(values):.3f})"
    return shown if seeds is None or len(values) == seeds else f"{shown} ({len(values)}/{seeds} seeds)"


def read_history(paths: list[str], metric: str) -> dict[str, dict[str, dict[int, float]]]:
    """{run: {temperature or range: {step: metric}}} from history.csv files (one, or a record's file per run)."""
    out: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                out[row["run"]][row["temperature"]][int(row["step"])] = float(row[metric])
    return out


def windowed(runs_dir: str, run: str, key: str, steps: list[int]) -> dict[int, float]:
    """{step: mean of `key` over the WINDOW rollout steps ending at step} from the run's metrics (its record's or
    its metrics.jsonl), for the steps the run has logged."""
    values = step_values(Path(runs_dir, run), key)
    last = max(values, default=0)
    return {s: sum(v for t, v in values.items() if s - WINDOW < t <= s) / WINDOW for s in steps if 0 < s <= last}


def paired_lines(history: dict, runs_of: dict[str, dict[int, str]], pair: tuple[str, str], steps: list[int],
                 metric: str, late_from: int | None) -> list[str]:
    """Markdown tables of `pair` = (A, B): per temperature range, A - B on the same seed at each kept step both runs
    of a seed reached (and the late-phase row, see the module docstring), as paired_summary sums them up."""
    a, b = pair
    seeds = sorted(runs_of[a].keys() & runs_of[b].keys())
    late = [s for s in steps if late_from is not None and s >= late_from]
    lines = [f"### {a} - {b}, {metric}: paired over seeds", "",
             f"{a} minus {b} trained on the same seed: the mean over seeds ± its standard error, in how many seeds {a} "
             "is higher, the two-sided p-values of the exact sign-flip test (never below 2/2^n: 0.0625 for 5 seeds) "
             "and of the paired t-test, and each seed's difference.", ""]
    for name in RANGES:
        # {algorithm: {seed: {step: value}}}
        points = {x: {seed: history[runs_of[x][seed]][name] for seed in seeds} for x in pair}
        rows = [(str(step), {seed: points[a][seed][step] - points[b][seed][step] for seed in seeds
                             if step in points[a][seed] and step in points[b][seed]})
                for step in steps]
        if late:   # only the seeds whose two runs reached every late kept step
            rows.append((f"mean of steps {late[0]}-{late[-1]} ({len(late)} kept)",
                         {seed: sum(points[a][seed][s] - points[b][seed][s] for s in late) / len(late)
                          for seed in seeds if all(s in points[x][seed] for x in pair for s in late)}))
        lines += [f"#### temperatures {name}", "",
                  f"| step | seeds | mean ± s.e. | {a} higher | sign-flip p | paired t p | each seed |",
                  "|---|:---:|:---:|:---:|:---:|:---:|---|"]
        for label, differences in rows:
            if not differences:
                continue
            summary = paired_summary(list(differences.values()))
            se = "-" if summary.standard_error is None else f"{summary.standard_error:.3f}"
            t_p = "-" if summary.t_p is None else f"{summary.t_p:.3g}"
            each = ", ".join(f"s{seed} {d:+.3f}" for seed, d in differences.items())
            lines.append(f"| {label} | {summary.n} | {summary.mean:+.3f} ± {se} | {summary.positive}/{summary.n} | "
                         f"{summary.sign_flip_p:.3g} | {t_p} | {each} |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", help="the runs' folder (ALG-sSEED/metrics.jsonl), with --history")
    parser.add_argument("--history", help="their evaluation's history.csv")
    parser.add_argument("--records", help="a bench.pilot_records folder instead of --runs and --history")
    parser.add_argument("--set", default="train", dest="set_name",
                        help="with --records: the evaluation set whose rows are read (train, heldout)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--metric", default="avg@16")
    parser.add_argument("--paired", nargs=2, default=["erpo", "grpo"], metavar=("A", "B"),
                        help="tabulate A minus B on the same seed (skipped unless both have runs)")
    parser.add_argument("--late-from", type=int, metavar="STEP",
                        help="add a row of each seed's mean over the kept steps from STEP on (the late phase)")
    args = parser.parse_args(argv)
    if args.records is not None and (args.runs or args.history):
        parser.error("give --records, or --runs and --history, not both")
    if args.records is not None:
        args.runs = args.records
        histories = [str(path) for path in record_histories(Path(args.records), args.set_name)]
        if not histories:
            parser.error(f"--records {args.records}: no run has a {history_name(args.set_name)}; check the folder "
                         "and --set")
    elif args.runs and args.history:
        histories = [args.history]
    else:
        parser.error("give --runs and --history (a pilot's folders), or --records (bench.pilot_records)")
    history = read_history(histories, args.metric)
    by_algorithm: dict[str, list[str]] = defaultdict(list)
    runs_of: dict[str, dict[int, str]] = defaultdict(dict)   # {algorithm: {seed: run}}
    for run in history:
        algorithm, seed = split_run(run)
        by_algorithm[algorithm].append(run)
        runs_of[algorithm][seed] = run
    steps = sorted({s for run in history.values() for points in run.values() for s in points})
    temperatures = sorted({t for run in history.values() for t in run if t not in RANGES and t != "all"}, key=float)
    os.makedirs(args.out, exist_ok=True)

    lines = ["### runs: where and when each trained (its journal)", "",
             "| run | commit | machine | trained (UTC) |", "|---|---|---|---|"]
    for run in sorted(history, key=split_run):
        where = provenance(run_journal(Path(args.runs), run), run)
        lines.append(f"| {run} | {where['commit']} | {where['machine']} | {where['trained']} |")
    lines += ["", f"{args.metric} over kept steps: mean over seeds (min-max); seeds per algorithm: "
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
    if all(algorithm in runs_of for algorithm in args.paired):
        lines += paired_lines(history, runs_of, tuple(args.paired), steps, args.metric, args.late_from)
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
