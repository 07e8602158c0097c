"""Scores and tables of `erpo eval`: metrics per (model, benchmark, temperature), averaged over benchmarks
("Avg.") and over the paper's temperature ranges, written as results.md / .json / .csv in the paper's Table 2
layout and plotted as accuracy vs temperature; for runs' histories (`RUN_DIR@all`), also a table step x temperature
per run (history.md / .csv) and its figure (accuracy_over_steps.png)."""
from __future__ import annotations

import csv
import json
import os

from erpo.eval.metrics import summarize_correctness
from erpo.eval.model_specs import ModelSpec
from erpo.plotting import plot_history, plot_temperature_curves

ALL_TEMPERATURES = "all"
# Temperature ranges of the paper's tables: label -> membership test.
TEMPERATURE_RANGES = {
    ALL_TEMPERATURES: lambda t: True,
    "<=1.0": lambda t: t <= 1.0 + 1e-9,
    "1.2-1.5": lambda t: 1.2 - 1e-9 <= t <= 1.5 + 1e-9,
}
# Their titles in results.md.
RANGE_NAMES = {ALL_TEMPERATURES: "all temperatures", "<=1.0": "temperatures <= 1.0",
               "1.2-1.5": "temperatures 1.2-1.5"}
BENCHMARK_AVERAGE = "Avg."


def score_samples(samples_by_problem: list[list[dict]], pass_ks: list[int]) -> dict:
    """Metrics of one (model, benchmark, temperature): summarize_correctness plus response statistics."""
    correct = [[bool(s["correct"]) for s in samples] for samples in samples_by_problem]
    scores = summarize_correctness(correct, pass_ks)
    flat = [s for samples in samples_by_problem for s in samples]
    scores["mean_response_tokens"] = sum(s["num_tokens"] for s in flat) / len(flat)
    scores["truncated_frac"] = sum(bool(s["truncated"]) for s in flat) / len(flat)
    return scores


def range_members(temperatures) -> dict[str, list[float]]:
    """TEMPERATURE_RANGES label -> the given temperatures inside that range, for each range holding any."""
    members = {label: [t for t in temperatures if inside(t)] for label, inside in TEMPERATURE_RANGES.items()}
    return {label: temps for label, temps in members.items() if temps}


def headline_metrics(k: int) -> list[tuple[str, str]]:
    """(row key, title) of the reported metrics: Avg@k, Pass@k, Pass@1 (Pass@k is Pass@1 when k == 1)."""
    return list(dict.fromkeys([(f"avg@{k}", f"Avg@{k}"), (f"pass@{k}", f"Pass@{k}"), ("pass@1", "Pass@1")]))


def _mean_rows(rows: list[dict], metric_keys: list[str]) -> dict:
    return {key: sum(r[key] for r in rows) / len(rows) for key in metric_keys}


def aggregate(per_temperature: list[dict], metric_keys: list[str]) -> list[dict]:
    """Add benchmark-average rows and temperature-range rows to per-temperature rows.

    per_temperature: rows ``{"model", "benchmark", "temperature": float, **metrics}``.
    Returns all rows; ``temperature`` is a float for single temperatures or a label of
    TEMPERATURE_RANGES; ``benchmark`` is BENCHMARK_AVERAGE for the unweighted mean over benchmarks.
    """
    rows = list(per_temperature)
    models = list(dict.fromkeys(r["model"] for r in rows))
    benches = list(dict.fromkeys(r["benchmark"] for r in rows))
    temps = sorted({r["temperature"] for r in rows})
    for model in models:
        for t in temps:
            group = [r for r in per_temperature if r["model"] == model and r["temperature"] == t]
            rows.append({"model": model, "benchmark": BENCHMARK_AVERAGE, "temperature": t,
                         **_mean_rows(group, metric_keys)})
    ranged = []
    for label, members in range_members(temps).items():
        for model in models:
            for bench in [*benches, BENCHMARK_AVERAGE]:
                group = [r for r in rows if r["model"] == model and r["benchmark"] == bench
                         and r["temperature"] in members]
                ranged.append({"model": model, "benchmark": bench, "temperature": label,
                               **_mean_rows(group, metric_keys)})
    return rows + ranged


def _table(header: list[str], body: list[list[float | str]], bold_best: bool) -> list[str]:
    """Markdown table; numbers with 3 decimals, the best of each numeric column in bold."""
    best = {}
    if bold_best:
        for col in range(1, len(header)):
            values = [row[col] for row in body if isinstance(row[col], float)]
            if values:
                best[col] = max(values)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + [":---:"] * (len(header) - 1)) + "|"]
    for row in body:
        cells = []
        for col, value in enumerate(row):
            if isinstance(value, float):
                text = f"{value:.3f}"
                cells.append(f"**{text}**" if col in best and value == best[col] else text)
            else:
                cells.append(str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(rows: list[dict], *, models: list[str], benchmarks: list[str], temperatures: list[float],
                    k: int, settings: dict) -> str:
    """The paper's Table 2 layout (one block per metric: models x benchmarks + Avg.) for each temperature
    range, then the per-temperature table (models x temperatures + range means) of the benchmark average."""
    metrics = headline_metrics(k)
    ranges = range_members(temperatures)
    index = {(r["model"], r["benchmark"], r["temperature"]): r for r in rows}
    bold = len(models) > 1
    out = ["# erpo eval results", ""]
    out += [f"- {key}: {value}" for key, value in settings.items()]
    out.append("")
    for label, members in ranges.items():
        out += [f"## Mean over {RANGE_NAMES[label]} ({', '.join(f'{t:g}' for t in members)})", ""]
        for key, title in metrics:
            out += [f"**Mean {title}**", ""]
            body = [[m, *[index[(m, b, label)][key] for b in [*benchmarks, BENCHMARK_AVERAGE]]] for m in models]
            out += _table(["Model", *benchmarks, BENCHMARK_AVERAGE], body, bold) + [""]
    out += [f"## By temperature ({BENCHMARK_AVERAGE} over benchmarks)", ""]
    header = ["Model", "Metric", *[f"T={t:g}" for t in temperatures], *[f"mean {r}" for r in ranges]]
    body = []
    for key, title in metrics:
        for m in models:
            body.append([m, title, *[index[(m, BENCHMARK_AVERAGE, t)][key] for t in temperatures],
                         *[index[(m, BENCHMARK_AVERAGE, r)][key] for r in ranges]])
    out += _table(header, body, bold_best=False) + [""]
    return "\n".join(out)


def write_results(output_dir: str, rows: list[dict], *, models: list[str], benchmarks: list[str],
                  temperatures: list[float], k: int, settings: dict) -> dict[str, str]:
    """Write results.md, results.json, results.csv and accuracy_vs_temperature.png; return their paths."""

    os.makedirs(output_dir, exist_ok=True)
    paths = {name: os.path.join(output_dir, f"results.{name}") for name in ("md", "json", "csv")}
    with open(paths["md"], "w", encoding="utf-8") as handle:
        handle.write(render_markdown(rows, models=models, benchmarks=benchmarks, temperatures=temperatures,
                                     k=k, settings=settings))
    with open(paths["json"], "w", encoding="utf-8") as handle:
        json.dump({"settings": settings, "rows": rows}, handle, indent=1)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(paths["csv"], "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    where = benchmarks[0] if len(benchmarks) == 1 else f"mean of {len(benchmarks)} benchmarks"
    average = {(r["model"], r["temperature"]): r for r in rows if r["benchmark"] == BENCHMARK_AVERAGE}
    curves = {f"{title} ({where})": {m: {t: average[(m, t)][key] for t in temperatures} for m in models}
              for key, title in headline_metrics(k)}
    paths["png"] = plot_temperature_curves(curves, os.path.join(output_dir, "accuracy_vs_temperature.png"))
    return paths


def history_rows(rows: list[dict], models: list[ModelSpec], k: int) -> list[dict]:
    """The benchmark-average scores of every model of a run's history: ``{"run", "step", "temperature", **headline
    metrics}``, runs in the order given, steps ascending, each temperature then each range of TEMPERATURE_RANGES."""
    keys = [key for key, _ in headline_metrics(k)]
    runs = list(dict.fromkeys(m.history for m in models if m.history is not None))
    out = []
    for model in sorted((m for m in models if m.history is not None), key=lambda m: (runs.index(m.history), m.step)):
        for row in rows:
            if row["model"] == model.label and row["benchmark"] == BENCHMARK_AVERAGE:
                out.append({"run": model.history, "step": model.step, "temperature": row["temperature"],
                            **{key: row[key] for key in keys}})
    return out


def render_history(history: list[dict], *, temperatures: list[float], k: int, where: str) -> str:
    """history.md: per run, a table of Avg@k by training step (rows) and temperature (columns, then range means)."""
    key, title = headline_metrics(k)[0]
    columns = [*temperatures, *range_members(temperatures)]
    out = ["# erpo eval: accuracy over training steps", "",
           f"{title} ({where}) of each kept checkpoint of each run (step 0: the model the run started from), by "
           "sampling temperature and over the paper's temperature ranges. Full metrics: history.csv.", ""]
    for run in dict.fromkeys(r["run"] for r in history):
        cells = {(r["step"], r["temperature"]): r[key] for r in history if r["run"] == run}
        out += [f"## {run}", ""]
        header = ["step", *[f"T={c:g}" if isinstance(c, float) else f"mean {c}" for c in columns]]
        body = [[str(step), *[cells[(step, c)] for c in columns]] for step in sorted({s for s, _ in cells})]
        out += _table(header, body, bold_best=False) + [""]
    return "\n".join(out)


def write_history(output_dir: str, rows: list[dict], *, models: list[ModelSpec], benchmarks: list[str],
                  temperatures: list[float], k: int) -> dict[str, str]:
    """Write history.md, history.csv and accuracy_over_steps.png for the runs' histories among `models`; return
    their paths ({} when no model is part of a history)."""
    history = history_rows(rows, models, k)
    if not history:
        return {}
    where = benchmarks[0] if len(benchmarks) == 1 else f"mean of {len(benchmarks)} benchmarks"
    paths = {"history_md": os.path.join(output_dir, "history.md"),
             "history_csv": os.path.join(output_dir, "history.csv")}
    with open(paths["history_md"], "w", encoding="utf-8") as handle:
        handle.write(render_history(history, temperatures=temperatures, k=k, where=where))
    with open(paths["history_csv"], "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(history[0]))
        writer.writeheader()
        writer.writerows(history)
    key, title = headline_metrics(k)[0]
    curves: dict[str, dict[float, dict[int, float]]] = {}
    for r in history:
        if isinstance(r["temperature"], float):
            curves.setdefault(r["run"], {}).setdefault(r["temperature"], {})[r["step"]] = r[key]
    paths["history_png"] = plot_history(curves, os.path.join(output_dir, "accuracy_over_steps.png"),
                                        metric=f"{title} ({where})")
    return paths
