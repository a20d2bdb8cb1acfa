"""F(D, K) and its knapsack backends against brute force (independent references)."""

from __future__ import annotations

import itertools
import math
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_testlib import brute_knapsack

from plora.config import ConfigError, LoRAConfig
from plora.cost import Strategy
from plora.planner import Objective, plan_sweep
from plora.planner import knapsack as kn
from plora.planner import knapsack_milp as milp
from plora.planner.ilp import build_classes, solve_pack
from plora.planner.solver import KnapsackSolver
from plora.planner.synthetic import AffineCostModel
from plora.planner.types import MEM_RTOL, call_strategy

GIB = float(1 << 30)


def make_configs(specs: list[tuple[int, int, int]]) -> list[LoRAConfig]:
    """Configs from (rank, batch size, steps) triples."""
    return [
        LoRAConfig(config_id=f"c{i:03d}", rank=r, alpha=2.0 * r, lr=1e-4, batch_size=b, max_steps=s)
        for i, (r, b, s) in enumerate(specs)
    ]


@st.composite
def instances(draw, max_configs: int = 9, duplicates: bool = True):
    """Random configs with random per-config memory/time, a random per-step overhead and a
    per-job start cost."""
    n = draw(st.integers(1, max_configs))
    specs = [
        (draw(st.sampled_from([4, 8, 16])), 1, draw(st.sampled_from([50, 100, 200])))
        for _ in range(n)
    ]
    configs = make_configs(specs)
    per = {}
    for cfg in configs:
        if duplicates and per and draw(st.booleans()):
            per[cfg.config_id] = per[draw(st.sampled_from(sorted(per)))]  # an identical twin
        else:
            mem = draw(st.floats(0.5, 30.0)) * GIB
            per[cfg.config_id] = (mem, draw(st.floats(1.0, 100.0)))
    cost = AffineCostModel(
        capacity_bytes=draw(st.floats(30.0, 80.0)) * GIB,
        weights_bytes=draw(st.floats(1.0, 20.0)) * GIB,
        base_act_bytes=0.0,
        step_overhead_s=draw(st.floats(0.0, 0.5)),
        job_start_s=draw(st.sampled_from([0.0, 5.0, 500.0])),  # a per-job cost: in fixed_time
        per_config=per,
    )
    return configs, cost


def brute_force(configs, cost, d, strategy, value):
    """max Σ v / job_time over every subset that fits in memory (Eq. 18-19 verbatim)."""
    s = call_strategy(d, strategy)
    base, cap = cost.base_memory(d, s), cost.capacity(d)
    best = 0.0
    for size in range(1, len(configs) + 1):
        for pack in itertools.combinations(configs, size):
            mem = base + sum(cost.config_memory(k, d, s) for k in pack)
            if mem <= cap * (1 + MEM_RTOL):
                best = max(best, sum(value(k) for k in pack) / cost.job_time(pack, d, s))
    return best


@settings(max_examples=60, deadline=None, derandomize=True)
@given(instances(), st.sampled_from([(1, None), (2, Strategy.TP), (4, Strategy.FSDP)]))
def test_ilp_equals_brute_force(inst, ds):
    configs, cost = inst
    d, strategy = ds
    table = build_classes(configs, cost, 4)
    option = next(o for o in table.options if (o.d, o.strategy) == (d, strategy))
    ref = brute_force(configs, cost, d, strategy, cost.config_work)
    for backend in ("bnb", "highs"):
        pack = solve_pack(table, option, table.counts, KnapsackSolver(backend))
        got = 0.0 if pack is None else pack.ratio
        assert got == pytest.approx(ref, rel=1e-9, abs=1e-12), backend
        if pack is not None:  # the pack is what it claims: memory and time from the cost model
            chosen = [cfg for c, t in enumerate(pack.take) for cfg in table.members[c][:t]]
            s = call_strategy(d, strategy)
            assert pack.time == pytest.approx(cost.job_time(chosen, d, s), rel=1e-12)
            assert pack.memory <= cost.capacity(d) * (1 + MEM_RTOL)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(instances(max_configs=7))
def test_rank_objective_equals_brute_force(inst):
    configs, cost = inst
    table = build_classes(configs, cost, 1, objective=Objective.RANK)
    pack = solve_pack(table, table.options[0], table.counts, KnapsackSolver("auto"))
    ref = brute_force(configs, cost, 1, None, lambda k: k.rank)
    assert (0.0 if pack is None else pack.ratio) == pytest.approx(ref, rel=1e-9, abs=1e-12)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.floats(0.1, 5), st.floats(0.0, 3), st.floats(0.1, 3), st.integers(0, 3)),
        min_size=1,
        max_size=6,
    ),
    st.floats(0.0, 8.0),
    st.one_of(st.just(math.inf), st.floats(0.0, 8.0)),
)
def test_knapsack_backends_agree_with_brute_force(items, cap_a, cap_b):
    p, a, b, n = (list(col) for col in zip(*items, strict=True))
    ref = brute_knapsack(p, a, b, n, cap_a, cap_b)
    x, val, proven = kn.solve_bnb(p, a, b, n, cap_a, cap_b)
    assert proven
    assert val == pytest.approx(ref, rel=1e-9, abs=1e-12)
    assert val == pytest.approx(float(np.dot(x, p)), rel=1e-12)
    assert all(0 <= xi <= ni for xi, ni in zip(x, n, strict=True))
    _, val_h = milp.solve_highs(p, a, b, n, cap_a, cap_b)
    assert val_h == pytest.approx(ref, rel=1e-6, abs=1e-9)
    if math.isinf(cap_b):
        assert kn.lp_bound(np.array(p), np.array(a), np.array(n), cap_a) >= ref - 1e-9


def test_cvxpy_backend_matches_highs():
    rng = np.random.default_rng(0)
    p, a, b = rng.uniform(0.1, 5, 12), rng.uniform(0.1, 3, 12), rng.uniform(0.1, 3, 12)
    n = rng.integers(1, 4, 12)
    for cap_b in (math.inf, 6.0):
        _, val_c = milp.solve_cvxpy(p, a, b, n, 9.0, cap_b)
        _, val_h = milp.solve_highs(p, a, b, n, 9.0, cap_b)
        _, val_b, _ = kn.solve_bnb(p, a, b, n, 9.0, cap_b)
        assert val_c == pytest.approx(val_h, rel=1e-6)
        assert val_b == pytest.approx(val_h, rel=1e-6)


def test_bnb_node_limit_falls_back_to_highs():
    # Subset-sum-like: every item has the same profit/weight ratio, so the LP bound never prunes.
    rng = np.random.default_rng(1)
    w = rng.uniform(1.0, 2.0, 14)
    args = (w, w, w, np.ones(14, dtype=int), 9.123, math.inf)
    _, _, proven = kn.solve_bnb(*args, node_limit=50)
    assert not proven
    solver = KnapsackSolver("auto", node_limit=50)
    _, val = solver(*args)
    assert "highs" in solver.used and any("HiGHS" in note for note in solver.notes)
    assert val == pytest.approx(milp.solve_highs(*args)[1], rel=1e-9)
    assert val <= 9.123 * (1 + 1e-9)
    assert val == pytest.approx(brute_knapsack(w, w, w, [1] * 14, 9.123, math.inf), rel=1e-9)


def test_identical_configs_are_grouped():
    configs = make_configs([(8, 1, 100)] * 50 + [(16, 2, 100)] * 30)
    table = build_classes(configs, AffineCostModel(), 8)
    assert sorted(table.counts) == [30, 50]


def test_duplicate_ids_and_unknown_solver_are_config_errors():
    cfg = make_configs([(8, 1, 10)])[0]
    with pytest.raises(ConfigError, match="appears twice"):
        build_classes([cfg, cfg], AffineCostModel(), 1)
    with pytest.raises(ConfigError, match="unknown solver"):
        KnapsackSolver("cplex")


# ----------------------------------------------------------------- gurobi (monkeypatched)
def fake_gurobipy(*, licensed: bool, max_vars: int = 2000) -> types.ModuleType:
    """A stand-in gurobipy: solves by enumeration; refuses like the real one when unlicensed
    or when the model exceeds the size-limited license."""
    mod = types.ModuleType("gurobipy")

    class GurobiError(Exception):
        pass

    class GRB:
        INTEGER, MAXIMIZE, OPTIMAL = "I", -1, 2

    class Env:
        def __init__(self, params=None):
            if not licensed:
                raise GurobiError("No Gurobi license found (code 10009)")

        def dispose(self):
            pass

    class Expr:
        __array_ufunc__ = None  # let numpy defer `ndarray @ MVar` and `<=` to us

        def __init__(self, coef):
            self.coef = np.asarray(coef)

        def __le__(self, rhs):
            return (self.coef, np.asarray(rhs))

    class MVar:
        __array_ufunc__ = None

        def __init__(self, ub):
            self.ub, self.X = ub, None

        def __rmatmul__(self, coef):
            return Expr(coef)

    class Model:
        def __init__(self, env=None):
            self.Params = types.SimpleNamespace()
            self.cons, self.Status = [], None

        def addMVar(self, m, lb, ub, vtype):
            if m > max_vars:
                raise GurobiError("Model too large for size-limited license (code 10010)")
            self.x = MVar(ub)
            return self.x

        def addConstr(self, expr):
            self.cons.append(expr)

        def setObjective(self, expr, sense):
            self.obj = expr.coef

        def optimize(self):
            best, arg = -1.0, None
            for x in itertools.product(*[range(int(u) + 1) for u in self.x.ub]):
                value = float(self.obj @ np.array(x))
                fits = all(np.all(r @ np.array(x) <= rhs + 1e-12) for r, rhs in self.cons)
                if fits and value > best:
                    best, arg = value, x
            self.x.X, self.Status = np.array(arg, float), GRB.OPTIMAL

        def dispose(self):
            pass

    mod.GurobiError, mod.GRB, mod.Env, mod.Model = GurobiError, GRB, Env, Model
    return mod


def tiny_sweep():
    configs = make_configs([(8, 1, 100), (16, 1, 100), (8, 2, 50), (32, 1, 200), (8, 1, 100)])
    return configs, AffineCostModel(per_config={}, allowed=())


def test_gurobi_used_when_licensed(monkeypatch):
    monkeypatch.setitem(sys.modules, "gurobipy", fake_gurobipy(licensed=True))
    configs, cost = tiny_sweep()
    plan = plan_sweep(configs, cost, 2, solver="gurobi")
    assert plan.solver == "gurobi" and not any("fell back" in n for n in plan.notes)
    assert plan.makespan_s == pytest.approx(plan_sweep(configs, cost, 2, solver="highs").makespan_s)


@pytest.mark.parametrize(
    "module",
    [None, fake_gurobipy(licensed=False), fake_gurobipy(licensed=True, max_vars=1)],
    ids=["not-installed", "no-license", "size-limit"],
)
def test_gurobi_falls_back_to_highs(monkeypatch, module):
    monkeypatch.setitem(sys.modules, "gurobipy", module)
    configs, cost = tiny_sweep()
    plan = plan_sweep(configs, cost, 2, solver="gurobi")
    assert plan.solver == "highs"
    assert any("fell back to HiGHS" in n for n in plan.notes)
    assert plan.makespan_s == pytest.approx(plan_sweep(configs, cost, 2).makespan_s)


@pytest.mark.parametrize("solver", ["highs", "cvxpy"])
def test_milp_backends_plan_like_branch_and_bound(solver):
    configs, _ = tiny_sweep()
    cost = AffineCostModel(allowed=(Strategy.TP,))
    ref = plan_sweep(configs, cost, 4)
    plan = plan_sweep(configs, cost, 4, solver=solver)
    assert plan.solver == solver
    assert plan.makespan_s == pytest.approx(ref.makespan_s, rel=1e-9)


def test_highs_time_limit_is_reported(monkeypatch):
    # A subset-sum instance HiGHS cannot close in ~0 s: the best solution comes back, noted.
    monkeypatch.setattr(milp, "HIGHS_TIME_LIMIT_S", 1e-9)
    rng = np.random.default_rng(2)
    w = rng.uniform(1.0, 2.0, 30)
    solver = KnapsackSolver("highs")
    x, val = solver(w, w, w, np.ones(30, dtype=int), 17.5, math.inf)
    assert any("not proven optimal" in n for n in solver.notes)
    assert val == pytest.approx(float(np.dot(x, w))) and val <= 17.5 * (1 + 1e-9)


class _Unkeyed:
    """A cost model's every method but ``price_key``: build_classes prices each config."""

    def __init__(self, cost) -> None:
        self._cost = cost

    def __getattr__(self, name: str):
        if name == "price_key":
            raise AttributeError(name)
        return getattr(self._cost, name)


def _paper_cost(early_stop: bool):
    import dataclasses
    from pathlib import Path

    from plora.config import SweepConfig
    from plora.cost.build import build_cost_model

    sweep = SweepConfig.from_yaml(Path(__file__).parents[2] / "sweeps" / "paper-table1.yaml")
    if not early_stop:
        sweep = dataclasses.replace(sweep, early_stop=None)
    return build_cost_model(sweep, use_profile=False)


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("objective", [Objective.WORK, Objective.RANK])
def test_priced_once_per_key_equals_priced_per_config(early_stop, objective):
    """The table built from one pricing per ``price_key`` is the one built config by config:
    the key holds everything SweepCostModel's answers depend on (lr, alpha, seed aside)."""
    import random

    from plora.config import PROJECTIONS

    rng = random.Random(7)
    configs = [
        LoRAConfig(config_id=f"k{i}", rank=rng.choice([8, 16, 64]), alpha=rng.choice([8, 32]),
                   lr=rng.choice([1e-4, 3e-4]), batch_size=rng.choice([1, 4, 16]),
                   dropout=rng.choice([0.0, 0.05, 0.1]), seed=rng.choice([0, 1]),
                   target_modules=rng.choice([PROJECTIONS, ("q_proj", "v_proj")]),
                   **rng.choice([{"max_steps": rng.choice([50, 80])}, {"epochs": 1.0}]))
        for i in range(300)
    ]  # fmt: skip
    cost = _paper_cost(early_stop)
    keyed = build_classes(configs, cost, 8, objective=objective)
    each = build_classes(configs, _Unkeyed(cost), 8, objective=objective)
    assert len({cost.price_key(c) for c in configs}) < len(configs) / 2  # keys are shared
    assert keyed.members == each.members
    for a, b in [(keyed.value, each.value), (keyed.work, each.work), (keyed.steps, each.steps)]:
        assert np.array_equal(a, b)
    assert len(keyed.options) == len(each.options)
    for x, y in zip(keyed.options, each.options, strict=True):
        assert (x.d, x.strategy) == (y.d, y.strategy)
        assert np.array_equal(x.mem, y.mem) and np.array_equal(x.time, y.time)
