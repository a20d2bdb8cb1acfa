"""How much each stored measurement counts: the newest sweep first, older ones behind it.

The profile store (:mod:`plora.cost.profile`) numbers the sweeps it records (1, 2, ...; 0 for
samples of files written before sweeps were numbered: the oldest). A machine's speed changes --
a test suite ran beside the last sweeps, a driver or library was upgraded, the box got less
loaded -- so the plan should follow what this machine did lately, not its whole history:

* **step times**: :func:`fit_by_sweep` fits the sweeps one after another, oldest first, each
  from the coefficients the sweeps before it gave (the defaults before the first) with the
  weak pull to that prior of :func:`plora.cost.throughput.fit`. What the newest sweep's steps
  identify comes from them alone; what they do not (other ``d`` or strategies, a split of the
  per-step overhead its pack shapes cannot tell apart) keeps the older sweeps' values, and
  their defaults where none measured it;
* **overheads**: a sweep ``k`` sweeps older than the newest one weighs :data:`SWEEP_DECAY`
  ``** k``, shared equally by its samples of each kind (:func:`sweep_weights`), so a sweep that
  recorded many samples counts no more than one that recorded few. With ``SWEEP_DECAY < 1/2``
  the newest sweep holds more than half the weight of every kind it measured, under any
  history, so the weighted median (:func:`weighted_median`) is the newest sweep's own median;
  kinds it did not measure come from the sweeps before it, then the defaults.

One odd sweep therefore moves the next plan, and the sweep after it moves it back; it does not
evict the history either: the store keeps a bounded number of samples per sweep
(:mod:`plora.cost.profile`), so a long sweep cannot push the older ones out.

Pure numerics: no I/O.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from plora.config import ConfigError
from plora.cost.throughput import Coefficients, StepSample, StepTimeModel, fit

#: Weight of a sweep relative to the next newer one (< 1/2: the newest sweep is a majority).
SWEEP_DECAY = 0.4


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
    samples: Sequence[StepSample], model: StepTimeModel, *, prior_weight: float = 1e-3
) -> Coefficients:
    """The step-time coefficients of ``samples`` fitted sweep by sweep, oldest first: each
    sweep's :func:`~plora.cost.throughput.fit` starts from the coefficients of the sweeps before
    it (``model``'s for the first), so the newest sweep decides what its steps identify.

    Raises:
        ConfigError: no samples.
    """
    if not samples:
        raise ConfigError("cost-model fit: no step samples to fit")
    timer = copy.copy(model)
    sweeps = sorted({s.sweep for s in samples})
    for n in sweeps:
        timer.coefficients = fit([s for s in samples if s.sweep == n], timer,
                                 prior_weight=prior_weight)  # fmt: skip
    return dataclasses.replace(
        timer.coefficients,
        source=f"fit of {len(samples)} measured steps of {len(sweeps)} sweeps, newest last",
    )


__all__ = [
    "SWEEP_DECAY",
    "fit_by_sweep",
    "sweep_weights",
    "weighted_median",
]
