"""How the runtime runs a sweep: :class:`RunOptions` (not part of the sweep's definition)."""

from __future__ import annotations

import dataclasses

from plora.cost.jobterms import DEFAULT_CHECKPOINT_EVERY
from plora.engine.api import PackEngine


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """How the runtime runs a sweep (not part of the sweep's definition)."""

    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY
    """Train-state checkpoint every N optimizer steps (None: only at the end)."""
    checkpoint_every_s: float | None = None
    """Also checkpoint when this many seconds passed since a job's last checkpoint."""
    record_profile: bool = True
    """Save the measured steps to the (model, GPU type) profile store for later sweeps."""
    max_retries: int = 2
    """Restarts of a job whose worker died before its configs fail."""
    refill: bool = True
    """Let queued configs join running jobs in slots that finished configs left."""
    tick_s: float = 0.25
    """How often the driver drains metrics and posts control when no job ends."""
    poll_every_s: float = 0.0
    """How often a worker asks for control (0: every step)."""
    ask_batch: int | None = None
    """Most configs asked from the config source at a time (default: all it gives)."""
    engine: type[PackEngine] | None = None
    """The engine class resident workers build (default ``plora.engine.PackSession``)."""
    calibration_steps: int = 3
    """Refit and re-plan once this many steps of the first job are measured (0: never)."""
    force_unlock: bool = False
    """Take over a sweep directory lock held from another host (``--force-unlock``); a lock whose
    owner is alive on this host is never broken, a dead one is always taken over."""
    retry_failed: bool = False
    """With ``--resume``: give the configs that failed another attempt (``--retry-failed``). Off
    by default, as ``Tuner.restore(resume_errored=False)``: a resume finishes what was left and
    does not pay again for a failure (out of memory alone, a bad config) unless asked."""
    allow_changed: bool = False
    """With ``--resume`` and a sweep whose definition differs from the saved ``sweep.yaml``: run
    the given one (``--allow-changed``) instead of refusing. Finished configs keep their results
    (a config is matched by its hyperparameters), configs the edit adds are trained, queued ones
    the edit removed from a grid/random space are stopped."""
    prestart: bool = True
    """Start a one-GPU worker group on every GPU right after Ray is up, so the workers import,
    initialise CUDA and load the base model while the driver reads the dataset and plans (not
    when the base model alone fills a GPU, nor when ``planner.strategies`` allows multi-GPU
    jobs: the plan may want several GPUs per job)."""
    actor_prefix: str | None = None
    """Name prefix of this sweep's Ray actors (the relay is ``<prefix>-coordinator``); default
    ``plora-<sweep name>-<random>``. The Tune integration names it to find the relay."""
    follow_configs: bool = False
    """Keep each config's step metrics in the relay until read (Tune proxy trials read them)."""


__all__ = ["RunOptions"]
