"""The repo tier (`pytest -m repo`): the repository's rules: documentation links and rows, ruff and the import
contract, packaging. Every test collected under this folder gets the marker."""
import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.repo)
