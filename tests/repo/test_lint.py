"""The repository's rules as tools: ruff (pyflakes, import order, lines <= 120; ruff.toml) on all code, and the
import contract (erpo's layers, evaluation never importing the trainer, erpo_kernels standing alone, its torch
reference never importing Triton, no cycle inside a subpackage; setup.cfg) checked by import-linter."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def tool(name: str) -> str:
    """The console script `name` installed with this Python (the test extra installs ruff and import-linter)."""
    path = Path(sys.executable).with_name(name)
    found = str(path) if path.is_file() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def test_ruff_passes_on_all_code():
    proc = run([tool("ruff"), "check", "--no-cache", "."])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_contract_is_kept():
    proc = run([tool("lint-imports"), "--no-cache"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


def test_optional_peers_skip_only_when_absent():
    """docs/CONTRIBUTING.md: a test skips where an optional peer is not installed and errors where it is installed but
    fails to import, so every pytest.importorskip in the tests passes exc_type=ModuleNotFoundError (without it, an
    installed peer that fails to import skips its tests in silence)."""
    calls = [(path, args) for path in sorted((REPO / "tests").rglob("*.py"))
             for args in re.findall(r"pytest\.importorskip\(([^)]*)\)", path.read_text())]
    assert len(calls) > 5    # the search sees them
    bare = [f"{path.relative_to(REPO)}: pytest.importorskip, arguments {args}" for path, args in calls
            if "exc_type=ModuleNotFoundError" not in args]
    assert not bare, bare


def test_one_did_you_mean():
    """A misspelled name's suggestion is formed in one place, `erpo_kernels.did_you_mean` (erpo_kernels may not import
    erpo): no other module of either package calls difflib itself (there were three copies)."""
    users = [str(path.relative_to(REPO)) for package in ("erpo", "erpo_kernels")
             for path in sorted((REPO / package).rglob("*.py")) if re.search(r"\bdifflib\b", path.read_text())]
    assert users == ["erpo_kernels/validation.py"], users
