"""Resident worker groups: which GPUs hold a loaded base model, and what a job pays to start.

The runtime keeps one worker group per block of ``d`` GPUs that loads the base model once and
serves job after job (DESIGN.md decision 7). In a simulated plan a job on GPU ids ``ids``
(``d = len(ids)``) is

* **warm** when ``ids`` is exactly a resident group: it starts at once;
* **cold** otherwise: the groups overlapping ``ids`` are torn down (their other GPUs become
  cold too), a new group ``ids`` starts and the job waits ``startup[d]`` first
  (``cost.startup_time(d)``: worker start + model load), which lands in the job's
  ``Job.startup_s``.

So a sweep that starts with no resident group pays the start-up once per group, and again only
where a group is rebuilt at another ``d``. :class:`Groups` with ``resident=None`` charges
nothing (every GPU counts as warm for every ``d``: the planner as it was before resident
workers); :meth:`Groups.never` charges every job (Ray Tune: a new process per trial).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def startup_times(cost: Any, degrees: Sequence[int]) -> dict[int, float]:
    """``cost.startup_time(d)`` for each d (0 for a cost model without ``startup_time``)."""
    fn = getattr(cost, "startup_time", None)
    return {d: float(fn(d)) if fn is not None else 0.0 for d in sorted(set(degrees))}


class Groups:
    """The resident group of each of the plan's GPUs during a simulation.

    Args:
        num_gpus: G.
        startup: ``d -> seconds`` a cold group of d GPUs needs.
        resident: the resident groups now, each a tuple of GPU ids (its length is its d);
            GPUs in none are cold. ``None``: start-up is not charged at all.
        never_warm: every job starts a new group (no resident workers).
    """

    def __init__(
        self,
        num_gpus: int,
        startup: Mapping[int, float],
        resident: Sequence[Sequence[int]] | None = (),
        *,
        never_warm: bool = False,
    ) -> None:
        self.num_gpus = num_gpus
        self.startup = dict(startup)
        self.track = resident is not None or never_warm
        self.never_warm = never_warm
        self.of: list[tuple[int, ...] | None] = [None] * num_gpus
        seen: set[int] = set()
        for group in resident or ():
            if seen & set(group):
                raise ValueError(f"resident groups overlap on GPU(s) {sorted(seen & set(group))}")
            seen |= set(group)
            self.set(tuple(group))

    @classmethod
    def never(cls, num_gpus: int, startup: Mapping[int, float]) -> Groups:
        """Groups that never stay warm: every job pays ``startup[d]``."""
        return cls(num_gpus, startup, never_warm=True)

    def copy(self) -> Groups:
        """An independent copy (simulations fork the state)."""
        new = Groups(self.num_gpus, self.startup, None, never_warm=self.never_warm)
        new.track, new.of = self.track, list(self.of)
        return new

    def set(self, ids: tuple[int, ...]) -> None:
        """Make ``ids`` a resident group, tearing down every group it overlaps."""
        ids = tuple(sorted(ids))
        if not ids or len(set(ids)) != len(ids) or any(not 0 <= g < self.num_gpus for g in ids):
            raise ValueError(
                f"resident group {ids}: GPU ids must be distinct, in [0, {self.num_gpus})"
            )
        # each overlapping group once (a group's GPUs share one tuple): O(G), not O(d^2)
        torn = {old[0]: old for g in ids if (old := self.of[g]) is not None}
        for old in torn.values():
            for h in old:
                self.of[h] = None
        for g in ids:
            self.of[g] = ids

    def warm(self, ids: Sequence[int]) -> bool:
        """Whether ``ids`` is exactly a resident group (a job there starts at once)."""
        if not self.track:
            return True
        if self.never_warm:
            return False
        ids = tuple(sorted(ids))
        if not ids:
            return True
        group = self.of[ids[0]]
        # one tuple comparison, then identity per GPU (a group's GPUs share one tuple): O(d)
        return group == ids and all((h := self.of[g]) is group or h == group for g in ids)

    def cost(self, ids: Sequence[int]) -> float:
        """Seconds a job on ``ids`` waits for its group: 0 if warm, else ``startup[d]``."""
        return 0.0 if self.warm(ids) else self.startup.get(len(ids), 0.0)

    def occupy(self, ids: Sequence[int]) -> float:
        """Start a job on ``ids``: its start-up wait (:meth:`cost`); ``ids`` become a group."""
        wait = self.cost(ids)
        if self.track:
            self.set(tuple(ids))
        return wait

    def allocate(self, free: list[int], d: int) -> tuple[int, ...]:
        """Take ``d`` GPU ids from ``free`` (sorted) for a job, and remove them from it.

        Preference: a free resident group of size d (no start-up), then the aligned free block
        of d that tears down the fewest warm GPUs, then the lowest free ids.
        """
        have = set(free)
        block: tuple[int, ...] | None = None
        rank = (True, 0)
        for s in free:  # aligned blocks in id order; the first of the least rank wins
            b = tuple(range(s, s + d))
            if s % d or not all(g in have for g in b):
                continue
            r = (not self.warm(b), self._torn(b))
            if block is None or r < rank:
                block, rank = b, r
            if not r[0] or r == (True, 0):
                break  # warm blocks all rank alike, and none ranks below a cold one tearing none
        if block is None:
            block = tuple(free[:d])
        for g in block:
            free.remove(g)
        return block

    def _torn(self, ids: tuple[int, ...]) -> int:
        """Warm GPUs a new group on ``ids`` would tear down."""
        hit = {group[0]: len(group) for g in ids if (group := self.of[g])}  # groups are disjoint
        return sum(hit.values())

    def cold_gpus(self, gpus: Sequence[int]) -> list[int]:
        """Those of ``gpus`` with no resident group (all of them when every job is cold)."""
        if not self.track:
            return []
        return [g for g in gpus if self.never_warm or self.of[g] is None]

    def min_startup(self) -> float:
        """The least start-up of any allowed d (0 when start-up is not charged)."""
        return min(self.startup.values(), default=0.0) if self.track else 0.0


__all__ = ["Groups", "startup_times"]
