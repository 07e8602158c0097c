"""A test leaves nothing outside its temporary folders (docs/CONTRIBUTING.md): erpo's user cache, the weight files'
digests that model fingerprints keep (erpo.models.fingerprint), and the libraries' user files (matplotlib's, the
Hugging Face caches) go under the session's temporary folder for them (ERPO_TESTS_USER_DIRS, tests/conftest.py), in the
test's process and in the processes it launches, not under the real HOME. A test file leaves the process-wide
functions and switches as it found them (support/process_globals.py): the next file in its process would compute
otherwise."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from erpo.models.fingerprint import fingerprint_cache_path, model_fingerprint
from paths import REPO, SUPPORT, TESTS


def test_model_fingerprints_keep_their_digests_under_the_sessions_user_folder(tmp_path):
    session = Path(os.environ["ERPO_TESTS_USER_DIRS"])   # tests/conftest.py
    assert not session.is_relative_to(Path.home())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    model_fingerprint(str(model))
    assert fingerprint_cache_path().is_relative_to(session), fingerprint_cache_path()
    assert str(model / "model.safetensors") in json.loads(fingerprint_cache_path().read_text())
    child = subprocess.run([sys.executable, "-c", "from erpo.models.fingerprint import fingerprint_cache_path as p; "
                            "print(p())"], env=dict(os.environ), capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(fingerprint_cache_path())   # a launched process inherits it


def test_libraries_keep_their_user_files_under_the_sessions_user_folder(tmp_path):
    """matplotlib's config and font cache and the Hugging Face caches (set at tests/conftest.py's import:
    huggingface_hub and datasets fix theirs at import, and the test files import transformers and TRL) resolve under
    the session's folder for them in the suite's process; a process it launches, whose HOME is here an empty folder,
    draws a plot and loads a local parquet folder through datasets, and leaves that HOME empty."""
    import huggingface_hub.constants
    import matplotlib

    session = Path(os.environ["ERPO_TESTS_USER_DIRS"])   # tests/conftest.py
    assert not session.is_relative_to(Path.home())
    folders = {"matplotlib config": matplotlib.get_configdir(), "matplotlib cache": matplotlib.get_cachedir(),
               "HF_HOME": huggingface_hub.constants.HF_HOME}
    if importlib.util.find_spec("datasets") is not None:   # TRL's dependency
        import datasets.config
        folders["datasets cache"] = datasets.config.HF_DATASETS_CACHE
    for what, folder in folders.items():
        assert Path(folder).is_relative_to(session), (what, folder)
    home = tmp_path / "home"
    home.mkdir()
    script = ("import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt, sys\n"
              "plt.plot([1, 2]); plt.savefig(sys.argv[1] + '/plot.png')\n"
              "try:\n    import datasets, pyarrow, pyarrow.parquet as pq\nexcept ImportError:\n    sys.exit()\n"
              "pq.write_table(pyarrow.table({'x': [1, 2]}), sys.argv[1] + '/rows/part.parquet')\n"
              "assert len(datasets.load_dataset(sys.argv[1] + '/rows', split='train')) == 2")
    (tmp_path / "rows").mkdir()
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env={**os.environ, "HOME": str(home)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and (tmp_path / "plot.png").exists(), done.stderr[-3000:]
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []


def leak_errors(tmp_path, leaks: str, next_file: str) -> list[str]:
    """The ERROR lines of pytest with tests/conftest.py as a plugin on `leaks` (test_a_leaks.py: two tests), then
    `next_file` (test_b_next.py: one test), in one process, as a pytest-xdist worker runs them (lines not cut), once
    its summary says 3 passed and 1 error: the leaking file's, at its last teardown."""
    (tmp_path / "test_a_leaks.py").write_text(leaks)
    (tmp_path / "test_b_next.py").write_text(next_file)
    path = os.pathsep.join([str(TESTS), str(SUPPORT), str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-p", "conftest", f"--rootdir={tmp_path}", f"--basetemp={tmp_path / 'run'}",
                           "test_a_leaks.py", "test_b_next.py"],
                          cwd=tmp_path, env=dict(os.environ, COLUMNS="1000", PYTHONPATH=path), capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.splitlines()[-1].startswith("3 passed, 1 error"), done.stdout[-3000:] + done.stderr
    return [line for line in done.stdout.splitlines() if line.startswith("ERROR ")]


LEAVES_LINEAR_REPLACED = """import torch


def linear(input, weight, bias=None):
    return input @ weight.t() + (0 if bias is None else bias)


def test_replaces_torch_linear_for_good():
    torch.nn.functional.linear = linear


def test_restores_what_it_replaces(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "softmax", linear)
    monkeypatch.setattr(torch.nn.Module, "_added_name", 1, raising=False)
"""

LEAVES_NOTHING = """import torch


def test_uses_whatever_linear_is_there():
    assert torch.nn.functional.linear(torch.ones(1, 2), torch.ones(3, 2)).shape == (1, 3)
"""


def test_a_file_that_leaves_a_torch_function_replaced_fails_and_the_next_file_does_not(tmp_path):
    """tests/conftest.py's check around each file (as DeepSpeed ZeRO-3 once left torch.nn.functional.linear replaced
    in a pytest-xdist worker, and a later file's bf16 forwards changed): the file that leaves torch's linear replaced
    errors at its last test's teardown, naming it; what monkeypatch restores, and a name only added, are no change;
    the next file in the same process passes."""
    assert leak_errors(tmp_path, LEAVES_LINEAR_REPLACED, LEAVES_NOTHING) == [
        "ERROR test_a_leaks.py::test_restores_what_it_replaces - Failed: test_a_leaks.py left process-wide state "
        "changed for the next file in this process: torch.nn.functional.linear: torch._C._nn.linear -> "
        "test_a_leaks.linear"]


LEAVES_A_VARIABLE_SET = """import os


def test_leaves_a_variable_set():
    os.environ["ERPO_TESTS_LEFT_SET"] = "29500"


def test_sets_and_removes_with_monkeypatch(monkeypatch):
    monkeypatch.setenv("ERPO_TESTS_PUT_BACK", "1")
    monkeypatch.delenv("HOME")
"""

READS_THE_ENVIRONMENT = """import os


def test_finds_no_variable_left():
    assert "ERPO_TESTS_PUT_BACK" not in os.environ and "HOME" in os.environ
"""


def test_a_file_that_leaves_an_environment_variable_set_fails_and_the_next_file_does_not(tmp_path):
    """The environment is watched too (tests/support/process_globals.py), a variable a file adds included: as an
    in-process `erpo train` once left MASTER_PORT set and a later file's child `erpo train` failed on the bound port.
    The file that sets a variable for good errors at its last test's teardown, naming it; what monkeypatch sets or
    removes and puts back is no change; the next file in the same process passes."""
    assert leak_errors(tmp_path, LEAVES_A_VARIABLE_SET, READS_THE_ENVIRONMENT) == [
        "ERROR test_a_leaks.py::test_sets_and_removes_with_monkeypatch - Failed: test_a_leaks.py left process-wide "
        "state changed for the next file in this process: os.environ.ERPO_TESTS_LEFT_SET: (none) -> '29500'"]
