"""A packed trainer's train state: what a checkpoint holds to resume it exactly.

Per adapter: its config, slot, step and token counts, losses, status, data stream position, LoRA
weights (PEFT-keyed) and -- while it trains -- its AdamW moments; plus the global step and the
torch / Python / CUDA RNG states. Version 2 keeps the packed optimizer's moments per adapter
(the schedule follows from the step); version 1 (one ``torch.optim.AdamW`` and ``LambdaLR`` state
dict per adapter) is still read.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from plora.config import LoRAConfig
from plora.engine import adapters
from plora.engine.checkpoint import adamw_slot_state, as_tuple, detached_copy
from plora.engine.reports import AdapterStatus

#: Format of :func:`trainer_state` (2: packed optimizer moments, PEFT-keyed).
TRAIN_STATE_VERSION = 2


def adapter_state(trainer: Any, config_id: str) -> dict[str, Any]:
    """One adapter's part of :func:`trainer_state` (live tensors; copy before keeping)."""
    ad = trainer.adapter(config_id)
    return {
        "config": ad.config.to_dict(),
        "slot": ad.slot,
        "total_steps": ad.total_steps,
        "step": ad.step,
        "tokens": ad.tokens,
        "last_loss": ad.last_loss,
        "losses": list(ad.losses),
        "status": str(ad.status),
        "stream": ad.stream.get_state(),
        "weights": adapters.adapter_state_dict(trainer.model, ad.slot),
        "optimizer": (
            trainer.optimizer.slot_state(ad.slot) if ad.status is AdapterStatus.ACTIVE else None
        ),
    }


def add_adapter_from_state(
    trainer: Any, st: dict[str, Any], *, slot: int | None = None, version: int = TRAIN_STATE_VERSION
) -> int:
    """Add an adapter to ``trainer`` from its :func:`adapter_state` (between steps) in ``slot``
    (None: a free one); it continues where it left off. Returns the slot."""
    slot = trainer.add(LoRAConfig.from_dict(st["config"]), slot=slot)
    ad = trainer.adapters[st["config"]["config_id"]]
    adapters.load_adapter_state_dict(trainer.model, ad.slot, st["weights"])
    ad.total_steps = st["total_steps"]
    ad.step, ad.tokens, ad.last_loss = st["step"], st["tokens"], st["last_loss"]
    ad.losses = list(st["losses"])
    ad.stream.set_state(st["stream"])
    status = AdapterStatus(st["status"])
    if status is AdapterStatus.ACTIVE:
        opt = st["optimizer"]
        if version == 1:
            keys = list(adapters.adapter_state_dict(trainer.model, ad.slot))
            opt = adamw_slot_state(opt, keys)
        if opt is not None:
            trainer.optimizer.load_slot_state(ad.slot, opt)
    else:
        trainer._retire(ad, status)
    return int(slot)


def trainer_state(trainer: Any) -> dict[str, Any]:
    """Everything ``trainer`` (a :class:`~plora.engine.trainer.PackedTrainer`) needs to resume
    exactly: weights, optimizer, schedule, data, RNG."""
    per_adapter = {cid: adapter_state(trainer, cid) for cid in trainer.adapters}
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "version": TRAIN_STATE_VERSION,
        "global_step": trainer.global_step,
        "adapters": per_adapter,
        "rng": rng,
    }
    copy: dict[str, Any] = detached_copy(state)
    return copy


def load_trainer_state(trainer: Any, state: dict[str, Any]) -> None:
    """Restore :func:`trainer_state` into ``trainer`` (which must hold no adapters).

    Reads version 2 (moments per adapter, PEFT-keyed; the schedule follows from the step)
    and version 1 (one ``torch.optim.AdamW`` and ``LambdaLR`` state dict per adapter).
    """
    if trainer.adapters:
        raise RuntimeError("load_state_dict needs a trainer without adapters")
    version = state.get("version")
    if version not in (1, TRAIN_STATE_VERSION):
        raise ValueError(f"unknown train-state version {version!r}")
    for _, st in sorted(state["adapters"].items(), key=lambda kv: kv[1]["slot"]):
        add_adapter_from_state(trainer, st, slot=st["slot"], version=version)
    trainer.global_step = state["global_step"]
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(as_tuple(state["rng"]["python"]))
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])


__all__ = [
    "TRAIN_STATE_VERSION",
    "adapter_state",
    "add_adapter_from_state",
    "load_trainer_state",
    "trainer_state",
]
