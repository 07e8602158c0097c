"""The integrations tier (`pytest -m integrations`): erpo.integrations: ERPOTrainer against TRL's GRPOTrainer and the
verl loss on verl's engine (parity, real training steps), the TRL peer harness. Every test collected under this
folder gets the marker."""
import pytest

from erpo.models.tiny import build_tokenizer
from tiny_models import save_tiny_model


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.integrations)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path of a saved tiny Qwen2 + tokenizer, the tokenizer): the ERPOTrainer tests' model. A path, so that TRL
    can load a reference model. (test_verl_integration.py has its own, with the HF model.)"""
    tokenizer = build_tokenizer()
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer), tokenizer
