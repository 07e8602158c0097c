"""The train tier (`pytest -m train`): erpo itself: config, data, rewards, rollout, reference cache, evaluation,
checkpoints, and `erpo train` / `erpo eval` / `erpo compare` end to end on tiny models (one process). Every test
collected under this folder gets the marker."""
import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.train)

