"""Fixtures shared by the CPU unit tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (tiny matmuls: threads only add overhead on 2 cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
