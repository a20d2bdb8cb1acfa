"""``early_stop:`` of a sweep: stop configs whose training loss lags, inside their packs (ASHA).

```yaml
early_stop:
  kind: asha              # asynchronous successive halving (Ray Tune's ASHAScheduler)
  grace_steps: 10         # no config is stopped before its 10th optimizer step
  reduction_factor: 2     # at each rung (10, 20, 40, ... steps) the worse half is stopped
```

The metric is the adapter's training ``loss`` of each step (what the packed trainer streams;
minimised). A stopped config frees its slot for the next queued config (refill) and ends with
status ``stopped``, its adapter exported as it was at that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from plora.config.validate import as_choice, as_float, as_int


class EarlyStopKind(StrEnum):
    """Which early-stopping rule a sweep uses."""

    ASHA = "asha"
    """Asynchronous successive halving (Li et al. 2020) on the per-step training loss."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EarlyStopConfig:
    """How a sweep stops lagging configs early."""

    kind: EarlyStopKind = EarlyStopKind.ASHA
    """The rule: ``asha``."""
    metric: str = "loss"
    """The streamed metric it ranks by: the adapter's training ``loss`` (minimised)."""
    grace_steps: int = 10
    """Optimizer steps every config trains before it may be stopped (the first rung)."""
    reduction_factor: float = 2.0
    """Rungs at ``grace_steps * reduction_factor**k`` steps; the best ``1/reduction_factor`` of
    the configs that reached a rung go on."""

    def __post_init__(self) -> None:
        kind = self.kind if isinstance(self.kind, str) else str(self.kind)
        object.__setattr__(
            self, "kind", EarlyStopKind(as_choice(kind, "kind", [k.value for k in EarlyStopKind]))
        )
        as_choice(self.metric, "metric", ("loss",), fix="the streamed training loss is 'loss'")
        as_int(self.grace_steps, "grace_steps", ge=1)
        rf = as_float(self.reduction_factor, "reduction_factor", gt=1.0)
        object.__setattr__(self, "reduction_factor", rf)

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": str(self.kind),
            "metric": self.metric,
            "grace_steps": self.grace_steps,
            "reduction_factor": self.reduction_factor,
        }


__all__ = ["EarlyStopConfig", "EarlyStopKind"]
