"""`python -m bench --progress FILE`: a run's results as JSON lines, each written the moment it is measured, so that
a run stopped part-way (a time limit, a crash) keeps what it did.

Each line is an object with one key: `{"meta": {...}}` opens a run, `{"plan": [...]}` lists the rows it will
measure (`bench.run.planned_rows`), then `{"floor": {...}}` and `{"row": {...}}` follow in measuring order. Several
runs may append to one file. `read_runs` turns a file back into result sets (`--merge` takes such files too); a
planned row the run never reached becomes a row with status `not reached`.
"""
from __future__ import annotations

import json
from pathlib import Path

NOT_REACHED = "not reached"


class ProgressWriter:
    """Appends one JSON line per item to `file` and flushes it at once."""

    def __init__(self, file: Path):
        file.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(file, "a", encoding="utf-8")

    def write(self, kind: str, item) -> None:
        self._handle.write(json.dumps({kind: item}, default=str) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def _lines(file: Path) -> list:
    """The file's objects; a last line cut off mid-write (the process was killed) is dropped."""
    text = file.read_text(encoding="utf-8").splitlines()
    items = []
    for number, line in enumerate(text, 1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(text):
                break
            raise ValueError(f"{file}:{number}: not a JSON line; a --progress file has one object per line")
    return items


def _key(row: dict) -> tuple:
    return row["path"], row["shape"], row["N"], row["contender"]


def read_runs(file: Path) -> list:
    """[{"meta", "floors", "rows"}] per run in `file`, rows in measuring order, then the planned rows the run did not
    reach (status `not reached`)."""
    runs = []
    for item in _lines(file):
        (kind, value), = item.items()
        if kind == "meta":
            runs.append({"meta": value, "plan": [], "floors": [], "rows": []})
        elif not runs:
            raise ValueError(f"{file}: a {kind!r} line before the first 'meta' line")
        elif kind in ("plan", "floor", "row"):
            target = runs[-1]
            if kind == "plan":
                target["plan"] = value
            else:
                target[kind + "s"].append(value)
        else:
            raise ValueError(f"{file}: unknown line kind {kind!r} (expected meta, plan, floor or row)")
    for run in runs:
        done = {_key(row) for row in run["rows"]}
        run["rows"] += [{**planned, "status": NOT_REACHED, "detail": "the run stopped before this row"}
                        for planned in run.pop("plan") if _key(planned) not in done]
    return runs
