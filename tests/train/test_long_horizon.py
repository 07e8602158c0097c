"""bench/long_horizon.py: the long-horizon summary's tables are the seeds' means and ranges of what it reads."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def write_inputs(root: Path) -> Path:
    """Two algorithms x two seeds, kept steps 0 / 50 / 100, temperatures 0.6 and 1.2; qkl = seed * step."""
    rows = []
    for alg, base in (("erpo", 0.5), ("grpo", 0.25)):
        for seed in (1, 2):
            run = f"{alg}-s{seed}"
            (root / run).mkdir()
            with open(root / run / "metrics.jsonl", "w", encoding="utf-8") as handle:
                for step in range(1, 101):
                    handle.write(json.dumps({"step": step, "qkl": float(seed * step), "entropy": 1.0}) + "\n")
            for step in (0, 50, 100):
                for t, value in (("0.6", base + seed / 10), ("1.2", base - seed / 10)):
                    rows.append({"run": run, "step": step, "temperature": t, "avg@16": value})
                for name, value in (("<=1.0", base + seed / 10), ("1.2-1.5", base - seed / 10)):
                    rows.append({"run": run, "step": step, "temperature": name, "avg@16": value})
    history = root / "history.csv"
    with open(history, "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["run", "step", "temperature", "avg@16"])
        writer.writeheader()
        writer.writerows(rows)
    return history


def summarize(runs: Path, history: Path) -> tuple[str, Path]:
    """(long_horizon.md, the output folder) of `python -m bench.long_horizon` over RUNS and its history.csv."""
    out = runs / "out"
    done = subprocess.run([sys.executable, "-m", "bench.long_horizon", "--runs", str(runs), "--history",
                           str(history), "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return (out / "long_horizon.md").read_text(), out


def test_tables_are_the_seeds_means_and_ranges(tmp_path):
    history = write_inputs(tmp_path)
    text, out = summarize(tmp_path, history)
    low = text.split("### avg@16, temperatures <=1.0")[1].split("###")[0]
    assert "| 50 | 0.650 (0.600-0.700) | 0.400 (0.350-0.450) |" in low
    high = text.split("### avg@16, temperatures 1.2-1.5")[1].split("###")[0]
    assert "| 100 | 0.350 (0.300-0.400) | 0.100 (0.050-0.150) |" in high
    qkl = text.split("### qkl")[1].split("###")[0]
    # the mean of steps 51..100 is 75.5 per unit of seed: seeds 1 and 2 give 75.5 and 151
    assert "| 100 | 113.250 (75.500-151.000) | 113.250 (75.500-151.000) |" in qkl
    assert (out / "long_horizon_accuracy.png").stat().st_size > 0 and (out / "long_horizon_drift.png").stat().st_size


def test_a_run_not_named_alg_seed_is_refused():
    pytest.importorskip("matplotlib")
    from bench.long_horizon import algorithm_of
    assert algorithm_of("grpo_b0-s12") == "grpo_b0"
    with pytest.raises(ValueError, match="ALG-sSEED"):
        algorithm_of("erpo")


def test_an_unfinished_run_is_averaged_only_where_it_reached(tmp_path):
    """A pilot summarized while a seed still trains: that seed's missing steps leave the mean (marked n/N seeds),
    its Query-KL is not read as zero past its last logged step, and a step no seed reached reads '-'."""
    history = write_inputs(tmp_path)
    with open(history, encoding="utf-8") as handle:
        rows = [r for r in csv.DictReader(handle) if not (r["run"] == "erpo-s2" and r["step"] == "100")]
    rows += [{"run": "grpo-s1", "step": "150", "temperature": t, "avg@16": "0.5"}
             for t in ("0.6", "1.2", "<=1.0", "1.2-1.5")]
    with open(history, "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["run", "step", "temperature", "avg@16"])
        writer.writeheader()
        writer.writerows(rows)
    metrics = tmp_path / "erpo-s2" / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(keepends=True)
                               if json.loads(line)["step"] <= 60))
    text, out = summarize(tmp_path, history)
    low = text.split("### avg@16, temperatures <=1.0")[1].split("###")[0]
    assert "| 50 | 0.650 (0.600-0.700) | 0.400 (0.350-0.450) |" in low
    assert "| 100 | 0.600 (0.600-0.600) (1/2 seeds) | 0.400 (0.350-0.450) |" in low
    assert "| 150 | - | 0.500 (0.500-0.500) (1/2 seeds) |" in low
    qkl = text.split("### qkl")[1].split("###")[0]
    assert "| 100 | 75.500 (75.500-75.500) (1/2 seeds) | 113.250 (75.500-151.000) |" in qkl
