"""The suite's launches (torchrun's and the DeepSpeed launcher's ranks, DeepSpeed's op build: tests/support's
process_group) end with everything they started: on a timeout, a failed assertion, Ctrl+C, or a launcher that exits
before its children. A rank left running keeps a core busy for the rest of the suite."""
import os
import subprocess
import time
from pathlib import Path

import pytest

from process_group import launched, run_group, running, wait_gone

# a launcher in miniature: a child in its process group that outlives it (`sleep`), its pid in $0 once started
SPAWN = 'sleep 600 >/dev/null 2>&1 & echo $! > "$0.tmp" && mv "$0.tmp" "$0"; '


def child_pid(pid_file: Path) -> int:
    """The launcher's child, once it has started (a hung launcher fails the test after 120 s)."""
    deadline = time.monotonic() + 120
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the launcher did not start its child"
        time.sleep(0.01)
    return int(pid_file.read_text())


def test_a_timed_out_launch_leaves_no_child(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_group(["bash", "-c", SPAWN + "wait", str(pid_file)], env=dict(os.environ), timeout=5)
    # 5 s is for bash to start its child; without one the test would check nothing
    assert pid_file.exists(), "the launcher had not started its child within the timeout"
    wait_gone([int(pid_file.read_text())], timeout=60)   # a killed child goes once reaped


def test_a_launcher_that_ends_before_its_child_takes_it_along(tmp_path):
    pid_file = tmp_path / "child.pid"
    done = run_group(["bash", "-c", SPAWN + "echo launched; exit 3", str(pid_file)], env=dict(os.environ), timeout=120)
    assert (done.returncode, done.stdout) == (3, "launched\n")
    wait_gone([int(pid_file.read_text())], timeout=60)   # a killed child goes once reaped


@pytest.mark.parametrize("error", [AssertionError, KeyboardInterrupt])
def test_a_failure_while_a_launch_runs_ends_its_children(tmp_path, error):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(error):
        with launched(["bash", "-c", SPAWN + "wait", str(pid_file)]) as launcher:
            pid = child_pid(pid_file)
            assert running(pid) and launcher.poll() is None
            raise error
    assert launcher.returncode == -9
    wait_gone([pid], timeout=60)
