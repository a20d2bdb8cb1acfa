"""How many units of each overhead a job and a config of a sweep pay, in seconds.

:class:`SweepOverheads` applies per-unit :class:`~plora.cost.overheads.Overheads` to one sweep
(its eval split, task metric and checkpoint interval). For a job whose longest config trains
``n`` steps, and a config k with ``P_k`` LoRA parameters training ``n_k`` steps::

    per_job(n)           = job_start_s + checkpoint_writes(n)·checkpoint_s
    per_config(P_k, n_k) = E_k + export_s + max(0, 4·P_k·w - E_k)
                           + active_checkpoints(n_k)·12·P_k·w
    E_k                  = R·(eval_s_per_row [+ generate_s_per_row, metric != none])

with ``R`` eval rows and ``w = write_s_per_gb / 1e9`` seconds per byte: a PEFT export writes
fp32 weights, a train-state checkpoint fp32 weights and both AdamW moments of every config still in the pack
(:func:`active_checkpoints`: a config is exported and leaves at its last step, before that
step's checkpoint). The export is charged for what is on the job's critical path
(``plora.engine.export``): ``export_s``, the device->host snapshot (measured: the
``export_critical_s`` per export that ``jobs.parquet`` records), and only the part of the file
write that outlasts the config's evaluation -- the write runs on a background thread while the
job evaluates the same adapters. The first depends only on the longest config, the second only
on the config: a job's time stays affine in its pack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from plora.config import ConfigError
from plora.cost.overheads import EvalMetric, Overheads

#: Bytes written per LoRA parameter: a PEFT export (fp32) and a train-state (fp32 weights and
#: both AdamW moments).
EXPORT_BYTES_PER_PARAM = 4.0
STATE_BYTES_PER_PARAM = 12.0
#: ``plora sweep --checkpoint-every`` / ``RunOptions.checkpoint_every`` default, in steps.
DEFAULT_CHECKPOINT_EVERY = 50
#: What ``dataset.metric: auto`` resolves to for each builtin task (``plora.tasks``).
BUILTIN_METRICS = {
    "arithmetic": "exact_match",
    "sentiment": "accuracy",
    "reverse": "exact_match",
    "copy": "exact_match",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class JobTimeTerms:
    """A job's (or one config's) seconds by kind; :attr:`total_s` is their sum."""

    job_start_s: float = 0.0
    train_s: float = 0.0
    """Packed training steps."""
    eval_s: float = 0.0
    export_s: float = 0.0
    checkpoint_s: float = 0.0

    @property
    def total_s(self) -> float:
        """The sum of the terms."""
        return self.job_start_s + self.train_s + self.eval_s + self.export_s + self.checkpoint_s

    def __add__(self, other: JobTimeTerms) -> JobTimeTerms:
        return JobTimeTerms(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                               for f in fields(self)})  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepOverheads:
    """:class:`Overheads` applied to one sweep: its eval split, metric and checkpoint interval.

    ``per_job(n)`` and ``per_config(P_k, n_k)`` are the terms of the module docstring; the cost
    model adds the first to its ``fixed_time`` and the second to its ``config_time``.
    """

    overheads: Overheads
    eval_rows: int = 0
    """Eval rows each config is evaluated on after training (0: no evaluation)."""
    eval_metric: EvalMetric = EvalMetric.NONE
    """The task metric scored beyond the eval loss."""
    checkpoint_every: int | None = None
    """Train-state checkpoint every this many steps (None: at the end only)."""

    def __post_init__(self) -> None:
        if not isinstance(self.eval_rows, int) or self.eval_rows < 0:
            raise ConfigError(f"cost model: eval_rows={self.eval_rows!r} must be an integer >= 0")
        every = self.checkpoint_every
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ConfigError(
                f"cost model: checkpoint_every={every!r} must be an integer >= 1 or None"
            )
        try:
            object.__setattr__(self, "eval_metric", EvalMetric(self.eval_metric))
        except ValueError:
            raise ConfigError(
                f"cost model: eval_metric={self.eval_metric!r}; use none, exact_match or accuracy"
            ) from None

    def per_job(self, steps: int) -> JobTimeTerms:
        """A job whose longest config runs ``steps``: its start and its checkpoint writes."""
        o = self.overheads
        writes = checkpoint_writes(steps, self.checkpoint_every)
        return JobTimeTerms(job_start_s=o.job_start_s, checkpoint_s=writes * o.checkpoint_s)

    def per_config(self, lora_params: float, steps: int) -> JobTimeTerms:
        """A config with ``lora_params`` LoRA parameters training ``steps`` steps: evaluation,
        the critical-path part of its export (the snapshot, and the write's excess over the
        evaluation it overlaps) and its bytes in the periodic checkpoints of its job."""
        o = self.overheads
        per_row = o.eval_s_per_row
        if self.eval_metric is not EvalMetric.NONE:
            per_row += o.generate_s_per_row
        ckpts = active_checkpoints(steps, self.checkpoint_every)
        per_byte = o.write_s_per_gb / 1e9
        eval_s = self.eval_rows * per_row
        write_s = EXPORT_BYTES_PER_PARAM * lora_params * per_byte  # overlaps the evaluation
        return JobTimeTerms(
            eval_s=eval_s,
            export_s=o.export_s + max(0.0, write_s - eval_s),
            checkpoint_s=ckpts * STATE_BYTES_PER_PARAM * lora_params * per_byte,
        )


def checkpoint_writes(steps: int, every: int | None) -> int:
    """Train-state writes of a job of ``steps`` steps: every ``every`` steps and one at the end
    (``plora.engine.session.run_pack``); only the one at the end when ``every`` is None."""
    return steps // every + 1 if every else 1


def active_checkpoints(steps: int, every: int | None) -> int:
    """Periodic checkpoints a config of ``steps`` steps is part of: those at multiples of
    ``every`` before its last step (it is exported and leaves the pack at its last step)."""
    return math.ceil(steps / every) - 1 if every else 0


def eval_defaults(dataset: Any) -> tuple[int, EvalMetric]:
    """``(eval rows, metric)`` a ``plora.config.DatasetSpec`` implies before its data is read.

    Rows: ``ceil(num_examples·eval_fraction)`` for a builtin (held out on top),
    ``round(num_examples·eval_fraction)`` for a file (a separate ``eval_path`` is assumed the
    same size). Metric: the spec's, or for ``auto`` the builtin task's and ``exact_match`` (the
    most expensive) for a file; the runtime passes the real ones once the data is loaded.
    """
    n, frac = int(dataset.num_examples), float(dataset.eval_fraction)
    builtin = getattr(dataset, "builtin", None)
    rows = math.ceil(n * frac) if builtin else round(n * frac)
    metric = str(getattr(dataset, "metric", "auto"))
    if metric == "auto":
        metric = BUILTIN_METRICS.get(builtin or "", EvalMetric.EXACT_MATCH)
    return int(rows), EvalMetric(metric)


__all__ = [
    "BUILTIN_METRICS",
    "DEFAULT_CHECKPOINT_EVERY",
    "EXPORT_BYTES_PER_PARAM",
    "STATE_BYTES_PER_PARAM",
    "JobTimeTerms",
    "SweepOverheads",
    "active_checkpoints",
    "checkpoint_writes",
    "eval_defaults",
]
