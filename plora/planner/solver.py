"""The knapsack backends of F(d, K) (:mod:`plora.planner.ilp`): which one runs, its fallbacks,
and the notes a plan carries about them."""

from __future__ import annotations

from collections.abc import Sequence

from plora.config import ConfigError
from plora.planner import knapsack, knapsack_milp

SOLVERS = ("auto", "bnb", "highs", "cvxpy", "gurobi")


class KnapsackSolver:
    """Runs the inner knapsacks on the chosen backend, with fallbacks and notes.

    ``auto`` and ``bnb`` run the exact branch and bound and, past its node limit, the HiGHS
    MILP (still exact); ``highs``/``cvxpy`` always run that MILP; ``gurobi`` runs gurobipy
    when installed and licensed, else HiGHS (noted once in :attr:`notes`). Knapsacks with a
    time cap (the deadline search of :mod:`plora.planner.schedule`, a heuristic layer on top
    of the paper) take branch and bound's best within ``heuristic_node_limit`` nodes on every
    backend; F(d, K) without a deadline is always solved exactly.
    """

    def __init__(
        self, solver: str = "auto", *, node_limit: int = 20_000, heuristic_node_limit: int = 25
    ) -> None:
        if solver not in SOLVERS:
            raise ConfigError(
                f"planner.solver: unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}"
            )
        self.requested = solver
        self.node_limit = node_limit
        self.heuristic_node_limit = heuristic_node_limit
        self.notes: list[str] = []
        self.used: set[str] = set()
        self._gurobi_ok = solver == "gurobi"

    @property
    def name(self) -> str:
        """Backends actually used, e.g. ``bnb`` or ``bnb+highs``."""
        order = ("bnb", "highs", "cvxpy", "gurobi")
        return "+".join(b for b in order if b in self.used) or (
            "bnb" if self.requested == "auto" else self.requested
        )

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def __call__(
        self,
        profit: Sequence[float],
        mem: Sequence[float],
        time: Sequence[float],
        count: Sequence[int],
        mem_cap: float,
        time_cap: float,
        *,
        size_cap: int | None = None,
        exact: bool = True,
    ) -> tuple[list[int], float]:
        """Solve one knapsack (``size_cap``: at most that many items in all); ``exact=False``
        accepts branch and bound's best past its limit."""
        args = (profit, mem, time, count, mem_cap, time_cap)
        if not exact:
            x, val, _ = knapsack.solve_bnb(
                *args, size_cap=size_cap, node_limit=self.heuristic_node_limit
            )
            return x, val
        if self.requested in ("auto", "bnb"):
            x, val, proven = knapsack.solve_bnb(
                *args, size_cap=size_cap, node_limit=self.node_limit
            )
            self.used.add("bnb")
            if proven:
                return x, val
            self._note(f"branch and bound passed {self.node_limit} nodes; HiGHS MILP solved it")
        elif self.requested == "cvxpy":
            self.used.add("cvxpy")
            return knapsack_milp.solve_cvxpy(*args, size_cap=size_cap)
        elif self.requested == "gurobi" and self._gurobi_ok:
            try:
                out = knapsack_milp.solve_gurobi(*args, size_cap=size_cap)
                self.used.add("gurobi")
                return out
            except knapsack_milp.GurobiUnavailable as err:
                self._gurobi_ok = False
                self._note(f"{err}; fell back to HiGHS")
        self.used.add("highs")
        try:
            return knapsack_milp.solve_highs(*args, size_cap=size_cap)
        except knapsack_milp.NotProven as err:
            self._note(
                f"a HiGHS knapsack hit its {knapsack_milp.HIGHS_TIME_LIMIT_S:g} s limit; "
                "its best solution was used (not proven optimal)"
            )
            return err.x, err.value


__all__ = ["SOLVERS", "KnapsackSolver"]
