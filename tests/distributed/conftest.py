"""The distributed tier (`pytest -m distributed`): several ranks on CPU (torchrun / the DeepSpeed launcher, gloo;
ZeRO-2 / ZeRO-3, FSDP2). Every test collected under this folder gets the marker."""
import importlib.util

import pytest
import torch


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.distributed)


@pytest.fixture(autouse=True, scope="module")
def _launches_keep_their_temporary_files_under_pytests(tmp_path_factory):
    """torchrun's agent makes a torchelastic_* folder in the temporary directory and leaves it there: the processes
    each test file launches (they inherit TMPDIR) make theirs under pytest's temporary folder instead."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))
        yield


@pytest.fixture(autouse=True, scope="session")
def _deepspeed_cpu_ops_built():
    """DeepSpeed's CPU ops built once, before the first test of the tier (deepspeed_ops.py), where DeepSpeed is
    installed and the ranks run on the CPU: their build is not charged to the limit of whichever test's ranks come
    first."""
    if importlib.util.find_spec("deepspeed") is not None and not torch.cuda.is_available():
        from deepspeed_ops import build_cpu_ops

        build_cpu_ops()
