"""Packed LoRA at model level: wrap a model's projections, put adapters into slots, route rows.

* :func:`inject` / :func:`uninject` -- wrap every Llama/Qwen2 projection in a
  :class:`~plora.engine.lora.PackedLoRALinear` (and put the base linears back);
* :func:`add_adapter` / :func:`remove_adapter` -- a config's factors into a slot of every layer it
  targets (between steps); :func:`adapter_parameters`, :func:`adapter_state_dict` (PEFT keys,
  :func:`peft_key`) and :func:`load_adapter_state_dict` read and write one slot;
* :func:`packed_segments`, :func:`use_slot`, :func:`base_only` -- which rows go through which
  slot in the next forward(s). Routing is stored on the modules (not a context variable) so
  activation-checkpoint recomputation during backward sees it: run backward inside the context.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from plora.config import PROJECTIONS, ConfigError, LoRAConfig
from plora.engine.attention import engine_attention
from plora.engine.lora import BASE_ONLY, PackedLoRALinear, Routing, SlotSpec, module_key

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def inject(
    model: nn.Module, *, targets: Iterable[str] = PROJECTIONS
) -> dict[str, PackedLoRALinear]:
    """Wrap the ``targets`` projections of every decoder layer in :class:`PackedLoRALinear`.

    Works for Llama/Qwen2-style models (``...layers.N.self_attn.q_proj`` etc.). Freezes every
    base parameter. Idempotent: already-wrapped modules are kept.

    Returns:
        ``{qualified module name: layer}`` in module order.
    """
    targets = tuple(targets)
    model.requires_grad_(False)
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        match = _LAYER_RE.search(name + ".")
        if leaf not in targets or match is None or not isinstance(module, nn.Linear):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(parent, PackedLoRALinear):
            continue
        setattr(parent, leaf, PackedLoRALinear(module, key=module_key(int(match[1]), leaf)))
    found = packed_layers(model)
    if not found:
        raise ValueError(
            "inject: no Llama/Qwen2-style projections (layers.N.*.q_proj ...) found in the model"
        )
    return found


def uninject(model: nn.Module) -> None:
    """Put every wrapped projection's original ``nn.Linear`` back (drops all slots)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, PackedLoRALinear):
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name), leaf, module.base_layer)


def packed_layers(model: nn.Module) -> dict[str, PackedLoRALinear]:
    """``{qualified name: layer}`` of every :class:`PackedLoRALinear` in ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedLoRALinear)}


def add_adapter(model: nn.Module, slot: int, config: LoRAConfig) -> list[torch.Tensor]:
    """Give ``slot`` factors for ``config`` in every targeted layer; return its factor views."""
    return add_adapters(model, {slot: config})[slot]


def add_adapters(
    model: nn.Module, configs: Mapping[int, LoRAConfig]
) -> dict[int, list[torch.Tensor]]:
    """:func:`add_adapter` for several slots (``{slot: config}``): each layer reallocates once
    for all of them (:meth:`PackedLoRALinear.add_slots`). Returns each slot's factor views.

    Raises:
        ConfigError: a config whose target_modules match no projection (nothing is added).
    """
    layers = packed_layers(model)
    for config in configs.values():
        if not any(name.rsplit(".", 1)[-1] in config.target_modules for name in layers):
            raise ConfigError(
                f"config {config.config_id}: target_modules {list(config.target_modules)} match "
                "no projection of this model; pick from the decoder's q/k/v/o/gate/up/down_proj"
            )
    for name, layer in layers.items():
        kind = name.rsplit(".", 1)[-1]
        layer.add_slots(
            {
                slot: SlotSpec(rank=c.rank, scale=float(c.scale), dropout=c.dropout, seed=c.seed)
                for slot, c in configs.items()
                if kind in c.target_modules
            }
        )
    return {slot: adapter_parameters(model, slot) for slot in configs}


def remove_adapter(model: nn.Module, slot: int) -> None:
    """Drop ``slot`` from every layer."""
    for layer in packed_layers(model).values():
        layer.remove_slot(slot)


def adapter_parameters(model: nn.Module, slot: int) -> list[torch.Tensor]:
    """Slot ``slot``'s factors in a fixed order (module order, A then B): views of the packed
    parameters (:meth:`PackedLoRALinear.factors`), for reading and copying, not for an optimizer.
    """
    params: list[torch.Tensor] = []
    for layer in packed_layers(model).values():
        if slot in layer.specs:
            params.extend(layer.factors(slot))
    return params


def adapter_state_dict(model: nn.Module, slot: int) -> dict[str, torch.Tensor]:
    """Slot ``slot``'s weights under PEFT's key names (``base_model.model.<module>.lora_A.weight``)."""
    out: dict[str, torch.Tensor] = {}
    for name, layer in packed_layers(model).items():
        if slot in layer.specs:
            a, b = layer.factors(slot)
            out[peft_key(name, "A")] = a.detach()
            out[peft_key(name, "B")] = b.detach()
    return out


def peft_key(module: str, factor: str) -> str:
    """PEFT's state-dict key of factor ``"A"`` or ``"B"`` of the packed layer named ``module``."""
    return f"base_model.model.{module}.lora_{factor}.weight"


def load_adapter_state_dict(model: nn.Module, slot: int, state: Mapping[str, torch.Tensor]) -> None:
    """Copy PEFT-keyed weights (as from :func:`adapter_state_dict`) into ``slot``'s factors."""
    expected = adapter_state_dict(model, slot)
    if set(state) != set(expected):
        missing = sorted(set(expected) - set(state))[:3]
        extra = sorted(set(state) - set(expected))[:3]
        raise ValueError(
            f"adapter weights do not match slot {slot}: missing {missing}, extra {extra}"
        )
    with torch.no_grad():
        for key, param in expected.items():
            param.copy_(state[key])


@contextlib.contextmanager
def _routed(model: nn.Module, routing: Routing) -> Iterator[None]:
    layers = list(packed_layers(model).values())
    saved = [layer.routing for layer in layers]
    for layer in layers:
        layer.routing = routing
    try:
        with engine_attention(model):  # also for checkpoint recomputation in backward
            yield
    finally:
        for layer, old in zip(layers, saved, strict=True):
            layer.routing = old


def packed_segments(
    model: nn.Module,
    segments: Iterable[Any],
    *,
    dropout_keys: Mapping[int, tuple[int, int]] | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Route rows ``[start, stop)`` through their slot for forwards (and backwards) inside.

    Args:
        segments: ``(slot, start, stop)`` tuples or objects with those attributes, rows of a
            slot contiguous, non-overlapping.
        dropout_keys: ``{slot: (adapter step, row offset)}`` for keyed dropout.
    """
    segs = []
    for seg in segments:
        slot, start, stop = (seg.slot, seg.start, seg.stop) if hasattr(seg, "slot") else seg
        if stop > start:
            segs.append((int(slot), int(start), int(stop)))
    segs.sort(key=lambda s: s[1])
    for prev, nxt in itertools.pairwise(segs):
        if nxt[1] < prev[2]:
            raise ValueError(f"overlapping segments {prev} and {nxt}")
    keys = dict(dropout_keys or {})
    return _routed(model, Routing(segments=tuple(segs), dropout_keys=keys))


def use_slot(
    model: nn.Module, slot: int | None, *, step: int = 0
) -> contextlib.AbstractContextManager[None]:
    """Apply only ``slot`` to every row (``None``: base model only)."""
    if slot is None:
        return _routed(model, BASE_ONLY)
    return _routed(model, Routing(single=slot, dropout_keys={slot: (step, 0)}))


def base_only(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Run the frozen base model alone."""
    return _routed(model, BASE_ONLY)


__all__ = [
    "adapter_parameters",
    "adapter_state_dict",
    "add_adapter",
    "add_adapters",
    "base_only",
    "inject",
    "load_adapter_state_dict",
    "packed_layers",
    "packed_segments",
    "peft_key",
    "remove_adapter",
    "uninject",
    "use_slot",
]
