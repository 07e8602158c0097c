"""The README's test command runs on every core (tests/conftest.py's pytest_cmdline_main, docs/CONTRIBUTING.md): a
folder of the suite (or the whole of it) goes to pytest-xdist's workers, a file at a time, FILES_FIRST first; without
the plugin (and with one file or test named, or `-n 0`) pytest runs it serially in its own process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from suite_schedule import FILES_FIRST

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
ONE_TEST = "test_parallel_suite.py::test_the_files_that_start_first_are_the_suite_s_files"  # imports nothing heavy


def run_pytest(tmp_path, *args: str) -> str:
    """`python -m pytest -v ARGS` from the repository root, the run's temporary files under tmp_path; its output
    (stdout, then stderr), once it has passed the one test selected."""
    # xdist's own override of the worker count: one worker process (each imports torch) shows the hook's xdist run
    env = dict(os.environ, PYTEST_XDIST_AUTO_NUM_WORKERS="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                           f"--basetemp={tmp_path / 'run'}", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "1 passed" in done.stdout.splitlines()[-1], done.stdout[-3000:] + done.stderr
    return done.stdout + done.stderr


def test_a_folder_runs_on_workers_and_without_xdist_in_the_process(tmp_path):
    pytest.importorskip("xdist", exc_type=ModuleNotFoundError)
    # the folder, with only this file collected (each process imports the files it collects)
    folder = ["tests/repo", *(f"--ignore-glob=*/repo/test_{glob}.py" for glob in ("[!p]*", "p[!a]*", "pac*")),
              "-k", ONE_TEST.split("::")[1]]
    output = run_pytest(tmp_path, *folder)
    assert "1 worker [1 item]" in output
    # pytest-benchmark (the bench extra), where installed, is off on xdist's processes without its warning from each
    assert "PytestBenchmarkWarning" not in output
    # the same folder without the plugin: pytest's own serial run (each run starts processes that import torch:
    # one file named and `-n 0`, the hook's other serial cases, are left to its code)
    output = run_pytest(tmp_path, "-p", "no:xdist", *folder)
    assert "workers" not in output and f"tests/repo/{ONE_TEST} PASSED" in output


def test_the_files_that_start_first_are_the_suite_s_files():
    """A renamed or removed file in FILES_FIRST would silently start wherever pytest collects it."""
    assert len(set(FILES_FIRST)) == len(FILES_FIRST)
    assert [name for name in FILES_FIRST if not (TESTS / name).is_file()] == []
