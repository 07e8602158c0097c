"""Test-wide setup: Triton kernels run compiled on a GPU when one is present, else in the interpreter on CPU; every
test starts from a fixed seed; tests/support's helper modules import by name (`from helpers import ...`).

A test file's tier is its folder (kernels/, train/, integrations/, distributed/, repo/): each folder's conftest.py
gives its tests the folder's marker (registered in pytest.ini), so `pytest -m kernels` runs the kernels tier.
support/ holds the importable helpers, workers/ the scripts that tests launch in their own processes.
"""
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

# must precede the first `import triton`; TRITON_INTERPRET=1 set by the caller forces the interpreter on a GPU too
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
# One torch thread per test process (trainer.cpu_threads defaults to OMP_NUM_THREADS, else all cores): tests run
# tiny matrices, often several processes at once, where more threads only contend.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch, imported above, has read the variable already: its thread count is set here, not only for subprocesses
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))


def pytest_addoption(parser):
    parser.addoption("--fused-options", default="", metavar="KEYS",
                     help="the fused loss's private knobs for the whole session, as the bench's contender keys, "
                          "comma-separated: erpo-dh32, erpo-epi, "
                          "erpo-epi-BMxBNxBK-wW-sS[-persistentP|-persistentsm][-tma], erpo-geom-ROWS[-GROUP] "
                          "(tests/support/fused_options.py; docs/CONTRIBUTING.md)")


# Where the libraries the suite runs keep their user files, each a folder of one temporary folder of the session
# (ERPO_TESTS_USER_DIRS): erpo's user cache ($XDG_CACHE_HOME/erpo: the weight files' digests, erpo.models.fingerprint),
# the Hugging Face caches (HF_HOME: huggingface_hub and datasets fix theirs at import; datasets caches a local parquet
# folder it loads there), matplotlib's config and font cache (MPLCONFIGDIR), XDG_CONFIG_HOME for the rest; never the
# real HOME (tests/repo/test_suite_isolation.py). Set here, at this file's import: a run that names a tier's folder
# (`pytest tests/integrations/...`) imports that folder's conftest.py, which imports transformers, before any
# pytest_configure; the variables are put back and the folder removed at the end (pytest_unconfigure).
USER_DIRS = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "MPLCONFIGDIR", "HF_HOME")
USER_DIRS_ROOT = tempfile.mkdtemp(prefix="erpo-tests-user-dirs-")
_USER_DIRS_BEFORE = {name: os.environ.get(name) for name in (*USER_DIRS, "ERPO_TESTS_USER_DIRS")}
os.environ["ERPO_TESTS_USER_DIRS"] = USER_DIRS_ROOT
for _name in USER_DIRS:
    os.environ[_name] = os.path.join(USER_DIRS_ROOT, _name.lower())
# Each pytest-xdist worker keeps user folders of its own (erpo's digest cache is read, merged and replaced: two
# workers writing it at once could drop each other's entries).


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite, or a folder of it, runs on every core of the machine with pytest-xdist (a worker per logical
    core, a file per worker at a time: `--dist loadfile`, so that a file's module fixtures run once), the slowest
    files first (tests/support/suite_schedule.py); one file or test named on the command line, `-n 0`,
    `-p no:xdist`, --pdb and --collect-only run serially, and `-n N` / `--dist` given on the command line win
    (docs/CONTRIBUTING.md)."""
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or config.option.numprocesses is not None or config.getoption("usepdb")
            or config.getoption("collectonly")
            or any(Path(arg.split("::")[0]).is_file() for arg in config.args)):
        return
    config.option.numprocesses = "logical"
    if config.option.dist == "no":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False   # FILES_FIRST's order, not xdist's (most tests first)


def pytest_collection_modifyitems(config, items):
    """In a pytest-xdist worker (whose collection the controller schedules, the same in each), the slowest files
    first (suite_schedule.FILES_FIRST); a serial run keeps pytest's order."""
    if hasattr(config, "workerinput"):
        from suite_schedule import files_first_order

        files_first_order(items)


def pytest_configure(config):
    """Before collection (a test may read a constant at import): --fused-options' knobs set, put back at the end.
    Under pytest-xdist, pytest-benchmark (the bench extra) off, as it turns itself off there, without its warning
    from every process (the suite times nothing: bench/test_bench.py runs alone)."""
    if config.pluginmanager.hasplugin("benchmark") and (config.getoption("dist", "no") != "no"
                                                        or "PYTEST_XDIST_WORKER" in os.environ):
        config.option.benchmark_disable = True
    from fused_options import enter_knobs

    config._fused_options = contextlib.ExitStack()
    try:
        config._fused_option_labels = enter_knobs(config.getoption("--fused-options"), config._fused_options)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None


def pytest_unconfigure(config):
    if hasattr(config, "_fused_options"):
        config._fused_options.close()
    for name, value in _USER_DIRS_BEFORE.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(USER_DIRS_ROOT, ignore_errors=True)


def pytest_report_header(config):
    labels = getattr(config, "_fused_option_labels", [])
    return [f"fused options: {'; '.join(labels)}"] if labels else []


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel tests put their tensors: CUDA (kernels compiled, checked against the torch reference) when a GPU
    is present and the interpreter is not forced, else the CPU (Triton's interpreter)."""
    if torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] != "1":
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture(autouse=True, scope="session")
def _interpreter_patches_once_per_launch():
    """In Triton's interpreter, the language is patched once per kernel launch, not again at each device-function
    call (interpreter_patch_once.py: the same values, half the interpreter's time on the loss's kernels)."""
    if os.environ["TRITON_INTERPRET"] != "1":
        yield
        return
    from interpreter_patch_once import patch_lang_once_per_launch

    with pytest.MonkeyPatch.context() as monkeypatch:
        patch_lang_once_per_launch(monkeypatch)
        yield


@pytest.fixture
def no_launcher_variables(monkeypatch):
    """The launcher variables (erpo.distributed.LAUNCHER_VARIABLES) unset, as in a process no launcher started; what
    the test, or the code it runs, sets of them is put back after it."""
    from erpo.distributed import LAUNCHER_VARIABLES

    for key in LAUNCHER_VARIABLES:
        monkeypatch.setenv(key, "")   # records the value, or its absence, for the teardown (a bare delenv would not)
        monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="module")
def _process_globals_as_found(request):
    """A file leaves the process-wide functions, methods and switches of support/process_globals.py as it found them:
    a pytest-xdist worker runs the next file in the same process. One that does not fails at its last test's
    teardown, naming each change (the change is left in place: undo it where the file makes it)."""
    from process_globals import changed_globals, process_globals

    before = process_globals()
    yield
    changes = changed_globals(before, process_globals())
    if changes:
        pytest.fail(f"{request.node.nodeid} left process-wide state changed for the next file in this process: "
                    f"{'; '.join(changes)}", pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_across_files():
    """A single-rank DeepSpeed run leaves a torch.distributed group (and DeepSpeed's copies of it) behind; never let
    it leak into the next file."""
    yield
    from erpo.distributed import destroy_distributed
    destroy_distributed()
