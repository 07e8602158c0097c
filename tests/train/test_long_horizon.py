"""bench/long_horizon.py: the long-horizon summary's tables are the seeds' means and ranges of what it reads."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def write_history(path: Path, rows: list[dict]) -> Path:
    """history.csv as `erpo eval` writes it, with the avg@16 column only."""
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["run", "step", "temperature", "avg@16"])
        writer.writeheader()
        writer.writerows(rows)
    return path


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
    return write_history(root / "history.csv", rows)


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
    pytest.importorskip("matplotlib", exc_type=ModuleNotFoundError)
    from bench.long_horizon import split_run
    assert split_run("grpo_b0-s12") == ("grpo_b0", 12)
    with pytest.raises(ValueError, match="ALG-sSEED"):
        split_run("erpo")


def test_an_unfinished_run_is_averaged_only_where_it_reached(tmp_path):
    """A pilot summarized while a seed still trains: that seed's missing steps leave the mean (marked n/N seeds),
    its Query-KL is not read as zero past its last logged step, and a step no seed reached reads '-'."""
    history = write_inputs(tmp_path)
    with open(history, encoding="utf-8") as handle:
        rows = [r for r in csv.DictReader(handle) if not (r["run"] == "erpo-s2" and r["step"] == "100")]
    rows += [{"run": "grpo-s1", "step": "150", "temperature": t, "avg@16": "0.5"}
             for t in ("0.6", "1.2", "<=1.0", "1.2-1.5")]
    write_history(history, rows)
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


SEED_GAPS = (0.05, 0.10, 0.15, 0.20, 0.25)   # ERPO's lead over GRPO at step 100, seeds 0-4


def write_paired_inputs(root: Path) -> Path:
    """Five seeds per algorithm, kept steps 0 / 50 / 100: GRPO at 0.5 + seed / 100 at every step and range; ERPO
    above it by SEED_GAPS[seed] * step / 100 at <= 1.0 and below it by as much at 1.2-1.5."""
    rows = []
    for alg in ("grpo", "erpo"):
        for seed, gap in enumerate(SEED_GAPS):
            run = f"{alg}-s{seed}"
            (root / run).mkdir()
            (root / run / "metrics.jsonl").write_text("".join(
                json.dumps({"step": step, "qkl": 1.0, "entropy": 1.0}) + "\n" for step in range(1, 101)))
            for step in (0, 50, 100):
                lead = gap * step / 100 if alg == "erpo" else 0.0
                for name, sign in (("<=1.0", 1), ("1.2-1.5", -1)):
                    value = 0.5 + seed / 100 + sign * lead
                    rows.append({"run": run, "step": step, "temperature": name, "avg@16": value})
    return write_history(root / "history.csv", rows)


def paired_table(text: str, name: str) -> str:
    section = text.split("### erpo - grpo, avg@16: paired over seeds")[1]
    return section.split(f"#### temperatures {name}")[1].split("###")[0]


def test_paired_differences_and_tests_over_seeds(tmp_path):
    """ERPO - GRPO per seed, their mean ± standard error, the sign-flip p (5 seeds all one way: 2/32) and the paired t
    p (t = 3 sqrt(2) on 4 degrees of freedom: 0.0132, scale-free, so the same at steps 50 and 100), and the late row
    (each seed's mean over steps 50 and 100: 0.75 of its step-100 gap)."""
    history = write_paired_inputs(tmp_path)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "bench.long_horizon", "--runs", str(tmp_path), "--history",
                           str(history), "--out", str(out), "--late-from", "50"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = (out / "long_horizon.md").read_text()
    low, high = paired_table(text, "<=1.0"), paired_table(text, "1.2-1.5")
    assert "| 0 | 5 | +0.000 ± 0.000 | 0/5 | 1 | - | s0 +0.000, s1 +0.000, s2 +0.000, s3 +0.000, s4 +0.000 |" in low
    assert ("| 50 | 5 | +0.075 ± 0.018 | 5/5 | 0.0625 | 0.0132 | "
            "s0 +0.025, s1 +0.050, s2 +0.075, s3 +0.100, s4 +0.125 |") in low
    assert ("| 100 | 5 | +0.150 ± 0.035 | 5/5 | 0.0625 | 0.0132 | "
            "s0 +0.050, s1 +0.100, s2 +0.150, s3 +0.200, s4 +0.250 |") in low
    assert "| mean of steps 50-100 (2 kept) | 5 | +0.113 ± 0.027 | 5/5 | 0.0625 | 0.0132 |" in low
    assert "| 100 | 5 | -0.150 ± 0.035 | 0/5 | 0.0625 | 0.0132 | s0 -0.050, s1 -0.100," in high


def test_paired_rows_use_the_seeds_both_runs_reached(tmp_path):
    """ERPO seed 4 not yet evaluated at step 100: that step pairs 4 seeds (gaps 0.05-0.20: mean 0.125, sign-flip
    2/16), the late row leaves seed 4 out, and without --late-from there is no late row; with --paired naming an
    algorithm that has no runs the paired section is left out."""
    history = write_paired_inputs(tmp_path)
    with open(history, encoding="utf-8") as handle:
        rows = [r for r in csv.DictReader(handle) if not (r["run"] == "erpo-s4" and r["step"] == "100")]
    write_history(history, rows)
    text, out = summarize(tmp_path, history)
    low = paired_table(text, "<=1.0")
    assert "| 100 | 4 | +0.125 ± 0.032 | 4/4 | 0.125 |" in low and "s3 +0.200 |" in low
    assert "| 50 | 5 |" in low and "mean of steps" not in low
    done = subprocess.run([sys.executable, "-m", "bench.long_horizon", "--runs", str(tmp_path), "--history",
                           str(history), "--out", str(out), "--late-from", "50", "--paired", "erpo", "ppo"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "paired over seeds" not in (out / "long_horizon.md").read_text()
