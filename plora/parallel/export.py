"""Whole adapters and optimizer moments from a parallel job's shards and stages, and back.

PEFT-keyed per-factor tensors (``...lora_A.weight`` (r, in), ``...lora_B.weight`` (out, r)):
an adapter's weights (``plora.engine.adapters.adapter_state_dict``) or its AdamW moments
(``PackedAdamW.slot_state``), which are laid out like the weights. :func:`gather_keyed` makes
them whole on every rank (TP shards all-gathered, stages' layers merged); :func:`shard_keyed`
takes this rank's part of whole ones. A whole state is independent of the layout: it loads
into any degrees, or into one process.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from plora.engine.adapters import adapter_state_dict, packed_layers, peft_key
from plora.engine.lora import PackedLoRALinear
from plora.parallel.tp import gather_factor, shard_factor


def _factor_layers(model: nn.Module) -> dict[str, tuple[PackedLoRALinear, str]]:
    return {
        peft_key(name, f): (layer, f) for name, layer in packed_layers(model).items() for f in "AB"
    }


def gather_keyed(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    pp_group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Whole (CPU) versions of this rank's PEFT-keyed shards; collective over the job (every
    rank calls it for the same adapter, in the same order)."""
    layers = _factor_layers(model)
    out = {k: gather_factor(*layers[k], tensors[k].detach()).cpu() for k in sorted(tensors)}
    if pp_group is not None:
        parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, out, group=pp_group)
        out = {k: v for part in parts for k, v in (part or {}).items()}
    return out


def shard_keyed(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's shards of whole PEFT-keyed tensors; keys of other stages' layers dropped."""
    layers = _factor_layers(model)
    return {k: shard_factor(*layers[k], t) for k, t in tensors.items() if k in layers}


def full_adapter_state_dict(
    model: nn.Module, slot: int, *, pp_group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Slot ``slot``'s whole PEFT-keyed weights on every rank (collective). Equals
    ``adapter_state_dict`` of the same adapter trained on one process."""
    return gather_keyed(model, adapter_state_dict(model, slot), pp_group=pp_group)


__all__ = ["full_adapter_state_dict", "gather_keyed", "shard_keyed"]
