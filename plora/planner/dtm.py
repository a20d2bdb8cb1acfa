"""Decomposed Throughput Maximization (Alg. 1): the jobs to start on ``g`` free GPUs.

A *policy* is a set of concurrent jobs ``{(pack_j, d_j, s_j)}`` with ``Σ d_j <= g``. Alg. 1
builds policies recursively: for every power of two ``d <= g`` take the best single job
``F(d, K)`` (:func:`plora.planner.ilp.solve_pack`, maximized over the strategies the cost
model allows for ``d > 1``), then recurse on ``g - d`` GPUs and the configs left.

Which policy: Alg. 1 line 11 returns the policy of minimum ``T(p)``; read literally that
favours policies that leave configs unscheduled (fewer, shorter jobs), so we follow the stated
principle of §6.2 and Eq. 13 instead: the policy of **maximum concurrent throughput**
``Σ_j v(pack_j) / T(pack_j)`` (ties: the first found, which explores better per-GPU
throughput first). That is the quantity the job planner (Alg. 2) is built to keep high.

Search: depth-first (on an explicit stack: a policy's jobs nest as deep as there are jobs),
children in order of per-GPU throughput ``F(d, K) / d``; memoized on
(GPUs left, multiset of configs left — the per-class counts) and pruned with the bound
``value(g, K) <= g · max_{d <= g} F(d, K) / d`` (each job ``j`` of any policy has
``F_j <= F(d_j, K) <= d_j · max_d F(d, K) / d``, and ``Σ d_j <= g``); ``F(d, K) / d`` is
itself bounded by ``max_k v_k / (d c_k(d))`` (a ratio of sums is at most the largest ratio),
so F is solved only for degrees that can matter. Each sub-problem prunes against its own
incumbent, so a memo entry is that sub-problem's optimum (within the node budget). F(d, K)
is memoized too, and a solved ``(K, cap)`` answers the sub-problems it dominates while its
pack is still available (:meth:`DTM.best_pack`): most of Alg. 2's questions at scale. Past
``node_budget`` nodes per call each node follows only its best child (the greedy chain), and
past ``NODE_CAP_FACTOR * node_budget`` nodes (chains included) the nodes still open try no
further child: a call costs ``O(node_budget + g)`` nodes, not ``node_budget`` chains of up to
``g`` jobs each (noted in the plan; 40,000 configs on 1,024 GPUs spent 1.6 million nodes in
234 calls before the cap).

Idle GPUs (our extension): when the configs run out before the GPUs do, every candidate policy
gets a local search that moves single configs out of its packs into new jobs on the idle GPUs
while that raises the throughput; Alg. 1 alone would leave those GPUs idle.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np

from plora.cost import within_capacity
from plora.planner.ilp import ClassTable, DegreeCosts, Pack, make_pack, solve_pack
from plora.planner.solver import KnapsackSolver

_TOL = 1e-12
_UNPRICED = object()  # a pack not yet in DTM._made


@dataclass(frozen=True, slots=True)
class Policy:
    """Concurrent jobs chosen by DTM."""

    packs: tuple[Pack, ...]
    throughput: float
    """``Σ_j v(pack_j) / T(pack_j)``."""
    gpus: int
    """GPUs the policy uses, ``Σ_j d_j``."""


EMPTY = Policy(packs=(), throughput=0.0, gpus=0)


def _moved(take: tuple[int, ...], c: int, delta: int) -> tuple[int, ...]:
    return (*take[:c], take[c] + delta, *take[c + 1 :])


def _dominates(
    have: np.ndarray, cap: float, pack: Pack | None, counts: np.ndarray, time_cap: float
) -> bool:
    """Whether ``pack``, the best pack for ``(have, cap)``, is the best for ``(counts,
    time_cap)`` too: a subproblem (``counts <= have``, ``time_cap <= cap``) that still allows
    it (or in which, as there, no pack fits)."""
    if time_cap > cap or not bool(np.all(counts <= have)):
        return False
    return pack is None or (pack.time <= time_cap and bool(np.all(np.asarray(pack.take) <= counts)))


def ubs_of(ubs: list[tuple[float, int]], d: int) -> float:
    """The per-GPU upper bound recorded for degree d."""
    return next(ub for ub, e in ubs if e == d)


class DTM:
    """Alg. 1 over one class table, with memos shared between calls.

    Args:
        table: config classes and their costs.
        solver: the knapsack backend for F(d, K).
        node_budget: search nodes per :meth:`solve` call before falling back to greedy chains.
    """

    NODE_CAP_FACTOR = 10
    """Past ``NODE_CAP_FACTOR * node_budget`` nodes in one call (greedy chains included)
    the nodes still open try no further child, so a call costs ``O(node_budget + g)`` nodes."""

    MADE_CACHE = 65_536
    """Packs :meth:`_spread` keeps priced (cleared when it holds more; 0: none, every pack
    priced afresh, the reference the tests compare with)."""

    CACHE_DEPTH = 8
    """Solved F(d, K) kept per d for :meth:`best_pack`'s dominance test."""

    def __init__(self, table: ClassTable, solver: KnapsackSolver, *, node_budget: int = 100):
        self.table = table
        self.solver = solver
        self.node_budget = node_budget
        self.budget_hit = False
        self._packs: dict[tuple[object, ...], Pack | None] = {}
        self._solved: dict[int, list[tuple[np.ndarray, float, Pack | None]]] = {}
        self._policies: dict[tuple[object, ...], Policy] = {}
        self._made: dict[tuple[int, tuple[int, ...]], Pack | None] = {}
        self._nodes = 0
        opts = table.options  # every option's (C,) costs stacked, for upper_ratios
        self._fits = np.array([o.fits for o in opts], dtype=bool).reshape(len(opts), -1)
        self._time = np.array([o.time for o in opts], dtype=float).reshape(len(opts), -1)
        with np.errstate(divide="ignore"):
            self._ratio = table.value / self._time
        self._degrees = sorted({o.d for o in opts})
        # (D, O): option o is of degree d (divided by d: the bound is per GPU)
        self._per_gpu = np.array(
            [[1.0 / d if o.d == d else 0.0 for o in opts] for d in self._degrees]
        ).reshape(len(self._degrees), len(opts))

    def best_pack(self, d: int, counts: tuple[int, ...], time_cap: float) -> Pack | None:
        """F(d, K) maximized over the strategies allowed for d (memoized).

        A solved ``(K, cap)`` answers every ``(K', cap')`` it dominates (``K' <= K``,
        ``cap' <= cap``) whose optimum it still allows (its pack ``<= K'`` and
        ``T <= cap'``): the feasible packs of ``(K', cap')`` are a subset of those of
        ``(K, cap)``, so that pack is optimal there too (and no pack fits where none did).
        Under a deadline the knapsack is a bounded heuristic (:class:`KnapsackSolver`), and a
        reused answer is its best pack for the larger problem. Alg. 2 asks such questions over and over -- a greedy chain removes one pack's configs
        at a time, time runs forward under a deadline, and every deadline of the search
        shares this DTM -- which :attr:`CACHE_DEPTH` recent answers per d catch.
        """
        key = (d, counts, time_cap)
        if key in self._packs:
            return self._packs[key]
        cnt = np.asarray(counts)
        recent = self._solved.setdefault(d, [])
        for have, cap, known in recent[::-1]:  # the most recent first
            if _dominates(have, cap, known, cnt, time_cap):
                self._packs[key] = known
                return known
        best = None
        for option in self.table.options:
            if option.d != d:
                continue
            pack = solve_pack(self.table, option, counts, self.solver, time_cap=time_cap)
            if pack is not None and (best is None or pack.ratio > best.ratio * (1 + _TOL)):
                best = pack
        self._packs[key] = best
        recent.append((cnt, time_cap, best))
        del recent[: -self.CACHE_DEPTH]
        return best

    def upper_ratios(self, g: int, counts: tuple[int, ...], cap: float) -> list[tuple[float, int]]:
        """``(ub_d, d)`` for every d <= g with a config to place: ``ub_d = max_k v_k / c_k(d, s)``
        over available classes and strategies, over d (``F(d, K) / d <= ub_d``); one numpy
        pass over every option at once."""
        avail = (np.asarray(counts) > 0) & self._fits & (self._time <= cap)
        per_option = np.where(avail, self._ratio, 0.0).max(axis=1, initial=0.0)
        ubs = (self._per_gpu * per_option).max(axis=1, initial=0.0).tolist()
        return [(ub, d) for ub, d in zip(ubs, self._degrees, strict=True) if d <= g and ub > 0]

    def solve(self, g: int, counts: tuple[int, ...], *, time_cap: float = math.inf) -> Policy:
        """The max-throughput policy on ``g`` GPUs for the configs left (``counts`` per class).

        Args:
            g: free GPUs.
            counts: configs left per class, shape (C,).
            time_cap: every job must satisfy ``T <= time_cap`` (``inf``: no deadline).
        """
        self._nodes = 0
        return self._solve(g, tuple(counts), time_cap)

    def _spread(self, policy: Policy, g: int, cap: float) -> Policy:
        """Local search on GPUs the policy leaves idle (our extension of Alg. 1).

        When the configs run out before the GPUs do, Alg. 1 packs them into few jobs and
        leaves GPUs idle. Moving one config out of a pack into a new job on idle GPUs (or into
        a job created by an earlier move) is kept while it raises ``Σ_j v_j / T_j``.
        """
        if policy.gpus >= g:
            return policy  # no idle GPU: nothing to spread to
        packs = list(policy.packs)
        fresh: set[int] = set()
        made = self._made
        if len(made) > self.MADE_CACHE:
            made.clear()

        def pack_of(option: DegreeCosts, take: tuple[int, ...]) -> Pack | None:
            # make_pack, memoized: the same shrunk and grown packs recur at every iteration
            # and at every level of a greedy chain (each level spreads its whole policy)
            if self.MADE_CACHE <= 0:
                return make_pack(self.table, option, take)
            key = (id(option), take)  # the table's options live as long as this DTM
            pack = made.get(key, _UNPRICED)
            if pack is _UNPRICED:
                pack = made[key] = make_pack(self.table, option, take)
            return pack  # type: ignore[return-value]

        table = self.table
        zero = (0,) * len(table.members)
        for _ in range(4 * sum(sum(p.take) for p in packs)):
            idle = g - sum(p.option.d for p in packs)
            if idle < 1 and not fresh:
                break
            best: tuple[float, int, int | None, Pack, Pack] | None = None
            for i, p in enumerate(packs):
                if sum(p.take) <= 1:
                    continue
                for c, t in enumerate(p.take):
                    if not t:
                        continue
                    shrunk = pack_of(p.option, _moved(p.take, c, -1))
                    assert shrunk is not None  # p had two or more configs
                    base = shrunk.ratio - p.ratio
                    targets: list[tuple[int | None, Pack | None]] = [
                        (j, pack_of(packs[j].option, _moved(packs[j].take, c, +1)))
                        for j in fresh
                        if j != i
                    ]
                    targets += [
                        (None, pack_of(o, _moved(zero, c, +1)))
                        for o in table.options
                        if o.d <= idle and o.fits[c]
                    ]
                    for j, new in targets:
                        if new is None or new.time > cap:
                            continue
                        if not within_capacity(new.memory, new.option.capacity):
                            continue
                        gain = base + new.ratio - (packs[j].ratio if j is not None else 0.0)
                        if gain > _TOL * policy.throughput and (best is None or gain > best[0]):
                            best = (gain, i, j, shrunk, new)
            if best is None:
                break
            _, i, j, shrunk, new = best
            packs[i] = shrunk
            if j is None:
                fresh.add(len(packs))
                packs.append(new)
            else:
                packs[j] = new
        if len(packs) == len(policy.packs) and not fresh:
            return policy
        return Policy(
            packs=tuple(packs),
            throughput=sum(p.ratio for p in packs),
            gpus=sum(p.option.d for p in packs),
        )

    def _solve(self, g: int, counts: tuple[int, ...], cap: float) -> Policy:
        """:meth:`_search` from ``(g, counts, cap)``, its sub-problems on an explicit stack.

        A policy of ``n`` jobs is a chain of ``n`` nested sub-problems: on 1,024 GPUs with
        one-GPU jobs that is more than Python's recursion limit (5,000 configs on 1,024 GPUs
        raised ``RecursionError``). Each sub-problem is a generator that yields the sub-problem it needs
        and receives its policy; this loop runs them in the order the recursion did.
        """
        stack = [self._search(g, counts, cap)]
        reply: Policy | None = None  # None: start the generator on top
        while True:
            top = stack[-1]
            try:
                sub = next(top) if reply is None else top.send(reply)
            except StopIteration as done:
                stack.pop()
                policy: Policy = done.value
                if not stack:
                    return policy
                reply = policy
            else:
                stack.append(self._search(*sub))
                reply = None

    def _search(
        self, g: int, counts: tuple[int, ...], cap: float
    ) -> Generator[tuple[int, tuple[int, ...], float], Policy, Policy]:
        """The best policy on ``g`` GPUs for ``counts`` (see the module): yields each
        sub-problem ``(g', counts', cap)`` it needs and is sent that sub-problem's policy."""
        if g <= 0 or not any(counts):
            return EMPTY
        key = (g, counts, cap)
        if key in self._policies:
            return self._policies[key]
        self._nodes += 1
        greedy_only = self._nodes > self.node_budget
        if greedy_only:
            self.budget_hit = True
        # Upper bounds F(d, K) <= d · ub_d (a ratio of sums is at most the largest ratio), so
        # F is solved only for degrees that may hold the best per-GPU throughput or survive
        # the pruning bound below.
        ubs = sorted(self.upper_ratios(g, counts, cap), reverse=True)
        solved: dict[int, Pack | None] = {}
        rho = 0.0  # best per-GPU throughput of a solved degree
        for ub, d in ubs:
            if ub <= rho:
                break
            solved[d] = pack = self.best_pack(d, counts, cap)
            if pack is not None:
                rho = max(rho, pack.ratio / d)
        if rho <= 0:
            self._policies[key] = EMPTY
            return EMPTY
        order = sorted(
            ((p.ratio / d, d) for d, p in solved.items() if p is not None), reverse=True
        ) + [(ub, d) for ub, d in ubs if d not in solved]
        best = EMPTY
        for _, d in order:
            if (
                best.packs
                and d not in solved
                and d * ubs_of(ubs, d) + (g - d) * rho <= (best.throughput * (1 + _TOL))
            ):
                continue
            if d not in solved:
                solved[d] = self.best_pack(d, counts, cap)
            pack = solved[d]
            if pack is None:
                continue
            if best.packs and pack.ratio + (g - d) * rho <= best.throughput * (1 + _TOL):
                continue
            rest = tuple(c - t for c, t in zip(counts, pack.take, strict=True))
            sub = yield (g - d, rest, cap)
            cand = Policy(
                packs=(pack, *sub.packs),
                throughput=pack.ratio + sub.throughput,
                gpus=d + sub.gpus,
            )
            cand = self._spread(cand, g, cap)
            if cand.throughput > best.throughput * (1 + _TOL):
                best = cand
            if greedy_only or self._nodes > self.NODE_CAP_FACTOR * self.node_budget:
                break  # past the cap the nodes still open try no further child
        if not greedy_only:
            self._policies[key] = best
        return best


__all__ = ["DTM", "EMPTY", "Policy"]
