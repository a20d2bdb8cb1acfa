"""The planner with a sweep's ``planner:`` options bound: what the coordinator calls.

The coordinator asks its planner for ``plan_sweep`` and ``replan`` with the cost model and the
GPUs of the moment only (:class:`plora.runtime.coordinator.state.Planner`); the sweep file's
solver and pack cap (``planner.solver``, ``planner.max_pack_size``) ride along here, so every
plan of a sweep -- the first one and each re-plan -- keeps to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plora.config import LoRAConfig, PlannerOptions
from plora.cost import CostModel
from plora.planner.schedule import plan_sweep, replan
from plora.planner.types import Job, Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepPlanner:
    """:func:`plan_sweep` and :func:`replan` with a sweep's planner options."""

    solver: str = "auto"
    """Knapsack backend (``planner.solver``)."""
    max_pack_size: int | None = None
    """Most configs per job (``planner.max_pack_size``); None: as many as fit."""

    @classmethod
    def from_options(cls, options: PlannerOptions) -> SweepPlanner:
        """The planner a sweep's ``planner:`` section asks for."""
        return cls(solver=options.solver, max_pack_size=options.max_pack_size)

    def plan_sweep(
        self,
        configs: Sequence[LoRAConfig],
        cost: CostModel,
        num_gpus: int,
        *,
        resident: Sequence[Sequence[int]] | None = (),
    ) -> Plan:
        """:func:`plora.planner.plan_sweep` with these options."""
        return plan_sweep(configs, cost, num_gpus, solver=self.solver, resident=resident,
                          max_pack_size=self.max_pack_size)  # fmt: skip

    def replan(
        self,
        remaining: Sequence[LoRAConfig],
        free_gpus: int,
        running: Sequence[Job],
        now: float,
        cost: CostModel,
        num_gpus: int,
        *,
        resident: Sequence[Sequence[int]] | None = None,
    ) -> Plan:
        """:func:`plora.planner.replan` with these options."""
        return replan(remaining, free_gpus, running, now, cost, num_gpus, solver=self.solver,
                      resident=resident, max_pack_size=self.max_pack_size)  # fmt: skip


__all__ = ["SweepPlanner"]
