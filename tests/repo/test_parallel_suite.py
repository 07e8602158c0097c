"""The README's test command runs on every core (tests/conftest.py's pytest_cmdline_main, docs/CONTRIBUTING.md): a
folder of the suite (or the whole of it) goes to pytest-xdist's workers, a file at a time, FILES_FIRST first; one file
or test named on the command line, `-n 0` or `-p no:xdist` run serially in pytest's own process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from suite_schedule import FILES_FIRST

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
ONE_TEST = "test_packaging.py::test_verl_plugin_names_a_module"


def run_pytest(tmp_path, *args: str) -> str:
    """`python -m pytest -q ARGS` from the repository root, the run's temporary files under tmp_path; its output, once
    it has passed the one test selected."""
    env = dict(os.environ, PYTEST_XDIST_AUTO_NUM_WORKERS="2")  # xdist's own override of the worker count
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--basetemp={tmp_path / 'run'}", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "1 passed" in done.stdout.splitlines()[-1], done.stdout[-3000:] + done.stderr
    return done.stdout


def test_a_folder_runs_on_workers_and_one_file_or_no_xdist_in_the_process(tmp_path):
    pytest.importorskip("xdist", exc_type=ModuleNotFoundError)
    name = ONE_TEST.split("::")[1]
    assert "2 workers [1 item]" in run_pytest(tmp_path, "-v", "tests/repo", "-k", name)
    for args in (["-v", f"tests/repo/{ONE_TEST}"], ["-v", "-p", "no:xdist", "tests/repo", "-k", name],
                 ["-v", "-n", "0", "tests/repo", "-k", name]):
        output = run_pytest(tmp_path, *args)
        assert "workers" not in output and f"tests/repo/{ONE_TEST} PASSED" in output, args


def test_the_files_that_start_first_are_the_suite_s_files():
    """A renamed or removed file in FILES_FIRST would silently start wherever pytest collects it."""
    assert len(set(FILES_FIRST)) == len(FILES_FIRST)
    assert [name for name in FILES_FIRST if not (TESTS / name).is_file()] == []
