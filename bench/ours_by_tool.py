"""Ours' default fused call (`fused_linear_erpo_loss`, the library's 1 GiB geometry) at the targets' N, as each tool
of a GPU lease timed it: the fused probe (its "library default" row), the bench (ours' row of bench 1) and the kernel
profile (ours' wall, kernels and idle time), side by side per lm_head, for summary.md (bench/gpu_check.py).

All three time the same fwd+bwd (`bench.contenders.Prepared.step`) on the same problem (bench.problem, 1024 rows a
sample); they differ in how many calls they time, what ran before, and the profile's own overhead (bench/README.md,
"How a contender is timed"). Two numbers answer the H200 lease of 2026-11-27 (issue 32's benchfair): the bench's
fwd+bwd against the probe's and the profile's wall (the harness's share), and the bench's fwd+bwd minus fwd, paired
per turn, against the profile's backward kernels, `_scale_kernel` (what else ours' backward costs).
"""
from __future__ import annotations

import json
from pathlib import Path

from .probe_pick import DEFAULT_VARIANT
from .problem import SHAPES
from .progress import read_runs

BACKWARD_KERNEL = "_scale_kernel"  # ours' backward on the fused path: one scale pass per gradient


def _json(path: Path):
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _spread(row: dict, median: str, low: str, high: str) -> str:
    return f"{row[median]:.2f} ({row[low]:.2f}-{row[high]:.2f})"


def ours_by_tool_lines(probe_json: Path, progress: Path, profile_json: Path, num_rows: int) -> list:
    """summary.md's lines: per shape of the probe, the bench and the profile (whichever ran), one table row per tool
    with ours' fwd+bwd (median and p20-p80, or the profile's wall per call), the calls timed, the bench's fwd and
    its paired fwd+bwd - fwd, and the profile's backward kernels; then how to read them. A tool that did not run
    (its file missing) or timed another shape or N has no row."""
    probe = _json(probe_json)
    bench = ([row for run in read_runs(progress) for row in run["rows"]] if progress.exists() else [])
    profile = _json(profile_json)
    rows = []
    for shape in SHAPES.values():
        probe_rows = [] if probe is None else probe["shapes"].get(shape.name, [])
        for row in (r for r in probe_rows if r["variant"] == DEFAULT_VARIANT):
            meta = probe["meta"]
            rows.append(f"| {shape.name} | probe | {_spread(row, 'median_ms', 'p20_ms', 'p80_ms')} | "
                        f"{meta.get('repeats', '-')} after {meta.get('warmup', '-')} | - | - | "
                        f"its first variant, alone |")
        for row in bench:
            if ((row["path"], row["shape"], row["N"], row["contender"]) != ("fused", shape.name, num_rows, "erpo")
                    or row.get("fwdbwd_ms") is None):
                continue
            step = row.get("bwd_step_ms")
            rows.append(f"| {shape.name} | bench | {_spread(row, 'fwdbwd_ms', 'fwdbwd_p20_ms', 'fwdbwd_p80_ms')} | "
                        f"{row['fwdbwd_reps']} | {row['fwd_ms']:.2f} | "
                        f"{'-' if step is None else f'{step:.2f} (paired per turn)'} | "
                        f"in turns with {', '.join(row.get('timed_with', ['erpo']))} |")
        if profile is not None and profile["meta"]["D"] == shape.hidden and profile["meta"]["N"] == num_rows:
            result = profile["results"].get("erpo")
            if isinstance(result, dict):
                backward = sum(k["us"] for k in result["kernels"] if k["name"] == BACKWARD_KERNEL) / 1e3
                rows.append(f"| {shape.name} | profile | wall {result['wall_us'] / 1e3:.2f} | "
                            f"{profile['meta']['calls']} | - | {backward:.2f} of `{BACKWARD_KERNEL}` | kernels "
                            f"{result['kernel_busy_us'] / 1e3:.2f}, GPU idle {result['gpu_idle_us'] / 1e3:.2f}, "
                            f"under the profiler |")
    if not rows:
        return ["- no tool timed ours' default call (the probe, bench 1 and the profile did not run or failed)"]
    reading = ("The bench's fwd+bwd above the probe's and the profile's wall by more than their spread is the "
               "harness's (what ran before, how many calls); its fwd+bwd - fwd, paired per turn, above the profile's "
               f"`{BACKWARD_KERNEL}` time is ours' backward's (host, allocator or kernels besides the scale passes).")
    return [f"Ours' default fused call at N={num_rows}, the same fwd+bwd (`Prepared.step`) timed by each tool:", "",
            "| shape | tool | fwd+bwd ms, median (p20-p80) | calls timed | fwd ms | fwd+bwd - fwd ms | how |",
            "|---|---|---|---|---|---|---|", *rows, "", reading]
