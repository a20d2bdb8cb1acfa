"""Makespan lower bound and the Thm 6.1 approximation-ratio bound.

Lower bound (no schedule on G GPUs can finish earlier), the max of:

* **work**: ``W = max(Σ_k config_work(k), gpu_seconds)`` spread over the GPUs from the time each
  becomes available -- ``config_work`` is, by the cost-model contract, the single-GPU seconds
  of config k (its tokens, evaluation and export) that no job can beat; ``gpu_seconds``: a
  config k in a job on d GPUs holds them for at least its own time, so the jobs hold at least
  ``Σ_k min_{(d,s)} d · config_time(k, d, s)`` GPU-seconds, plus the per-job part
  ``min_{(d,s)} d · fixed_time(max_k steps_k, d, s)`` of the job holding the longest config
  (``fixed_time`` non-decreasing in steps). GPU g becomes available after ``a_g``: a running
  job's remaining time, the least start-up ``min_d startup_time(d)`` for a GPU with no
  resident worker group, 0 otherwise; the bound is the smallest ``x`` with
  ``Σ_g max(0, x - a_g) >= W`` (water filling), and at least the last running job's end;
* **longest config**: ``min_g a_g + max_k min_{(d,s) it fits} T({k}, d, s)`` -- no job starts
  before some GPU is available;

each measured from ``now``. Only what every schedule pays is counted: start-up once on
GPUs that have to be used cold, never the re-grouping a particular schedule chooses.

Thm 6.1 (App. C): with F the makespan, and the last job (the one ending last) on D GPUs
running ``T_last``, the greedy schedule is within ``AR <= F / (F - T_last (G - D) / G)`` of
the optimum, under the theorem's premise that all G GPUs are busy before the last job starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from plora.planner.ilp import ClassTable, alone_times
from plora.planner.types import Job


def water_fill(available: Sequence[float], work: float) -> float:
    """The smallest ``x >= 0`` with ``Σ_g max(0, x - available[g]) >= work``: when ``work``
    seconds spread over GPUs that become free at ``available`` can be done at the earliest."""
    a = sorted(max(float(t), 0.0) for t in available)
    if work <= 0 or not a:
        return 0.0
    total = 0.0
    for i, t in enumerate(a):
        total += t
        x = (work + total) / (i + 1)  # the first i + 1 GPUs share the work
        if i + 1 == len(a) or x <= a[i + 1]:
            return x
    raise AssertionError("unreachable")  # pragma: no cover


def lower_bound(
    table: ClassTable,
    num_gpus: int,
    counts: Sequence[int] | None = None,
    *,
    now: float = 0.0,
    busy: Sequence[tuple[float, int]] = (),
    cold: int = 0,
    startup: float = 0.0,
) -> float:
    """A makespan lower bound for the configs left.

    Args:
        table: config classes and costs.
        num_gpus: G.
        counts: configs left per class (default: all), shape (C,).
        now: time origin of the configs left.
        busy: ``(seconds still to run, GPUs)`` of running jobs.
        cold: free GPUs without a resident worker group.
        startup: seconds before a cold GPU can work (the least ``startup_time(d)``).

    Returns:
        Seconds from the plan's time origin (``now`` included).
    """
    cnt = np.asarray(table.counts if counts is None else counts, dtype=float)
    running = max((max(t, 0.0) for t, _ in busy), default=0.0)
    if not cnt.any():
        return now + running
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
        longest = np.minimum(longest, alone_times(table, opt))
        # a micro-batched job pays the per-step part m' >= 1 times: at least once
        fixed = opt.fixed if opt.micro is None else opt.micro.fixed[1]
        min_fixed = min(min_fixed, opt.d * fixed[max_steps])
    gpu_seconds = float(cnt[left] @ min_gpu_sec[left]) + min_fixed
    available = [max(t, 0.0) for t, d in busy for _ in range(d)]
    available += [max(startup, 0.0)] * cold
    available = (available + [0.0] * num_gpus)[:num_gpus]
    average = max(water_fill(available, max(work, gpu_seconds)), running)
    return now + max(average, min(available) + float(longest[left].max()))


def ratio_bound(jobs: Sequence[Job], num_gpus: int, *, origin: float = 0.0) -> float:
    """Thm 6.1: ``F / (F - T_last (G - D) / G)`` for the job ending last (1.0 without jobs)."""
    if not jobs:
        return 1.0
    last = max(jobs, key=lambda j: (j.end_s, j.start_s))
    span = last.end_s - origin
    denom = span - last.duration_s * (num_gpus - last.gpus) / num_gpus
    return span / denom if denom > 0 else math.inf


__all__ = ["lower_bound", "ratio_bound", "water_fill"]
