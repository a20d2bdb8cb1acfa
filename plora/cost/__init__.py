"""Cost model: how much memory and time a job takes.

The planner sees the cost model only through :class:`CostModel`; ``plora.cost.memory``,
``plora.cost.throughput``, ``plora.cost.overheads`` and ``plora.cost.profile`` implement it
from the paper's App. A memory model, a FLOPs/bytes step-time model fitted from measured
steps, and the measured seconds outside steps (worker start, model load, job start,
evaluation, export, checkpoints) -- ``plora.cost.model.SweepCostModel``.

Pure: no Ray, no I/O, no printing (``plora.cost.profile`` reads/writes profile files only
through explicit ``load``/``save`` calls made by the CLI or the coordinator).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from plora.config import LoRAConfig, Strategy

#: Relative slack of the memory rule (float round-off only).
MEM_RTOL = 1e-9


def memory_limit(capacity: float) -> float:
    """The most bytes per GPU a job may use on GPUs of ``capacity`` usable bytes: ``capacity``
    up to :data:`MEM_RTOL`. The one memory rule of plora -- the sweep's validation, the planner
    (every option, pack and tail move) and the runtime (refills, micro-batch counts) all ask
    it, so what fits is decided once."""
    return capacity * (1 + MEM_RTOL)


def within_capacity(used: float, capacity: float) -> bool:
    """Whether a job of ``used`` bytes per GPU fits GPUs of ``capacity`` (:func:`memory_limit`)."""
    return used <= memory_limit(capacity)


@runtime_checkable
class CostModel(Protocol):
    """What the planner needs to know about a job ``(pack, d, strategy)``.

    All memory in bytes *per GPU*; all times in seconds. Optional: ``price_key(config)``, a
    hashable that equal configs share when every method prices them alike (None: price this
    one on its own); the planner then prices one config per key
    (:func:`plora.planner.ilp.build_classes`).
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
        """What a job whose longest config runs ``steps`` steps pays whatever its pack: its
        start on a warm group, per-step overhead, checkpoint writes. Non-decreasing in steps."""
        ...

    def config_time(self, config: LoRAConfig, d: int, strategy: Strategy) -> float:
        """Seconds the config adds to any job it is packed into: its tokens' share of the
        steps, its evaluation and its export."""
        ...

    def job_time(self, pack: Sequence[LoRAConfig], d: int, strategy: Strategy) -> float:
        """T(pack, d, strategy): wall time of the job on a warm group, from its start until
        every config of the pack is trained, evaluated and exported.

        Always ``fixed_time(max(steps(k) for k in pack), d, strategy) + sum(config_time(k, ...))``
        so that for a fixed longest config T is affine in the pack (what the exact ILP needs).
        """
        ...

    def startup_time(self, d: int) -> float:
        """Seconds a cold group of d GPUs needs before its first job (worker start + model
        load); a warm (resident) group serves later jobs without it. The planner charges it
        once per group; cost models without this method are treated as 0."""
        ...

    def config_work(self, config: LoRAConfig) -> float:
        """Single-GPU seconds one config would take alone at full efficiency, without job
        overheads: lower-bound work (every schedule pays at least this for it)."""
        ...

    def strategies(self) -> Sequence[Strategy]:
        """Strategies the runtime supports for d > 1 (empty: only d = 1 jobs)."""
        ...


__all__ = ["MEM_RTOL", "CostModel", "Strategy", "memory_limit", "within_capacity"]
