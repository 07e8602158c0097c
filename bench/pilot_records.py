"""Records of a pilot's runs that the repository keeps (issue 35): a session's machine, with the pilot's folders
under /work/runs, is gone by the next session; what the comparison needs of each run goes into the repository.

    python -m bench.pilot_records --pilot ROOT/pilot-NAME [--pilot ROOT2/pilot-NAME ...] --out bench/measured/pilot-NAME

For every run (ALG-sSEED/) of the pilot folders (made by bench.pilot of this or an older commit) that is finished
(its final/ written) and evaluated (both sets' eval-SET/history.csv have its rows at step 0 and at each of its kept
checkpoints), writes its record OUT/ALG-sSEED/ (history-SET.csv, metrics.csv.gz, journal.jsonl: bench/run_record.py)
and, with the first record, OUT/settings.json; a run not yet finished or evaluated is skipped and said so.
`bench.long_horizon --records OUT` summarizes the records of every session together.

One record folder holds one setting: pilot folders with the same settings.json (e.g. a seed's GRPO and ERPO run as
two pilots side by side) go into one OUT; pilots, or an OUT, of other settings are refused, naming the field. A
record is never overwritten by a different one of the same run (refused, naming the files that differ); writing an
identical one again changes nothing, so the command can be rerun after every run that ends.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import sys
from pathlib import Path

from bench import pilot
from bench.long_horizon import RUN_NAME
from bench.run_record import JOURNAL, METRICS_RECORD, SETTINGS, history_name, metrics_text, run_journal
from erpo.atomic import publish
from erpo.manifest import CHECKPOINTS_DIR, complete_checkpoints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.pilot_records", description=__doc__.splitlines()[0])
    p.add_argument("--pilot", required=True, action="append", type=Path,
                   help="a pilot folder (ROOT/pilot-NAME); repeat for pilots of the same settings")
    p.add_argument("--out", required=True, type=Path, help="the record folder (in the repository)")
    return p.parse_args(argv)


def shared_settings(pilots: list[Path]) -> dict:
    """The settings.json all `pilots` share; SystemExit naming the fields where one differs from the first."""
    found = {}
    for folder in pilots:
        path = folder / SETTINGS
        if not path.is_file():
            raise SystemExit(f"--pilot {folder}: no {SETTINGS}; give a folder bench.pilot made (ROOT/pilot-NAME)")
        found[folder] = json.loads(path.read_text(encoding="utf-8"))
    first, settings = next(iter(found.items()))
    for folder, other in found.items():
        if changed := pilot.settings_difference(settings, other):
            raise SystemExit(f"--pilot {folder}: its settings differ from --pilot {first}'s in "
                             f"{describe(changed)}; records of other settings go to another --out")
    return settings


def describe(changed: dict) -> str:
    """"'lr' (0.002 against 0.003), ..." of settings_difference's answer."""
    return ", ".join(f"{key!r} ({a!r} against {b!r})" for key, (a, b) in changed.items())


def history_rows(path: Path) -> tuple[list[str], dict[str, list[list[str]]]]:
    """(header, {run: its rows as the file spells them}) of a history.csv; ([], {}) when there is none yet."""
    if not path.is_file():
        return [], {}
    with open(path, encoding="utf-8", newline="") as handle:
        header, *rows = list(csv.reader(handle))
    by_run: dict[str, list[list[str]]] = {}
    for row in rows:
        by_run.setdefault(row[header.index("run")], []).append(row)
    return header, by_run


def csv_text(header: list[str], rows: list[list[str]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerows([header, *rows])
    return out.getvalue()


def run_record(folder: Path, run: str, histories: dict[str, tuple[list[str], dict]]) -> dict[str, str] | str:
    """The record of `folder`/`run` ({file name: text}, metrics.csv.gz's before compression), or why there is none
    yet (a sentence)."""
    run_dir = folder / run
    if pilot.run_state(run_dir) != "finished":
        return "not finished"
    kept = {0} | {step for step, _ in complete_checkpoints(run_dir / CHECKPOINTS_DIR)}
    files = {}
    for set_name, (header, by_run) in histories.items():
        rows = by_run.get(run, [])
        missing = kept - {int(row[header.index("step")]) for row in rows}
        if missing:
            return f"not evaluated on {set_name} at steps {sorted(missing)}"
        files[history_name(set_name)] = csv_text(header, rows)
    files[METRICS_RECORD] = metrics_text(run_dir)
    files[JOURNAL] = "".join(json.dumps(entry) + "\n" for entry in run_journal(folder, run))
    return files


def read_record(path: Path) -> dict[str, str] | None:
    """A written record as run_record gives it ({file name: text}, decompressed), or None when there is none."""
    if not path.is_dir():
        return None
    return {file.name: (gzip.decompress(file.read_bytes()) if file.suffix == ".gz" else file.read_bytes()).decode()
            for file in path.iterdir() if file.is_file()}


def differing(a: dict[str, str], b: dict[str, str]) -> str:
    return ", ".join(sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name)))


def write_record(path: Path, files: dict[str, str]) -> None:
    """Publish the record folder in one rename (a crash leaves no half record); gzip without a time stamp."""
    def write(tmp: Path) -> None:
        tmp.mkdir()
        for name, text in files.items():
            data = text.encode("utf-8")
            (tmp / name).write_bytes(gzip.compress(data, mtime=0) if name.endswith(".gz") else data)
    publish(path, write)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = shared_settings(args.pilot)
    saved = args.out / SETTINGS
    if saved.is_file() and (changed := pilot.settings_difference(json.loads(saved.read_text(encoding="utf-8")),
                                                                 settings)):
        raise SystemExit(f"--out {args.out}: its records are of other settings than the pilots': "
                         f"{describe(changed)} (as records, pilots); give another --out")
    records: dict[str, tuple[Path, dict[str, str]]] = {}
    for folder in args.pilot:
        histories = {name: history_rows(folder / f"eval-{name}" / "history.csv") for name in pilot.eval_sets(settings)}
        for run_dir in sorted(d for d in folder.iterdir() if d.is_dir() and RUN_NAME.match(d.name)):
            record = run_record(folder, run_dir.name, histories)
            if isinstance(record, str):
                print(f"{run_dir}: skipped, {record}")
                continue
            if run_dir.name in records and records[run_dir.name][1] != record:
                other, first = records[run_dir.name]
                raise SystemExit(f"{run_dir.name}: --pilot {other} and --pilot {folder} hold different runs of that "
                                 f"name (differing in {differing(first, record)}); record them apart")
            records[run_dir.name] = folder, record
    existing = {run: read_record(args.out / run) for run in records}
    for run, (folder, record) in records.items():   # every refusal before anything is written
        if existing[run] not in (None, record):
            raise SystemExit(f"{args.out / run}: a different record of {run} is there (differing from "
                             f"{folder / run}'s in {differing(existing[run], record)}); records are never "
                             "overwritten: remove it first if the new one is right, or give another --out")
    if records and not saved.is_file():
        publish(saved, lambda tmp: tmp.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8"))
    for run, (folder, record) in records.items():
        if existing[run] == record:
            print(f"{args.out / run}: unchanged")
            continue
        write_record(args.out / run, record)
        size = sum(file.stat().st_size for file in (args.out / run).iterdir())
        print(f"{args.out / run}: recorded from {folder / run} ({size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
