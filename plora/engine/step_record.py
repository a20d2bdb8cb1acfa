"""A training adapter's running record, and what one packed step reports.

:class:`TrainingAdapter` is the trainer's bookkeeping for one adapter (config, slot, schedule,
data stream, counters). After a step's single device read, :func:`record_step` turns the read
values (every slot's gradient norm, then every micro-batch's per-slot CE sums) into each
adapter's :class:`~plora.engine.reports.StepMetrics`, advancing its counters; :func:`pack_profile`
assembles the pack's :class:`~plora.engine.reports.PackProfile` from the kept step profiles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from plora.config import LoRAConfig
from plora.engine.device import device_name
from plora.engine.reports import AdapterStatus, PackProfile, StepMetrics, StepProfile


@dataclass(slots=True)
class TrainingAdapter:
    """One adapter as :class:`~plora.engine.trainer.PackedTrainer` trains it."""

    config: LoRAConfig
    slot: int
    total_steps: int
    stream: Any
    lr_lambda: Callable[[int], float]
    """The schedule's multiplier of ``config.lr`` at an optimizer step (0-based)."""
    step: int = 0
    tokens: int = 0
    last_loss: float | None = None
    status: AdapterStatus = AdapterStatus.ACTIVE
    losses: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepShape:
    """The forwards of one step (what its :class:`~plora.engine.reports.StepProfile` reports)."""

    rows: int
    """Rows over every forward."""
    padded_tokens: int
    """Token positions over every forward, padding included."""
    seq_len: int
    """The widest forward's length."""
    micro_batches: int
    """Forwards (micro-batches) of the step."""


@dataclass(frozen=True, slots=True)
class StepReadback:
    """What a step leaves on the device for its one device -> host read (after its sync)."""

    values: torch.Tensor
    """float64, 1-D: every slot's gradient norm (the first ``num_norms``), then each
    micro-batch's CE sums, one per slot of its ``ce_slots`` entry."""
    num_norms: int
    ce_slots: list[list[int]]
    """Per micro-batch that has CE sums: its slots, in ``values``' order."""
    shape: StepShape


@dataclass(frozen=True, slots=True)
class Accumulated:
    """The eager forwards and backwards of one step, gradients accumulated, before the
    optimizer: per micro-batch with targets, its slots and their CE sums (a float64 device
    tensor, read after the step), and the forwards' shape."""

    ce_parts: list[tuple[list[int], torch.Tensor]]
    shape: StepShape


def record_step(
    active: Sequence[TrainingAdapter],
    *,
    batches: dict[int, list[Any]],
    denoms: dict[int, int],
    lrs: dict[int, float],
    values: list[float],
    num_norms: int,
    ce_slots: Sequence[Sequence[int]],
    elapsed: float,
) -> tuple[list[StepMetrics], int]:
    """Advance every active adapter by the step just taken and return its metrics.

    Args:
        active: the adapters that trained this step (slot order).
        batches: each slot's examples this step.
        denoms: each slot's target-token count ``N_i`` (the loss's divisor).
        lrs: each slot's learning rate this step.
        values: the step's one host read: ``num_norms`` gradient norms indexed by slot, then,
            per micro-batch, the CE sums of its slots in ``ce_slots`` order.
        num_norms: how many gradient norms lead ``values``.
        ce_slots: per micro-batch, the slots whose CE sums follow in ``values``.
        elapsed: the step's wall time in seconds.

    Returns:
        ``(metrics, tokens)``: one :class:`StepMetrics` per adapter of ``active`` and the step's
        non-padding token count. Each adapter's ``step``, ``tokens``, ``last_loss`` and
        ``losses`` are updated; its mean loss is ``Σ CE sums / N_i``.
    """
    ce_sums = dict.fromkeys(batches, 0.0)
    cursor = num_norms
    for slots in ce_slots:
        for slot in slots:
            ce_sums[slot] += values[cursor]
            cursor += 1
    metrics = []
    tokens_total = 0
    for ad in active:
        tokens = sum(len(ex.input_ids) for ex in batches[ad.slot])
        tokens_total += tokens
        ad.step += 1
        ad.tokens += tokens
        ad.last_loss = ce_sums[ad.slot] / denoms[ad.slot]
        ad.losses.append(ad.last_loss)
        metrics.append(
            StepMetrics(
                config_id=ad.config.config_id,
                step=ad.step,
                loss=ad.last_loss,
                lr=lrs[ad.slot],
                tokens=tokens,
                grad_norm=values[ad.slot],
                time_s=elapsed,
            )
        )
    return metrics, tokens_total


def pack_profile(
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    adapters: Sequence[TrainingAdapter],
    steps: Sequence[StepProfile],
) -> PackProfile:
    """The pack's profile: its device (with the CUDA index resolved), dtype, the adapters'
    ranks and batch sizes in slot order, and the measured ``steps``."""
    ads = sorted(adapters, key=lambda a: a.slot)
    return PackProfile(
        device=str(
            device
            if device.index is not None or device.type == "cpu"
            else torch.device(device.type, torch.cuda.current_device())
        ),
        device_name=device_name(device),
        dtype=str(autocast_dtype or torch.float32).removeprefix("torch."),
        ranks=tuple(a.config.rank for a in ads),
        batch_sizes=tuple(a.config.batch_size for a in ads),
        steps=tuple(steps),
    )


__all__ = [
    "Accumulated",
    "StepReadback",
    "StepShape",
    "TrainingAdapter",
    "pack_profile",
    "record_step",
]
