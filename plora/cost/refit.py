"""What a refit of :class:`plora.cost.model.SweepCostModel` changed, and the activation-memory
rescale it derives from measured peaks.

:func:`activation_scale` finds the smallest factor on the App. A activation memory (base
activations and logits) under which every measured d = 1 peak is covered; mLoRA's
``β0 + β1·B·L + β2·B·L²`` fit of the same peaks goes into the :class:`RefitReport`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from plora.config import ConfigError
from plora.cost.memory import adapter_memory, base_memory
from plora.cost.memory_options import MemoryOptions
from plora.cost.profile import MemoryFit, fit_memory
from plora.cost.throughput import Coefficients, StepSample
from plora.model_spec import ModelSpec

#: Bounds of the activation scale a memory refit may set.
SCALE_RANGE = (0.25, 4.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class RefitReport:
    """What a refit changed (for the coordinator's log)."""

    old: Coefficients
    new: Coefficients
    num_samples: int
    error_before: float
    """Mean |relative error| of step times under the old coefficients."""
    error_after: float
    """The same under the new coefficients."""
    activation_scale_old: float
    activation_scale_new: float
    memory_fit: MemoryFit | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary."""
        return {
            "num_samples": self.num_samples,
            "old": self.old.to_dict(),
            "new": self.new.to_dict(),
            "step_time_rel_error_before": self.error_before,
            "step_time_rel_error_after": self.error_after,
            "activation_scale_old": self.activation_scale_old,
            "activation_scale_new": self.activation_scale_new,
            "memory_fit": None
            if self.memory_fit is None
            else {"b0": self.memory_fit.b0, "b1": self.memory_fit.b1, "b2": self.memory_fit.b2},
        }


def activation_scale(
    spec: ModelSpec, memory: MemoryOptions, samples: Sequence[StepSample]
) -> tuple[float | None, MemoryFit | None]:
    """``(scale, mLoRA fit)`` from the measured d = 1 peaks; ``(None, ...)`` without peaks."""
    unit = replace(memory, activation_scale=1.0, reserved_bytes=0.0)
    points, measured, predicted = [], [], []
    for s in samples:
        if s.peak_memory_bytes is None or s.d != 1:
            continue
        static = base_memory(spec, options=unit).total
        act = 0.0
        for a in s.adapters:
            m = adapter_memory(
                spec,
                rank=a.rank,
                targets=a.targets,
                batch_size=a.sequences,
                seq_len=s.seq_len,
                dropout=a.dropout,
                options=unit,
            ).components
            static += m["lora_params"] + m["lora_grads"] + m["optimizer"] + m["lora_activations"]
            act += m["base_activations"] + m["logits"]
        seqs = sum(a.sequences for a in s.adapters)
        points.append((seqs, s.seq_len, float(s.peak_memory_bytes) - static))
        measured.append(float(s.peak_memory_bytes) - static)
        predicted.append(act)
    if not points:
        return None, None
    try:  # mLoRA's fit, reported for the log
        mfit: MemoryFit | None = fit_memory(points)
    except ConfigError:  # a single batch x length size
        mfit = None
    # Conservative: the smallest scale under which every measured peak is covered. A
    # least-squares scale would under-predict half of the jobs, and under-predicting
    # memory means OOM, over-predicting only a smaller pack.
    scale = max((m / p for m, p in zip(measured, predicted, strict=True) if p > 0), default=None)
    if scale is None:
        return None, mfit
    return float(min(max(scale, SCALE_RANGE[0]), SCALE_RANGE[1])), mfit


__all__ = ["SCALE_RANGE", "RefitReport", "activation_scale"]
