"""Resident worker groups as the coordinator sees them: which GPUs hold the base model (warm),
which groups are still starting and when each is predicted ready.

Plain bookkeeping, no Ray: the driver starts and stops the groups (:mod:`plora.runtime.actors.group`)
and tells the coordinator, which keeps one :class:`Residency`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

GpuIds = tuple[int, ...]


@dataclass(kw_only=True, slots=True)
class Residency:
    """Worker groups by their (sorted) GPU ids."""

    groups: set[GpuIds] = field(default_factory=set)
    """Resident worker groups that hold the base model: a job on one pays no start-up."""
    starting: dict[GpuIds, float] = field(default_factory=dict)
    """Worker groups still starting, with the time they are predicted ready."""

    @property
    def warm_gpus(self) -> set[int]:
        """GPUs of a resident worker group."""
        return {g for group in self.groups for g in group}

    def drop(self, gpu_ids: Sequence[int]) -> None:
        """Forget every group (resident or starting) that shares a GPU with ``gpu_ids``."""
        self.groups = {g for g in self.groups if not set(g) & set(gpu_ids)}
        self.starting = {g: t for g, t in self.starting.items() if not set(g) & set(gpu_ids)}

    def start(self, gpu_ids: Sequence[int], *, ready_at: float) -> None:
        """A group was asked for on ``gpu_ids``; it is predicted ready at ``ready_at``."""
        self.drop(gpu_ids)
        self.starting[tuple(sorted(gpu_ids))] = ready_at

    def ready(self, gpu_ids: Sequence[int]) -> None:
        """The group on ``gpu_ids`` loaded the base model: its GPUs are warm."""
        self.drop(gpu_ids)
        self.groups.add(tuple(sorted(gpu_ids)))

    def ready_at(
        self,
        gpu_ids: Sequence[int],
        *,
        now: float,
        startup_time: Callable[[int], float] | None,
    ) -> float:
        """When a worker group on exactly ``gpu_ids`` is predicted ready: now for a resident
        one, its predicted time for one starting, else now + ``startup_time(d)`` (the driver
        starts one for the job)."""
        key = tuple(sorted(gpu_ids))
        if key in self.groups:
            return now
        if key in self.starting:
            return max(self.starting[key], now)
        return now + (float(startup_time(len(key))) if startup_time is not None else 0.0)

    def idle_starting(self, *, busy: set[int], now: float) -> list[Any]:
        """Groups still starting that no job runs on (none of their GPUs in ``busy``), as
        placeholder planner jobs holding their GPUs until they are ready (what the planner
        should see of them)."""
        from plora.planner import Job

        idle = [(ids, t) for ids, t in sorted(self.starting.items()) if not set(ids) & busy]
        return [
            Job(job_id=f"start{ids}", config_ids=(), gpus=len(ids), strategy=None, start_s=now,
                end_s=max(t, now), memory_gib_per_gpu=0.0, gpu_ids=ids)
            for ids, t in idle
        ]  # fmt: skip


__all__ = ["Residency"]
