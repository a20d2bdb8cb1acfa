"""The dist tier: gloo process groups of 2 and 4 CPU processes spawned by the tests."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/dist/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.dist)


@pytest.fixture
def one_thread():
    """One torch thread, as in the workers (same matmul reduction order as the reference)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
