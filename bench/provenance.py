"""Where a recorded number comes from, written the same way by every bench script (`python -m bench`,
bench.gemm_probe, bench.row_kernel_probe, bench.fused_probe, bench.kernel_profile, bench.host_cost): the exact
command, the commit, the date (UTC) and the versions of torch and Triton; and the probes' markdown report that opens
with them, written one way (`write_report`)."""
from __future__ import annotations

import datetime
import shlex
import subprocess
from pathlib import Path

import torch


def git_commit() -> str:
    """`git rev-parse HEAD` of the working directory, "+dirty" when it holds uncommitted changes; "unknown" without
    git, "unknown (no commit)" outside a repository."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown (no commit)"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def provenance(module: str, argv: list[str], commit: str | None = None) -> dict:
    """{"command": `python -m <module>` and argv, shell-quoted, "commit": `commit` (None: `git_commit()`), "date":
    now in UTC (ISO 8601, seconds), "torch": its version, "triton": its version, None when it is not installed}."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"command": shlex.join(["python", "-m", module, *argv]), "commit": commit or git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton_version}


def header_lines(record: dict) -> list[str]:
    """`record`'s provenance (a `provenance` dict, or a results file's meta holding its keys) as markdown list items:
    command, commit, date, versions."""
    versions = f"torch {record['torch']}" + (f", triton {record['triton']}" if record.get("triton") else "")
    return [f"- command: `{record['command']}`", f"- commit: `{record['commit']}`", f"- date: `{record['date']}`",
            f"- {versions}"]


def write_report(out: str | Path, name: str, lines: list[str]) -> Path:
    """Write a probe's markdown report, `lines` (its title, `header_lines`, its tables) one a line, to the file
    `name` in the folder `out` (made, with its parents, when missing); returns the file's path."""
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
