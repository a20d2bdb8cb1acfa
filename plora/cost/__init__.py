"""Cost model: how much memory and time a job takes.

The planner sees the cost model only through :class:`CostModel`; ``plora.cost.memory``,
``plora.cost.throughput`` and ``plora.cost.profile`` implement it from the paper's App. A
memory model and a FLOPs/bytes step-time model fitted from measured steps.

Pure: no Ray, no I/O, no printing (``plora.cost.profile`` reads/writes profile files only
through explicit ``load``/``save`` calls made by the CLI or the coordinator).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol, runtime_checkable

from plora.config import LoRAConfig


class Strategy(StrEnum):
    """How a job with d > 1 GPUs splits the base model."""

    TP = "tp"
    FSDP = "fsdp"
    PP = "pp"


@runtime_checkable
class CostModel(Protocol):
    """What the planner needs to know about a job ``(pack, d, strategy)``.

    All memory in bytes *per GPU*; all times in seconds.
    """

    def base_memory(self, d: int, strategy: Strategy) -> float:
        """M_base per GPU: frozen weights plus base activations (no adapters)."""
        ...

    def config_memory(self, config: LoRAConfig, d: int, strategy: Strategy) -> float:
        """M_lora,k per GPU: one adapter's params, grads, optimizer state and activations."""
        ...

    def capacity(self, d: int) -> float:
        """C * M_gpu: usable bytes per GPU (the right-hand side of Eq. 19 divided by d)."""
        ...

    def steps(self, config: LoRAConfig) -> int:
        """Optimizer steps the config trains for (``max_steps`` or epochs x dataset / batch)."""
        ...

    def fixed_time(self, steps: int, d: int, strategy: Strategy) -> float:
        """Per-job overhead for a job whose longest config runs ``steps`` steps (no tokens)."""
        ...

    def config_time(self, config: LoRAConfig, d: int, strategy: Strategy) -> float:
        """Seconds the config's own tokens add to any job it is packed into."""
        ...

    def job_time(self, pack: Sequence[LoRAConfig], d: int, strategy: Strategy) -> float:
        """T(pack, d, strategy): wall time to train every config of the pack to completion.

        Always ``fixed_time(max(steps(k) for k in pack), d, strategy) + sum(config_time(k, ...))``
        so that for a fixed longest config T is affine in the pack (what the exact ILP needs).
        """
        ...

    def config_work(self, config: LoRAConfig) -> float:
        """Single-GPU seconds one config would take alone at full efficiency (lower-bound work)."""
        ...

    def strategies(self) -> Sequence[Strategy]:
        """Strategies the runtime supports for d > 1 (empty: only d = 1 jobs)."""
        ...


__all__ = ["CostModel", "Strategy"]
