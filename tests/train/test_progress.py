"""Every long phase shows its progress as training does (erpo.progress), run as a user runs it: on a terminal, tqdm
bars for the SFT warm start, the reference cache and training; with stderr to a file (a log, CI), plain log lines
(here one per update: ERPO_PROGRESS_SECONDS=0), no carriage return, for those and for `erpo eval`."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from erpo.cli.commands import main
from erpo.progress import LogProgress, progress_seconds
from terminal import TerminalRun
from test_resume import env, small_run_args

PHASES = ("tiny theta0 SFT", "reference cache ell_theta0(q)", "erpo train")


def train_command(out: Path, cache: Path) -> list[str]:
    return [sys.executable, "-m", "erpo", "train", "--output-dir", str(out), "--max-steps", "2",
            *small_run_args(cache), "logging.progress_bar=true", "reference.batch_size=8"]


def test_without_a_terminal_every_phase_logs_plain_progress_lines(tmp_path, monkeypatch, capsys, caplog):
    """`erpo train` in a process with stderr to a pipe; then `erpo eval` of its model in this process (stderr
    captured: no terminal either), its progress the records of erpo's logger."""
    out = tmp_path / "run"
    log_env = dict(env(), ERPO_PROGRESS_SECONDS="0")
    train = subprocess.run(train_command(out, tmp_path / "cache"), env=log_env, capture_output=True, text=True,
                           timeout=300)
    assert train.returncode == 0, train.stderr[-4000:]
    assert "\r" not in train.stderr
    lines = train.stderr.splitlines()
    for phase in PHASES:
        counts = [line.split(f"{phase}: ")[1].split(" ")[0] for line in lines if f" erpo: {phase}: " in line]
        assert counts and counts[-1].split("/")[0] == counts[-1].split("/")[1], (phase, train.stderr[-3000:])
    assert "tiny theta0 SFT: 5/5 step (100%)" in train.stderr and "erpo train: 2/4 step (50%)" in train.stderr

    monkeypatch.setenv("ERPO_PROGRESS_SECONDS", "0")
    caplog.set_level("INFO", logger="erpo")
    capsys.readouterr()
    assert main(["eval", "--model", str(out), "--temperatures", "1.0", "--k", "2", "--max-new-tokens", "4",
                 "--output-dir", str(tmp_path / "eval")]) == 0
    assert "\r" not in capsys.readouterr().err   # no tqdm bar
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("run | synthetic | T=1: 64/64 problem (100%)") for line in lines), lines[-20:]


def test_on_a_terminal_the_phases_show_progress_bars(tmp_path):
    run = TerminalRun(train_command(tmp_path / "run", tmp_path / "cache"), env=env())
    try:
        status = run.wait(timeout=300)
    finally:
        run.kill()
    assert status == 0, run.output[-4000:]
    for phase in PHASES:   # a tqdm bar: redrawn after a carriage return, "N/TOTAL [elapsed<left, rate]"
        assert f"\r{phase}: 100%|" in run.output, (phase, run.output[-3000:])
    assert "elapsed, about" not in run.output     # no log lines of progress on a terminal


def test_progress_lines_are_spaced_by_the_interval(monkeypatch, caplog):
    clock = [0.0]
    monkeypatch.setattr("erpo.progress.time.monotonic", lambda: clock[0])
    caplog.set_level("INFO", logger="erpo")
    shown = LogProgress(100, "phase", "step", seconds=30)
    for _ in range(100):
        clock[0] += 1.0
        shown.update(1)
    shown.close()
    assert [r.getMessage() for r in caplog.records] == [
        "phase: 30/100 step (30%), 0:30 elapsed, about 1:10 left",
        "phase: 60/100 step (60%), 1:00 elapsed, about 0:40 left",
        "phase: 90/100 step (90%), 1:30 elapsed, about 0:10 left",
        "phase: 100/100 step (100%), 1:40 elapsed"]


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_a_bad_progress_interval_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("ERPO_PROGRESS_SECONDS", value)
    with pytest.raises(ValueError, match="ERPO_PROGRESS_SECONDS must be a number of seconds >= 0"):
        progress_seconds()
    monkeypatch.setenv("ERPO_PROGRESS_SECONDS", "2.5")
    assert progress_seconds() == 2.5
    del os.environ["ERPO_PROGRESS_SECONDS"]
    assert progress_seconds() == 30.0
