"""The least-squares core of the step-time fits (:func:`fit_pairs`): :mod:`plora.cost.fit`
refits a sweep's coefficients with it, :mod:`plora.cost.priors` fits the step table's."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from plora.config import ConfigError
from plora.cost.throughput import Coefficients, StepSample, StepTimeModel


def fit_pairs(
    pairs: Sequence[tuple[StepSample, StepTimeModel]],
    prior: Coefficients,
    *,
    fallback: Coefficients,
    prior_weight: float = 1e-3,
    free: Sequence[int] | None = None,
    source: str | None = None,
) -> Coefficients:
    """:func:`plora.cost.fit.fit` over steps of several models at once: each sample is booked by its own
    timer (its model's shapes), and one set of coefficients, pulled towards ``prior``, fits them
    all (the per-GPU-type priors of :mod:`plora.cost.priors` fit two base shapes so).
    ``free``: the indices into ``θ`` that move (default all); the others keep ``prior``'s.
    ``fallback``: whose ``θ`` scales the unknowns where ``prior``'s is 0.

    Raises:
        ConfigError: no samples.
    """
    from scipy.optimize import lsq_linear  # lazily: planning without a profile never needs it

    if not pairs:
        raise ConfigError("cost-model fit: no step samples to fit")
    theta0 = prior._theta()
    moving = np.array(sorted(set(range(len(theta0)) if free is None else free)), dtype=int)
    kept = np.array([j for j in range(len(theta0)) if j not in set(moving)], dtype=int)
    scale = np.where(theta0 > 0, theta0, fallback._theta())[moving]
    rows, rhs = [], []
    for s, timer in pairs:
        known, feats = timer.sample_terms(s)
        known += float(feats[kept] @ theta0[kept])
        rows.append(feats[moving] * scale / s.step_time_s)  # solve for u = theta / scale
        rhs.append((s.step_time_s - known) / s.step_time_s)
    lam = math.sqrt(prior_weight)
    a = np.vstack([np.array(rows), lam * np.eye(len(moving))])
    b = np.concatenate([np.array(rhs), lam * theta0[moving] / scale])
    inverse = np.array([0.0, 1.0, 1.0, 0.0, 0.0, 1.0])[moving]  # 1/e >= 1; overheads >= 0
    u = lsq_linear(a, b, bounds=(inverse / scale, np.inf), method="bvls").x
    theta = theta0.copy()
    theta[moving] = u * scale
    label = source or f"fit of {len(pairs)} measured steps"
    return Coefficients._from_theta(theta, source=label)


__all__ = ["fit_pairs"]
