"""How much each stored measurement counts: the newest sweep first, older ones behind it.

The profile store (:mod:`plora.cost.profile`) numbers the sweeps it records (1, 2, ...; 0 for
samples of files written before sweeps were numbered: the oldest). A machine's speed changes --
a test suite ran beside the last sweeps, a driver or library was upgraded, the box got less
loaded -- so the plan should follow what this machine did lately, not its whole history:

* a sweep ``k`` sweeps older than the newest one weighs :data:`SWEEP_DECAY` ``** k``, shared
  equally by its samples (per overhead kind; all its steps for the step-time fit), so a sweep
  that recorded many samples counts no more than one that recorded few;
* with ``SWEEP_DECAY < 1/2`` the newest sweep always holds more than half the weight of any
  overhead kind it measured (``1 - d`` at least, under any history), so the weighted median
  (:func:`weighted_median`) is the newest sweep's own median, and the step-time fit, a Huber
  fit (:func:`huber_lstsq`), follows the newest sweep to within a few per cent (its majority
  decides; disagreeing older samples pull only linearly);
* older sweeps still count where the newest did not measure: overhead kinds it has no sample
  of, and step-time coefficients its steps do not identify (other ``d``, strategies, shapes);
  then the defaults.

One odd sweep therefore moves the next plan, and the sweep after it moves it back; it does not
evict the history either: the store keeps a bounded number of samples per sweep
(:mod:`plora.cost.profile`), so a long sweep cannot push the older ones out.

Pure numerics: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np

from plora.config import ConfigError

#: Weight of a sweep relative to the next newer one (< 1/2: the newest sweep is a majority).
SWEEP_DECAY = 0.4
#: Huber threshold of the step-time fit from a profile: relative step-time error beyond which
#: a sample pulls linearly (5 %: one sweep's steps agree far better than a loaded box's).
STEP_HUBER = 0.05
#: Reweighting rounds of :func:`huber_lstsq` at most (it stops once the fit settles).
HUBER_ITERATIONS = 100


def sweep_weights(
    sweeps: Sequence[int],
    groups: Sequence[Hashable] | None = None,
    *,
    decay: float = SWEEP_DECAY,
) -> list[float]:
    """Per-sample weights: sweep ``s`` weighs ``decay ** age(s)`` (age: how many distinct sweeps
    in ``sweeps`` are newer), shared equally by its samples within each group.

    Args:
        sweeps: each sample's sweep number (larger: newer).
        groups: each sample's group (e.g. its overhead kind); default one group. Within a
            group the weights of one sweep sum to ``decay ** age``.
        decay: weight ratio of consecutive sweeps, in (0, 1].

    Raises:
        ConfigError: a decay outside (0, 1], or groups that do not match the samples.
    """
    if not 0 < decay <= 1:
        raise ConfigError(f"sweep weights: decay={decay!r} must be in (0, 1]")
    keys = [None] * len(sweeps) if groups is None else list(groups)
    if len(keys) != len(sweeps):
        raise ConfigError(f"sweep weights: {len(keys)} groups for {len(sweeps)} samples")
    newest_first = sorted(set(sweeps), reverse=True)
    age = {s: i for i, s in enumerate(newest_first)}
    count: dict[tuple[Hashable, int], int] = {}
    for key, s in zip(keys, sweeps, strict=True):
        count[key, s] = count.get((key, s), 0) + 1
    return [decay ** age[s] / count[key, s] for key, s in zip(keys, sweeps, strict=True)]


def weighted_median(values: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """The median of ``values`` with ``weights`` (default equal: ``statistics.median``): the
    mean of the lower and upper weighted medians (the values where the cumulative weight first
    reaches, and first passes, half the total)."""
    if not values:
        raise ConfigError("weighted median of no values")
    v = np.asarray(values, dtype=float)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=float)
    if w.shape != v.shape or (w < 0).any() or not w.sum() > 0:
        raise ConfigError("weighted median: need one weight >= 0 per value, not all 0")
    order = np.argsort(v, kind="stable")
    v, cum = v[order], np.cumsum(w[order])
    half, tol = cum[-1] / 2.0, 1e-12 * cum[-1]
    lower = v[int(np.searchsorted(cum, half - tol, side="left"))]
    upper = v[min(int(np.searchsorted(cum, half + tol, side="right")), len(v) - 1)]
    return float((lower + upper) / 2.0)


def huber_lstsq(
    solve: Callable[[np.ndarray], np.ndarray],
    residuals: Callable[[np.ndarray], np.ndarray],
    weights: np.ndarray,
    threshold: float,
) -> np.ndarray:
    """Minimize ``Σ_i w_i·huber(r_i)`` by iteratively reweighted least squares.

    Args:
        solve: the weighted least-squares solution for given per-sample weights.
        residuals: each sample's residual ``r_i`` under a solution.
        weights: the samples' own weights ``w_i``.
        threshold: Huber's ``c``: ``r²`` for ``|r| <= c``, ``2c|r| - c²`` beyond.

    Returns:
        The solution (the plain weighted least-squares one when every residual is within ``c``).
    """
    if not threshold > 0:
        raise ConfigError(f"huber fit: threshold={threshold!r} must be > 0")
    u = solve(weights)
    for _ in range(HUBER_ITERATIONS):
        r = np.abs(residuals(u))
        new = solve(weights * np.minimum(1.0, threshold / np.maximum(r, 1e-12)))
        settled = np.max(np.abs(new - u)) <= 1e-10 * max(1.0, float(np.max(np.abs(u))))
        u = new
        if settled:
            break
    return u


__all__ = [
    "HUBER_ITERATIONS",
    "STEP_HUBER",
    "SWEEP_DECAY",
    "huber_lstsq",
    "sweep_weights",
    "weighted_median",
]
