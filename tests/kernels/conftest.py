"""The kernels tier (`pytest -m kernels`): erpo_kernels against the torch reference and the plain formula: values,
gradients, options, errors, torch.compile, the sm_90 compile check, the README's kernel examples and the benchmark
harness's smoke run. Every test collected under this folder gets the marker."""
import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.kernels)
