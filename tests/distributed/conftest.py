"""The distributed tier (`pytest -m distributed`): several ranks on CPU (torchrun / the DeepSpeed launcher, gloo;
ZeRO-2 / ZeRO-3, FSDP2). Every test collected under this folder gets the marker."""
import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.distributed)
