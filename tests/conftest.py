"""Test-wide setup: Triton kernels run in the interpreter on CPU, and every test starts from a fixed seed."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`
# One torch thread per test process (trainer.cpu_threads defaults to OMP_NUM_THREADS, else all cores): tests run
# tiny matrices, often several processes at once, where more threads only contend.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_across_files():
    """A single-rank DeepSpeed run leaves a torch.distributed group (and DeepSpeed's copies of it) behind; never let
    it leak into the next file."""
    yield
    from erpo.distributed import destroy_distributed
    destroy_distributed()
