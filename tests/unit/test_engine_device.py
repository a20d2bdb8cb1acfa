"""``model_device``: where a model computes, also when part of it is in host memory."""

from __future__ import annotations

import torch
from torch import nn

from plora.engine.device import model_device
from plora.engine.evaluate import _device


def test_a_model_computes_where_its_first_parameter_off_the_host_is() -> None:
    """An offloaded base's first parameters (its embedding shards) stay on the host while the
    model runs on its GPU: evaluation and the attention switch must take the GPU. ``meta``
    stands in for the GPU here."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    assert model_device(model) == torch.device("meta") == _device(model)
    assert model_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert model_device(nn.ReLU()) == torch.device("cpu") == _device(object())
