"""The planner and training sections of a sweep: :class:`PlannerOptions`, :class:`TrainingOptions`.

Both are read by :class:`plora.config.sweep.SweepConfig` (``planner:`` and ``training:``) and
re-exported there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from plora.config.errors import ConfigError, join_key
from plora.config.fused import FusedKernels
from plora.config.hardware import SUPPORTED_STRATEGIES, Strategy
from plora.config.validate import as_bool, as_choice, as_float, as_int, as_switch

#: Knapsack backends of the planner (``plora.planner.solver.SOLVERS``).
PLANNER_SOLVERS: tuple[str, ...] = ("auto", "bnb", "highs", "cvxpy", "gurobi")
#: The environment variable that turns ``training.cuda_graphs: auto`` off (``0``/``off``/``false``/``no``).
CUDA_GRAPHS_ENV = "PLORA_CUDA_GRAPHS"
#: Default most configs a sweep may have (``planner.max_configs``): the planner's target size.
DEFAULT_MAX_CONFIGS = 10_000


class CpuOffload(StrEnum):
    """``planner.cpu_offload``: whether fsdp jobs may keep the frozen base in host memory
    (strategy ``fsdp_offload``: FSDP2's ``CPUOffloadPolicy``; each layer's shard crosses PCIe
    to its GPU every forward and backward, so a step is slower, but only the LM head and the
    layers being computed are on the GPU)."""

    AUTO = "auto"
    """Only for configs that fit no allowed GPU count otherwise (needs ``fsdp`` in
    ``planner.strategies``; never on ``gpu_type: cpu``, where host memory is the device's)."""
    ON = "on"
    """Every fsdp job offloads its base (``fsdp_offload`` in place of ``fsdp``)."""
    OFF = "off"
    """Never."""

    @classmethod
    def parse(cls, value: Any, key: str = "cpu_offload") -> CpuOffload:
        """``value`` as a member (``True``/``False`` read as on/off, as YAML writes them)."""
        fix = "auto offloads the base to host memory only when nothing else fits"
        return cls(as_switch(value, key, fix=fix))


class CudaGraphs(StrEnum):
    """``training.cuda_graphs``: whether one-GPU jobs replay their steady packed step --
    forward, backward, clipping and AdamW -- as CUDA graphs (:mod:`plora.engine.graphed`), one
    graph per padded-length bucket. The first step of each new shape runs eagerly (and the
    capture follows it); jobs of several GPUs always run the eager step."""

    AUTO = "auto"
    """On when the job runs on CUDA, unless the worker's environment sets
    ``PLORA_CUDA_GRAPHS=0``."""
    ON = "on"
    """Always; on the CPU the graph's static-buffer step runs eagerly (nothing is captured)."""
    OFF = "off"
    """Never: the eager step."""

    @classmethod
    def parse(cls, value: Any, key: str = "cuda_graphs") -> CudaGraphs:
        """``value`` as a member (``True``/``False`` read as on/off, as YAML writes them)."""
        fix = "auto replays the steady step as CUDA graphs on a GPU; off runs it eagerly"
        return cls(as_switch(value, key, fix=fix))

    @property
    def trainer_arg(self) -> bool | None:
        """:class:`~plora.engine.trainer.PackedTrainer`'s ``cuda_graphs``: None (auto), True
        (on) or False (off)."""
        return None if self is CudaGraphs.AUTO else self is CudaGraphs.ON


def cuda_graphs_resolved(requested: bool | None, *, cuda: bool) -> bool:
    """Whether the steady step is graphed: ``requested`` (``CudaGraphs.trainer_arg``) when set;
    None (auto): on for CUDA unless :data:`CUDA_GRAPHS_ENV` says ``0``/``off``/``false``/``no``
    in this process's environment. The engine resolves its trainers' switch with it and the
    planner the sweep's (:func:`plora.cost.build.plan_cuda_graphs`)."""
    if requested is not None:
        return requested
    return cuda and os.environ.get(CUDA_GRAPHS_ENV, "1").strip().lower() not in (
        "0", "off", "false", "no",
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerOptions:
    """How the job planner runs."""

    solver: str = "auto"
    """Knapsack backend of the ILPs: auto | bnb (exact branch and bound, then HiGHS) | highs |
    cvxpy | gurobi (if installed and licensed, else HiGHS)."""
    strategies: tuple[Any, ...] = ()
    """Multi-GPU strategies (:class:`Strategy`: tp | fsdp | pp) the planner may give a job of
    d = 2, 4, ... GPUs (one worker group, one process group); empty (the default): every job
    runs on one GPU. ``plora sweep`` runs all three (``SUPPORTED_STRATEGIES``)."""
    cpu_offload: CpuOffload = CpuOffload.AUTO
    """FSDP2 CPU offload of the frozen base for fsdp jobs (:class:`CpuOffload`): auto (only for
    configs that fit nothing else) | on (every fsdp job) | off."""
    seq_len: int | None = None
    """Sequence length to plan with; default ``dataset.max_seq_len``."""
    time_limit_s: float = 60.0
    """Wall-clock budget of one ILP solve (reserved: the planner bounds its search by node
    counts today and does not read it yet)."""
    max_configs: int = DEFAULT_MAX_CONFIGS
    """Most configs the sweep may have: a larger space is refused when the sweep file is read,
    before anything is expanded, naming the parameters that multiply it."""
    max_pack_size: int | None = None
    """Most configs one job may train at once; None (the default): as many as fit. Every pack
    the planner forms (first plan and re-plans) and every refill of a running job keep to it;
    1 runs the Min-GPU baseline for real on plora's own engine (one config per job)."""

    def __post_init__(self) -> None:
        as_choice(self.solver, "solver", PLANNER_SOLVERS)
        raw = self.strategies
        if isinstance(raw, str) or not isinstance(raw, list | tuple):
            raise ConfigError(
                "must be a list", key="strategies", value=raw, fix="write e.g. [tp] or [tp, fsdp]"
            )
        out: list[Strategy] = []
        for i, s in enumerate(raw):
            key = join_key("strategies", i)
            name = str(s) if isinstance(s, Strategy) else s
            if name == Strategy.FSDP_OFFLOAD:
                raise ConfigError("is not a strategy to list", key=key, value=name,
                                  fix="list fsdp and set planner.cpu_offload: on")  # fmt: skip
            out.append(Strategy(as_choice(name, key, [m.value for m in SUPPORTED_STRATEGIES])))
        object.__setattr__(self, "strategies", tuple(dict.fromkeys(out)))
        offload = CpuOffload.parse(self.cpu_offload)
        object.__setattr__(self, "cpu_offload", offload)
        if offload is CpuOffload.ON and Strategy.FSDP not in self.strategies:
            raise ConfigError(
                "offloads the base of fsdp jobs, and planner.strategies has no fsdp",
                key="cpu_offload", value=str(offload),
                fix="add fsdp to planner.strategies, or use auto or off",
            )  # fmt: skip
        if self.seq_len is not None:
            as_int(self.seq_len, "seq_len", ge=8)
        object.__setattr__(
            self, "time_limit_s", as_float(self.time_limit_s, "time_limit_s", gt=0.0)
        )
        as_int(self.max_configs, "max_configs", ge=1, fix="use a positive count, e.g. 10000")
        if self.max_pack_size is not None:
            as_int(self.max_pack_size, "max_pack_size", ge=1,
                   fix="use a whole number >= 1 (1: one config per job), or null for no cap")  # fmt: skip


def job_strategies(
    strategies: tuple[Strategy, ...], cpu_offload: CpuOffload, *, cpu: bool
) -> tuple[Strategy, ...]:
    """The strategies a plan's d > 1 jobs may have: ``planner.strategies`` with
    ``planner.cpu_offload`` applied. off: as listed; auto: ``fsdp_offload`` after ``fsdp`` (the
    planner gives it only to configs that fit nothing else: :mod:`plora.planner.offload`), none
    on ``cpu`` workers; on: ``fsdp_offload`` in place of ``fsdp``."""
    if Strategy.FSDP not in strategies or cpu_offload is CpuOffload.OFF:
        return strategies
    if cpu_offload is CpuOffload.ON:
        return tuple(Strategy.FSDP_OFFLOAD if s is Strategy.FSDP else s for s in strategies)
    return strategies if cpu else (*strategies, Strategy.FSDP_OFFLOAD)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingOptions:
    """How every job of the sweep trains (the same for all configs; planning assumes it too)."""

    gradient_checkpointing: bool = False
    """Recompute the frozen base's layer activations in backward: activation memory drops from
    all layers to one layer plus the layer inputs, for about one extra forward of compute.
    Needed for large batches at long sequences (e.g. the paper's batch 32 at 1024 tokens)."""
    fused_kernels: FusedKernels = FusedKernels.AUTO
    """Liger-Kernel's fused RMSNorm, SwiGLU and RoPE on the frozen base (:mod:`plora.config.fused`):
    auto (on when ``liger_kernel`` is installed and the sweep runs on CUDA) | on | off. The plan
    assumes what the engine will run (memory and step-time model)."""
    cuda_graphs: CudaGraphs = CudaGraphs.AUTO
    """Replay one-GPU jobs' steady packed step as CUDA graphs (:class:`CudaGraphs`): auto (on
    CUDA) | on | off (the eager step)."""

    def __post_init__(self) -> None:
        as_bool(self.gradient_checkpointing, "gradient_checkpointing")
        object.__setattr__(
            self, "fused_kernels", FusedKernels.parse(self.fused_kernels, "fused_kernels")
        )
        object.__setattr__(self, "cuda_graphs", CudaGraphs.parse(self.cuda_graphs))


__all__ = [
    "CUDA_GRAPHS_ENV",
    "DEFAULT_MAX_CONFIGS",
    "PLANNER_SOLVERS",
    "CpuOffload",
    "CudaGraphs",
    "PlannerOptions",
    "TrainingOptions",
    "cuda_graphs_resolved",
    "job_strategies",
]
