"""bench/pilot_records.py and bench.long_horizon --records: a pilot's finished and evaluated runs kept as small
records in the repository, summarized as the pilot's own folders are, across pilots, sessions and machines."""
from __future__ import annotations

import csv
import gzip
import io
import json
import random
from pathlib import Path

import pytest

from bench import long_horizon, pilot_records
from bench.run_record import STEP_COLUMNS, step_values
from paths import REPO

SETTINGS = {"lr": 0.002, "max_steps": 20, "warmup_ratio": 0.005, "max_operand": 10, "save_steps": 5,
            "keep_every": 10, "eval_n": 4, "k": 16, "overrides": []}
KEPT = (10, 15, 20)          # complete checkpoints of every synthetic run
TEMPERATURES = ("0.6", "1.2", "<=1.0", "1.2-1.5")
HISTORY_FIELDS = ["run", "step", "temperature", "avg@16", "pass@16", "pass@1"]


def step_record(run: str, step: int) -> dict:
    """A metrics.jsonl line: values that differ by run and step (qkl None at step 1, as GRPO's first step logs 0)."""
    seed = int(run.rsplit("-s", 1)[1])
    base = (1.5 if run.startswith("erpo") else 1.0) + seed / 7
    return {"reward": base / 3 + step / 997, "accuracy": base / 3 + step / 997, "completions/mean_length": 10.5,
            "qkl": None if step == 1 else base * step / 3, "entropy": 0.2 / (step + seed), "grad_norm": base / step,
            "completions/clipped_ratio": step / 40, "lr": 0.002, "step": step, "rollout_step": step,
            "step_seconds": 0.4}


def value(run: str, set_name: str, step: int, temperature: str, metric: str) -> float:
    seed = int(run.rsplit("-s", 1)[1])
    lead = 0.03 * (seed + 1) * step / 20 if run.startswith("erpo") else 0.0
    return round(0.4 + step / 100 + lead - (0.1 if "1.2" in temperature else 0) + (0.02 if metric != "avg@16" else 0)
                 - (0.3 if set_name == "heldout" else 0), 6)


def make_pilot(folder: Path, runs: list[str], *, settings: dict = SETTINGS, machine: str = "machine A",
               commit: str = "1400876", unfinished: tuple[str, ...] = ()) -> Path:
    """A pilot folder as bench.pilot leaves it: settings.json, journal.jsonl, ALG-sSEED/ (final/, the kept
    checkpoints, metrics.jsonl with step 7 logged twice: a resume), eval-SET/history.csv. `unfinished` runs have
    trained to step 12 without a final/ and are not evaluated."""
    folder.mkdir(parents=True)
    (folder / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")
    journal, rows = [], {"train": [], "heldout": []}
    for index, run in enumerate(runs):   # run i trains from 21:0i to 21:4i
        last = 12 if run in unfinished else 20
        run_dir = folder / run
        for step in KEPT:
            if step <= last:
                (run_dir / "checkpoints" / f"step-{step}").mkdir(parents=True)
                (run_dir / "checkpoints" / f"step-{step}" / "meta.json").write_text("{}")
        lines = [step_record(run, step) for step in range(1, last + 1)]
        lines.insert(6, {**step_record(run, 7), "qkl": -1.0})   # step 7 before a resume: its later line wins
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        context = {"commit": commit, "machine": machine}
        journal += [{"utc": f"2026-11-26T21:0{index}:10+00:00", "event": "start", "what": f"train {run}",
                     "command": "x", **context}]
        if run in unfinished:
            continue
        (run_dir / "final").mkdir()
        (run_dir / "final" / "config.json").write_text("{}")
        journal += [{"utc": f"2026-11-26T21:4{index}:05+00:00", "event": "end", "what": f"train {run}", "status": 0,
                     **context}]
        for set_name in rows:
            journal += [{"utc": "2026-11-26T21:42:00+00:00", "event": event, "what": f"eval {set_name} {run}",
                         **context} for event in ("start", "end")]
            rows[set_name] += [{"run": run, "step": step, "temperature": t,
                                **{m: value(run, set_name, step, t, m) for m in HISTORY_FIELDS[3:]}}
                               for step in (0, *KEPT) for t in TEMPERATURES]
    journal.append({"utc": "2026-11-26T21:50:00+00:00", "event": "start", "what": "eval train all", **context})
    (folder / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in journal))
    for set_name, set_rows in rows.items():
        (folder / f"eval-{set_name}").mkdir()
        with open(folder / f"eval-{set_name}" / "history.csv", "w", encoding="utf-8", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=HISTORY_FIELDS)   # erpo eval's \r\n line ends
            writer.writeheader()
            writer.writerows(set_rows)
    return folder


def edit_history(path: Path, edit) -> None:
    """Rewrite a history.csv with edit(its rows)."""
    with open(path, encoding="utf-8") as handle:
        rows = edit(list(csv.DictReader(handle)))
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=HISTORY_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def record(argv: list[str], capsys) -> list[str]:
    """bench.pilot_records' printed lines."""
    capsys.readouterr()
    assert pilot_records.main(argv) == 0
    return capsys.readouterr().out.splitlines()


def summary(tmp_path: Path, name: str, source: list[str], metric: str = "avg@16") -> str:
    out = tmp_path / name
    long_horizon.main([*source, "--out", str(out), "--metric", metric, "--late-from", "15"])
    return (out / "long_horizon.md").read_text()


RUNS = ["grpo-s0", "erpo-s0", "grpo-s1", "erpo-s1"]


def test_a_summary_of_the_records_is_the_summary_of_the_pilot(tmp_path, capsys):
    """Records of a two-seed pilot: per run the history rows of both sets, the step columns (a resumed step's last
    line, values exact, absent ones empty) and the run's journal lines; bench.long_horizon over the records writes
    the same long_horizon.md as over the pilot's folders (tables, paired rows, late row, runs with their commit and
    machine), on both sets and metrics."""
    folder = make_pilot(tmp_path / "pilot-p", RUNS)
    out = tmp_path / "records"
    lines = record(["--pilot", str(folder), "--out", str(out)], capsys)
    assert sorted(line.split(":")[0] for line in lines) == sorted(str(out / run) for run in RUNS)
    assert json.loads((out / "settings.json").read_text()) == SETTINGS
    run = out / "erpo-s1"
    assert sorted(p.name for p in run.iterdir()) == ["history-heldout.csv", "history-train.csv", "journal.jsonl",
                                                     "metrics.csv.gz"]
    table = list(csv.DictReader(io.StringIO(gzip.decompress((run / "metrics.csv.gz").read_bytes()).decode())))
    assert list(table[0]) == ["step", *STEP_COLUMNS] and [int(r["step"]) for r in table] == list(range(1, 21))
    assert table[0]["qkl"] == "" and float(table[6]["qkl"]) == step_record("erpo-s1", 7)["qkl"]
    assert all(float(table[s - 1][key]) == step_record("erpo-s1", s)[key] for s in (2, 13, 20) for key in STEP_COLUMNS)
    with open(run / "history-heldout.csv", encoding="utf-8") as handle:
        kept = list(csv.DictReader(handle))
    assert {r["run"] for r in kept} == {"erpo-s1"} and len(kept) == 4 * len(TEMPERATURES)
    assert float(kept[-1]["pass@16"]) == value("erpo-s1", "heldout", 20, "1.2-1.5", "pass@16")
    journal = [json.loads(line) for line in (run / "journal.jsonl").read_text().splitlines()]
    assert [e["what"] for e in journal] == ["train erpo-s1", "train erpo-s1", "eval train erpo-s1",
                                            "eval train erpo-s1", "eval heldout erpo-s1", "eval heldout erpo-s1"]

    for set_name in ("train", "heldout"):
        for metric in ("avg@16", "pass@16"):
            direct = summary(tmp_path, f"direct-{set_name}-{metric}", [
                "--runs", str(folder), "--history", str(folder / f"eval-{set_name}" / "history.csv")], metric)
            recorded = summary(tmp_path, f"records-{set_name}-{metric}", [
                "--records", str(out), "--set", set_name], metric)
            assert recorded == direct
    assert "| erpo-s1 | 1400876 | machine A | 2026-11-26 21:03 - 2026-11-26 21:43 |" in recorded
    assert "| mean of steps 15-20 (2 kept) | 2 |" in recorded
    assert (tmp_path / "records-train-avg@16" / "long_horizon_drift.png").stat().st_size > 0


def test_side_by_side_pilots_go_into_one_record_folder_and_are_summarized_together(tmp_path, capsys):
    """Seed 0 from one session's pilot, seed 1 as two pilots side by side on another machine and commit: one record
    folder; its summary pairs both seeds (ERPO leads by 0.03 (seed + 1) * step / 20) and names each run's machine."""
    out = tmp_path / "records"
    record(["--pilot", str(make_pilot(tmp_path / "s0" / "pilot-p", RUNS[:2])), "--out", str(out)], capsys)
    other = {"machine": "machine B", "commit": "abc1234"}
    pilots = [make_pilot(tmp_path / alg / "pilot-p", [f"{alg}-s1"], **other) for alg in ("grpo", "erpo")]
    lines = record(["--pilot", str(pilots[0]), "--pilot", str(pilots[1]), "--out", str(out)], capsys)
    recorded = [f"{out / run}: recorded from {folder / run}" for run, folder in zip(("grpo-s1", "erpo-s1"), pilots)]
    assert [line.split(" (")[0] for line in lines] == recorded
    assert sorted(p.name for p in out.iterdir()) == ["erpo-s0", "erpo-s1", "grpo-s0", "grpo-s1", "settings.json"]
    text = summary(tmp_path, "both", ["--records", str(out)])
    assert "| grpo-s0 | 1400876 | machine A |" in text and "| erpo-s1 | abc1234 | machine B |" in text
    low = text.split("#### temperatures <=1.0")[1].split("####")[0]
    assert "| 20 | 2 | +0.045 ± 0.015 | 2/2 | 0.5 | 0.205 | s0 +0.030, s1 +0.060 |" in low


def test_unfinished_and_unevaluated_runs_are_skipped(tmp_path, capsys):
    folder = make_pilot(tmp_path / "pilot-p", RUNS[:2], unfinished=("erpo-s0",))
    edit_history(folder / "eval-heldout" / "history.csv", lambda rows: [r for r in rows if r["step"] != "15"])
    out = tmp_path / "records"
    lines = record(["--pilot", str(folder), "--out", str(out)], capsys)
    assert lines == [f"{folder / 'erpo-s0'}: skipped, not finished",
                     f"{folder / 'grpo-s0'}: skipped, not evaluated on heldout at steps [15]"]
    assert not out.exists()


def test_other_settings_and_a_different_record_are_refused_and_an_identical_one_is_left_as_it_is(tmp_path, capsys):
    folder = make_pilot(tmp_path / "a" / "pilot-p", RUNS[:2])
    faster = make_pilot(tmp_path / "b" / "pilot-p", RUNS[2:], settings={**SETTINGS, "lr": 0.003})
    out = tmp_path / "records"
    with pytest.raises(SystemExit, match=r"^--pilot .*/b/pilot-p: its settings differ from .* in 'lr' \(0.002 against "
                                         r"0.003\); records of other settings go to another --out$"):
        pilot_records.main(["--pilot", str(folder), "--pilot", str(faster), "--out", str(out)])
    assert not out.exists()

    record(["--pilot", str(folder), "--out", str(out)], capsys)
    written = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert record(["--pilot", str(folder), "--out", str(out)], capsys) == [
        f"{out / run}: unchanged" for run in ("erpo-s0", "grpo-s0")]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == written
    with pytest.raises(SystemExit, match=r"^--out .*: its records are of other settings than the pilots': 'lr' "
                                         r"\(0.002 against 0.003\)"):
        pilot_records.main(["--pilot", str(faster), "--out", str(out)])

    # grpo-s0 evaluated otherwise (another sample cache)
    edit_history(folder / "eval-train" / "history.csv",
                 lambda rows: [{**r, "avg@16": "0.123"} if r["run"] == "grpo-s0" and r["step"] == "20" else r
                               for r in rows])
    with pytest.raises(SystemExit, match=r"records/grpo-s0: a different record of grpo-s0 is there \(differing from "
                                         r".*/a/pilot-p/grpo-s0's in history-train.csv\); records are never "):
        pilot_records.main(["--pilot", str(folder), "--out", str(out)])
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == written
    twin = make_pilot(tmp_path / "c" / "pilot-p", RUNS[:1], machine="machine C")
    with pytest.raises(SystemExit, match=r"^grpo-s0: --pilot .* and --pilot .*/c/pilot-p hold different runs of that "
                                         r"name \(differing in history-train.csv, journal.jsonl\); record them apart$"):
        pilot_records.main(["--pilot", str(folder), "--pilot", str(twin), "--out", str(tmp_path / "elsewhere")])


def test_a_full_length_run_records_in_well_under_a_megabyte(tmp_path, capsys):
    """6000 steps of full-precision values (as the comparison's runs log): metrics.csv.gz stays under 400 kB."""
    folder = make_pilot(tmp_path / "pilot-p", RUNS[:1])
    draw = random.Random(0)
    (folder / "grpo-s0" / "metrics.jsonl").write_text("".join(
        json.dumps({**{key: draw.random() for key in STEP_COLUMNS}, "step": step}) + "\n" for step in range(1, 6001)))
    record(["--pilot", str(folder), "--out", str(tmp_path / "records")], capsys)
    assert 100e3 < (tmp_path / "records" / "grpo-s0" / "metrics.csv.gz").stat().st_size < 400e3


def test_runs_and_records_from_before_the_trl_names_read_under_them(tmp_path, capsys):
    """A run that logged truncated_frac (before 2026-11-27) is recorded under completions/clipped_ratio, values
    exact, and step_values reads it so from its metrics.jsonl; a record written then (the repository's
    bench/measured/pilot-lr2e-3-6k, whose metrics.csv.gz has a truncated_frac column) reads under the new name too,
    every step's value as the column holds it."""
    folder = make_pilot(tmp_path / "pilot-p", RUNS[:1])
    log = folder / "grpo-s0" / "metrics.jsonl"
    log.write_text(log.read_text().replace('"completions/clipped_ratio"', '"truncated_frac"'))
    new_name = "completions/clipped_ratio"
    assert step_values(folder / "grpo-s0", new_name) == {s: step_record("grpo-s0", s)[new_name] for s in range(1, 21)}
    record(["--pilot", str(folder), "--out", str(tmp_path / "records")], capsys)
    table = csv.DictReader(io.StringIO(gzip.decompress(
        (tmp_path / "records" / "grpo-s0" / "metrics.csv.gz").read_bytes()).decode()))
    assert {int(row["step"]): float(row[new_name]) for row in table} == {
        s: step_record("grpo-s0", s)[new_name] for s in range(1, 21)}
    committed = REPO / "bench" / "measured" / "pilot-lr2e-3-6k" / "erpo-s0"
    rows = list(csv.DictReader(io.StringIO(gzip.decompress((committed / "metrics.csv.gz").read_bytes()).decode())))
    assert "truncated_frac" in rows[0] and len(rows) == 6000
    assert step_values(committed, new_name) == {int(row["step"]): float(row["truncated_frac"]) for row in rows}


def test_long_horizon_takes_records_or_runs_and_history(tmp_path):
    with pytest.raises(SystemExit):
        long_horizon.main(["--records", str(tmp_path), "--runs", str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        long_horizon.main(["--runs", str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):   # no run holds a history of that set
        long_horizon.main(["--records", str(tmp_path), "--set", "heldout", "--out", str(tmp_path / "o")])
