"""Where the test tree's parts are, for tests that launch processes: the repository root, tests/support (the
importable helpers, on sys.path through tests/conftest.py) and tests/workers (scripts run in their own processes)."""
import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SUPPORT = TESTS / "support"
WORKERS = TESTS / "workers"
INTERPRETER_SITE = SUPPORT / "interpreter_site"  # its sitecustomize.py: Triton's interpreter patched as in the suite


def worker_pythonpath() -> str:
    """PYTHONPATH for a worker process: the repository (this checkout's erpo and erpo_kernels), tests/support (its
    helpers), tests/support/interpreter_site (under TRITON_INTERPRET=1, Triton's interpreter patched once per launch,
    as in the suite's own process), then the caller's PYTHONPATH."""
    return os.pathsep.join([str(REPO), str(SUPPORT), str(INTERPRETER_SITE), os.environ.get("PYTHONPATH", "")])
