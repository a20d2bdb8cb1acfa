"""MILP backends of the bounded knapsack of :mod:`plora.planner.knapsack`: HiGHS, cvxpy, Gurobi.

The same problem as there (``max p·x`` under a memory row and, with a deadline, a time row, and
with ``planner.max_pack_size`` a row ``Σ x_i <= K``; ``0 <= x_i <= n_i`` integer), written as a
MILP with every row scaled to right-hand side 1
(HiGHS' tolerances are absolute) and solved with zero optimality gap:

* ``highs``: HiGHS through ``highspy``; past :data:`HIGHS_TIME_LIMIT_S` it raises
  :class:`NotProven` carrying the best solution found.
* ``cvxpy``: the same MILP built with cvxpy and solved by ``cp.HIGHS`` (slow to build; reference).
* ``gurobi``: gurobipy, imported lazily; raises :class:`GurobiUnavailable` when it is not
  installed, not licensed, or the model exceeds a size-limited license.

Each backend sees only the items that fit alone (the others are 0 in every solution); the
solution is mapped back to all items. Solvers import lazily (layer map: planner).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from plora.planner.knapsack import KnapsackFn

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


def _scaled_rows(
    mem: np.ndarray, time: np.ndarray, mem_cap: float, time_cap: float, size_cap: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Constraint rows scaled to right-hand side 1 (HiGHS tolerances are absolute)."""
    rows = [mem / mem_cap if mem_cap > 0 else mem]
    rhs = [1.0 if mem_cap > 0 else 0.0]
    if math.isfinite(time_cap):
        rows.append(time / time_cap if time_cap > 0 else time)
        rhs.append(1.0 if time_cap > 0 else 0.0)
    if size_cap is not None:
        rows.append(np.ones_like(mem) / size_cap)
        rhs.append(1.0)
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
        *,
        size_cap: int | None = None,
    ) -> tuple[list[int], float]:
        m = len(profit)
        if m == 0 or mem_cap < 0 or time_cap < 0 or (size_cap is not None and size_cap < 1):
            return [0] * m, 0.0
        idx, data = _fitting(profit, mem, time, count, mem_cap, time_cap)
        x = [0] * m
        if len(idx) == 0:
            return x, 0.0
        try:
            sub, val = backend(*data, mem_cap, time_cap, size_cap)
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
    size_cap: int | None = None,
) -> tuple[list[int], float]:
    """The knapsack as a MILP solved by HiGHS (``highspy``), zero optimality gap."""
    import highspy

    p = np.asarray(profit, dtype=float)
    m = len(p)
    rows, rhs = _scaled_rows(
        np.asarray(mem, float), np.asarray(time, float), mem_cap, time_cap, size_cap
    )
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
    size_cap: int | None = None,
) -> tuple[list[int], float]:
    """The knapsack MILP built with cvxpy (integer variables) and solved by ``cp.HIGHS``."""
    import cvxpy as cp

    p = np.asarray(profit, dtype=float)
    m = len(p)
    rows, rhs = _scaled_rows(
        np.asarray(mem, float), np.asarray(time, float), mem_cap, time_cap, size_cap
    )
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
    size_cap: int | None = None,
) -> tuple[list[int], float]:
    """The knapsack MILP solved by gurobipy; :class:`GurobiUnavailable` when it cannot run."""
    try:
        import gurobipy as gp
    except ImportError as err:
        raise GurobiUnavailable("gurobipy is not installed") from err
    p = np.asarray(profit, dtype=float)
    m = len(p)
    rows, rhs = _scaled_rows(
        np.asarray(mem, float), np.asarray(time, float), mem_cap, time_cap, size_cap
    )
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
    "HIGHS_TIME_LIMIT_S",
    "GurobiUnavailable",
    "NotProven",
    "solve_cvxpy",
    "solve_gurobi",
    "solve_highs",
]
