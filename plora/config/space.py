"""The search space: YAML parameters -> :class:`~plora.config.LoRAConfig` configs.

Each parameter of :class:`SearchSpace` is a :class:`Domain`, written in YAML as

* a fixed value: ``rank: 16``;
* a grid: ``lr: [1.0e-4, 2.0e-4]`` or ``lr: {grid: [1.0e-4, 2.0e-4]}`` (``grid_search`` too);
* a distribution, with Ray Tune's names and bounds semantics: ``{uniform: [lo, hi]}``,
  ``{quniform: [lo, hi, q]}``, ``{loguniform: [lo, hi]}``, ``{qloguniform: [lo, hi, q]}``,
  ``{randint: [lo, hi]}`` (hi exclusive), ``{qrandint: [lo, hi, q]}`` (hi inclusive),
  ``{lograndint: [lo, hi]}`` (hi exclusive), ``{qlograndint: [lo, hi, q]}`` (hi inclusive),
  ``{choice: [a, b, c]}``; the bounds may also be a mapping ``{low: .., high: .., q: ..}``.

``target_modules`` values are themselves lists, so a plain list of module names is *one*
fixed value; a list of choices (each a list or ``all`` / ``attention`` / ``mlp``) is a grid.

Turning a space into configs (:func:`plora.tune.space.expand`) and into Ray Tune domains lives
in :mod:`plora.tune.space`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from plora.config.errors import ConfigError, join_key
from plora.config.lora import PROJECTIONS, Schedule, normalize_targets
from plora.config.validate import as_bool, as_choice, as_float, as_int, check_keys


class Kind(StrEnum):
    """What a :class:`Domain` is: fixed, grid, or a Ray Tune sampling distribution."""

    FIXED = "fixed"
    GRID = "grid"
    CHOICE = "choice"
    UNIFORM = "uniform"
    QUNIFORM = "quniform"
    LOGUNIFORM = "loguniform"
    QLOGUNIFORM = "qloguniform"
    RANDINT = "randint"
    QRANDINT = "qrandint"
    LOGRANDINT = "lograndint"
    QLOGRANDINT = "qlograndint"


_LISTED = (Kind.FIXED, Kind.GRID, Kind.CHOICE)
_INT_KINDS = (Kind.RANDINT, Kind.QRANDINT, Kind.LOGRANDINT, Kind.QLOGRANDINT)
_QUANTIZED = (Kind.QUNIFORM, Kind.QLOGUNIFORM, Kind.QRANDINT, Kind.QLOGRANDINT)
_LOG = (Kind.LOGUNIFORM, Kind.QLOGUNIFORM, Kind.LOGRANDINT, Kind.QLOGRANDINT)


@dataclass(frozen=True, kw_only=True, slots=True)
class Domain:
    """One parameter's values: ``values`` for fixed/grid/choice, else ``[low, high]`` (+ ``q``)."""

    kind: Kind
    """Fixed value, grid, choice or distribution."""
    values: tuple[Any, ...] = ()
    """The value (fixed: exactly one) or the candidates (grid, choice)."""
    low: float | None = None
    """Lower bound (inclusive) of a distribution."""
    high: float | None = None
    """Upper bound: exclusive for randint/lograndint, inclusive otherwise (Ray Tune's rules)."""
    q: float | None = None
    """Quantization step of the q* distributions."""

    @property
    def is_fixed(self) -> bool:
        """A single value."""
        return self.kind is Kind.FIXED

    def sample(self, rng: random.Random) -> Any:
        """One draw; a grid counts as a uniform choice."""
        k, lo, hi = self.kind, self.low, self.high
        if k is Kind.FIXED:
            return self.values[0]
        if k in (Kind.GRID, Kind.CHOICE):
            return self.values[rng.randrange(len(self.values))]
        assert lo is not None and hi is not None
        if k is Kind.RANDINT:
            return rng.randrange(int(lo), int(hi))
        if k is Kind.QRANDINT:
            x: float = rng.randint(int(lo), int(hi))
        elif k in _LOG:
            x = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        else:
            x = rng.uniform(lo, hi)
        if k is Kind.LOGRANDINT:
            return min(int(hi) - 1, int(x))
        if self.q is None:
            return x
        q = self.q
        steps = min(max(round(x / q), math.ceil(lo / q - 1e-9)), math.floor(hi / q + 1e-9))
        return int(steps * q) if k in _INT_KINDS else round(steps * q, 12)

    def to_yaml(self, encode: Callable[[Any], Any] = lambda v: v) -> Any:
        """The YAML form this domain is read back from (see the module docstring)."""
        if self.kind is Kind.FIXED:
            return encode(self.values[0])
        if self.kind is Kind.GRID:
            return [encode(v) for v in self.values]
        if self.kind is Kind.CHOICE:
            return {str(self.kind): [encode(v) for v in self.values]}
        bounds = [self.low, self.high] + ([self.q] if self.q is not None else [])
        return {str(self.kind): bounds}


@dataclass(frozen=True, slots=True)
class _Param:
    kind: str  # float | int | bool | schedule | targets
    check: Callable[[Any, str], Any]  # validate + normalize one value (raises ConfigError)
    default: Any = None


def _targets(v: Any, key: str) -> tuple[str, ...]:
    try:
        return normalize_targets(v, where=key)
    except ConfigError as err:
        raise ConfigError(
            str(err).split(": ", 1)[-1].split(";")[0], key=key, value=v,
            fix=f"use all, attention, mlp or a list of {', '.join(PROJECTIONS)}",
        ) from None  # fmt: skip


def _grad_norm(v: Any, key: str) -> float | None:
    return None if v is None else as_float(v, key, gt=0.0, fix="use a positive norm or null")


#: Every parameter a config has, in expansion order, with its type and check.
PARAMS: dict[str, _Param] = {
    "lr": _Param("float", lambda v, k: as_float(v, k, gt=0.0, fix="use a positive learning rate, e.g. 1.0e-4")),
    "batch_size": _Param("int", lambda v, k: as_int(v, k, ge=1, fix="use a batch size such as 1, 8 or 32")),
    "rank": _Param("int", lambda v, k: as_int(v, k, ge=1, fix="use a LoRA rank such as 8, 16 or 64")),
    "alpha": _Param("float", lambda v, k: as_float(v, k, gt=0.0, fix="use a positive alpha, e.g. 2 * rank")),
    "alpha_ratio": _Param("float", lambda v, k: as_float(v, k, gt=0.0, fix="alpha = alpha_ratio * rank; use e.g. 2")),
    "target_modules": _Param("targets", _targets, PROJECTIONS[:1] + PROJECTIONS[2:3]),
    "dropout": _Param("float", lambda v, k: as_float(v, k, ge=0.0, lt=1.0, fix="use a dropout in [0, 1), e.g. 0.05"), 0.0),
    "epochs": _Param("float", lambda v, k: as_float(v, k, gt=0.0, fix="use a positive number of epochs, e.g. 1")),
    "max_steps": _Param("int", lambda v, k: as_int(v, k, ge=1, fix="use a positive step count, e.g. 100")),
    "warmup_steps": _Param("int", lambda v, k: as_int(v, k, ge=0, fix="use 0 or more warmup steps"), 0),
    "schedule": _Param("schedule", lambda v, k: Schedule(as_choice(v, k, [s.value for s in Schedule])), Schedule.CONSTANT),
    "weight_decay": _Param("float", lambda v, k: as_float(v, k, ge=0.0, fix="use 0 or a small decay such as 0.01"), 0.0),
    "max_grad_norm": _Param("float", _grad_norm, 1.0),
    "use_rslora": _Param("bool", as_bool, False),
    "seed": _Param("int", lambda v, k: as_int(v, k, ge=0, fix="use a non-negative integer seed"), 0),
}  # fmt: skip
_HINTS = {"learning_rate": "lr", "r": "rank", "lora_r": "rank", "lora_rank": "rank", "lora_alpha": "alpha",
          "bs": "batch_size", "lora_dropout": "dropout", "steps": "max_steps", "num_epochs": "epochs",
          "lr_scheduler_type": "schedule", "scheduler": "schedule", "targets": "target_modules"}  # fmt: skip
TARGET_PRESETS = ("all", "attention", "mlp")


def _parse_domain(name: str, raw: Any) -> Domain:
    """Parse and validate the YAML value of parameter ``name`` (errors keyed ``name...``)."""
    p = PARAMS[name]
    if isinstance(raw, Mapping):
        if len(raw) != 1:
            raise ConfigError("a distribution is a mapping with one key", key=name, value=dict(raw),
                              fix=f"write e.g. {{loguniform: [1.0e-5, 1.0e-3]}}; kinds: {', '.join(k.value for k in Kind if k is not Kind.FIXED)}")  # fmt: skip
        (kind_name, body), = raw.items()  # fmt: skip
        kind_name = "grid" if kind_name == "grid_search" else kind_name
        check_keys({kind_name: body}, [k.value for k in Kind if k is not Kind.FIXED], where=name)
        kind = Kind(kind_name)
        key = join_key(name, kind_name)
        if kind in (Kind.GRID, Kind.CHOICE):
            return _listed(p, kind, body, key)
        return _ranged(p, kind, body, name)
    if isinstance(raw, list | tuple) and p.kind == "targets":
        if not raw:
            raise ConfigError(
                "empty list", key=name, value=raw, fix="name at least one module or use all"
            )
        if all(isinstance(v, str) and v not in TARGET_PRESETS for v in raw):
            return Domain(kind=Kind.FIXED, values=(p.check(raw, name),))
        if any(isinstance(v, str) and v not in TARGET_PRESETS for v in raw):
            raise ConfigError("mixes module names and choices", key=name, value=raw,
                              fix="write one list of modules, or {grid: [[q_proj, v_proj], all]} for a grid")  # fmt: skip
        return _listed(p, Kind.GRID, raw, name)
    if isinstance(raw, list | tuple):
        return _listed(p, Kind.GRID, raw, name)
    return Domain(kind=Kind.FIXED, values=(p.check(raw, name),))


def _listed(p: _Param, kind: Kind, body: Any, key: str) -> Domain:
    if not isinstance(body, list | tuple):
        raise ConfigError(
            "must be a list of values", key=key, value=body, fix="write e.g. [8, 16, 32]"
        )
    if not body:
        raise ConfigError(f"empty {kind} list", key=key, value=body, fix="give at least one value")
    values = tuple(p.check(v, join_key(key, i)) for i, v in enumerate(body))
    if len(set(values)) != len(values):
        dup = next(v for i, v in enumerate(values) if v in values[:i])
        raise ConfigError("duplicate value", key=key, value=dup, fix="list each value once")
    return Domain(kind=kind, values=values)


def _ranged(p: _Param, kind: Kind, body: Any, name: str) -> Domain:
    if p.kind not in ("float", "int"):
        raise ConfigError(f"{name} takes listed values only", key=join_key(name, str(kind)), value=body,
                          fix="use a fixed value, a list (grid) or {choice: [...]}")  # fmt: skip
    if p.kind == "int" and kind not in _INT_KINDS:
        raise ConfigError(f"{name} is an integer", key=join_key(name, str(kind)), value=body,
                          fix="use randint, qrandint, lograndint, qlograndint or a grid")  # fmt: skip
    names = ("low", "high", "q") if kind in _QUANTIZED else ("low", "high")
    if isinstance(body, Mapping):
        check_keys(body, names, where=name)
        missing = [n for n in names if n not in body]
        if missing:
            raise ConfigError(f"missing {missing[0]}", key=join_key(name, missing[0]), value=dict(body),
                              fix=f"give {', '.join(names)}")  # fmt: skip
        args = dict(body)
    elif isinstance(body, list | tuple) and len(body) == len(names):
        args = dict(zip(names, body, strict=True))
    else:
        raise ConfigError(f"{kind} needs [{', '.join(names)}]", key=join_key(name, str(kind)), value=body,
                          fix=f"write {{{kind}: [{', '.join(names)}]}}")  # fmt: skip
    num = (lambda v, k: as_int(v, k)) if kind in _INT_KINDS else (lambda v, k: as_float(v, k))
    lo, hi = num(args["low"], join_key(name, "low")), num(args["high"], join_key(name, "high"))
    p.check(lo, join_key(name, "low"))
    q = None
    if "q" in args:
        q = num(args["q"], join_key(name, "q"))
        if q <= 0:
            raise ConfigError(
                "must be > 0", key=join_key(name, "q"), value=args["q"], fix="use a positive step"
            )
    exclusive = kind in (Kind.RANDINT, Kind.LOGRANDINT)
    if hi <= lo if exclusive or kind not in _INT_KINDS else hi < lo:
        raise ConfigError(f"must be > low={lo:g}" + (" (high is exclusive)" if exclusive else ""),
                          key=join_key(name, "high"), value=args["high"], fix="swap or widen the bounds")  # fmt: skip
    p.check(hi - 1 if exclusive else hi, join_key(name, "high"))
    if kind in _LOG and lo <= 0:
        raise ConfigError("must be > 0 for a log distribution", key=join_key(name, "low"), value=args["low"],
                          fix="use a positive lower bound or a uniform distribution")  # fmt: skip
    if q is not None and math.floor(hi / q + 1e-9) < math.ceil(lo / q - 1e-9):
        raise ConfigError(
            "no multiple of q lies in [low, high]",
            key=join_key(name, "q"),
            value=q,
            fix="use a smaller q",
        )
    return Domain(kind=kind, low=lo, high=hi, q=q)


def _fixed(value: Any) -> Domain:
    return Domain(kind=Kind.FIXED, values=(value,))


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    """The domain of every config hyperparameter (see the module docstring for the YAML).

    Exactly one of ``alpha`` / ``alpha_ratio`` and one of ``epochs`` / ``max_steps``.
    """

    lr: Domain
    """Peak learning rate."""
    batch_size: Domain
    """Sequences per optimizer step."""
    rank: Domain
    """LoRA rank r."""
    alpha: Domain | None = None
    """LoRA alpha, absolute."""
    alpha_ratio: Domain | None = None
    """LoRA alpha relative to the rank: alpha = alpha_ratio * rank (the paper's r/4 .. 4r)."""
    target_modules: Domain = field(default_factory=lambda: _fixed(PARAMS["target_modules"].default))
    """Projections to adapt; each value a module list or all / attention / mlp."""
    dropout: Domain = field(default_factory=lambda: _fixed(0.0))
    """LoRA dropout in [0, 1)."""
    epochs: Domain | None = None
    """Passes over the training data."""
    max_steps: Domain | None = None
    """Optimizer steps."""
    warmup_steps: Domain = field(default_factory=lambda: _fixed(0))
    """Linear warmup steps."""
    schedule: Domain = field(default_factory=lambda: _fixed(Schedule.CONSTANT))
    """constant | linear | cosine after warmup."""
    weight_decay: Domain = field(default_factory=lambda: _fixed(0.0))
    """AdamW weight decay."""
    max_grad_norm: Domain = field(default_factory=lambda: _fixed(1.0))
    """Per-adapter gradient clip norm (null: none)."""
    use_rslora: Domain = field(default_factory=lambda: _fixed(False))
    """rsLoRA scaling alpha / sqrt(r)."""
    seed: Domain = field(default_factory=lambda: _fixed(0))
    """Per-config seed (adapter init, data order, dropout)."""

    def __post_init__(self) -> None:
        for a, b in (("alpha", "alpha_ratio"), ("epochs", "max_steps")):
            if (getattr(self, a) is None) == (getattr(self, b) is None):
                both = getattr(self, a) is not None
                if both:
                    raise ConfigError(f"set exactly one of {a} and {b} (both given)", key=b,
                                      value=_domain_yaml(b, getattr(self, b)), fix=f"remove {a} or {b}")  # fmt: skip
                raise ConfigError(
                    f"set exactly one of {a} and {b} (neither given)",
                    key=a,
                    fix=f"add {a}: or {b}:",
                )
        for name in PARAMS:
            dom = getattr(self, name)
            if dom is None:
                continue
            if not isinstance(dom, Domain):
                raise ConfigError(
                    "must be a Domain",
                    key=name,
                    value=dom,
                    fix="build spaces with SearchSpace.from_dict",
                )
            if (
                _parse_domain(name, _domain_yaml(name, dom)) != dom
            ):  # validates programmatic domains
                raise ConfigError(
                    "not in normal form",
                    key=name,
                    value=dom,
                    fix="build spaces with SearchSpace.from_dict",
                )

    def domains(self) -> dict[str, Domain]:
        """The parameters that are set, in expansion order."""
        return {n: d for n in PARAMS if (d := getattr(self, n)) is not None}

    @property
    def grid_size(self) -> int:
        """Points of the Cartesian product of the grid parameters (1 with no grid)."""
        return math.prod(self.grid_counts().values())

    def grid_counts(self) -> dict[str, int]:
        """Values of each grid parameter (the factors of :attr:`grid_size`)."""
        return {n: len(d.values) for n, d in self.domains().items() if d.kind is Kind.GRID}

    @classmethod
    def from_dict(cls, raw: Any) -> SearchSpace:
        """Parse the ``space:`` section (errors keyed relative to it, e.g. ``lr.low``)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(
                "must be a mapping of parameters",
                value=raw,
                fix="write e.g. lr: 1.0e-4 / rank: [8, 16]",
            )
        if not raw:
            raise ConfigError(
                "empty search space",
                value={},
                fix="set at least lr, batch_size, rank, alpha(_ratio), and epochs or max_steps",
            )
        for key in raw:
            if key not in PARAMS and key in _HINTS:
                raise ConfigError(f"unknown key (did you mean {_HINTS[key]!r}?)", key=str(key), value=raw[key],
                                  fix=f"rename it to {_HINTS[key]}")  # fmt: skip
        check_keys(raw, PARAMS, where=None)
        for name in ("lr", "batch_size", "rank"):
            if name not in raw:
                raise ConfigError(
                    "missing required parameter",
                    key=name,
                    fix=f"add {name}: (a value, a list or a distribution)",
                )
        return cls(**{name: _parse_domain(name, value) for name, value in raw.items()})

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (inverse of :meth:`from_dict`)."""
        return {name: _domain_yaml(name, dom) for name, dom in self.domains().items()}


def _domain_yaml(name: str, dom: Domain) -> Any:
    if name == "target_modules" and dom.kind is not Kind.FIXED:
        return {str(dom.kind): [targets_yaml(v) for v in dom.values]}
    return dom.to_yaml(targets_yaml if name == "target_modules" else plain_value)


def plain_value(v: Any) -> Any:
    return str(v) if isinstance(v, StrEnum) else v


def targets_yaml(t: tuple[str, ...]) -> Any:
    """Target modules as YAML writes them: a preset's name (all, attention, mlp) or the list."""
    presets = {PROJECTIONS: "all", PROJECTIONS[:4]: "attention", PROJECTIONS[4:]: "mlp"}
    return presets.get(tuple(t), list(t))


__all__ = [
    "PARAMS",
    "TARGET_PRESETS",
    "Domain",
    "Kind",
    "SearchSpace",
    "plain_value",
    "targets_yaml",
]
