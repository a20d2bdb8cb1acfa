"""Exact bounded knapsack backends for the inner problem of the Dinkelbach iteration.

The problem, for item classes ``i = 1..m`` with ``n_i`` identical copies each::

    max  Σ_i p_i x_i
    s.t. Σ_i a_i x_i <= A        (memory per GPU left after the base model)
         Σ_i b_i x_i <= B        (job time budget; B = +inf when there is no deadline)
         Σ_i x_i     <= K        (most configs per job, ``planner.max_pack_size``; K = none)
         x_i ∈ {0, 1, ..., n_i}

with ``p_i > 0``. With all ``n_i = 1`` this is the 0-1 knapsack of Eq. 19 on the classes.

Backends, all exact (optimal up to a 1e-12 relative tolerance):

* ``bnb``: depth-first branch and bound over classes sorted by ``p_i / a_i`` with the Dantzig
  LP bound (the min of the bounds of both constraints when ``B`` is finite, and ``K`` times the
  largest profit left when ``K`` is set). Pure Python, no
  solver start-up cost; returns ``None`` past ``node_limit`` nodes so the caller can fall back.
* ``highs``, ``cvxpy``, ``gurobi``: the MILP solved by a solver with zero gap
  (:mod:`plora.planner.knapsack_milp`).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence

import numpy as np

#: A knapsack backend: ``(profit, mem, time, count, mem_cap, time_cap, *, size_cap=None) ->
#: (x, value)``.
KnapsackFn = Callable[..., tuple[list[int], float]]

#: Relative optimality tolerance of every backend.
REL_TOL = 1e-12


def _ratios(p: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``p / w`` per class, ``inf`` where ``w <= 0`` (a class that weighs nothing first)."""
    out = np.full(len(p), math.inf)
    with np.errstate(over="ignore"):
        np.divide(p, w, out=out, where=w > 0)
    return out


def lp_bound(profit: np.ndarray, weight: np.ndarray, count: np.ndarray, cap: float) -> float:
    """Dantzig's bound: the LP relaxation of ``max p·x, w·x <= cap, 0 <= x <= n`` (numpy).

    Args:
        profit: ``p > 0``, shape (m,).
        weight: ``w >= 0``, shape (m,).
        count: ``n >= 0``, shape (m,).
        cap: capacity (``inf`` allowed).
    """
    if cap < 0:
        return 0.0
    if not math.isfinite(cap):
        return float(profit @ count)
    with np.errstate(divide="ignore", over="ignore"):
        ratio = np.where(weight > 0, profit / np.where(weight > 0, weight, 1.0), np.inf)
    order = np.argsort(-ratio, kind="stable")
    w = (weight * count)[order]
    p = (profit * count)[order]
    cw = np.cumsum(w)
    j = int(np.searchsorted(cw, cap, side="right"))
    ub = float(p[:j].sum())
    if j < len(w):
        room = cap - (cw[j - 1] if j else 0.0)
        ub += float(profit[order[j]] * room / weight[order[j]])
    return ub


def solve_bnb(
    profit: Sequence[float],
    mem: Sequence[float],
    time: Sequence[float],
    count: Sequence[int],
    mem_cap: float,
    time_cap: float = math.inf,
    *,
    size_cap: int | None = None,
    node_limit: int = 200_000,
) -> tuple[list[int], float, bool]:
    """Branch and bound: ``(x, value, proven)``.

    ``proven`` is False when the search stopped at ``node_limit`` nodes: ``x`` is then the best
    solution found (feasible, maybe not optimal).

    Args:
        profit: ``p_i > 0``, shape (m,).
        mem: ``a_i >= 0``, shape (m,).
        time: ``b_i >= 0``, shape (m,).
        count: ``n_i >= 0``, shape (m,).
        mem_cap: ``A``.
        time_cap: ``B`` (``inf``: memory constraint only).
        size_cap: ``K``, the most items taken in all (None: no such constraint).
        node_limit: give up (return None) after this many search nodes.
    """
    m = len(profit)
    if m == 0 or mem_cap < 0 or time_cap < 0 or (size_cap is not None and size_cap < 1):
        return [0] * m, 0.0, True
    two = math.isfinite(time_cap)
    sized = size_cap is not None
    prof_arr, mem_arr = np.asarray(profit, dtype=float), np.asarray(mem, dtype=float)
    # by ratio p/a, then profit, best first (stable: numpy's lexsort, not a key per class)
    order = np.lexsort((-prof_arr, -_ratios(prof_arr, mem_arr))).tolist()
    p = prof_arr[order].tolist()
    a = mem_arr[order].tolist()
    b = np.asarray(time, dtype=float)[order].tolist()
    n = [int(count[i]) for i in order]
    tol_a = abs(mem_cap) * 1e-12
    tol_b = abs(time_cap) * 1e-12 if two else 0.0
    # Prefix sums for the Dantzig bound on the memory constraint.
    cw = [0.0] * (m + 1)
    cp = [0.0] * (m + 1)
    for j in range(m):
        cw[j + 1] = cw[j] + n[j] * a[j]
        cp[j + 1] = cp[j] + n[j] * p[j]
    order_b = (
        np.argsort(-_ratios(np.asarray(p), np.asarray(b)), kind="stable").tolist() if two else []
    )
    top = [0.0] * (m + 1)  # the largest profit among classes j..m-1 (the size cap's bound)
    for j in range(m - 1, -1, -1):
        top[j] = max(top[j + 1], p[j])

    def bound(i: int, ra: float, rb: float, rc: int) -> float:
        # Dantzig bound on memory: whole classes i..j-1, then a fraction of class j.
        j = bisect_right(cw, cw[i] + ra, lo=i) - 1
        ub = cp[j] - cp[i]
        if j < m:
            ub += p[j] * max(0.0, ra - (cw[j] - cw[i])) / a[j] if a[j] > 0 else n[j] * p[j]
        if sized:
            ub = min(ub, rc * top[i])
        if not two:
            return ub
        ub_b, r = 0.0, rb
        for k in order_b:
            if k < i:
                continue
            w = n[k] * b[k]
            if w <= r:
                ub_b += n[k] * p[k]
                r -= w
            else:
                ub_b += p[k] * r / b[k]
                break
        return min(ub, ub_b)

    # Past position j no item fits once the room is below every weight from j on: the skip
    # loop below then jumps to the end instead of testing each item (deep in the tree, where
    # little room is left, that test ran once per class per node).
    min_a = [math.inf] * (m + 1)
    for j in range(m - 1, -1, -1):
        min_a[j] = min(min_a[j + 1], a[j] if n[j] > 0 else math.inf)
    inv_a = [1.0 / w if w > 0 else math.inf for w in a]
    inv_b = [1.0 / w if w > 0 else math.inf for w in b]

    def kmax(i: int, ra: float, rb: float, rc: int) -> int:
        k = min(n[i], rc) if sized else n[i]
        fa = (ra + tol_a) * inv_a[i]
        if fa < k:
            k = int(fa)
        if two:
            fb = (rb + tol_b) * inv_b[i]
            if fb < k:
                k = int(fb)
        return k if k > 0 else 0

    # Classes of equal weights (memory, and time under a deadline) sit in the order above by
    # profit, best first, and some optimum takes a prefix of each such group (swap a taken
    # copy for a skipped better one: same weights, no less profit). So once a class is taken
    # short of its count, no later class of its weights is tried in that subtree: without
    # this, a sweep whose configs differ only in their step count (one class each, a few
    # distinct memory sizes) searched every subset of the near-equal ones.
    keys: dict[tuple[float, float], int] = {}
    group = [keys.setdefault((a[j], b[j] if two else 0.0), len(keys)) for j in range(m)]
    closed = [0] * len(keys)  # frames on the stack, per group, holding fewer than n copies

    best, best_x = 0.0, [0] * m
    frames: list[list[int]] = []  # [class index, copies taken]
    i, val, ra, rb = 0, 0.0, float(mem_cap), float(time_cap) if two else 0.0
    rc = int(size_cap) if size_cap is not None else 0
    nodes, proven = 0, True
    while True:
        nodes += 1
        if nodes > node_limit:
            proven = False
            break
        if val > best * (1 + REL_TOL):
            best = val
            best_x = [0] * m
            for j, c in frames:
                best_x[j] = c
        if i < m and min_a[i] > (ra + tol_a) * (1 + 1e-9):
            i = m  # no item from i on fits the memory left
        while i < m and (closed[group[i]] or kmax(i, ra, rb, rc) == 0):
            i += 1
        if i < m and val + bound(i, ra, rb, rc) > best * (1 + REL_TOL):
            k = kmax(i, ra, rb, rc)
            frames.append([i, k])
            if k < n[i]:
                closed[group[i]] += 1
            val += k * p[i]
            ra -= k * a[i]
            rb -= k * b[i]
            rc -= k
            i += 1
            continue
        # Backtrack: take one copy fewer of the deepest class still holding some. With the
        # memory constraint alone the Dantzig bound B(r) is concave with slopes <= p_j / a_j,
        # so val + B grows no larger as copies of class j are dropped: once the child with
        # one copy fewer fails the bound, every smaller count fails too and j is done (not so
        # under a second row or the size cap, whose bounds a dropped copy loosens).
        while frames:
            j, c = frames[-1]
            if c == 0:
                frames.pop()
                closed[group[j]] -= 1
                continue
            if c == n[j]:
                closed[group[j]] += 1  # one copy short from now on
            frames[-1][1] = c - 1
            val -= p[j]
            ra += a[j]
            rb += b[j]
            rc += 1
            if not two and not sized and val + bound(j + 1, ra, rb, rc) <= best * (1 + REL_TOL):
                val -= (c - 1) * p[j]
                ra += (c - 1) * a[j]
                frames.pop()
                closed[group[j]] -= 1
                continue
            i = j + 1
            break
        else:
            break
    x = [0] * m
    for pos, orig in enumerate(order):
        x[orig] = best_x[pos]
    return x, best, proven


__all__ = [
    "REL_TOL",
    "KnapsackFn",
    "lp_bound",
    "solve_bnb",
]
