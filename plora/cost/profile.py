"""Measured step profiles, cached per (model, GPU type), and the mLoRA memory fit.

A :class:`Profile` holds measured :class:`~plora.cost.throughput.StepSample` s of one base
model on one GPU type, for any parallel degree ``d`` and strategy (each sample records its
own), plus the coefficients last fitted from them, and measured
:class:`~plora.cost.overheads.OverheadSample` s (worker start, model load, job start, eval,
export, checkpoint writes) that ``build_cost_model`` fits over its defaults. Files written
before overheads were recorded load with none. :class:`ProfileStore` keeps one JSON file
per (model, GPU type) under a directory (default ``~/.cache/plora/profiles/``, or
``$PLORA_PROFILE_DIR``); reads and writes happen only in explicit :meth:`ProfileStore.load` /
:meth:`ProfileStore.save` calls (atomic, via :mod:`plora.utils`), so a second sweep on the same
model and GPU plans from measurements instead of defaults.

Each :meth:`ProfileStore.record` is one sweep: its samples are numbered with the next sweep
number (files written before sweeps were numbered load as sweep 0, the oldest) and thinned to a
bounded number per sweep, so the store keeps several sweeps. The cost model weighs the sweeps
by age, the newest most (:mod:`plora.cost.recency`, :meth:`Profile.overhead_weights`).

:func:`fit_memory` is mLoRA's online memory model ``Mem = β0 + β1·B·L + β2·B·L²`` (B sequences
of length L per step) fitted to measured peaks by least squares.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from plora.config import ConfigError
from plora.cost import Strategy
from plora.cost.overheads import OverheadSample
from plora.cost.recency import sweep_weights
from plora.cost.throughput import Coefficients, StepSample
from plora.utils import atomic_write_json

_T = TypeVar("_T")

PROFILE_FORMAT = 1
#: Samples kept per profile (newest win): bounds the file and the refit's cost.
MAX_SAMPLES = 2000
#: Overhead samples kept per profile (newest win).
MAX_OVERHEAD_SAMPLES = 1000
#: Step samples one sweep keeps (evenly spaced over the sweep's): one long sweep cannot push
#: the sweeps before it out of the store (it keeps at least five sweeps).
MAX_SWEEP_SAMPLES = MAX_SAMPLES // 5
#: Overhead samples one sweep keeps per kind (evenly spaced): at most 7·24 = 168 per sweep.
MAX_SWEEP_OVERHEADS_PER_KIND = 24


def default_profile_dir() -> Path:
    """``$PLORA_PROFILE_DIR`` or ``~/.cache/plora/profiles``."""
    env = os.environ.get("PLORA_PROFILE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "plora" / "profiles"


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryFit:
    """``peak = β0 + β1·B·L + β2·B·L²`` bytes (B sequences of length L in the step)."""

    b0: float
    b1: float
    b2: float

    def predict(self, sequences: float, seq_len: float) -> float:
        """Predicted peak bytes."""
        return self.b0 + self.b1 * sequences * seq_len + self.b2 * sequences * seq_len**2

    def per_sequence(self, seq_len: float) -> float:
        """Bytes one more sequence of length ``seq_len`` adds: ``β1·L + β2·L²``."""
        return self.b1 * seq_len + self.b2 * seq_len**2


def fit_memory(points: Iterable[tuple[float, float, float]]) -> MemoryFit:
    """Fit :class:`MemoryFit` to ``(sequences B, seq_len L, peak_bytes)`` points.

    With a single sequence length the L² term cannot be told from the L term: β2 is then 0
    and β1 absorbs it. Coefficients are constrained to be >= 0 (a negative slope is noise).

    Raises:
        ConfigError: fewer than two distinct ``B·L`` values.
    """
    pts = np.array([(float(b), float(s), float(m)) for b, s, m in points])
    if pts.size == 0 or len({b * s for b, s, _ in pts}) < 2:
        raise ConfigError("memory fit: need peaks at >= 2 distinct batch x sequence sizes")
    bl, bl2, y = pts[:, 0] * pts[:, 1], pts[:, 0] * pts[:, 1] ** 2, pts[:, 2]
    two_lengths = len(set(pts[:, 1])) >= 2
    cols = [np.ones_like(bl), bl] + ([bl2] if two_lengths else [])
    x = np.stack(cols, axis=1)
    norm = np.abs(x).max(axis=0)
    beta = np.linalg.lstsq(x / norm, y, rcond=None)[0] / norm
    if two_lengths and beta[2] < 0:  # refit without the quadratic term
        x, norm = x[:, :2], norm[:2]
        beta = np.linalg.lstsq(x / norm, y, rcond=None)[0] / norm
    b0, b1 = float(beta[0]), max(float(beta[1]), 0.0)
    b2 = max(float(beta[2]), 0.0) if len(beta) > 2 else 0.0
    return MemoryFit(b0=b0, b1=b1, b2=b2)


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """Measured steps of one model on one GPU type (all ``d`` and strategies)."""

    model: str
    gpu_type: str
    samples: tuple[StepSample, ...] = ()
    coefficients: Coefficients | None = None
    """The coefficients last fitted from ``samples`` (None: not fitted yet)."""
    memory_fit: MemoryFit | None = field(default=None)
    """mLoRA memory fit of the d = 1 peaks, when they allow one."""
    overhead_samples: tuple[OverheadSample, ...] = ()
    """Measured seconds outside steps (fitted by ``Overheads.refit``, median per kind)."""

    def add(
        self, samples: Iterable[StepSample] = (), overheads: Iterable[OverheadSample] = ()
    ) -> Profile:
        """A copy with ``samples`` and ``overheads`` appended as they are (the newest
        :data:`MAX_SAMPLES` and :data:`MAX_OVERHEAD_SAMPLES` kept)."""
        return replace(
            self,
            samples=(*self.samples, *samples)[-MAX_SAMPLES:],
            overhead_samples=(*self.overhead_samples, *overheads)[-MAX_OVERHEAD_SAMPLES:],
        )

    @property
    def last_sweep(self) -> int:
        """The newest sweep number among the samples (0: none numbered)."""
        steps = max((s.sweep for s in self.samples), default=0)
        return max(steps, max((o.sweep for o in self.overhead_samples), default=0))

    def add_sweep(
        self, samples: Sequence[StepSample] = (), overheads: Sequence[OverheadSample] = ()
    ) -> Profile:
        """A copy with one more sweep's samples, numbered :attr:`last_sweep` + 1 and thinned to
        :data:`MAX_SWEEP_SAMPLES` steps and :data:`MAX_SWEEP_OVERHEADS_PER_KIND` overhead samples
        per kind (evenly spaced, in their order), then :meth:`add` ed."""
        n = self.last_sweep + 1
        kinds = sorted({o.kind for o in overheads})
        per_kind = [[j for j, o in enumerate(overheads) if o.kind == k] for k in kinds]
        keep = sorted(i for ids in per_kind for i in _spaced(ids, MAX_SWEEP_OVERHEADS_PER_KIND))
        return self.add(
            [replace(s, sweep=n) for s in _spaced(list(samples), MAX_SWEEP_SAMPLES)],
            [replace(overheads[i], sweep=n) for i in keep],
        )

    def overhead_weights(self) -> list[float]:
        """Each overhead sample's weight in its kind's median, by its sweep's age
        (:func:`plora.cost.recency.sweep_weights`)."""
        return sweep_weights(
            [o.sweep for o in self.overhead_samples], [o.kind for o in self.overhead_samples]
        )

    def select(self, d: int | None = None, strategy: Strategy | None = None) -> list[StepSample]:
        """Samples with degree ``d`` (and ``strategy`` for d > 1); all when ``d`` is None."""
        if d is None:
            return list(self.samples)
        return [s for s in self.samples if s.d == d and (d == 1 or s.strategy == strategy)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (inverse: :meth:`from_dict`)."""
        return {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "gpu_type": self.gpu_type,
            "coefficients": None if self.coefficients is None else self.coefficients.to_dict(),
            "memory_fit": None
            if self.memory_fit is None
            else {"b0": self.memory_fit.b0, "b1": self.memory_fit.b1, "b2": self.memory_fit.b2},
            "samples": [s.to_dict() for s in self.samples],
            "overhead_samples": [s.to_dict() for s in self.overhead_samples],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "profile") -> Profile:
        """Inverse of :meth:`to_dict`; raises :class:`ConfigError` on a malformed profile."""
        try:
            if data.get("format") != PROFILE_FORMAT:
                raise ValueError(f"format {data.get('format')!r} != {PROFILE_FORMAT}")
            coef = data.get("coefficients")
            mem = data.get("memory_fit")
            return cls(
                model=str(data["model"]),
                gpu_type=str(data["gpu_type"]),
                samples=tuple(StepSample.from_dict(s) for s in data.get("samples", [])),
                coefficients=None if coef is None else Coefficients(**coef),
                memory_fit=None if mem is None else MemoryFit(**mem),
                overhead_samples=tuple(
                    OverheadSample.from_dict(o) for o in data.get("overhead_samples") or ()
                ),
            )
        except (KeyError, TypeError, ValueError, ConfigError) as err:
            raise ConfigError(
                f"{where}: malformed profile ({err}); delete the file to re-profile"
            ) from None


def _spaced(items: list[_T], k: int) -> list[_T]:
    """``k`` of ``items`` evenly spaced from the first to the last (all when they are <= k)."""
    if len(items) <= k:
        return items
    if k < 2:
        return items[-k:] if k else []
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)]


class ProfileStore:
    """One JSON file per (model, GPU type) under ``root``."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_profile_dir()

    def path(self, model: str, gpu_type: str) -> Path:
        """File of the (model, GPU type) profile; the model id is made file-name safe."""
        safe = re.sub(r"[^A-Za-z0-9._-]+", "--", f"{model}@{gpu_type}").strip("-")
        return self.root / f"{safe}.json"

    def load(self, model: str, gpu_type: str) -> Profile:
        """The stored profile, or an empty one when none exists."""
        path = self.path(model, gpu_type)
        if not path.is_file():
            return Profile(model=model, gpu_type=gpu_type)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(
                f"profile {path}: unreadable ({err}); delete it to re-profile"
            ) from None
        return Profile.from_dict(data, where=f"profile {path}")

    def save(self, profile: Profile) -> Path:
        """Write ``profile`` atomically; returns its path."""
        path = self.path(profile.model, profile.gpu_type)
        atomic_write_json(path, profile.to_dict())
        return path

    def record(
        self,
        model: str,
        gpu_type: str,
        samples: Sequence[StepSample] = (),
        *,
        overheads: Sequence[OverheadSample] = (),
    ) -> Profile:
        """Load, append one sweep's step ``samples`` and ``overheads``
        (:meth:`Profile.add_sweep`), save, and return the profile. The load and save hold an
        exclusive lock on a ``.lock`` file beside the profile, so two sweeps that end together
        both land, under distinct sweep numbers."""
        path = self.path(model, gpu_type)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            profile = self.load(model, gpu_type).add_sweep(samples, overheads)
            self.save(profile)
        return profile


__all__ = [
    "MAX_OVERHEAD_SAMPLES",
    "MAX_SAMPLES",
    "MAX_SWEEP_OVERHEADS_PER_KIND",
    "MAX_SWEEP_SAMPLES",
    "MemoryFit",
    "Profile",
    "ProfileStore",
    "default_profile_dir",
    "fit_memory",
]
