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


@pytest.fixture(scope="module")
def qwen():
    """(model, tokenizer) of the built-in tiny-qwen2 (``plora.models.load_model``), once per
    module."""
    from plora.models import load_model

    return load_model("tiny-qwen2")


@pytest.fixture(autouse=True)
def _plan_without_liger(monkeypatch: pytest.MonkeyPatch):
    """Plan as on a machine without Liger-Kernel, whatever this one has installed: with
    ``training.fused_kernels: auto`` a GPU sweep's plan (memory, step times, profile key)
    follows ``liger_installed()``, and golden plans must not depend on the host's extras.
    Tests of the switch set it themselves."""
    from plora.config import fused

    monkeypatch.setattr(fused, "liger_installed", lambda: False)


@pytest.fixture(autouse=True)
def _plan_graphs_whatever_the_environment(monkeypatch: pytest.MonkeyPatch):
    """Plan as where ``PLORA_CUDA_GRAPHS`` is unset: with ``training.cuda_graphs: auto`` a GPU
    sweep's plan (d = 1 step times, profile key) follows it, and golden plans must not depend
    on the shell the tests run from. Tests of the switch set it themselves."""
    monkeypatch.delenv("PLORA_CUDA_GRAPHS", raising=False)
