"""Micro-batched packs: a pack's rows run in ``m`` forwards per optimizer step.

A pack whose rows do not all fit the GPU at once can still train as one job: the trainer
(``PackedTrainer(max_rows=...)``) splits each step's rows into micro-batches of at most
``⌈R/m⌉`` rows (rows of one adapter may straddle two) and accumulates gradients, so the loss
and the update are those of the whole step. What changes is cost:

* memory: the per-config states (LoRA parameters, gradients, optimizer state) stay whole; the
  activations (``lora_activations``, ``base_activations``, ``logits`` of
  :func:`plora.cost.memory.adapter_memory`) are alive for one micro-batch only. Rows differ
  per config (rank, dropout), so we charge, conservatively, the pack's largest activation per
  row times the rows of one micro-batch::

      M(m) = M_base + Σ_k S_k + ⌈R/m⌉ · max_k (A_k / b_k)        (m > 1)

  with ``S_k`` the states and ``A_k`` the activations of config k's ``b_k`` rows. ``m = 1``
  is the unchanged ``M_base + Σ_k (S_k + A_k)``.
* time: every forward pays the step's fixed part again (per-layer launch overhead, the packed
  LoRA layers' launches, reading the frozen weights, FSDP's gathers: ``t_fixed`` of
  :class:`~plora.cost.throughput.StepTimeModel`), so a step costs ``m·t_fixed`` plus the
  same per-config terms (its FLOPs are those of the same tokens, its optimizer step is once).

Pure functions of numbers; :class:`plora.cost.model.SweepCostModel` feeds them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from plora.config import ConfigError

#: Components of :func:`plora.cost.memory.adapter_memory` that live only while a micro-batch's
#: rows are in flight; every other component is per-config state.
ACTIVATION_PARTS = ("lora_activations", "base_activations", "logits")

#: Default for the most forwards per step the planner may give a pack
#: (``SweepCostModel(max_micro_batches=...)``; 1 turns micro-batched packs off).
MAX_MICRO_BATCHES = 16


def check_micro_batches(micro_batches: int) -> int:
    """``micro_batches`` if it is an integer >= 1, else a :class:`ConfigError`."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ConfigError(f"micro_batches={micro_batches!r} must be an integer >= 1")
    return micro_batches


def rows_per_micro_batch(rows: int, micro_batches: int) -> int:
    """``⌈rows / m⌉``: the most rows alive at once (the trainer's ``max_rows``)."""
    return max(1, math.ceil(rows / check_micro_batches(micro_batches)))


def state_and_row_activation(components: Mapping[str, float], rows: int) -> tuple[float, float]:
    """``(S_k, a_k)`` of one config from its :func:`~plora.cost.memory.adapter_memory`
    components: the state bytes and the activation bytes per row of its ``rows`` rows."""
    act = sum(v for k, v in components.items() if k in ACTIVATION_PARTS)
    state = sum(v for k, v in components.items() if k not in ACTIVATION_PARTS)
    return float(state), float(act) / rows


def micro_batched_memory(
    base: float, parts: Sequence[tuple[float, float]], rows: Sequence[int], micro_batches: int
) -> float:
    """``M_base + Σ S_k + ⌈R/m⌉ · max_k a_k`` bytes per GPU for configs of ``parts``
    ``(S_k, a_k)`` and ``rows`` ``b_k`` (``R = Σ b_k``). For m = 1 callers keep the additive
    model (exactly)."""
    if not parts:
        return float(base)
    live = rows_per_micro_batch(int(sum(rows)), micro_batches)
    return float(base) + sum(s for s, _ in parts) + live * max(a for _, a in parts)


def smallest_micro_batches(
    base: float,
    parts: Sequence[tuple[float, float]],
    rows: Sequence[int],
    capacity: float,
    *,
    limit: int | None = None,
) -> int | None:
    """The smallest ``m >= 2`` (at most ``limit``, and at most ``R``: one row per micro-batch)
    whose :func:`micro_batched_memory` is within ``capacity``; None when none is."""
    total = int(sum(rows))
    top = total if limit is None else min(total, limit)
    for m in range(2, top + 1):
        # only m where ⌈R/m⌉ drops are worth a look: the memory is that of the rows alive
        if m > 2 and rows_per_micro_batch(total, m) == rows_per_micro_batch(total, m - 1):
            continue
        if micro_batched_memory(base, parts, rows, m) <= capacity:
            return m
    return None


__all__ = [
    "ACTIVATION_PARTS",
    "MAX_MICRO_BATCHES",
    "check_micro_batches",
    "micro_batched_memory",
    "rows_per_micro_batch",
    "smallest_micro_batches",
    "state_and_row_activation",
]
