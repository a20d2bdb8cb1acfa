"""Expected adapter-steps of a config under ASHA early stopping (``early_stop:`` in the sweep).

ASHA (asynchronous successive halving; Ray Tune's ``ASHAScheduler``, which
:mod:`plora.tune.adapter_stopper` drives) records each config's loss at the rungs
``r_k = grace · η^k`` (``η`` the reduction factor). A config arriving at a rung goes on when its
loss is no worse than the ``1 - 1/η`` quantile (numpy's interpolated percentile) of the losses
recorded there before it -- every earlier arrival, stopped or not; the first always goes on.

Survival. Which configs go on depends on the order they reach a rung and on how their losses
rank. plora's configs reach a rung in about the order they are packed (an adapter steps with its
pack; later jobs come after), and configs' losses keep their ranks from rung to rung far more
than they reshuffle. :func:`survival` takes exactly that model -- ``N`` configs (the sweep's
size) with random, persistent ranks arriving in a fixed order -- and counts, over a fixed set
of random orders (deterministic), the fraction ``f_k`` still training after rung ``k``. Early
arrivals pass often (they meet few records), so a small sweep keeps well above ``η^-k``; a
large one approaches it (``N`` unknown: that limit).

A config with a budget of ``T`` steps then trains, in expectation,

    E[steps] = Σ_k (r_{k+1} - r_k) · f_k ,   r_0 = 0, f_0 = 1, the last segment ending at ``T``,

and one still training at step ``p`` has ``Σ_{segments after p} length · f_k / f_{k(p)}`` to go.
The planner charges a config's rows (its share of every packed step) at :func:`expected_steps`
and a pack's per-step overhead at the longest budget (a pack's survivors train to the end); the
coordinator's ETA of a running job uses :func:`expected_steps_left`. The check against Ray's
own ASHA stopping simulated sweeps is ``tests/unit/test_cost_early_stop.py``.
"""

from __future__ import annotations

import bisect
import functools
import math
import random
from typing import Protocol


class EarlyStopLike(Protocol):
    """What the prediction reads of ``plora.config.asha_options.EarlyStopConfig``."""

    @property
    def grace_steps(self) -> int: ...

    @property
    def reduction_factor(self) -> float: ...


ARRIVALS = 1 << 14
"""Config arrivals :func:`survival` simulates (over random orders, with a fixed seed: the same
plan every time); sweeps beyond :data:`MAX_POPULATION` configs are simulated at that size
(the fractions have settled by then) so that planning 10,000 configs stays fast."""
MAX_POPULATION = 1024


@functools.lru_cache(maxsize=64)
def survival(population: int, eta: float, rungs: int) -> tuple[float, ...]:
    """``(f_1, ..., f_rungs)``: the fraction of ``population`` configs still training after
    each rung, under ASHA's rule with persistent ranks and a fixed arrival order."""
    q = 1.0 - 1.0 / eta
    rng = random.Random(0x45A)
    population = min(population, MAX_POPULATION)
    samples = max(16, ARRIVALS // population)
    alive_after = [0] * rungs
    for _ in range(samples):
        alive = [rng.random() for _ in range(population)]  # a reward per config, in order
        for k in range(rungs):
            recorded: list[float] = []
            kept = []
            for reward in alive:
                if not recorded or reward >= _percentile(recorded, q):
                    kept.append(reward)
                bisect.insort(recorded, reward)
            alive = kept
            alive_after[k] += len(kept)
    return tuple(n / (samples * population) for n in alive_after)


def _percentile(ordered: list[float], q: float) -> float:
    """numpy's linearly interpolated percentile ``100 q`` of a sorted list."""
    h = (len(ordered) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])


def segments(
    steps: int, early_stop: EarlyStopLike, *, population: int | None = None
) -> list[tuple[int, int, float]]:
    """``[(start, end, fraction still training)]`` covering ``[0, steps)``: up to the first rung
    below ``steps``, between consecutive rungs, from the last rung to the end; ``population``
    is the sweep's number of configs (None: many)."""
    grace, eta = int(early_stop.grace_steps), float(early_stop.reduction_factor)
    if grace < 1 or eta <= 1:
        raise ValueError(
            f"early stop: grace_steps={grace} must be >= 1 and reduction_factor={eta} > 1"
        )
    if steps < 1:
        return []
    ends = []
    rung = float(grace)
    while rung < steps:
        ends.append(round(rung))
        rung *= eta
    fracs = survival(population, eta, len(ends)) if population else None
    out: list[tuple[int, int, float]] = []
    start, frac = 0, 1.0
    for k, end in enumerate(ends):
        if end > start:
            out.append((start, end, frac))
            start = end
        frac = fracs[k] if fracs is not None else frac / eta
    out.append((start, steps, frac))
    return out


def expected_steps(
    steps: int, early_stop: EarlyStopLike | None, *, population: int | None = None
) -> float:
    """Expected steps one config with a budget of ``steps`` trains (``steps`` without early
    stopping)."""
    if early_stop is None:
        return float(steps)
    parts = segments(steps, early_stop, population=population)
    return sum((end - start) * frac for start, end, frac in parts)


def expected_steps_left(
    steps: int, progress: int, early_stop: EarlyStopLike | None, *, population: int | None = None
) -> float:
    """Expected steps still to come of a config that trained ``progress`` of its ``steps`` and
    is still training (so it passed every rung up to ``progress``)."""
    progress = max(0, min(progress, steps))
    if early_stop is None:
        return float(steps - progress)
    parts = segments(steps, early_stop, population=population)
    now = next((frac for start, end, frac in parts if start <= progress < end), 1.0)
    if now <= 0:
        return 0.0
    return sum(
        (end - max(start, progress)) * frac / now for start, end, frac in parts if end > progress
    )


__all__ = ["EarlyStopLike", "expected_steps", "expected_steps_left", "segments", "survival"]
