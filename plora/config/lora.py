"""One config: :class:`LoRAConfig`, a point of the search space with a stable ``config_id``.

The planner, the engine and the runtime all speak in these. Also the LoRA target modules
(:data:`PROJECTIONS`, their YAML aliases, :func:`normalize_targets`) and the lr
:class:`Schedule`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from plora.config.errors import ConfigError

#: The seven projections of a Llama/Qwen2 decoder layer that LoRA may target, in layer order.
PROJECTIONS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

#: Short names users may write in YAML, mapped to the HF module names.
PROJECTION_ALIASES: dict[str, str] = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}


class Schedule(StrEnum):
    """Learning-rate schedule after warmup."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


def normalize_targets(targets: Any, *, where: str = "target_modules") -> tuple[str, ...]:
    """Return ``targets`` as a sorted-by-layer-order tuple of HF projection names.

    Accepts ``"all"``, ``"attention"`` (q,k,v,o), ``"mlp"`` (gate,up,down), a single name or a
    list of names/aliases. Raises :class:`ConfigError` on an unknown module.
    """
    if isinstance(targets, str):
        if targets == "all":
            return PROJECTIONS
        if targets == "attention":
            return PROJECTIONS[:4]
        if targets == "mlp":
            return PROJECTIONS[4:]
        targets = [targets]
    try:
        names = list(targets)
    except TypeError:
        raise ConfigError(
            f"{where}: {targets!r} is not a list of modules; use e.g. [q_proj, v_proj] or 'all'"
        ) from None
    out = set()
    for name in names:
        full = PROJECTION_ALIASES.get(str(name), str(name))
        if full not in PROJECTIONS:
            raise ConfigError(
                f"{where}: unknown target module {name!r}; choose from {', '.join(PROJECTIONS)}"
            )
        out.add(full)
    if not out:
        raise ConfigError(f"{where}: empty target module list; name at least one projection")
    return tuple(p for p in PROJECTIONS if p in out)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoRAConfig:
    """One config: the hyperparameters of one LoRA adapter's training run.

    Exactly one of ``max_steps`` and ``epochs`` sets the training length.
    """

    config_id: str = ""
    """Stable id; derived from the hyperparameters (a short hash) when left empty."""
    rank: int
    """LoRA rank r (>= 1)."""
    alpha: float
    """LoRA alpha; the adapter's scale is alpha / r (alpha / sqrt(r) with ``use_rslora``)."""
    lr: float
    """Peak AdamW learning rate (> 0)."""
    batch_size: int
    """Sequences per optimizer step for this adapter (>= 1)."""
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    """Subset of :data:`PROJECTIONS` this adapter adds LoRA to."""
    dropout: float = 0.0
    """LoRA dropout on the adapter input, in [0, 1)."""
    max_steps: int | None = None
    """Optimizer steps to train; exclusive with ``epochs``."""
    epochs: float | None = None
    """Passes over the training split; exclusive with ``max_steps``."""
    warmup_steps: int = 0
    """Linear warmup steps from 0 to ``lr``."""
    schedule: Schedule = Schedule.CONSTANT
    """Schedule after warmup: constant, linear decay to 0, or cosine decay to 0."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float | None = 1.0
    """Per-adapter gradient clipping (L2 over this adapter's parameters); None disables."""
    use_rslora: bool = False
    """Scale by alpha / sqrt(r) (rsLoRA) instead of alpha / r."""
    seed: int = 0
    """Seeds adapter init, data order and dropout for this config alone."""

    def __post_init__(self) -> None:
        where = f"config {self.config_id or '<new>'}"
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError(f"{where}: rank={self.rank!r} must be an integer >= 1")
        if not self.alpha > 0:
            raise ConfigError(f"{where}: alpha={self.alpha!r} must be > 0")
        if not self.lr > 0:
            raise ConfigError(f"{where}: lr={self.lr!r} must be > 0")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"{where}: batch_size={self.batch_size!r} must be an integer >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{where}: dropout={self.dropout!r} must be in [0, 1)")
        if (self.max_steps is None) == (self.epochs is None):
            raise ConfigError(f"{where}: set exactly one of max_steps and epochs")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"{where}: max_steps={self.max_steps!r} must be >= 1")
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(f"{where}: epochs={self.epochs!r} must be > 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"{where}: warmup_steps={self.warmup_steps!r} must be >= 0")
        if self.weight_decay < 0:
            raise ConfigError(f"{where}: weight_decay={self.weight_decay!r} must be >= 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"{where}: max_grad_norm={self.max_grad_norm!r} must be > 0 or null")
        object.__setattr__(self, "target_modules", normalize_targets(self.target_modules))
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        if not self.config_id:
            object.__setattr__(self, "config_id", self.fingerprint())

    @property
    def scale(self) -> float:
        """The LoRA output scale s = alpha / r (or alpha / sqrt(r) for rsLoRA)."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    def hparams(self) -> dict[str, Any]:
        """The hyperparameters as plain JSON-able values, without ``config_id``."""
        # fields read as they are: each is a scalar, an enum or a tuple of str (immutable), so
        # dataclasses.asdict's deep copy only cost time (the driver writes every config's dict
        # into state.json's log at each write: 45 % of its time at 10,000 configs)
        d = {name: getattr(self, name) for name in _HPARAMS}
        d["target_modules"] = list(self.target_modules)
        d["schedule"] = str(self.schedule)
        return d

    def fingerprint(self) -> str:
        """A short stable hash of the hyperparameters (used as the default ``config_id``)."""
        blob = json.dumps(self.hparams(), sort_keys=True, default=str).encode()
        return "c" + hashlib.sha1(blob).hexdigest()[:10]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict including ``config_id``; inverse of :meth:`from_dict`."""
        return {"config_id": self.config_id, **self.hparams()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoRAConfig:
        """Build from :meth:`to_dict` output (lists become tuples)."""
        data = dict(data)
        if "target_modules" in data:
            data["target_modules"] = tuple(data["target_modules"])
        return cls(**data)


_HPARAMS = tuple(f.name for f in fields(LoRAConfig) if f.name != "config_id")


__all__ = ["PROJECTIONS", "PROJECTION_ALIASES", "LoRAConfig", "Schedule", "normalize_targets"]
