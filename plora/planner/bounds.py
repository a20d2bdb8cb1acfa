"""Makespan lower bound and the Thm 6.1 approximation-ratio bound.

Lower bound (no schedule on G GPUs can finish earlier), the max of:

* **work**: ``Σ_k config_work(k) / G`` -- ``config_work`` is, by the cost-model contract, the
  single-GPU seconds of config k at full efficiency, which no job can beat;
* **GPU-seconds**: a config k in a job on d GPUs holds them for at least its own tokens'
  time, so the jobs hold at least ``Σ_k min_{(d,s)} d · config_time(k, d, s)`` GPU-seconds,
  plus the overhead ``min_{(d,s)} d · fixed_time(max_k steps_k, d, s)`` of the job holding
  the longest config (``fixed_time`` non-decreasing in steps); divided by G;
* **longest config**: ``max_k min_{(d,s) it fits} T({k}, d, s)``;

each measured from ``now`` with the GPU-seconds still held by running jobs added to the two
averages.

Thm 6.1 (App. C): with F the makespan, and the last job (the one ending last) on D GPUs
running ``T_last``, the greedy schedule is within ``AR <= F / (F - T_last (G - D) / G)`` of
the optimum, under the theorem's premise that all G GPUs are busy before the last job starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from plora.planner.ilp import ClassTable
from plora.planner.types import Job


def lower_bound(
    table: ClassTable,
    num_gpus: int,
    counts: Sequence[int] | None = None,
    *,
    now: float = 0.0,
    busy: Sequence[tuple[float, int]] = (),
) -> float:
    """A makespan lower bound for the configs left.

    Args:
        table: config classes and costs.
        num_gpus: G.
        counts: configs left per class (default: all), shape (C,).
        now: time origin of the configs left.
        busy: ``(seconds still to run, GPUs)`` of running jobs.

    Returns:
        Seconds from the plan's time origin (``now`` included).
    """
    cnt = np.asarray(table.counts if counts is None else counts, dtype=float)
    if not cnt.any():
        return now + max((t for t, _ in busy), default=0.0)
    held = sum(max(t, 0.0) * d for t, d in busy)
    work = float(cnt @ table.work)
    left = cnt > 0
    min_gpu_sec = np.full(len(cnt), math.inf)
    longest = np.full(len(cnt), math.inf)
    max_steps = int(table.steps[left].max())
    min_fixed = math.inf
    for opt in table.options:
        if opt.d > num_gpus:
            continue
        gpu_sec = np.where(opt.fits, opt.d * opt.time, math.inf)
        min_gpu_sec = np.minimum(min_gpu_sec, gpu_sec)
        alone = np.array([opt.fixed[int(s)] for s in table.steps]) + opt.time
        longest = np.minimum(longest, np.where(opt.fits, alone, math.inf))
        min_fixed = min(min_fixed, opt.d * opt.fixed[max_steps])
    gpu_seconds = float(cnt[left] @ min_gpu_sec[left]) + min_fixed
    average = (max(work, gpu_seconds) + held) / num_gpus
    return now + max(average, float(longest[left].max()))


def ratio_bound(jobs: Sequence[Job], num_gpus: int, *, origin: float = 0.0) -> float:
    """Thm 6.1: ``F / (F - T_last (G - D) / G)`` for the job ending last (1.0 without jobs)."""
    if not jobs:
        return 1.0
    last = max(jobs, key=lambda j: (j.end_s, j.start_s))
    span = last.end_s - origin
    denom = span - last.duration_s * (num_gpus - last.gpus) / num_gpus
    return span / denom if denom > 0 else math.inf


__all__ = ["lower_bound", "ratio_bound"]
