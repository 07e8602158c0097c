"""The train tier (`pytest -m train`): erpo itself: config, data, rewards, rollout, reference cache, evaluation,
checkpoints, and `erpo train` / `erpo eval` / `erpo compare` end to end on tiny models (one process). Every test
collected under this folder gets the marker."""
import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.train)


@pytest.fixture
def no_launcher_variables(monkeypatch):
    """The launcher variables (erpo.distributed.LAUNCHER_VARIABLES) unset, as in a process no launcher started; what
    the test, or the code it runs, sets of them is put back after it."""
    from erpo.distributed import LAUNCHER_VARIABLES

    for key in LAUNCHER_VARIABLES:
        monkeypatch.setenv(key, "")   # records the value, or its absence, for the teardown (a bare delenv would not)
        monkeypatch.delenv(key)
