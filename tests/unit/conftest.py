"""Every test under tests/unit/ is marked ``unit``: ``python -m pytest -m unit`` (or
``python -m pytest tests/unit``) runs the fast tier alone, with no kernel process."""
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)         # before -m selects on the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.unit)
