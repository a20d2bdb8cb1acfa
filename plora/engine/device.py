"""The device a model runs on: where its parameters are, its name, its peak memory so far."""

from __future__ import annotations

import resource

import torch
from torch import nn


def model_device(model: nn.Module) -> torch.device:
    """Where ``model`` computes: the device of its first parameter off the host, else the CPU.
    (FSDP2's CPU offload keeps the frozen base's shards in host memory while the model runs on
    its GPU, :mod:`plora.parallel.fsdp`: the first parameter alone may be on the host.)"""
    on = (p.device for p in model.parameters() if p.device.type != "cpu")
    return next(on, torch.device("cpu"))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``x`` on ``device`` without waiting for it (pinned, non-blocking on CUDA)."""
    if x.device == device:
        return x
    if device.type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


__all__ = ["device_name", "model_device", "peak_memory", "to_device"]
