"""What the trainer reports: per-adapter step metrics and the pack's measured profile."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from plora.config import LoRAConfig


class AdapterStatus(StrEnum):
    """Where an adapter is in its life inside a pack, and how its training there ended
    (``ConfigResult.status``: completed, stopped or aborted)."""

    ACTIVE = "active"
    """Training: it takes part in the next step."""
    COMPLETED = "completed"
    """Trained for all its steps."""
    STOPPED = "stopped"
    """Stopped early (a scheduler's or the user's stop); exported as it was."""
    ABORTED = "aborted"
    """The pack was aborted before it finished; resumable from its checkpoint."""
    PAUSED = "paused"
    """Left its pack at a step boundary with its whole train-state saved
    (:mod:`plora.engine.pause`); it continues exactly when it joins a pack again."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Control:
    """What a running pack should do before its next step (``PackHooks.poll()``'s answer)."""

    stop: frozenset[str] = frozenset()
    """Config ids to stop now (their adapters are exported as they are)."""
    add: tuple[LoRAConfig, ...] = ()
    """Configs to add to the pack (refill; a paused config continues where it left off)."""
    pause: frozenset[str] = frozenset()
    """Config ids to pause now: they leave with their train-state (:mod:`plora.engine.pause`)."""
    abort: bool = False
    """Stop the whole pack (checkpointed, resumable)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    """One adapter's numbers for one optimizer step."""

    config_id: str
    step: int
    """The adapter's own step count after this update (1-based)."""
    loss: float
    """Mean token loss of the adapter's batch (before the update)."""
    lr: float
    """Learning rate used for this update."""
    tokens: int
    """Non-padding input tokens of the adapter's batch."""
    grad_norm: float
    """L2 norm of the adapter's gradient before clipping."""
    time_s: float
    """Wall time of the whole packed step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepProfile:
    """Measurements of one packed step (for the cost model)."""

    step: int
    time_s: float
    adapters: int
    rows: int
    seq_len: int
    """Longest padded row length of the step."""
    tokens: int
    """Non-padding input tokens over all adapters."""
    padded_tokens: int
    micro_batches: int
    peak_memory_bytes: int
    """``torch.cuda.max_memory_allocated`` during the step on GPU; process max RSS on CPU."""
    host_s: float | None = None
    """Step start until the step's last kernel was enqueued (before the synchronize): the
    host's share. On CPU, where kernels run as they are issued, about ``time_s``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackProfile:
    """The first steps of a pack, as measured; handed to ``plora.cost.profile``."""

    device: str
    """``"cuda:0"``, ``"cpu"``, ... (``str(torch.device)``)."""
    device_name: str
    """The accelerator's name (``torch.cuda.get_device_name``) or ``"cpu"``."""
    dtype: str
    ranks: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    steps: tuple[StepProfile, ...]

    @property
    def mean_step_time_s(self) -> float:
        """Mean step time, skipping the first (warm-up) step when there are more."""
        steps = self.steps[1:] if len(self.steps) > 1 else self.steps
        return sum(s.time_s for s in steps) / max(1, len(steps))

    @property
    def tokens_per_s(self) -> float:
        """Non-padding tokens per second over the measured steps (after warm-up)."""
        steps = self.steps[1:] if len(self.steps) > 1 else self.steps
        t = sum(s.time_s for s in steps)
        return sum(s.tokens for s in steps) / t if t > 0 else 0.0

    @property
    def peak_memory_bytes(self) -> int:
        return max((s.peak_memory_bytes for s in self.steps), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "device_name": self.device_name,
            "dtype": self.dtype,
            "ranks": list(self.ranks),
            "batch_sizes": list(self.batch_sizes),
            "steps": [{k: getattr(s, k) for k in StepProfile.__slots__} for s in self.steps],
        }


__all__ = ["AdapterStatus", "PackProfile", "StepMetrics", "StepProfile"]
