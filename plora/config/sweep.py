"""A whole sweep read from YAML: :class:`SweepConfig`.

Model, dataset, search space, search algorithm, hardware, planner and training options (the
last two: :mod:`plora.config.sweep_options`, re-exported here). Bad values fail here, before
any Ray or GPU work, with a :class:`ConfigError` naming the file, key and value.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from plora.config.asha_options import EarlyStopConfig
from plora.config.dataset import BUILTIN_DATASETS, DatasetSpec
from plora.config.errors import ConfigError, join_key
from plora.config.fused import FUSED_KERNELS_KEY, FusedKernels
from plora.config.hardware import HardwareConfig, Strategy
from plora.config.model import ModelRef, looks_like_path
from plora.config.space import SearchSpace
from plora.config.sweep_options import (
    DEFAULT_MAX_CONFIGS,
    PLANNER_SOLVERS,
    CpuOffload,
    CudaGraphs,
    PlannerOptions,
    TrainingOptions,
    job_strategies,
)
from plora.config.tracking import LoggingOptions
from plora.config.validate import (
    as_choice,
    as_int,
    as_str,
    check_keys,
    expect_mapping,
    load_yaml,
)

#: What a sweep ranks configs by: eval/train loss (min) or the dataset's task metric (max).
SWEEP_METRICS: tuple[str, ...] = ("eval_loss", "train_loss", "eval_metric")


class SearchAlgo(StrEnum):
    """How configs are drawn from the space (Ray Tune searcher names)."""

    GRID = "grid"
    RANDOM = "random"
    OPTUNA = "optuna"
    HYPEROPT = "hyperopt"


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepConfig:
    """A whole sweep: what to fine-tune, on what, over which space, on which hardware.

    Read from YAML with :meth:`from_yaml`; :meth:`to_yaml` writes it back (round trip).
    Configs come from :func:`plora.tune.space.expand` (grid/random) or a Ray Tune searcher
    (optuna/hyperopt, via :func:`plora.tune.space.to_tune_param_space`).
    """

    name: str
    """Sweep name (letters, digits, ``.``, ``_``, ``-``); names the sweep directory."""
    model: ModelRef
    """The frozen base model."""
    dataset: DatasetSpec
    """The fine-tuning data."""
    space: SearchSpace
    """The search space over LoRA hyperparameters."""
    search: SearchAlgo = SearchAlgo.GRID
    """grid: Cartesian product of grid parameters (x num_samples); random: num_samples draws;
    optuna / hyperopt: num_samples trials proposed by that Ray Tune searcher."""
    num_samples: int = 1
    """Grid: repeats of the grid (random parameters re-drawn, seed advanced); others: configs."""
    metric: str = "eval_loss"
    """What ranks configs: eval_loss | train_loss | eval_metric (the dataset's task metric)."""
    mode: str = ""
    """min | max; default min for losses and max for eval_metric."""
    seed: int = 0
    """Seed of the search itself (random draws, searcher); configs carry their own ``seed``."""
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    """The GPUs."""
    planner: PlannerOptions = field(default_factory=PlannerOptions)
    """Job planner options."""
    training: TrainingOptions = field(default_factory=TrainingOptions)
    """Training options shared by all jobs."""
    early_stop: EarlyStopConfig | None = None
    """Stop lagging configs early inside their packs (``early_stop:``; None: train all steps)."""
    logging: LoggingOptions = field(default_factory=LoggingOptions)
    """Where the live curves go (``logging:``): TensorBoard under the sweep directory by
    default; MLflow, W&B when asked (:mod:`plora.config.tracking`)."""
    source: str | None = field(default=None, compare=False)
    """The YAML file this sweep was read from (for error messages); not part of the sweep."""
    key_lines: Mapping[str, int] | None = field(default=None, compare=False, repr=False)
    """Line of every key path in :attr:`source` (``hardware.num_gpus`` -> 4), so that checks
    made after reading (:meth:`locate`) point at the line too; not part of the sweep."""

    def __post_init__(self) -> None:
        name = as_str(self.name, "name")
        if not re.fullmatch(r"[A-Za-z0-9][\w.\-]*", name):
            raise ConfigError("must be letters, digits, '.', '_' or '-'", key="name", value=name,
                              fix="it names the sweep directory; e.g. qwen-lr-rank")  # fmt: skip
        for key, cls in (("model", ModelRef), ("dataset", DatasetSpec), ("space", SearchSpace),
                         ("hardware", HardwareConfig), ("planner", PlannerOptions), ("training", TrainingOptions),
                         ("logging", LoggingOptions)):  # fmt: skip
            if not isinstance(getattr(self, key), cls):
                raise ConfigError(f"must be a {cls.__name__}", key=key, value=getattr(self, key))
        if self.early_stop is not None and not isinstance(self.early_stop, EarlyStopConfig):
            raise ConfigError("must be an EarlyStopConfig", key="early_stop", value=self.early_stop)
        object.__setattr__(self, "search", SearchAlgo(as_choice(str(self.search) if isinstance(self.search, SearchAlgo) else self.search, "search", [a.value for a in SearchAlgo])))  # fmt: skip
        as_int(self.num_samples, "num_samples", ge=1)
        as_choice(self.metric, "metric", SWEEP_METRICS)
        mode = self.mode or ("max" if self.metric == "eval_metric" else "min")
        as_choice(mode, "mode", ("min", "max"))
        if self.metric.endswith("_loss") and mode == "max":
            raise ConfigError(
                "a loss is minimized",
                key="mode",
                value=mode,
                fix="use mode: min or metric: eval_metric",
            )
        object.__setattr__(self, "mode", mode)
        as_int(self.seed, "seed", ge=0)
        if self.training.fused_kernels is FusedKernels.ON and self.hardware.is_cpu:
            raise ConfigError(
                "Liger-Kernel's fused ops run on CUDA only; this sweep runs on CPU "
                "(hardware.gpu_type: cpu)", key=FUSED_KERNELS_KEY, value="on",
                fix="use auto or off",
            )  # fmt: skip
        if self.planner.cpu_offload is CpuOffload.ON and self.hardware.is_cpu:
            raise ConfigError(
                "CPU workers hold the base in host memory already (hardware.gpu_type: cpu)",
                key="planner.cpu_offload", value="on", fix="use auto or off",
            )  # fmt: skip
        self._check_size()

    @property
    def job_strategies(self) -> tuple[Strategy, ...]:
        """The strategies the plan's d > 1 jobs may have: ``planner.strategies`` with
        ``planner.cpu_offload`` applied (:func:`~plora.config.sweep_options.job_strategies`)."""
        return job_strategies(
            self.planner.strategies, self.planner.cpu_offload, cpu=self.hardware.is_cpu
        )

    @property
    def num_configs(self) -> int:
        """Configs the sweep has, computed without expanding it: grid points x ``num_samples``
        for a grid search, ``num_samples`` for the others."""
        if self.search is SearchAlgo.GRID:
            return self.space.grid_size * self.num_samples
        return self.num_samples

    def size_factors(self) -> dict[str, int]:
        """What multiplies :attr:`num_configs`: each grid parameter's value count (grid search)
        and ``num_samples`` when above 1, largest first."""
        factors: dict[str, int] = {}
        if self.search is SearchAlgo.GRID:
            factors = {f"space.{n}": n_values for n, n_values in self.space.grid_counts().items()}
        if self.num_samples > 1:
            factors["num_samples"] = self.num_samples
        return dict(sorted(factors.items(), key=lambda kv: -kv[1]))

    def _check_size(self) -> None:
        limit = self.planner.max_configs
        n = self.num_configs
        if n <= limit:
            return
        factors = self.size_factors()
        product = " x ".join(f"{k} ({v})" for k, v in factors.items())
        in_space = any(k.startswith("space.") for k in factors)
        raise ConfigError(
            f"{n:,} configs ({product}) exceeds planner.max_configs={limit:,}",
            key="space" if in_space else "num_samples",
            fix=("use fewer values of those parameters (or search: random with num_samples)"
                 if in_space else "lower num_samples") + ", or raise planner.max_configs",
        )  # fmt: skip

    def locate(self, err: ConfigError) -> ConfigError:
        """``err`` with this sweep's file and the line of its key filled in (what it already
        names is kept): for the checks that need more than the file (the model's shape, the
        cluster's GPUs), made after it was read."""
        return err.located(file=self.source, lines=self.key_lines)

    @contextlib.contextmanager
    def located(self) -> Iterator[None]:
        """A :class:`ConfigError` raised inside comes out :meth:`locate` d (one line, no
        traceback chain)."""
        try:
            yield
        except ConfigError as err:
            raise self.locate(err) from None

    @property
    def seq_len(self) -> int:
        """The sequence length used for planning: ``planner.seq_len`` or ``dataset.max_seq_len``."""
        return self.planner.seq_len or self.dataset.max_seq_len

    def check_trainable(self) -> None:
        """Checks that only matter once training starts (dataset files exist); raises
        :class:`ConfigError` naming this sweep's file."""
        try:
            self.dataset.check_files()
        except ConfigError as err:
            raise err.located(file=self.source, prefix="dataset") from None

    # --------------------------------------------------------------------------- YAML / dict

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict in the YAML layout; ``from_dict(to_dict())`` gives an equal sweep."""
        ds = {k: getattr(self.dataset, k) for k in _fields(DatasetSpec)}
        return {
            "name": self.name,
            "model": {k: getattr(self.model, k) for k in _fields(ModelRef)},
            "dataset": {k: v for k, v in ds.items() if v is not None},
            "space": self.space.to_dict(),
            "search": str(self.search),
            "num_samples": self.num_samples,
            "metric": self.metric,
            "mode": self.mode,
            "seed": self.seed,
            "hardware": {k: getattr(self.hardware, k) for k in _fields(HardwareConfig)},
            "planner": {
                **{k: _plain(getattr(self.planner, k)) for k in _fields(PlannerOptions)},
                "strategies": [str(s) for s in self.planner.strategies],
            },
            "training": {k: _plain(getattr(self.training, k)) for k in _fields(TrainingOptions)},
            **({"early_stop": self.early_stop.to_dict()} if self.early_stop is not None else {}),
            **({"logging": self.logging.to_dict()} if self.logging != LoggingOptions() else {}),
        }

    def to_yaml(self, path: str | os.PathLike[str] | None = None) -> str:
        """The sweep as YAML text; also written atomically to ``path`` when given."""
        import yaml

        class Dumper(yaml.SafeDumper):
            """Block style, except lists of scalars (``[8, 16, 32]``)."""

        def represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
            flow = all(not isinstance(v, list | dict) for v in data)
            return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

        Dumper.add_representer(list, represent_list)
        text = yaml.dump(self.to_dict(), Dumper=Dumper, sort_keys=False, width=100)
        if path is not None:
            from plora.utils import atomic_write_text

            atomic_write_text(path, text)
        return text

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> SweepConfig:
        """Read and validate a sweep file. Every problem is a one-line :class:`ConfigError`
        naming the file, line, key path and value. Relative paths inside are resolved against
        the file's directory."""
        data, lines = load_yaml(path)
        return cls.from_dict(data, source=str(path), lines=lines, base_dir=Path(path).parent)

    @classmethod
    def from_dict(
        cls,
        data: Any,
        *,
        source: str | None = None,
        lines: dict[str, int] | None = None,
        base_dir: str | os.PathLike[str] | None = None,
    ) -> SweepConfig:
        """Validate a parsed YAML document (see :meth:`from_yaml`)."""
        try:
            sweep = _parse_sweep(cls, data, SearchSpace, source=source, base_dir=base_dir)
        except ConfigError as err:
            raise err.located(file=source, lines=lines) from None
        if lines:
            object.__setattr__(sweep, "key_lines", dict(lines))
        return sweep


_TOP_KEYS = ("name", "model", "dataset", "space", "search", "num_samples", "metric", "mode",
             "seed", "hardware", "planner", "training", "seq_len", "early_stop", "logging")  # fmt: skip


def _or_empty(section: Any) -> Any:
    """An absent or empty (``key:`` with no value) section means all defaults."""
    return {} if section is None else section


def _plain(value: Any) -> Any:
    """An enum member as its string (what YAML writes); anything else unchanged."""
    return str(value) if isinstance(value, StrEnum) else value


def _fields(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _resolve(value: Any, base_dir: str | os.PathLike[str] | None) -> Any:
    """Make a relative path absolute against the sweep file's directory."""
    if not isinstance(value, str) or base_dir is None or Path(value).expanduser().is_absolute():
        return value
    return str((Path(base_dir) / value).resolve())


def _section(cls: type, raw: Any, key: str, *, required: tuple[str, ...] = ()) -> Any:
    """Build dataclass ``cls`` from mapping ``raw`` found at ``key``; errors get the key prefix."""
    raw = expect_mapping(raw, key, what=f"the {key} section")
    check_keys(raw, _fields(cls), where=key)
    for name in required:
        if name not in raw:
            raise ConfigError(
                "missing required key", key=join_key(key, name), fix=f"add {name}: under {key}:"
            )
    try:
        return cls(**raw)
    except ConfigError as err:
        raise err.located(prefix=key) from None


def _parse_sweep(cls: type[SweepConfig], data: Any, space_cls: Any, *, source: str | None,
                 base_dir: str | os.PathLike[str] | None) -> SweepConfig:  # fmt: skip
    if data is None:
        raise ConfigError("empty sweep file", fix="write at least model:, dataset: and space:")
    data = dict(expect_mapping(data, None, what="a sweep: model, dataset, space, ..."))
    check_keys(data, _TOP_KEYS, where=None)
    for key, example in (("model", "model: Qwen/Qwen2.5-0.5B"), ("dataset", "dataset: {builtin: arithmetic}"),
                         ("space", "space: {lr: 1.0e-4, rank: 8, ...}")):  # fmt: skip
        if data.get(key) is None:
            raise ConfigError("missing required section", key=key, fix=f"add e.g. {example}")
    model = data["model"]
    if isinstance(model, str):
        model = {"name_or_path": model}
    model = dict(
        expect_mapping(model, "model", what="name_or_path, dtype, quantization, trust_remote_code")
    )
    name = model.get("name_or_path")
    if isinstance(name, str) and looks_like_path(name):
        model["name_or_path"] = _resolve(name, base_dir)
    dataset = data["dataset"]
    if isinstance(dataset, str):
        dataset = {"builtin": dataset} if dataset in BUILTIN_DATASETS else {"path": dataset}
    dataset = dict(expect_mapping(dataset, "dataset", what="path or builtin, num_examples, ..."))
    for key in ("path", "eval_path"):
        dataset[key] = _resolve(dataset.get(key), base_dir)
        if dataset[key] is None:
            dataset.pop(key)
    if "seq_len" in data:
        seq_len = as_int(data["seq_len"], "seq_len", ge=8)
        if dataset.setdefault("max_seq_len", seq_len) != seq_len:
            raise ConfigError("differs from dataset.max_seq_len", key="seq_len", value=seq_len,
                              fix="give the sequence length once")  # fmt: skip
    kwargs: dict[str, Any] = {
        "model": _section(ModelRef, model, "model", required=("name_or_path",)),
        "dataset": _section(DatasetSpec, dataset, "dataset"),
        "hardware": _section(HardwareConfig, _or_empty(data.get("hardware")), "hardware"),
        "planner": _section(PlannerOptions, _or_empty(data.get("planner")), "planner"),
        "training": _section(TrainingOptions, _or_empty(data.get("training")), "training"),
    }
    if data.get("early_stop") is not None:
        kwargs["early_stop"] = _section(EarlyStopConfig, data["early_stop"], "early_stop")
    if data.get("logging") is not None:
        try:
            kwargs["logging"] = LoggingOptions.from_dict(data["logging"], base_dir=base_dir)
        except ConfigError as err:
            raise err.located(prefix="logging") from None
    try:
        kwargs["space"] = space_cls.from_dict(data["space"])
    except ConfigError as err:
        raise err.located(prefix="space") from None
    for key in ("search", "num_samples", "metric", "mode", "seed"):
        if key in data:
            kwargs[key] = data[key]
    name = data.get("name") or (Path(source).stem if source else None)
    if name is None:
        raise ConfigError("missing required key", key="name", fix="add name: my-sweep")
    return cls(name=name, source=source, **kwargs)


__all__ = [
    "DEFAULT_MAX_CONFIGS",
    "PLANNER_SOLVERS",
    "SWEEP_METRICS",
    "CpuOffload",
    "CudaGraphs",
    "PlannerOptions",
    "SearchAlgo",
    "SweepConfig",
    "TrainingOptions",
]
