"""The integrations tier (`pytest -m integrations`): erpo.integrations: ERPOTrainer against TRL's GRPOTrainer and the
verl loss on verl's engine (parity, real training steps), the TRL peer harness. Every test collected under this
folder gets the marker."""
import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.integrations)
