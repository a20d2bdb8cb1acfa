"""The planner and training sections of a sweep: :class:`PlannerOptions`, :class:`TrainingOptions`.

Both are read by :class:`plora.config.sweep.SweepConfig` (``planner:`` and ``training:``) and
re-exported there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plora.config.errors import ConfigError, join_key
from plora.config.fused import FusedKernels
from plora.config.hardware import Strategy
from plora.config.validate import as_bool, as_choice, as_float, as_int

#: Knapsack backends of the planner (``plora.planner.ilp.SOLVERS``).
PLANNER_SOLVERS: tuple[str, ...] = ("auto", "bnb", "highs", "cvxpy", "gurobi")
#: Default most configs a sweep may have (``planner.max_configs``): the planner's target size.
DEFAULT_MAX_CONFIGS = 10_000


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
    seq_len: int | None = None
    """Sequence length to plan with; default ``dataset.max_seq_len``."""
    time_limit_s: float = 60.0
    """Wall-clock budget of one ILP solve (reserved: the planner bounds its search by node
    counts today and does not read it yet)."""
    max_configs: int = DEFAULT_MAX_CONFIGS
    """Most configs the sweep may have: a larger space is refused when the sweep file is read,
    before anything is expanded, naming the parameters that multiply it."""

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
            out.append(
                Strategy(
                    as_choice(
                        str(s) if isinstance(s, Strategy) else s, key, [m.value for m in Strategy]
                    )
                )
            )
        object.__setattr__(self, "strategies", tuple(dict.fromkeys(out)))
        if self.seq_len is not None:
            as_int(self.seq_len, "seq_len", ge=8)
        object.__setattr__(
            self, "time_limit_s", as_float(self.time_limit_s, "time_limit_s", gt=0.0)
        )
        as_int(self.max_configs, "max_configs", ge=1, fix="use a positive count, e.g. 10000")


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

    def __post_init__(self) -> None:
        as_bool(self.gradient_checkpointing, "gradient_checkpointing")
        object.__setattr__(
            self, "fused_kernels", FusedKernels.parse(self.fused_kernels, "fused_kernels")
        )


__all__ = ["DEFAULT_MAX_CONFIGS", "PLANNER_SOLVERS", "PlannerOptions", "TrainingOptions"]
