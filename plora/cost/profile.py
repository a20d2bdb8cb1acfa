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

:func:`fit_memory` is mLoRA's online memory model ``Mem = β0 + β1·B·L + β2·B·L²`` (B sequences
of length L per step) fitted to measured peaks by least squares.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from plora.config import ConfigError
from plora.cost import Strategy
from plora.cost.overheads import OverheadSample
from plora.cost.throughput import Coefficients, StepSample
from plora.utils import atomic_write_json

PROFILE_FORMAT = 1
#: Samples kept per profile (newest win): bounds the file and the refit's cost.
MAX_SAMPLES = 2000
#: Overhead samples kept per profile (newest win).
MAX_OVERHEAD_SAMPLES = 500


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
        """A copy with ``samples`` and ``overheads`` appended (the newest :data:`MAX_SAMPLES`
        and :data:`MAX_OVERHEAD_SAMPLES` kept)."""
        return replace(
            self,
            samples=(*self.samples, *samples)[-MAX_SAMPLES:],
            overhead_samples=(*self.overhead_samples, *overheads)[-MAX_OVERHEAD_SAMPLES:],
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
        """Load, append step ``samples`` and ``overheads``, save, and return the profile."""
        profile = self.load(model, gpu_type).add(samples, overheads)
        self.save(profile)
        return profile


__all__ = [
    "MAX_OVERHEAD_SAMPLES",
    "MAX_SAMPLES",
    "MemoryFit",
    "Profile",
    "ProfileStore",
    "default_profile_dir",
    "fit_memory",
]
