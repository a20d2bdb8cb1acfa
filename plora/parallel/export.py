"""An adapter's full PEFT weights from a parallel job's shards and stages (collective)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plora.engine.lora import packed_layers, peft_key
from plora.parallel.tp import gather_factor


def full_adapter_state_dict(
    model: nn.Module, slot: int, *, pp_group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Slot ``slot``'s PEFT-keyed weights (``lora_A`` (r, in), ``lora_B`` (out, r)), whole.

    TP shards are all-gathered over each layer's TP group and the stages' layers over
    ``pp_group``; every rank of the job must call it (same slots, same order) and every rank
    gets the full dict (CPU tensors). Equals ``plora.engine.lora.adapter_state_dict`` of the
    same adapter trained on one process.
    """
    out: dict[str, torch.Tensor] = {}
    for name, layer in packed_layers(model).items():
        if slot in layer.specs:
            a, b = layer.factors(slot)
            out[peft_key(name, "A")] = gather_factor(layer, "A", a.detach()).cpu()
            out[peft_key(name, "B")] = gather_factor(layer, "B", b.detach()).cpu()
    if pp_group is not None:
        parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, out, group=pp_group)
        out = {k: v for part in parts for k, v in (part or {}).items()}
    return out


__all__ = ["full_adapter_state_dict"]
