"""Exact bounded knapsack backends for the inner problem of the Dinkelbach iteration.

The problem, for item classes ``i = 1..m`` with ``n_i`` identical copies each::

    max  Σ_i p_i x_i
    s.t. Σ_i a_i x_i <= A        (memory per GPU left after the base model)
         Σ_i b_i x_i <= B        (job time budget; B = +inf when there is no deadline)
         x_i ∈ {0, 1, ..., n_i}

with ``p_i > 0``. With all ``n_i = 1`` this is the 0-1 knapsack of Eq. 19 on the classes.

Backends, all exact (optimal up to a 1e-12 relative tolerance):

* ``bnb``: depth-first branch and bound over classes sorted by ``p_i / a_i`` with the Dantzig
  LP bound (the min of the bounds of both constraints when ``B`` is finite). Pure Python, no
  solver start-up cost; returns ``None`` past ``node_limit`` nodes so the caller can fall back.
* ``highs``: the MILP solved by HiGHS through ``highspy`` (gaps set to zero).
* ``cvxpy``: the same MILP built with cvxpy and solved by ``cp.HIGHS`` (slow to build; reference).
* ``gurobi``: gurobipy, imported lazily; raises :class:`GurobiUnavailable` when it is not
  installed, not licensed, or the model exceeds a size-limited license.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: A knapsack backend: ``(profit, mem, time, count, mem_cap, time_cap) -> (x, value)``.
KnapsackFn = Callable[..., tuple[list[int], float]]

#: Relative optimality tolerance of every backend.
REL_TOL = 1e-12

#: Wall-clock cap of one HiGHS knapsack MILP (zero-gap MILPs of subset-sum-like instances can
#: run very long); past it the best solution found is returned.
HIGHS_TIME_LIMIT_S = 10.0


class NotProven(RuntimeError):
    """A MILP backend hit its time limit: ``x``/``value`` are its best solution, maybe not optimal."""

    def __init__(self, x: list[int], value: float) -> None:
        super().__init__(f"knapsack MILP stopped at its time limit with value {value:g}")
        self.x, self.value = x, value


class GurobiUnavailable(RuntimeError):
    """gurobipy cannot solve this model (not installed, no license, or over the size limit)."""


def _ratio(p: float, w: float) -> float:
    return p / w if w > 0 else math.inf


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
        node_limit: give up (return None) after this many search nodes.
    """
    m = len(profit)
    if m == 0 or mem_cap < 0 or time_cap < 0:
        return [0] * m, 0.0, True
    two = math.isfinite(time_cap)
    order = sorted(range(m), key=lambda i: (-_ratio(profit[i], mem[i]), -profit[i]))
    p = [float(profit[i]) for i in order]
    a = [float(mem[i]) for i in order]
    b = [float(time[i]) for i in order]
    n = [int(count[i]) for i in order]
    tol_a = abs(mem_cap) * 1e-12
    tol_b = abs(time_cap) * 1e-12 if two else 0.0
    # Prefix sums for the Dantzig bound on the memory constraint.
    cw = [0.0] * (m + 1)
    cp = [0.0] * (m + 1)
    for j in range(m):
        cw[j + 1] = cw[j] + n[j] * a[j]
        cp[j + 1] = cp[j] + n[j] * p[j]
    order_b = sorted(range(m), key=lambda j: -_ratio(p[j], b[j])) if two else []

    def bound(i: int, ra: float, rb: float) -> float:
        # Dantzig bound on memory: whole classes i..j-1, then a fraction of class j.
        j = bisect_right(cw, cw[i] + ra, lo=i) - 1
        ub = cp[j] - cp[i]
        if j < m:
            ub += p[j] * max(0.0, ra - (cw[j] - cw[i])) / a[j] if a[j] > 0 else n[j] * p[j]
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

    inv_a = [1.0 / w if w > 0 else math.inf for w in a]
    inv_b = [1.0 / w if w > 0 else math.inf for w in b]

    def kmax(i: int, ra: float, rb: float) -> int:
        k = n[i]
        fa = (ra + tol_a) * inv_a[i]
        if fa < k:
            k = int(fa)
        if two:
            fb = (rb + tol_b) * inv_b[i]
            if fb < k:
                k = int(fb)
        return k if k > 0 else 0

    best, best_x = 0.0, [0] * m
    frames: list[list[int]] = []  # [class index, copies taken]
    i, val, ra, rb = 0, 0.0, float(mem_cap), float(time_cap) if two else 0.0
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
        while i < m and kmax(i, ra, rb) == 0:
            i += 1
        if i < m and val + bound(i, ra, rb) > best * (1 + REL_TOL):
            k = kmax(i, ra, rb)
            frames.append([i, k])
            val += k * p[i]
            ra -= k * a[i]
            rb -= k * b[i]
            i += 1
            continue
        # Backtrack: take one copy fewer of the deepest class still holding some. With the
        # memory constraint alone the Dantzig bound B(r) is concave with slopes <= p_j / a_j,
        # so val + B grows no larger as copies of class j are dropped: once the child with
        # one copy fewer fails the bound, every smaller count fails too and j is done.
        while frames:
            j, c = frames[-1]
            if c == 0:
                frames.pop()
                continue
            frames[-1][1] = c - 1
            val -= p[j]
            ra += a[j]
            rb += b[j]
            if not two and val + bound(j + 1, ra, rb) <= best * (1 + REL_TOL):
                val -= (c - 1) * p[j]
                ra += (c - 1) * a[j]
                frames.pop()
                continue
            i = j + 1
            break
        else:
            break
    x = [0] * m
    for pos, orig in enumerate(order):
        x[orig] = best_x[pos]
    return x, best, proven


def _scaled_rows(
    mem: np.ndarray, time: np.ndarray, mem_cap: float, time_cap: float
) -> tuple[np.ndarray, np.ndarray]:
    """Constraint rows scaled to right-hand side 1 (HiGHS tolerances are absolute)."""
    rows = [mem / mem_cap if mem_cap > 0 else mem]
    rhs = [1.0 if mem_cap > 0 else 0.0]
    if math.isfinite(time_cap):
        rows.append(time / time_cap if time_cap > 0 else time)
        rhs.append(1.0 if time_cap > 0 else 0.0)
    return np.vstack(rows), np.asarray(rhs)


def _finish(x_raw: Any, profit: np.ndarray) -> tuple[list[int], float]:
    x = [round(float(v)) for v in x_raw]
    return x, float(np.dot(profit, x))


def _fitting(
    profit: Sequence[float],
    mem: Sequence[float],
    time: Sequence[float],
    count: Sequence[int],
    mem_cap: float,
    time_cap: float,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Items that fit alone (others are 0 in every solution) and their data; keeps the
    scaled rows of the MILPs at most 1."""
    p, a, b = (np.asarray(v, dtype=float) for v in (profit, mem, time))
    n = np.asarray(count, dtype=float)
    keep = (n > 0) & (a <= mem_cap) & (b <= time_cap)
    return np.flatnonzero(keep), (p[keep], a[keep], b[keep], n[keep])


def _milp(backend: KnapsackFn) -> KnapsackFn:
    """Run a MILP backend on the items that fit alone; map the solution back."""

    def run(
        profit: Sequence[float],
        mem: Sequence[float],
        time: Sequence[float],
        count: Sequence[int],
        mem_cap: float,
        time_cap: float = math.inf,
    ) -> tuple[list[int], float]:
        m = len(profit)
        if m == 0 or mem_cap < 0 or time_cap < 0:
            return [0] * m, 0.0
        idx, data = _fitting(profit, mem, time, count, mem_cap, time_cap)
        x = [0] * m
        if len(idx) == 0:
            return x, 0.0
        try:
            sub, val = backend(*data, mem_cap, time_cap)
        except NotProven as err:
            for i, v in zip(idx, err.x, strict=True):
                x[int(i)] = v
            raise NotProven(x, err.value) from None
        for i, v in zip(idx, sub, strict=True):
            x[int(i)] = v
        return x, val

    run.__name__, run.__doc__ = backend.__name__.lstrip("_"), backend.__doc__
    return run


def _solve_highs(
    profit: Sequence[float],
    mem: Sequence[float],
    time: Sequence[float],
    count: Sequence[int],
    mem_cap: float,
    time_cap: float = math.inf,
) -> tuple[list[int], float]:
    """The knapsack as a MILP solved by HiGHS (``highspy``), zero optimality gap."""
    import highspy

    p = np.asarray(profit, dtype=float)
    m = len(p)
    rows, rhs = _scaled_rows(np.asarray(mem, float), np.asarray(time, float), mem_cap, time_cap)
    h = highspy.Highs()  # type: ignore[no-untyped-call]
    for key, value in (
        ("output_flag", False),
        ("mip_rel_gap", 0.0),
        ("mip_abs_gap", 0.0),
        ("mip_feasibility_tolerance", 1e-9),
        ("primal_feasibility_tolerance", 1e-9),
        ("time_limit", HIGHS_TIME_LIMIT_S),
    ):
        h.setOptionValue(key, value)
    lp = highspy.HighsLp()
    lp.num_col_ = m
    lp.num_row_ = rows.shape[0]
    lp.sense_ = highspy.ObjSense.kMaximize
    lp.col_cost_ = p
    lp.col_lower_ = np.zeros(m)
    lp.col_upper_ = np.asarray(count, dtype=float)
    lp.row_lower_ = np.full(rows.shape[0], -highspy.kHighsInf)
    lp.row_upper_ = rhs
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.arange(0, rows.shape[0] * m + 1, rows.shape[0], dtype=np.int32)
    lp.a_matrix_.index_ = np.tile(np.arange(rows.shape[0], dtype=np.int32), m)
    lp.a_matrix_.value_ = rows.T.reshape(-1)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * m
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kTimeLimit:
        if h.getInfo().primal_solution_status:
            raise NotProven(*_finish(h.getSolution().col_value, p))
        raise NotProven([0] * m, 0.0)  # nothing found yet: the empty pack is feasible
    if status != highspy.HighsModelStatus.kOptimal:
        raise RuntimeError(f"HiGHS knapsack MILP ended with status {h.getModelStatus()}")
    return _finish(h.getSolution().col_value, p)


def _solve_cvxpy(
    profit: Sequence[float],
    mem: Sequence[float],
    time: Sequence[float],
    count: Sequence[int],
    mem_cap: float,
    time_cap: float = math.inf,
) -> tuple[list[int], float]:
    """The knapsack MILP built with cvxpy (integer variables) and solved by ``cp.HIGHS``."""
    import cvxpy as cp

    p = np.asarray(profit, dtype=float)
    m = len(p)
    rows, rhs = _scaled_rows(np.asarray(mem, float), np.asarray(time, float), mem_cap, time_cap)
    counts = np.asarray(count, dtype=float)
    x = cp.Variable(m, boolean=True) if np.all(counts == 1) else cp.Variable(m, integer=True)
    cons = [rows @ x <= rhs, x >= 0, x <= counts]
    prob = cp.Problem(cp.Maximize(p @ x), cons)
    prob.solve(solver=cp.HIGHS, mip_rel_gap=0.0, mip_abs_gap=0.0)  # type: ignore[no-untyped-call]
    if prob.status != cp.OPTIMAL:
        raise RuntimeError(f"cvxpy/HiGHS knapsack MILP ended with status {prob.status}")
    return _finish(x.value, p)


def _solve_gurobi(
    profit: Sequence[float],
    mem: Sequence[float],
    time: Sequence[float],
    count: Sequence[int],
    mem_cap: float,
    time_cap: float = math.inf,
) -> tuple[list[int], float]:
    """The knapsack MILP solved by gurobipy; :class:`GurobiUnavailable` when it cannot run."""
    try:
        import gurobipy as gp
    except ImportError as err:
        raise GurobiUnavailable("gurobipy is not installed") from err
    p = np.asarray(profit, dtype=float)
    m = len(p)
    rows, rhs = _scaled_rows(np.asarray(mem, float), np.asarray(time, float), mem_cap, time_cap)
    try:
        env = gp.Env(params={"OutputFlag": 0})
        model = gp.Model(env=env)
        model.Params.MIPGap = 0.0
        model.Params.MIPGapAbs = 0.0
        x = model.addMVar(m, lb=0.0, ub=np.asarray(count, float), vtype=gp.GRB.INTEGER)
        model.addConstr(rows @ x <= rhs)
        model.setObjective(p @ x, gp.GRB.MAXIMIZE)
        model.optimize()
        if model.Status != gp.GRB.OPTIMAL:
            raise RuntimeError(f"gurobi knapsack MILP ended with status {model.Status}")
        values = list(x.X)
        model.dispose()
        env.dispose()
    except gp.GurobiError as err:
        raise GurobiUnavailable(f"gurobi refused the model ({err})") from err
    return _finish(values, p)


solve_highs = _milp(_solve_highs)
solve_cvxpy = _milp(_solve_cvxpy)
solve_gurobi = _milp(_solve_gurobi)

__all__ = [
    "REL_TOL",
    "GurobiUnavailable",
    "NotProven",
    "lp_bound",
    "solve_bnb",
    "solve_cvxpy",
    "solve_gurobi",
    "solve_highs",
]
