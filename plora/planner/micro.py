"""Micro-batched options for the packing ILP: a pack too big to have every row live at once.

For d = 1 and a sweep whose configs do not all fit one GPU with every row live, the class
table (:func:`plora.planner.ilp.build_classes`) gets, next to the usual option, options of
``m = 2, 4, 8, ...`` forwards per step up to ``M = min(cost.max_micro_batches, rows of the
sweep)``, M itself the last (:mod:`plora.cost.microbatch`:
the states of every config plus the activations of ``⌈R/m⌉`` rows; the step's fixed part paid
``m`` times). The knapsack needs memory linear in the pack, so an option of m charges each
class ``S_k + b_k·a_max/m`` over a base raised by ``a_max·(m-1)/m`` -- an upper bound on the
exact memory, so every pack it admits fits. :func:`micro_fit` then prices the chosen pack
exactly with the smallest ``m' <= m`` that fits it (``m' = 1`` when it fits with every row
live). Whether a config fits an option at all is that exact price of it alone
(:func:`alone_fits`), the one test the validation, the planner and the lower bound share. The
planner compares these packs with the others by predicted throughput as it does
any pack: a micro-batched job is chosen only when the cost model predicts it faster than
more jobs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from plora.config import LoRAConfig
from plora.cost import memory_limit
from plora.cost.microbatch import rows_per_micro_batch
from plora.planner.types import call_strategy


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class MicroCosts:
    """What a micro-batched option needs to price a pack exactly."""

    micro_batches: int
    """m, the most forwards per step of this option."""
    base: float
    """``M_base(d, s)`` bytes per GPU (without the linearization's margin)."""
    whole: np.ndarray
    """``M_k(d, s)`` per class with every row live (the m = 1 memory), shape (C,)."""
    state: np.ndarray
    """``S_k`` per class: LoRA params, grads and optimizer state, shape (C,)."""
    row_act: np.ndarray
    """``a_k`` per class: activation bytes per row, shape (C,)."""
    rows: np.ndarray
    """``b_k`` per class: rows (sequences) per step, shape (C,)."""
    fixed: dict[int, dict[int, float]]
    """``fixed_time(steps, d, s, micro_batches=m')`` per ``m' <= m`` and distinct step count."""


def supports_micro_batches(cost: Any) -> bool:
    """Whether ``cost`` prices micro-batched packs and allows them (``SweepCostModel`` with
    ``max_micro_batches > 1``; a bare :class:`plora.cost.CostModel` need not)."""
    return hasattr(cost, "config_memory_parts") and int(getattr(cost, "max_micro_batches", 1)) > 1


def micro_options(
    cost: Any,
    option: Any,
    members: Sequence[Sequence[LoRAConfig]],
    distinct_steps: Sequence[int],
) -> list[Any]:
    """Micro-batched variants of the d = 1 ``option`` (a ``DegreeCosts``; none when every config fits at once,
    when d > 1, or when the cost model cannot price them)."""
    if option.d != 1 or option.strategy is not None or not supports_micro_batches(cost):
        return []
    counts = np.array([len(m) for m in members], dtype=np.int64)
    cap = memory_limit(option.capacity)
    if option.base + float(option.mem @ counts) <= cap:
        return []  # the whole sweep fits one job with every row live
    s = call_strategy(1, None)
    parts = [cost.config_memory_parts(m[0], 1, s) for m in members]
    state = np.array([p[0] for p in parts], dtype=float)
    row_act = np.array([p[1] for p in parts], dtype=float)
    rows = np.array([m[0].batch_size for m in members], dtype=np.int64)
    a_max = float(row_act.max())
    total_rows = int(rows @ counts)
    fixed: dict[int, dict[int, float]] = {1: dict(option.fixed)}
    out: list[Any] = []  # plora.planner.ilp.DegreeCosts (that module imports this one)
    top = min(int(cost.max_micro_batches), total_rows)
    m = 2
    while m <= top:
        for k in range(len(fixed) + 1, m + 1):
            fixed[k] = {t: float(cost.fixed_time(t, 1, s, micro_batches=k)) for t in distinct_steps}
        base = option.base + a_max * (m - 1) / m
        mem = state + rows * (a_max / m)
        micro = MicroCosts(micro_batches=m, base=option.base, whole=option.mem,
                           state=state, row_act=row_act, rows=rows,
                           fixed={k: fixed[k] for k in range(1, m + 1)})  # fmt: skip
        fits = alone_fits(micro, cap)
        if fits.any():
            out.append(replace(option, base=base, mem=mem, fits=fits, fixed=fixed[m], micro=micro))
            if base + float(mem @ counts) <= cap:
                break  # every config fits one job with m forwards: more is only slower
        m = top if m < top < 2 * m else 2 * m  # doubling, and the most forwards last
    return out


def micro_fit(micro: MicroCosts, take: np.ndarray, cap: float) -> tuple[int, float]:
    """``(m', bytes)``: the smallest ``m' <= m`` with which the pack ``take`` fits ``cap`` and
    its memory then (m' = 1: the additive memory); ``(m, bytes at m)`` when none does."""
    whole = micro.base + float(micro.whole @ take)
    if whole <= cap:
        return 1, whole
    states = float(micro.state @ take)
    act = float(micro.row_act[take > 0].max())
    rows = int(micro.rows @ take)
    live = math.floor((cap - micro.base - states) / act) if act > 0 else rows  # rows that fit
    m = max(2, math.ceil(rows / live)) if live >= 1 else micro.micro_batches + 1
    m = min(m, micro.micro_batches)
    memory = micro.base + states + rows_per_micro_batch(rows, m) * act
    if m > 2 and micro.base + states + rows_per_micro_batch(rows, m - 1) * act <= cap:
        m -= 1  # float round-off at the boundary: keep the smallest m that fits
        memory = micro.base + states + rows_per_micro_batch(rows, m) * act
    return m, memory


def alone_fits(micro: MicroCosts, cap: float) -> np.ndarray:
    """Per class, whether one config of it fits ``cap`` bytes with at most m forwards, priced
    exactly as every pack is (:func:`micro_fit`): a micro-batched option's ``fits``. The
    knapsack's linear memory is an upper bound, so a config can fit alone where the linear
    form says it does not; the planner (which starts from single configs), the sweep's
    validation and the lower bound all go by this test, shape (C,) bool."""
    eye = np.eye(len(micro.rows), dtype=np.int64)
    return np.array([micro_fit(micro, one, cap)[1] <= cap for one in eye], dtype=bool)


def consolidated(table: Any) -> list[Any]:
    """One class table per micro-batched option of ``table`` (a ``ClassTable``) in which d = 1
    jobs take that option: its knapsack fills a pack to what fits with m forwards (the plain
    option stays only for classes the micro-batched one cannot hold). Greedy throughput would
    rather fill a job with every row live and start another; these tables give the planner's
    makespan comparison (:func:`plora.planner.schedule.replan`) the one-job alternative.
    :func:`make_pack` still prices every pack with its smallest fitting m."""
    micro = [o for o in table.options if o.micro is not None]
    wide = [o for o in table.options if o.d > 1]
    out = []
    for option in micro:
        # the other d = 1 options (every row live, or more forwards) only for the classes this
        # one cannot hold: without them such a class (a batch that needs m = 8 where this
        # option has m = 2) could start nowhere
        others = [
            replace(o, fits=o.fits & ~option.fits)
            for o in table.options
            if o.d == 1 and o is not option
        ]
        kept = [o for o in others if o.fits.any()]
        out.append(replace(table, options=(*kept, option, *wide)))
    return out


__all__ = [
    "MicroCosts",
    "alone_fits",
    "consolidated",
    "micro_fit",
    "micro_options",
    "supports_micro_batches",
]
