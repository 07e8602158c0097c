"""PNG figures: training dynamics from ``metrics.jsonl`` and evaluation accuracy vs temperature and over steps.

``plot_runs`` draws the paper's Figures 1/5 view (reward, Query-KL, Policy-KL, entropy per step, several
runs overlaid); ``plot_temperature_curves`` draws the paper's Figure "Variation of Metrics with
Temperature" (one line per model); ``plot_history`` its long-horizon view (accuracy over training steps, one
line per temperature, one panel per run). All use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from erpo.records import iter_jsonl, with_current_metric_names  # noqa: E402

# (metrics.jsonl key, panel title) in drawing order.
DYNAMICS_PANELS = (
    ("reward", "Reward"),
    ("qkl", "Query-KL"),
    ("policy_kl", "Policy-KL"),
    ("entropy", "Entropy"),
)


def read_metrics(path: str) -> list[dict]:
    """Records of a ``metrics.jsonl`` sorted by ``step``, under today's metric names (a run logged before a rename
    reads as a new one); the last record of a repeated step wins (a resumed run logs the steps after its checkpoint
    again) and a torn last line (crash) is skipped."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics file at {path}")
    by_step: dict[int, dict] = {}
    for line_no, record in iter_jsonl(path, torn_tail_ok=True):  # a torn final line: an interrupted run
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}:{line_no}: each record must be an object with a 'step'")
        by_step[int(record["step"])] = with_current_metric_names(record)
    return [by_step[step] for step in sorted(by_step)]


def _metrics_path(run_dir: str) -> str:
    if os.path.isfile(run_dir):
        return run_dir
    return os.path.join(run_dir, "metrics.jsonl")


def _run_label(run_dir: str) -> str:
    path = os.path.abspath(run_dir)
    if os.path.isfile(path):
        path = os.path.dirname(path)
    return os.path.basename(path.rstrip(os.sep)) or path


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: the exponential moving average with weight `weight` in [0, 1), debiased. After k
    values the running sum is divided by 1 - weight**k (the total weight it holds), so early points are averages of
    the values so far, not pulled toward 0 or toward the first value."""
    out, running = [], 0.0
    for k, value in enumerate(values, 1):
        running = weight * running + (1.0 - weight) * value
        out.append(running / (1.0 - weight ** k))
    return out


def _save(fig, out_png: str) -> str:
    """Lay out `fig`, write it to `out_png` (creating its directory), close it; returns out_png."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def plot_runs(run_dirs: list[str], out_png: str, *, labels: list[str] | None = None, smooth: float = 0.0) -> str:
    """Write a 2x2 PNG of reward, Query-KL, Policy-KL and entropy per step, one line per run.

    run_dirs: training output dirs (or their ``metrics.jsonl`` files). labels: legend names (default:
    the dir names). smooth: TensorBoard-style EMA weight in [0, 1); when > 0 the raw curve is drawn
    faint under the smoothed one. A metric a run never logged (e.g. ``policy_kl`` = null for ERPO) is
    left out of that panel and named in its title. Returns out_png.
    """
    if isinstance(run_dirs, str) or not run_dirs:
        raise ValueError("run_dirs must be a non-empty list of run directories")
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"labels has {len(labels)} names for {len(run_dirs)} runs")
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth must be in [0, 1), got {smooth}")
    runs = [read_metrics(_metrics_path(d)) for d in run_dirs]
    labels = labels or [_run_label(d) for d in run_dirs]

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes.flat, DYNAMICS_PANELS):
        missing = []
        for index, (records, label) in enumerate(zip(runs, labels)):
            steps, values = _series(records, key)
            if not steps:
                missing.append(label)
                continue
            color = colors[index % len(colors)]
            if smooth > 0:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                values = ema(values, smooth)
            ax.plot(steps, values, color=color, linewidth=1.8, label=label,
                    marker="o" if len(steps) <= 30 else None, markersize=3)
        ax.set_title(title + (f"  (not logged: {', '.join(missing)})" if missing else ""))
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle("Training dynamics")
    return _save(fig, out_png)


def plot_temperature_curves(curves: dict[str, dict[str, dict[float, float]]], out_png: str, *,
                            title: str = "Accuracy vs sampling temperature") -> str:
    """Write a PNG with one panel per metric, x = temperature, one line per model.

    curves: ``{metric_name: {model_name: {temperature: score in [0, 1]}}}``. Returns out_png.
    """
    if not curves:
        raise ValueError("curves must hold at least one metric")
    fig, axes = plt.subplots(1, len(curves), figsize=(4.6 * len(curves), 4), squeeze=False)
    for ax, (metric, by_model) in zip(axes[0], curves.items()):
        for model, points in by_model.items():
            temps = sorted(points)
            ax.plot(temps, [points[t] for t in temps], marker="o", linewidth=1.8, label=model)
        ax.set_title(metric)
        ax.set_xticks(sorted({t for points in by_model.values() for t in points}))
        ax.set_xlabel("temperature")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("accuracy")
    fig.suptitle(title)
    return _save(fig, out_png)


def plot_history(curves: dict[str, dict[float, dict[int, float]]], out_png: str, *, metric: str) -> str:
    """Write a PNG of accuracy over training steps: one panel per run, side by side on one y scale, one line per
    sampling temperature (dark blue to orange: low to high).

    curves: ``{run: {temperature: {step: score in [0, 1]}}}``; metric: the y axis' name (e.g. "Avg@8").
    Returns out_png.
    """
    if not curves:
        raise ValueError("curves must hold at least one run")
    temperatures = sorted({t for by_temperature in curves.values() for t in by_temperature})
    # plasma from dark blue to orange (its pale yellow end left out): a darker line is a lower temperature
    colors = plt.get_cmap("plasma")([0.85 * i / max(1, len(temperatures) - 1) for i in range(len(temperatures))])
    fig, axes = plt.subplots(1, len(curves), figsize=(4.6 * len(curves), 4), squeeze=False, sharey=True)
    for ax, (run, by_temperature) in zip(axes[0], curves.items()):
        for t, color in zip(temperatures, colors):
            points = by_temperature.get(t)
            if points:
                steps = sorted(points)
                ax.plot(steps, [points[s] for s in steps], marker="o", markersize=3, linewidth=1.8, color=color,
                        label=f"T={t:g}")
        ax.set_title(run)
        ax.set_xlabel("training step (rollout steps)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-0.03, 1.03)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(metric)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"{metric} over training steps, by sampling temperature")
    return _save(fig, out_png)
