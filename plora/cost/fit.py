"""Refit the step-time coefficients from measured steps (:func:`fit`) and score a model
against them (:func:`relative_errors`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plora.config import ConfigError
from plora.cost.leastsq import fit_pairs
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
    return fit_pairs(
        [(s, model) for s in samples],
        model.coefficients,
        fallback=DEFAULT_COEFFICIENTS,
        prior_weight=prior_weight,
    )


def relative_errors(samples: Sequence[StepSample], model: StepTimeModel) -> np.ndarray:
    """``(predicted - measured) / measured`` per sample."""
    theta = model.coefficients._theta()
    out = []
    for s in samples:
        known, feats = model.sample_terms(s)
        out.append((known + feats @ theta - s.step_time_s) / s.step_time_s)
    return np.array(out)


__all__ = ["fit", "fit_pairs", "relative_errors"]
