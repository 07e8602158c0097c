"""Reading records: JSONL / JSON / Parquet datasets, Hugging Face Hub datasets, and JSONL logs that a crash may
have cut short (with the metric names a training log held before a rename)."""
from __future__ import annotations

import json
import os

from erpo.errors import MissingInputError, MissingPackageError, UserError

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")  # the local file formats `read_records` reads
# metrics.jsonl names of runs logged before they took TRL's (2026-11-27) -> TRL's name, the same values
RENAMED_METRICS = {"response_length": "completions/mean_length", "truncated_frac": "completions/clipped_ratio"}


def with_current_metric_names(record: dict) -> dict:
    """A step's metrics (a metrics.jsonl record, or a row of a pilot record's metrics.csv.gz) under today's names:
    those in RENAMED_METRICS renamed, the others as they are."""
    return {RENAMED_METRICS.get(key, key): value for key, value in record.items()}


def iter_jsonl(path: str, *, torn_tail_ok: bool = False):
    """Yield (line number, record) for each non-empty line of a JSONL file.

    Line numbers count from 1. With `torn_tail_ok`, an unparsable *last* line (a crash mid-write) is skipped; any
    other bad line raises a UserError naming `path:line`.
    """
    with open(path, encoding="utf-8") as handle:
        # Split on "\n" only: str.splitlines also breaks at U+2028, U+0085 and the like, which JSON strings may
        # hold unescaped (json.dumps(..., ensure_ascii=False) writes them as they are).
        lines = handle.read().split("\n")
    if lines[-1] == "":  # the newline that ends the last line
        lines.pop()
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if torn_tail_ok and line_no == len(lines):
                return
            raise UserError(f"{path}:{line_no}: not valid JSON ({err.msg}); fix or remove that line") from err
        yield line_no, record


def read_located_records(path: str) -> list[tuple[str, object]]:
    """(where, row) for each row of a local `.jsonl` (one object a line), `.json` (a list of objects) or `.parquet`
    file; `where` says where the row is for error messages, counting from 1: "line N" (.jsonl), "record N"
    (the Nth item of a .json list) or "row N" (.parquet). Missing or unreadable files are a UserError."""
    if not os.path.exists(path):
        raise MissingInputError(f"no such file {path}; check the path")
    if not os.path.isfile(path):
        raise UserError(f"{path} is not a file")
    if path.endswith(".jsonl"):
        return [(f"line {line_no}", record) for line_no, record in iter_jsonl(path)]
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as handle:
            try:
                rows = json.load(handle)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from err
        if not isinstance(rows, list):
            raise UserError(f"{path}: expected a JSON list of records")
        return [(f"record {i}", row) for i, row in enumerate(rows, 1)]
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise MissingPackageError(f"reading {path} needs pyarrow: pip install pyarrow") from err
        return [(f"row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist(), 1)]
    raise UserError(f"{path} must end in .jsonl, .json or .parquet")


def read_records(path: str) -> list:
    """Rows of a local `.jsonl`, `.json` or `.parquet` file (see `read_located_records`)."""
    return [row for _, row in read_located_records(path)]


def read_hub_records(name: str, *, split: str, config: str | None = None) -> list[dict]:
    """Rows (dicts) of the Hugging Face Hub dataset `name`, subset `config`, split `split`.

    Needs `datasets` and network access; without `datasets` a MissingPackageError (an ImportError) says so, and a
    name the Hub (or a local directory) does not hold, or no network, is a MissingInputError (one line)."""
    try:
        import datasets
    except ImportError as err:
        raise MissingPackageError(f"{name!r} is not a local .jsonl/.json/.parquet file; loading it from the Hugging "
                                  "Face Hub needs `pip install datasets` and network access (or download it and pass "
                                  "the local file)") from err
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except (FileNotFoundError, ConnectionError) as err:   # no such dataset (or no data files in a directory); offline
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MissingInputError(f"dataset {name!r}: {reason}; check the name, or download it and pass the local "
                                ".jsonl/.json/.parquet file") from err
    return [dict(row) for row in rows]
