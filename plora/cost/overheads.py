"""The seconds a sweep spends outside packed training steps, and their fit from measurements.

Resident workers (DESIGN.md decision 7): a group of ``d`` GPUs starts once and serves job after
job, so a sweep pays

* per **worker group** (cold): ``worker_start_s + model_load_s`` -- :meth:`Overheads.startup_s`,
  charged by the planner once per group (at the start of a sweep, and when a group is torn down
  for another ``d``);
* per **job** on a warm group: ``job_start_s`` (trainer set-up) and ``checkpoint_s`` per
  train-state write;
* per **config**: ``eval_s_per_row`` and ``generate_s_per_row`` per eval row, ``export_s``
  per PEFT export (its critical path), and ``write_s_per_gb`` for each GB it writes (the
  export's bytes only where their write outlasts the evaluation it overlaps).

How many units a job and a config pay is :mod:`plora.cost.jobterms`; per-job terms depend on
the longest config's steps alone and per-config terms on the config alone, so a job's time
stays ``fixed(max steps) + Σ per-config``: affine in the pack, as the planner's ILP needs.

Defaults (:meth:`Overheads.default`) come from physics where there is some -- model load is
weight bytes over a load bandwidth plus a fixed part, an eval forward is the forward FLOPs at
the fitted efficiency plus :data:`FORWARD_FRACTION` of a step's launches, exact-match
generation is ``max_new_tokens`` decode steps of an eval batch, writes are bytes over a write
bandwidth -- and from measurements otherwise (:mod:`plora.cost.defaults`: resident workers of a
1.5B model on H100 and H200 hosts, their first step's kernel compilation included). They are
labelled ``source="default"``; :meth:`Overheads.refit` replaces every kind that was measured
(:class:`OverheadSample`: median seconds per unit) and keeps the prior for the rest.

Pure: no I/O (the profile store in :mod:`plora.cost.profile` persists samples).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from typing import Any

from plora.config import ConfigError
from plora.cost.defaults import CPU, GPU
from plora.cost.recency import weighted_median
from plora.cost.throughput import StepTimeModel
from plora.model_spec import ModelSpec

#: The share of a training step's fixed part (launches, weight reads) a forward pays
#: (forward, backward with twice the kernels, optimizer).
FORWARD_FRACTION = 1.0 / 3.0
#: The generation budget of exact match (``plora.engine.evaluate_packed``'s default).
EVAL_MAX_NEW_TOKENS = 8
#: Rows per packed-evaluation forward, at most: the size of the forwards
#: :mod:`plora.engine.evaluate_packed` runs (the default of its functions; the kernel warm-up
#: compiles for it) and this module charges a forward's fixed part over (:func:`rows_per_forward`).
EVAL_BATCH_ROWS = 128
#: Padded tokens (rows x width) per packed-evaluation forward, at most. A forward without
#: gradients holds one layer's activations at a time: a few GiB at this size on the models plora
#: trains, where the training step beside it holds every layer's. A scoring forward that still
#: runs out of GPU memory is split in two and retried (``evaluate_packed._score_rows``).
EVAL_MAX_TOKENS = 65_536


def rows_per_forward(width: int) -> int:
    """Rows of a packed-evaluation forward whose rows are ``width`` tokens long (at least 1)."""
    return max(1, min(EVAL_BATCH_ROWS, EVAL_MAX_TOKENS // max(1, width)))


#: Label options an accuracy metric scores per row when the labels are not known yet.
ACCURACY_OPTIONS = 2


class EvalMetric(StrEnum):
    """The task metric scored after the eval loss (``plora.engine.evaluate``)."""

    NONE = "none"
    """Eval loss only."""
    EXACT_MATCH = "exact_match"
    """Greedy generation of up to ``max_new_tokens`` per row."""
    ACCURACY = "accuracy"
    """One scoring forward per label option per row."""


class OverheadKind(StrEnum):
    """What an :class:`OverheadSample` measured, and the unit its ``count`` counts."""

    WORKER_START = "worker_start"
    """Worker groups started (process start, imports, CUDA init)."""
    MODEL_LOAD = "model_load"
    """Worker groups that loaded the base model onto their device(s)."""
    JOB_START = "job_start"
    """Jobs started on a warm group (trainer set-up)."""
    EVAL = "eval"
    """Config-rows of eval-loss forward (configs evaluated x eval rows)."""
    GENERATE = "generate"
    """Config-rows of task-metric scoring beyond the loss (generation / option scoring)."""
    EXPORT = "export"
    """PEFT exports (configs); ``bytes`` = the bytes written, when known."""
    CHECKPOINT = "checkpoint"
    """Train-state checkpoint writes of a job; ``bytes`` = the bytes written, when known."""


#: The :class:`Overheads` field each kind measures (seconds per unit).
FIELD_OF: dict[OverheadKind, str] = {
    OverheadKind.WORKER_START: "worker_start_s",
    OverheadKind.MODEL_LOAD: "model_load_s",
    OverheadKind.JOB_START: "job_start_s",
    OverheadKind.EVAL: "eval_s_per_row",
    OverheadKind.GENERATE: "generate_s_per_row",
    OverheadKind.EXPORT: "export_s",
    OverheadKind.CHECKPOINT: "checkpoint_s",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class OverheadSample:
    """One measurement: ``seconds`` spent on ``count`` units of ``kind`` (see :class:`OverheadKind`)."""

    kind: OverheadKind
    seconds: float
    """Wall seconds of the whole measured span, >= 0."""
    count: float = 1.0
    """Units in the span (groups, jobs, config-rows, exports, writes), > 0."""
    bytes: float = 0.0
    """Bytes written (export, checkpoint): their ``write_s_per_gb`` share is not part of
    the fitted fixed seconds."""
    sweep: int = 0
    """The profile store's number of the sweep that measured it (see
    :attr:`plora.cost.throughput.StepSample.sweep`; 0: not recorded yet, or an older file)."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", OverheadKind(self.kind))
        except ValueError:
            kinds = ", ".join(OverheadKind)
            raise ConfigError(f"overhead sample: kind={self.kind!r}; use one of {kinds}") from None
        for name, low in (("seconds", 0.0), ("bytes", 0.0)):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= low):
                raise ConfigError(f"overhead sample: {name}={v!r} must be a finite number >= 0")
        if not (
            isinstance(self.count, int | float) and math.isfinite(self.count) and self.count > 0
        ):
            raise ConfigError(f"overhead sample: count={self.count!r} must be > 0")
        if not (isinstance(self.sweep, int) and self.sweep >= 0):
            raise ConfigError(f"overhead sample: sweep={self.sweep!r} must be an integer >= 0")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (inverse: :meth:`from_dict`)."""
        return {"kind": str(self.kind), "seconds": self.seconds, "count": self.count,
                "bytes": self.bytes, "sweep": self.sweep}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OverheadSample:
        """Inverse of :meth:`to_dict`."""
        return cls(kind=data["kind"], seconds=float(data["seconds"]),
                   count=float(data.get("count", 1.0)), bytes=float(data.get("bytes", 0.0)),
                   sweep=int(data.get("sweep", 0)))  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Overheads:
    """Seconds outside packed training steps (see the module docstring for how each is charged)."""

    worker_start_s: float
    """Per worker group: process start, imports, CUDA init (and first-use kernel compilation)."""
    model_load_s: float
    """Per worker group: the frozen base model loaded onto its device(s)."""
    job_start_s: float
    """Per job on a warm group: trainer set-up (data, adapters, optimizers)."""
    eval_s_per_row: float
    """Per config per eval row: the eval-loss forward."""
    generate_s_per_row: float
    """Per config per eval row, extra for the task metric (exact-match generation or accuracy
    option scoring); not charged when the metric is ``none``."""
    export_s: float
    """Per config: the PEFT export's part on the job's critical path (the device->host
    snapshot; measured: ``export_critical_s`` per export). The file write runs in the
    background during evaluation: only its excess over the config's evaluation comes on top
    (:mod:`plora.cost.jobterms`)."""
    checkpoint_s: float
    """Per train-state checkpoint write of a job: fixed part; the adapters' bytes come on top."""
    write_s_per_gb: float = 1.0
    """Seconds per 1e9 bytes of adapter exports and checkpoint state (1 / bandwidth)."""
    source: str = "default"
    """``default`` (physics and the constants of :mod:`plora.cost.overheads`), ``cpu-default``,
    ``zero``, ``given`` or ``measured`` (after :meth:`refit`; see :attr:`measured`)."""
    measured: tuple[str, ...] = ()
    """Fields whose value comes from measurements (the rest keep their prior)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("source", "measured"):
                continue
            v = getattr(self, f.name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"overheads: {f.name}={v!r} must be a finite number >= 0")
        names = {f.name for f in fields(self)}
        bad = [m for m in self.measured if m not in names]
        if bad:
            raise ConfigError(f"overheads: measured names unknown fields {bad}")
        object.__setattr__(self, "measured", tuple(sorted(set(self.measured))))

    @property
    def startup_s(self) -> float:
        """A cold worker group: ``worker_start_s + model_load_s``."""
        return self.worker_start_s + self.model_load_s

    # ---------------------------------------------------------------- constructors
    @classmethod
    def zero(cls) -> Overheads:
        """No overheads: only packed training steps are charged (pure step-time math)."""
        return cls(worker_start_s=0.0, model_load_s=0.0, job_start_s=0.0, eval_s_per_row=0.0,
                   generate_s_per_row=0.0, export_s=0.0, checkpoint_s=0.0, write_s_per_gb=0.0,
                   source="zero")  # fmt: skip

    @classmethod
    def default(
        cls,
        spec: ModelSpec,
        timer: StepTimeModel,
        *,
        seq_len: int,
        metric: EvalMetric | str = EvalMetric.NONE,
        weight_bytes: float | None = None,
        cpu: bool = False,
        max_new_tokens: int = EVAL_MAX_NEW_TOKENS,
        label_options: int = ACCURACY_OPTIONS,
    ) -> Overheads:
        """Physics defaults for ``spec`` on ``timer``'s GPU (see the module docstring).

        * model load: ``weight_bytes / load_bytes_per_s + model_load_fixed_s``
          (:data:`~plora.cost.defaults.GPU`, :data:`~plora.cost.defaults.CPU`);
        * eval row: the forward FLOPs of ``seq_len`` tokens at the fitted base efficiency
          (``s·(2·P_mm + A_fwd(s)) / (e_b·P)``: half a frozen-base training step) plus a
          row's share of a forward's launches and weight reads, ``FORWARD_FRACTION·t_fixed / n``
          (``t_fixed`` the step-time model's per-step fixed part, ``n`` the rows of a packed
          forward at ``seq_len``: :func:`rows_per_forward`);
        * exact match: the prompt's forward (one eval row) plus ``max_new_tokens`` decode
          steps, each a forward of an eval batch bound by launches and weight reads
          (``FORWARD_FRACTION·t_fixed / n`` per row);
          accuracy: ``label_options`` scoring forwards per row; none: 0;
        * worker start, job start, write bandwidth, fixed export/checkpoint parts:
          :data:`~plora.cost.defaults.GPU` (worker start from the measured cold start, compilation
          included) or :data:`~plora.cost.defaults.CPU`.

        Args:
            spec: the base model's shapes.
            timer: the step-time model (its coefficients and GPU).
            seq_len: the padded length of an eval row.
            metric: the task metric (:class:`EvalMetric`).
            weight_bytes: bytes of the frozen weights (default bf16: 2·params).
            cpu: the CPU constants instead of the GPU ones.
            max_new_tokens: exact-match generation budget.
            label_options: label options an accuracy metric scores.
        """
        metric = EvalMetric(metric)
        weights = 2.0 * spec.total_params if weight_bytes is None else float(weight_bytes)
        flops = seq_len * spec.forward_flops_per_token(seq_len)
        compute = flops / (timer.coefficients.base_efficiency * timer.gpu.peak_flops)
        launch = FORWARD_FRACTION * timer.fixed_step_time(1, None) / rows_per_forward(seq_len)
        eval_row = compute + launch
        if metric is EvalMetric.EXACT_MATCH:
            generate = eval_row + max_new_tokens * launch
        elif metric is EvalMetric.ACCURACY:
            generate = label_options * eval_row
        else:
            generate = 0.0
        c = CPU if cpu else GPU
        return cls(
            worker_start_s=c.worker_start_s,
            model_load_s=weights / c.load_bytes_per_s + c.model_load_fixed_s,
            job_start_s=c.job_start_s,
            eval_s_per_row=eval_row,
            generate_s_per_row=generate,
            export_s=c.export_fixed_s,
            checkpoint_s=c.checkpoint_fixed_s,
            write_s_per_gb=c.write_s_per_gb,
            source="cpu-default" if cpu else "default",
        )

    # ----------------------------------------------------------------------- fit
    def refit(
        self, samples: Iterable[OverheadSample], weights: Iterable[float] | None = None
    ) -> Overheads:
        """These overheads with every measured kind replaced by its median seconds per unit.

        Per sample the unit cost is ``(seconds - bytes·write_s_per_gb/1e9) / count`` (clipped
        at 0); the median over a kind's samples is robust to a first-call outlier (a cold
        cache). With ``weights`` (one per sample, e.g. the profile store's by sweep age,
        :func:`plora.cost.recency.sweep_weights`) it is the weighted median. Kinds without
        samples keep this object's value. No samples: ``self``.
        """
        samples = list(samples)
        given = [1.0] * len(samples) if weights is None else [float(w) for w in weights]
        if len(given) != len(samples):
            raise ConfigError(f"overheads refit: {len(given)} weights for {len(samples)} samples")
        per_kind: dict[OverheadKind, tuple[list[float], list[float]]] = {}
        for s, w in zip(samples, given, strict=True):
            if not isinstance(s, OverheadSample):
                raise ConfigError(f"overheads refit: {s!r} is not an OverheadSample")
            unit = max(s.seconds - s.bytes * self.write_s_per_gb / 1e9, 0.0) / s.count
            units, ws = per_kind.setdefault(s.kind, ([], []))
            units.append(unit)
            ws.append(w)
        if not per_kind:
            return self
        changes = {FIELD_OF[k]: weighted_median(u, w) for k, (u, w) in per_kind.items()}
        measured = (*self.measured, *changes)
        return replace(self, **changes, source="measured", measured=measured)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (inverse: :meth:`from_dict`)."""
        out = asdict(self)
        out["measured"] = list(self.measured)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Overheads:
        """Inverse of :meth:`to_dict`; raises :class:`ConfigError` on unknown or missing keys."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"overheads: unknown keys {unknown}")
        try:
            kw: dict[str, Any] = {k: (tuple(v) if k == "measured" else v) for k, v in data.items()}
            return cls(**kw)
        except TypeError as err:
            raise ConfigError(f"overheads: {err}") from None


__all__ = [
    "EVAL_BATCH_ROWS",
    "EVAL_MAX_TOKENS",
    "FIELD_OF",
    "EvalMetric",
    "OverheadKind",
    "OverheadSample",
    "Overheads",
    "rows_per_forward",
]
