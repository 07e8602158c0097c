"""A pilot run's record: the few small files that keep what the comparison needs of a run (issue 35) in the
repository, since only the repository outlives a session's machine; and the readers that take a run's step metrics
and journal from a record or from the pilot's own folders alike.

A record folder (`bench.pilot_records` writes it) holds `settings.json` (the pilot's settings, one setting per
folder) and one folder per run, ALG-sSEED/:
- `history-SET.csv`: the run's rows of the pilot's `eval-SET/history.csv` (SET: train, heldout), values as spelled;
- `metrics.csv.gz`: per rollout step (a step's last record: a resumed run appends), the STEP_COLUMNS of the run's
  metrics.jsonl, each value written as Python's repr of the float (read back exactly), gzip-compressed (a record
  written before the rename of 2026-11-27 has `truncated_frac` for `completions/clipped_ratio`: `step_values` reads
  both);
- `journal.jsonl`: the pilot journal's lines that name the run (its trainings and the evaluations after them: UTC
  times, commit, machine, exit status; a call that only evaluates, "eval SET all", names no run and is left out).
"""
from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path

from erpo.records import iter_jsonl, with_current_metric_names

# the Query-KL and entropy bench.long_horizon reads, and what docs/pilots.md reads of a run's journal
STEP_COLUMNS = ("reward", "accuracy", "qkl", "entropy", "grad_norm", "completions/clipped_ratio")
METRICS_LOG = "metrics.jsonl"       # the run's own, one JSON line per step
METRICS_RECORD = "metrics.csv.gz"   # the record's
JOURNAL = "journal.jsonl"           # the pilot folder's (every run) and a record's (its run)
SETTINGS = "settings.json"


def history_name(set_name: str) -> str:
    """The record's file of one evaluation set's history rows."""
    return f"history-{set_name}.csv"


def logged_steps(run_dir: Path) -> dict[int, dict]:
    """{step: the last record of that step} of the run's metrics.jsonl (a resumed run appends its steps again), under
    today's metric names."""
    return {int(record["step"]): with_current_metric_names(record)
            for _, record in iter_jsonl(str(run_dir / METRICS_LOG))}


def step_values(run_dir: Path, key: str) -> dict[int, float]:
    """{rollout step: value of `key`} of a run, steps that logged none left out, from a record's metrics.csv.gz when
    `run_dir` holds one, else from the run's metrics.jsonl (its last record of a step); `key` is today's name of the
    metric, whichever name the record or the log has it under."""
    record = run_dir / METRICS_RECORD
    if record.is_file():
        rows = csv.DictReader(io.StringIO(gzip.decompress(record.read_bytes()).decode("utf-8")))
        return {int(row["step"]): float(row[key]) for row in map(with_current_metric_names, rows) if row[key]}
    return {step: float(r[key]) for step, r in logged_steps(run_dir).items() if r.get(key) is not None}


def names_run(entry: dict, run: str) -> bool:
    """Whether a journal line is about `run`: its `what` ("train RUN", "eval SET RUN [RUN ...]") names it."""
    return run in entry.get("what", "").split()


def run_journal(folder: Path, run: str) -> list[dict]:
    """The journal lines of `run`: a record's FOLDER/RUN/journal.jsonl, else the lines of a pilot folder's
    FOLDER/journal.jsonl that name it; [] when there is neither."""
    for path, own in ((folder / run / JOURNAL, True), (folder / JOURNAL, False)):
        if path.is_file():
            return [entry for _, entry in iter_jsonl(str(path)) if own or names_run(entry, run)]
    return []


def record_histories(records: Path, set_name: str) -> list[Path]:
    """The history-SET.csv files of a record folder's runs, in the order the runs trained (their journal's first
    line, then their names), as one pilot's history.csv lists them."""
    def trained_first(path: Path) -> tuple[str, str]:
        entries = run_journal(records, path.parent.name)
        return (entries[0]["utc"] if entries else "", path.parent.name)
    return sorted(records.glob(f"*/{history_name(set_name)}"), key=trained_first)


def minute(utc: str) -> str:
    """'YYYY-MM-DD HH:MM' of a journal's ISO time (UTC)."""
    return utc[:16].replace("T", " ")


def provenance(entries: list[dict], run: str) -> dict[str, str]:
    """{"commit", "machine", "trained"} of `run` from its journal lines: the commits and machines its trainings ran
    on (", "-joined when a resume moved it), and the UTC span from its first training start to its last training
    end; "-" for what the lines do not say."""
    trainings = [e for e in entries if e.get("what") == f"train {run}"]

    def distinct(key: str) -> str:
        return ", ".join(dict.fromkeys(e[key] for e in trainings if e.get(key))) or "-"

    starts = [e["utc"] for e in trainings if e.get("event") == "start"]
    ends = [e["utc"] for e in trainings if e.get("event") == "end"]
    span = f"{minute(min(starts))} - {minute(max(ends))}" if starts and ends else "-"
    return {"commit": distinct("commit"), "machine": distinct("machine"), "trained": span}


def metrics_text(run_dir: Path) -> str:
    """The record's metrics table of a run (CSV text: step, then STEP_COLUMNS; empty where a step logged none)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *STEP_COLUMNS])
    for step, record in sorted(logged_steps(run_dir).items()):
        writer.writerow([step, *("" if record.get(key) is None else repr(float(record[key])) for key in STEP_COLUMNS)])
    return out.getvalue()
