"""Where the test tree's parts are, for tests that launch processes: the repository root, tests/support (the
importable helpers, on sys.path through tests/conftest.py) and tests/workers (scripts run in their own processes)."""
import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SUPPORT = TESTS / "support"
WORKERS = TESTS / "workers"


def worker_pythonpath() -> str:
    """PYTHONPATH for a worker process: the repository (this checkout's erpo and erpo_kernels), tests/support (its
    helpers), then the caller's PYTHONPATH."""
    return os.pathsep.join([str(REPO), str(SUPPORT), os.environ.get("PYTHONPATH", "")])
