"""F(D, K): the single-job throughput ILP (Eq. 18-19), solved exactly.

For a job on ``d`` GPUs with strategy ``s`` and a pack ``H ⊆ K``::

    F(d, K) = max_H  Σ_k v_k H_k / T(H, d, s)
              s.t.   M_base(d, s) + Σ_k H_k M_k(d, s) <= capacity(d)       (Eq. 19, per GPU)
                     T(H, d, s) <= time_cap                                  (optional deadline)
                     Σ_k H_k <= max_pack                 (optional: ``planner.max_pack_size``)

``T(H) = fixed_time(max_{k∈H} steps_k) + Σ_k H_k c_k`` is affine in H once the longest
config is fixed (``fixed_time`` holds every per-job cost -- the job's start on a warm worker
group, its per-step overhead, its checkpoint writes -- and ``c_k`` every per-config one -- the
config's tokens, evaluation and export; a per-job cost is what makes bigger packs pay), so we enumerate the distinct step counts θ as that threshold (only configs
with ``steps <= θ``, overhead ``fixed_time(θ)``; with ``fixed_time`` non-decreasing in steps,
the max over θ is exactly F) and for each θ solve the 0-1 *linear-fractional* knapsack by
Dinkelbach's method: for the current ratio λ solve the linear knapsack
``max Σ (v_k - λ c_k) H_k - λ fixed(θ)`` (:mod:`plora.planner.knapsack`); if its optimum is
positive the maximizer has a ratio above λ and becomes the next λ, otherwise λ is optimal.
λ starts from the best ratio found so far (over thresholds), so a threshold that cannot beat
it costs one knapsack.

Configs with identical costs (same value, steps, memory and time at every ``(d, s)``) are
grouped into *classes*: the knapsack is bounded over classes, which keeps 1,000-config sweeps
small (a grid has few distinct cost signatures).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from plora.config import ConfigError, LoRAConfig
from plora.cost import CostModel, Strategy, memory_limit
from plora.cost.microbatch import rows_per_micro_batch
from plora.planner import knapsack
from plora.planner.groups import startup_times
from plora.planner.micro import MicroCosts, micro_fit, micro_options, supports_micro_batches
from plora.planner.offload import last_resort
from plora.planner.solver import KnapsackSolver
from plora.planner.types import Objective, call_strategy


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class DegreeCosts:
    """Costs of every config class on one ``(d, strategy)``."""

    d: int
    strategy: Strategy | None
    base: float
    """``M_base(d, s)`` bytes per GPU."""
    capacity: float
    """``capacity(d)`` bytes per GPU."""
    mem: np.ndarray
    """``M_k(d, s)`` per class, shape (C,)."""
    time: np.ndarray
    """``config_time(k, d, s)`` per class, shape (C,)."""
    fits: np.ndarray
    """Whether a class fits alone: ``base + mem <= capacity``, shape (C,) bool."""
    fixed: dict[int, float]
    """``fixed_time(steps, d, s)`` per distinct step count of the configs."""
    micro: MicroCosts | None = None
    """Set on a micro-batched option (m > 1 forwards per step): ``base``, ``mem`` and
    ``fixed`` above are then the linear, conservative form the knapsack needs (see
    :class:`MicroCosts`); :func:`make_pack` prices the chosen pack exactly."""

    @property
    def micro_batches(self) -> int:
        """Forwards per step this option allows (1: every row live at once)."""
        return 1 if self.micro is None else self.micro.micro_batches

    @property
    def mem_budget(self) -> float:
        """Bytes per GPU left for adapters (:func:`plora.cost.memory_limit`)."""
        return memory_limit(self.capacity) - self.base


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ClassTable:
    """Configs grouped into cost classes plus their costs on every allowed ``(d, s)``."""

    members: tuple[tuple[LoRAConfig, ...], ...]
    """Configs of each class, in input order."""
    value: np.ndarray
    """``v_k`` per class (:class:`Objective`), shape (C,)."""
    work: np.ndarray
    """``cost.config_work(k)`` per class (for the lower bound), shape (C,)."""
    steps: np.ndarray
    """Optimizer steps per class, shape (C,)."""
    options: tuple[DegreeCosts, ...]
    """Every allowed ``(d, s)``: d = 1 (no strategy), and d = 2, 4, ... <= G per strategy."""
    startup: dict[int, float] = field(default_factory=dict)
    """``cost.startup_time(d)`` per allowed d: a cold worker group's start (0 if unknown)."""
    max_pack: int | None = None
    """Most configs one pack may hold (``planner.max_pack_size``); None: as many as fit. Every
    pack is priced by :func:`make_pack`, which refuses a larger one, and :func:`solve_pack`'s
    knapsacks carry it as a third row."""

    @property
    def counts(self) -> tuple[int, ...]:
        """How many configs each class holds."""
        return tuple(len(m) for m in self.members)


def degrees(num_gpus: int, strategies: Sequence[Strategy]) -> list[tuple[int, Strategy | None]]:
    """Allowed ``(d, strategy)``: ``(1, None)`` then every power of two ``2..G`` per strategy."""
    out: list[tuple[int, Strategy | None]] = [(1, None)]
    d = 2
    while d <= num_gpus:
        out.extend((d, s) for s in dict.fromkeys(strategies))
        d *= 2
    return out


_Row = tuple[float, int, list[float], list[float], float]
"""A config's ``(value, steps, memory per option, time per option, work)``."""


def _price(
    cfg: LoRAConfig,
    cost: CostModel,
    opts: Sequence[tuple[int, Strategy | None]],
    objective: Objective,
    *,
    micro: bool,
) -> tuple[tuple[float, ...], _Row]:
    """One config's class key (every number the planner reads of it) and its row."""
    work = float(cost.config_work(cfg))
    value = work if objective is Objective.WORK else float(cfg.rank)
    steps = int(cost.steps(cfg))
    mems = [float(cost.config_memory(cfg, d, call_strategy(d, s))) for d, s in opts]
    times = [float(cost.config_time(cfg, d, call_strategy(d, s))) for d, s in opts]
    if not value > 0 or steps < 1:
        raise ValueError(f"cost model: config {cfg.config_id} has value {value}, steps {steps}")
    key: tuple[float, ...] = (value, work, steps, *mems, *times)
    if micro:  # micro-batched options price states and rows apart
        parts = cost.config_memory_parts(cfg, 1, call_strategy(1, None))  # type: ignore[attr-defined]
        key += (*parts, cfg.batch_size)
    return key, (value, steps, mems, times, work)


def build_classes(
    configs: Sequence[LoRAConfig],
    cost: CostModel,
    num_gpus: int,
    *,
    objective: Objective = Objective.WORK,
    max_pack: int | None = None,
) -> ClassTable:
    """Query the cost model once per config and ``(d, s)`` and group identical configs
    (``max_pack``: :attr:`ClassTable.max_pack`). A cost model with ``price_key(config)``
    (configs of equal keys are priced alike by every method; None: this one on its own) is
    queried once per key: 100,000 configs of a few dozen shapes cost a dict lookup each."""
    if max_pack is not None and max_pack < 1:
        raise ConfigError(f"planner.max_pack_size={max_pack!r}: must be >= 1, or null for no cap")
    ids = [c.config_id for c in configs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError(f"configs: config_id {dup!r} appears twice; config ids must be unique")
    opts = degrees(num_gpus, list(cost.strategies()))
    micro = supports_micro_batches(cost)
    price_key = getattr(cost, "price_key", None)  # configs priced alike share one pricing
    priced: dict[Hashable, tuple[tuple[float, ...], _Row]] = {}
    sig: dict[tuple[float, ...], list[LoRAConfig]] = {}
    rows: dict[tuple[float, ...], _Row] = {}
    for cfg in configs:
        pk = price_key(cfg) if price_key is not None else None
        found = priced.get(pk) if pk is not None else None
        key, row = found if found is not None else _price(cfg, cost, opts, objective, micro=micro)
        if pk is not None:
            priced[pk] = (key, row)
        sig.setdefault(key, []).append(cfg)
        rows[key] = row
    keys = list(sig)
    distinct_steps = sorted({rows[k][1] for k in keys})
    mem = np.array([rows[k][2] for k in keys], dtype=float).reshape(len(keys), len(opts))
    tim = np.array([rows[k][3] for k in keys], dtype=float).reshape(len(keys), len(opts))
    options = []
    members = tuple(tuple(sig[k]) for k in keys)
    for j, (d, s) in enumerate(opts):
        base = float(cost.base_memory(d, call_strategy(d, s)))
        capacity = float(cost.capacity(d))
        option = DegreeCosts(
            d=d,
            strategy=s,
            base=base,
            capacity=capacity,
            mem=mem[:, j].copy(),
            time=tim[:, j].copy(),
            fits=base + mem[:, j] <= memory_limit(capacity),
            fixed={t: float(cost.fixed_time(t, d, call_strategy(d, s))) for t in distinct_steps},
        )
        options.append(option)
        options.extend(micro_options(cost, option, members, distinct_steps))
    return ClassTable(
        members=members,
        value=np.array([rows[k][0] for k in keys], dtype=float),
        work=np.array([rows[k][4] for k in keys], dtype=float),
        steps=np.array([rows[k][1] for k in keys], dtype=np.int64),
        options=tuple(last_resort(options)),  # cpu_offload: auto offloads only what must be
        startup=startup_times(cost, [d for d, _ in opts]),
        max_pack=max_pack,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Pack:
    """A solution of F(d, K): how many configs of each class go into one job."""

    option: DegreeCosts
    take: tuple[int, ...]
    """Configs taken per class, shape (C,)."""
    value: float
    """``Σ v_k H_k``."""
    time: float
    """``T(H, d, s)`` seconds."""
    memory: float
    """``M_base + Σ M_k`` bytes per GPU (micro-batched: states + the live rows' activations)."""
    micro_batches: int = 1
    """Forwards per optimizer step: the smallest m the pack fits with (1: every row live)."""
    max_rows: int | None = None
    """``⌈rows/m⌉``, the trainer's rows per forward when ``micro_batches > 1``; else None."""

    @property
    def ratio(self) -> float:
        """Throughput ``value / time``."""
        return self.value / self.time


def make_pack(
    table: ClassTable, option: DegreeCosts, take: Sequence[int] | np.ndarray
) -> Pack | None:
    """The :class:`Pack` taking ``take[c]`` configs of class c on ``option``; None if empty or
    larger than ``table.max_pack``."""
    x = np.asarray(take, dtype=np.int64)
    if not x.any() or (table.max_pack is not None and int(x.sum()) > table.max_pack):
        return None
    longest = int(table.steps[x > 0].max())
    micro = option.micro
    if micro is None:
        return Pack(
            option=option,
            take=tuple(x.tolist()),
            value=float(table.value @ x),
            time=option.fixed[longest] + float(option.time @ x),
            memory=option.base + float(option.mem @ x),
        )
    m, memory = micro_fit(micro, x, memory_limit(option.capacity))
    rows = int(micro.rows @ x)
    return Pack(
        option=option,
        take=tuple(x.tolist()),
        value=float(table.value @ x),
        time=micro.fixed[m][longest] + float(option.time @ x),
        memory=memory,
        micro_batches=m,
        max_rows=rows_per_micro_batch(rows, m) if m > 1 else None,
    )


def alone_times(table: ClassTable, option: DegreeCosts) -> np.ndarray:
    """``T({k}, d, s)`` per class: one config of the class alone on ``option``, priced as
    :func:`make_pack` prices every pack (a micro-batched option with its smallest fitting m);
    ``inf`` where it does not fit, shape (C,)."""
    if option.micro is None:
        alone = np.array([option.fixed[int(s)] for s in table.steps]) + option.time
    else:
        alone = np.full(len(table.members), np.inf)
        for c in np.flatnonzero(option.fits):
            single = make_pack(table, option, np.eye(len(table.members), dtype=np.int64)[c])
            assert single is not None  # one config: never empty
            alone[c] = single.time
    return np.where(option.fits, alone, np.inf)


#: Up to this many distinct step counts among a knapsack's configs, every one is a threshold θ
#: (F(d, K) exact); past it the thresholds are bucketed (:func:`step_thresholds`).
STEP_THRESHOLDS = 16

#: Width of a threshold bucket: the step counts in ``(θ / STEP_BUCKET, θ]`` share threshold θ.
STEP_BUCKET = 1.1


def step_thresholds(steps: Sequence[int] | np.ndarray) -> list[int]:
    """The thresholds θ :func:`solve_pack` enumerates, longest first.

    Every distinct step count when there are at most :data:`STEP_THRESHOLDS` of them (a grid,
    epochs over one dataset): F(d, K) is then exact. A sweep whose configs each have their own
    step count has as many thresholds as configs, each costing Dinkelbach knapsacks (200
    configs on 6 GPUs ran 111,580 knapsacks); there the counts are bucketed geometrically
    (:data:`STEP_BUCKET`) and each bucket's longest count is its threshold. A pack whose longest
    config is shorter than its bucket's threshold is then priced in the knapsack with the
    bucket's per-job time ``fixed_time(θ) >= fixed_time(longest)``: conservative, at most
    the per-job time of 10 % more steps; :func:`make_pack` prices the pack chosen exactly.
    The thresholds number at most ``log(max / min) / log(STEP_BUCKET) + 1`` (24 for steps in
    20..180).
    """
    distinct = sorted({int(s) for s in steps}, reverse=True)
    if len(distinct) <= STEP_THRESHOLDS:
        return distinct
    tops: list[int] = []
    for s in distinct:
        if not tops or s * STEP_BUCKET < tops[-1]:
            tops.append(s)
    return tops


def solve_pack(
    table: ClassTable,
    option: DegreeCosts,
    counts: Sequence[int],
    solver: KnapsackSolver,
    *,
    time_cap: float = math.inf,
) -> Pack | None:
    """F(d, K) on the configs left (``counts`` per class); ``None`` if no config fits.

    Args:
        table: the class table.
        option: the ``(d, s)`` of the job.
        counts: configs available per class, shape (C,).
        solver: the knapsack backend.
        time_cap: only packs with ``T(H) <= time_cap`` (a deadline); ``inf`` for none.

    Packs hold at most ``table.max_pack`` configs when it is set (a third knapsack row).
    """
    cnt = np.asarray(counts, dtype=np.int64)
    avail = (cnt > 0) & option.fits & (option.time <= time_cap)
    if not avail.any():
        return None
    v, c, a, steps = table.value, option.time, option.mem, table.steps
    budget = option.mem_budget

    fixed = option.fixed.__getitem__

    best_x: np.ndarray | None = None
    lam = 0.0
    # A single config is a feasible pack: start λ at the best of them.
    for k in np.flatnonzero(avail):
        t = fixed(int(steps[k])) + c[k]
        if t <= time_cap and v[k] / t > lam:
            lam = v[k] / t
            best_x = np.zeros_like(cnt)
            best_x[k] = 1
    if best_x is None:
        return None
    for theta in step_thresholds(steps[avail]):
        f0 = fixed(theta)
        idx_all = np.flatnonzero(avail & (steps <= theta))
        for _ in range(64):
            prof = v[idx_all] - lam * c[idx_all]
            pos = prof > 0
            if not pos.any():
                break
            idx = idx_all[pos]
            ub = knapsack.lp_bound(prof[pos], a[idx], cnt[idx], budget)
            ub = min(ub, knapsack.lp_bound(prof[pos], c[idx], cnt[idx], time_cap - f0))
            if table.max_pack is not None:  # K copies at most, none above the best profit
                ub = min(ub, table.max_pack * float(prof[pos].max()))
            if ub - lam * f0 <= knapsack.REL_TOL * max(ub, lam * f0, 1e-300):
                break  # not even the LP relaxation beats λ
            x, val = solver(
                prof[pos].tolist(),
                a[idx].tolist(),
                c[idx].tolist(),
                cnt[idx].tolist(),
                budget,
                time_cap - f0,
                size_cap=table.max_pack,
                exact=not math.isfinite(time_cap),
            )
            if val - lam * f0 <= knapsack.REL_TOL * max(val, lam * f0, 1e-300):
                break
            xs = np.zeros_like(cnt)
            xs[idx] = x
            new = float(v @ xs) / (f0 + float(c @ xs))
            if new <= lam * (1 + knapsack.REL_TOL):
                break
            lam, best_x = new, xs
    return make_pack(table, option, best_x)
