"""The distributed tier (`pytest -m distributed`): several ranks on CPU (torchrun / the DeepSpeed launcher, gloo;
ZeRO-2 / ZeRO-3, FSDP2). Every test collected under this folder gets the marker."""
import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.distributed)


@pytest.fixture(autouse=True, scope="module")
def _launches_keep_their_temporary_files_under_pytests(tmp_path_factory):
    """torchrun's agent makes a torchelastic_* folder in the temporary directory and leaves it there: the processes
    each test file launches (they inherit TMPDIR) make theirs under pytest's temporary folder instead."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))
        yield

