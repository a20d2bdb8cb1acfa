"""How much each stored measurement counts: recent sweeps most, older ones less.

The profile store (:mod:`plora.cost.profile`) numbers the sweeps it records (1, 2, ...; 0 for
samples of files written before sweeps were numbered: the oldest). A machine's speed changes --
a test suite ran beside the last sweeps, a driver or library was upgraded, the box got less
loaded -- so the plan should follow what this machine did lately, not its whole history:

* a sweep ``k`` sweeps older than the newest one weighs :data:`SWEEP_DECAY` ``** k``
  (:func:`sweep_weights`), shared equally by its samples (of each overhead kind), so a sweep
  that recorded many samples counts no more than one that recorded few;
* **overheads**: the weighted median per kind (:func:`weighted_median`); kinds no sweep measured
  keep their defaults;
* **step times**: each sweep is fitted from the ones before it (:func:`fit_by_sweep`: what its
  steps identify comes from them, the rest from older sweeps, then the defaults), and the fit
  closest to the others by sweep weight is used -- a weighted median of the sweeps' fits.

With a decay of 0.6, the newest sweep decides alone against a history of one or two sweeps
(a store of files written before sweeps were numbered is one sweep, the oldest: a polluted old
store stops misleading the plan after one new sweep); against three or more consistent sweeps
one odd sweep does not move the plan, and two agreeing new sweeps do (a machine that got faster
is followed after two sweeps). The store keeps a bounded number of samples per sweep
(:mod:`plora.cost.profile`), so a long odd sweep cannot evict the history either.

Pure numerics: no I/O.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from plora.config import ConfigError
from plora.cost.fit import fit
from plora.cost.throughput import Coefficients, StepSample, StepTimeModel

#: Weight of a sweep relative to the next newer one. In (1/2, 1/√2): the newest sweep alone
#: outweighs one or two sweeps before it but not three or more (``1 < 0.6 + 0.36 + 0.216``),
#: while the newest two outweigh any history (``1 + 0.6 > Σ_{k>=2} 0.6^k = 0.9``).
SWEEP_DECAY = 0.6
#: Sweeps fitted apart (:func:`fit_by_sweep`); older ones weigh < 0.6^12 ≈ 0.002 and are
#: fitted as one block before them.
MAX_SWEEP_FITS = 12


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


def fit_by_sweep(
    samples: Sequence[StepSample],
    model: StepTimeModel,
    *,
    prior_weight: float = 1e-3,
    decay: float = SWEEP_DECAY,
) -> Coefficients:
    """The step-time coefficients of ``samples``: the weighted medoid of the sweeps' own fits.

    The sweeps are fitted one after another, oldest first, each by
    :func:`~plora.cost.fit.fit` from the coefficients of the sweeps before it (``model``'s
    for the first; sweeps more than :data:`MAX_SWEEP_FITS` behind the newest as one block), so
    fit ``k`` is what sweep ``k`` measured, and the older sweeps' values where its steps identify
    nothing. Of these fits the one whose step times (on every recent sample's pack, in log) lie
    closest to the others', each weighed by its sweep's :func:`sweep_weights`, is returned; on a
    tie the newest.

    Raises:
        ConfigError: no samples.
    """
    if not samples:
        raise ConfigError("cost-model fit: no step samples to fit")
    sweeps = sorted({s.sweep for s in samples})
    recent = sweeps[-MAX_SWEEP_FITS:]
    timer = copy.copy(model)
    older = [s for s in samples if s.sweep < recent[0]]
    if older:
        timer.coefficients = fit(older, timer, prior_weight=prior_weight)
    fits = []
    for n in recent:
        timer.coefficients = fit([s for s in samples if s.sweep == n], timer,
                                 prior_weight=prior_weight)  # fmt: skip
        fits.append(timer.coefficients)
    terms = [model.sample_terms(s) for s in samples if s.sweep >= recent[0]]
    known = np.array([k for k, _ in terms])
    feats = np.array([f for _, f in terms])
    thetas = np.array([c._theta() for c in fits])  # fit x coefficient
    logs = np.log(np.maximum(known[None, :] + thetas @ feats.T, 1e-12))  # fit x sample
    apart = np.abs(logs[:, None, :] - logs[None, :, :]).mean(axis=2)  # fit x fit
    weights = np.array(sweep_weights(recent, decay=decay))
    cost = apart @ weights
    best = len(fits) - 1 - int(np.argmin(cost[::-1]))  # the newest of equals
    return dataclasses.replace(
        fits[best],
        source=f"fit of {len(samples)} measured steps, {len(sweeps)} sweeps: sweep {recent[best]}",
    )


__all__ = [
    "MAX_SWEEP_FITS",
    "SWEEP_DECAY",
    "fit_by_sweep",
    "sweep_weights",
    "weighted_median",
]
