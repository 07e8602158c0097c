"""Test-wide setup: Triton kernels run compiled on a GPU when one is present, else in the interpreter on CPU; every
test starts from a fixed seed; each test file belongs to a tier (pytest -m kernels | e2e | distributed, pytest.ini).
"""
import os
from pathlib import Path

import torch

# must precede the first `import triton`; TRITON_INTERPRET=1 set by the caller forces the interpreter on a GPU too
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
# One torch thread per test process (trainer.cpu_threads defaults to OMP_NUM_THREADS, else all cores): tests run
# tiny matrices, often several processes at once, where more threads only contend.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# The tiers (markers registered in pytest.ini), by test file. Unlisted files are the fast unit tests of erpo.
TIERS = {
    "kernels": ("test_reference.py", "test_triton_logits.py", "test_fused_linear.py", "test_fused_linear_loss.py",
                "test_errors.py", "test_kernel_seams.py", "test_layout.py", "test_compile_hopper.py"),
    "distributed": ("test_multirank.py", "test_zero3.py", "test_fsdp2.py", "test_distributed.py"),
    "e2e": ("test_trainer.py", "test_resume.py", "test_lora_train.py", "test_compare.py", "test_readme_examples.py",
            "test_trl_integration.py", "test_bench_smoke.py", "test_cli.py"),
}


def pytest_collection_modifyitems(items):
    tier_of = {name: tier for tier, names in TIERS.items() for name in names}
    for item in items:
        tier = tier_of.get(Path(str(item.fspath)).name)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel tests put their tensors: CUDA (kernels compiled, checked against the torch reference) when a GPU
    is present and the interpreter is not forced, else the CPU (Triton's interpreter)."""
    if torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] != "1":
        return torch.device("cuda")
    return torch.device("cpu")


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
