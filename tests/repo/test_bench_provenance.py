"""bench/provenance.py: the command, commit, date and versions that every bench report records, written one way,
and the probes' report file.
(That bench.kernel_profile's report, the one that runs on the CPU, opens with them: tests/repo/test_gpu_check.py, on
the dry run's logits stage.)"""
import datetime
import re

import pytest
import torch

from bench.provenance import git_commit, header_lines, provenance, write_report
from paths import REPO


def test_provenance_records_the_exact_command_the_commit_the_utc_date_and_the_versions():
    triton = pytest.importorskip("triton", exc_type=ModuleNotFoundError)
    record = provenance("bench.gemm_probe", ["--out", "a dir", "--rows", "512"], "abc123")
    assert record["command"] == "python -m bench.gemm_probe --out 'a dir' --rows 512"  # as a shell reruns it
    assert record["commit"] == "abc123"
    date = datetime.datetime.fromisoformat(record["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert abs(datetime.datetime.now(datetime.timezone.utc) - date) < datetime.timedelta(minutes=1)
    assert (record["torch"], record["triton"]) == (torch.__version__, triton.__version__)


def test_without_a_commit_it_asks_git(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", provenance("bench", [])["commit"])
    monkeypatch.chdir(tmp_path)  # no repository here
    assert git_commit() == "unknown (no commit)"


def test_header_lines_name_each_field_and_leave_out_a_missing_triton():
    record = dict(command="python -m bench --smoke", commit="abc123", date="2026-11-26T06:00:00+00:00",
                  torch="2.11.0", triton="3.6.0")
    assert header_lines(record) == ["- command: `python -m bench --smoke`", "- commit: `abc123`",
                                    "- date: `2026-11-26T06:00:00+00:00`", "- torch 2.11.0, triton 3.6.0"]
    assert header_lines({**record, "triton": None})[-1] == "- torch 2.11.0"


def test_write_report_makes_the_folder_and_writes_one_line_each(tmp_path):
    path = write_report(tmp_path / "new" / "dir", "probe.md", ["# A probe", "", "| a | b |"])
    assert path == tmp_path / "new" / "dir" / "probe.md"
    assert path.read_text() == "# A probe\n\n| a | b |\n"
    write_report(tmp_path / "new" / "dir", "probe.md", ["# Again"])  # the folder exists: the file is replaced
    assert path.read_text() == "# Again\n"
