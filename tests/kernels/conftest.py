"""The kernels tier (`pytest -m kernels`): erpo_kernels against the torch reference and the plain formula: values,
gradients, options, errors, torch.compile, the sm_90 compile check, the README's kernel examples and the benchmark
harness's smoke run. Every test collected under this folder gets the marker.

Under the interpreter the tier holds Triton to what the GPU image does (tests/support/interpreter_as_gpu.py): numpy's
deprecated array-to-scalar conversion, an error with the image's numpy 2.5, is an error here; tl.minimum /
tl.maximum drop a NaN as the compiled kernels do; an fp32 -> bf16 cast rounds to nearest even as compiled (the
interpreter truncates); a test of what must be exact asks for `fma_as_compiled`."""
import os

import pytest

from interpreter_as_gpu import (
    NUMPY_SCALAR_ERROR,
    bf16_rounding_as_compiled,
    fma_contraction_as_compiled,
    min_max_drop_nan_as_compiled,
)


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.kernels)
    item.add_marker(pytest.mark.filterwarnings(NUMPY_SCALAR_ERROR))


@pytest.fixture(autouse=True)
def _min_max_drop_nan_as_compiled(monkeypatch):
    if os.environ["TRITON_INTERPRET"] == "1":
        min_max_drop_nan_as_compiled(monkeypatch)


@pytest.fixture(autouse=True)
def _bf16_rounding_as_compiled(monkeypatch):
    if os.environ["TRITON_INTERPRET"] == "1":
        bf16_rounding_as_compiled(monkeypatch)


@pytest.fixture
def fma_as_compiled(monkeypatch):
    """Under the interpreter, fp32 products fused into the adds and subtractions they feed, as compiled
    (interpreter_as_gpu.fma_contraction_as_compiled)."""
    if os.environ["TRITON_INTERPRET"] == "1":
        fma_contraction_as_compiled(monkeypatch)
