"""Refit the step-time coefficients from measured steps (:func:`fit`) and score a model
against them (:func:`relative_errors`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from plora.config import ConfigError
from plora.cost.priors import DEFAULT_COEFFICIENTS
from plora.cost.throughput import Coefficients, StepSample, StepTimeModel


def fit(
    samples: Sequence[StepSample],
    model: StepTimeModel,
    *,
    prior_weight: float = 1e-3,
) -> Coefficients:
    """Least-squares refit of the coefficients of ``model`` from measured steps.

    Minimizes ``Σ_i ((t̂_i - t_i)/t_i)² + λ·Σ_j ((θ_j - θ0_j)/s_j)²`` over
    ``θ = (o, 1/e_b, 1/e_l, a, m, 1/e_c)`` (λ = ``prior_weight``, θ0 the model's coefficients,
    ``s_j = θ0_j``, or the default's where ``θ0_j`` is 0) within the physical ranges:
    efficiencies in (0, 1], overheads >= 0 (``scipy.optimize.lsq_linear``). A bound is kept in
    the fit, not clipped after it: a step much faster than the prior predicts moves every
    coefficient that can still move, instead of one that is then cut off at 0.

    Raises:
        ConfigError: no samples.
    """
    if not samples:
        raise ConfigError("cost-model fit: no step samples to fit")
    return fit_pairs([(s, model) for s in samples], model.coefficients, prior_weight=prior_weight)


def fit_pairs(
    pairs: Sequence[tuple[StepSample, StepTimeModel]],
    prior: Coefficients,
    *,
    prior_weight: float = 1e-3,
    free: Sequence[int] | None = None,
    source: str | None = None,
) -> Coefficients:
    """:func:`fit` over steps of several models at once: each sample is booked by its own
    timer (its model's shapes), and one set of coefficients, pulled towards ``prior``, fits them
    all (the per-GPU-type priors of :mod:`plora.cost.priors` fit two base shapes so).
    ``free``: the indices into ``θ`` that move (default all); the others keep ``prior``'s.

    Raises:
        ConfigError: no samples.
    """
    from scipy.optimize import lsq_linear  # lazily: planning without a profile never needs it

    if not pairs:
        raise ConfigError("cost-model fit: no step samples to fit")
    theta0 = prior._theta()
    moving = np.array(sorted(set(range(len(theta0)) if free is None else free)), dtype=int)
    kept = np.array([j for j in range(len(theta0)) if j not in set(moving)], dtype=int)
    scale = np.where(theta0 > 0, theta0, DEFAULT_COEFFICIENTS._theta())[moving]
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


def relative_errors(samples: Sequence[StepSample], model: StepTimeModel) -> np.ndarray:
    """``(predicted - measured) / measured`` per sample."""
    theta = model.coefficients._theta()
    out = []
    for s in samples:
        known, feats = model.sample_terms(s)
        out.append((known + feats @ theta - s.step_time_s) / s.step_time_s)
    return np.array(out)


__all__ = ["fit", "fit_pairs", "relative_errors"]
