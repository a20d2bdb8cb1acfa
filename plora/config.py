"""Typed, frozen, self-validating configuration.

Two levels:

* :class:`LoRAConfig` -- one *config*: a point of the search space (rank, alpha, lr, batch
  size, target modules, ...) with a stable ``config_id``. The planner, the engine and the
  runtime all speak in these.
* :class:`SweepConfig` -- a whole sweep read from YAML: model, dataset, search space, search
  algorithm, hardware and planner options. Bad values fail here, before any Ray or GPU work,
  with a :class:`ConfigError` naming the file, key and value.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plora._validate import (
    ConfigError,
    as_bool,
    as_choice,
    as_float,
    as_int,
    as_str,
    check_keys,
    expect_mapping,
    join_key,
    load_yaml,
)

if TYPE_CHECKING:
    from plora.space import SearchSpace

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
        d = asdict(self)
        d.pop("config_id")
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


# ---------------------------------------------------------------------------------- sweep level

#: Built-in tiny base models, built locally without the hub (``plora.models``).
BUILTIN_MODELS: tuple[str, ...] = ("tiny-qwen2", "tiny-llama")
#: Built-in synthetic datasets (``plora.engine.tasks``).
BUILTIN_DATASETS: tuple[str, ...] = ("arithmetic", "sentiment", "reverse")
#: Dataset file layouts: ``auto`` detects from the rows (``text`` / ``prompt``+``completion`` /
#: chat ``messages``) or a ``datasets.save_to_disk`` directory (``disk``).
DATASET_FORMATS: tuple[str, ...] = ("auto", "text", "prompt_completion", "chat", "disk")
#: Task metrics of a dataset; ``auto`` picks the builtin task's metric (none for text rows).
DATASET_METRICS: tuple[str, ...] = ("auto", "exact_match", "accuracy", "none")
#: What a sweep ranks configs by: eval/train loss (min) or the dataset's task metric (max).
SWEEP_METRICS: tuple[str, ...] = ("eval_loss", "train_loss", "eval_metric")
#: Knapsack backends of the planner (``plora.planner.ilp.SOLVERS``).
PLANNER_SOLVERS: tuple[str, ...] = ("auto", "bnb", "highs", "cvxpy", "gurobi")
#: Model dtypes; aliases map to these names (``torch.<name>``).
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}  # fmt: skip
#: Memory (GiB) of known accelerators; ``gpu_memory_gib`` defaults from this table.
#: ``cpu`` stands for a CPU worker (``num_gpus`` = worker slots, memory = host RAM budget each).
GPU_MEMORY_GIB: dict[str, float] = {
    "A10": 24.0, "A10G": 24.0, "L4": 24.0, "RTX4090": 24.0, "L40S": 48.0, "A6000": 48.0,
    "V100-16GB": 16.0, "V100-32GB": 32.0, "A100-40GB": 40.0, "A100-80GB": 80.0,
    "H100": 80.0, "H100-80GB": 80.0, "H200": 141.0, "B200": 180.0, "cpu": 16.0,
}  # fmt: skip
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is written as a filesystem path rather than a hub id (``org/name``)."""
    return (
        name.startswith(("/", "./", "../", "~"))
        or name in (".", "..")
        or name.count("/") > 1
        or name.endswith("/")
        or "\\" in name
    )


def _gpu_key(name: str) -> str:
    """Spelling-insensitive GPU name: ``a100_40gb``, ``A100-40G`` and ``A100 40GB`` -> ``A10040``."""
    key = re.sub(r"[\s_]+", "-", name.strip().upper())
    return re.sub(r"-(\d+)GB?$", r"-\1", key).replace("-", "")


_GPU_LOOKUP = {_gpu_key(k): k for k in GPU_MEMORY_GIB}


class SearchAlgo(StrEnum):
    """How configs are drawn from the space (Ray Tune searcher names)."""

    GRID = "grid"
    RANDOM = "random"
    OPTUNA = "optuna"
    HYPEROPT = "hyperopt"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRef:
    """The frozen base model every config of a sweep fine-tunes."""

    name_or_path: str
    """A Hugging Face hub id (``Qwen/Qwen2.5-7B``), a local model directory, or a built-in tiny
    model (``tiny-qwen2`` | ``tiny-llama``)."""
    dtype: str = "auto"
    """Weights dtype: auto | float32 | bfloat16 | float16 (aliases fp32, bf16, fp16)."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained`` for models with custom code."""

    def __post_init__(self) -> None:
        name = as_str(self.name_or_path, "name_or_path", fix="write a hub id such as Qwen/Qwen2.5-0.5B, a local model directory or tiny-qwen2")  # fmt: skip
        dtype = (
            _DTYPE_ALIASES.get(self.dtype, self.dtype)
            if isinstance(self.dtype, str)
            else self.dtype
        )
        object.__setattr__(self, "dtype", as_choice(dtype, "dtype", DTYPES))
        as_bool(self.trust_remote_code, "trust_remote_code")
        if name in BUILTIN_MODELS:
            return
        if looks_like_path(name):
            path = Path(name).expanduser()
            if not path.is_dir():
                raise ConfigError("model directory not found", key="name_or_path", value=name,
                                  fix="fix the path (relative paths are relative to the sweep file) or use a hub id")  # fmt: skip
            if not (path / "config.json").is_file():
                raise ConfigError("not a Hugging Face model directory (no config.json)", key="name_or_path", value=name,
                                  fix="point to a directory written by save_pretrained")  # fmt: skip
        elif not _HF_ID.match(name):
            raise ConfigError("not a hub id, local path or built-in model", key="name_or_path", value=name,
                              fix=f"write org/name, ./path/to/model or one of {', '.join(BUILTIN_MODELS)}")  # fmt: skip

    @property
    def is_builtin(self) -> bool:
        """Whether this is a built-in tiny model (built locally, no hub access)."""
        return self.name_or_path in BUILTIN_MODELS

    @property
    def is_local(self) -> bool:
        """Whether ``name_or_path`` is an existing local directory."""
        return Path(self.name_or_path).expanduser().is_dir()


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetSpec:
    """The fine-tuning data. Exactly one of ``path`` and ``builtin``.

    Files are only required to exist for training (:meth:`check_files`): planning needs just
    ``num_examples`` and ``max_seq_len``.
    """

    path: str | None = None
    """A ``.jsonl`` file (rows with ``text``, or ``prompt``+``completion``, or chat ``messages``)
    or a directory written by ``datasets.save_to_disk``."""
    builtin: str | None = None
    """A built-in synthetic task: arithmetic (exact match) | sentiment (accuracy) | reverse."""
    format: str = "auto"
    """Row layout: auto | text | prompt_completion | chat | disk."""
    num_examples: int = 2000
    """Training examples: for a builtin, the training rows generated (held-out rows come on
    top); for a file, a planning hint (the real count replaces it once the file is read)."""
    eval_path: str | None = None
    """Separate evaluation file; when absent ``eval_fraction`` of the data is held out."""
    eval_fraction: float = 0.1
    """Fraction held out for evaluation when there is no ``eval_path``, in [0, 1)."""
    max_seq_len: int = 256
    """Maximum tokens per example (longer ones are truncated); the planner's sequence length."""
    completion_only: bool = True
    """Train only on completion/answer tokens (prompt tokens masked from the loss)."""
    metric: str = "auto"
    """Task metric: auto | exact_match | accuracy | none."""
    seed: int = 0
    """Seed of the train/eval split and of builtin data generation."""

    def __post_init__(self) -> None:
        if (self.path is None) == (self.builtin is None):
            raise ConfigError(
                "set exactly one of path and builtin", key="path/builtin",
                value=f"{self.path!r}/{self.builtin!r}",
                fix=f"e.g. path: data/train.jsonl, or builtin: {BUILTIN_DATASETS[0]}",
            )  # fmt: skip
        if self.builtin is not None:
            as_choice(
                self.builtin, "builtin", BUILTIN_DATASETS, fix="or give a .jsonl path instead"
            )
        if self.path is not None:
            as_str(self.path, "path")
            p = Path(self.path).expanduser()
            if p.is_file() and p.suffix not in (".jsonl", ".json"):
                raise ConfigError("dataset file must be .jsonl", key="path", value=self.path,
                                  fix="convert it to JSON lines or pass a save_to_disk directory")  # fmt: skip
        if self.eval_path is not None:
            as_str(self.eval_path, "eval_path")
        as_choice(self.format, "format", DATASET_FORMATS)
        as_int(self.num_examples, "num_examples", ge=1)
        object.__setattr__(
            self, "eval_fraction", as_float(self.eval_fraction, "eval_fraction", ge=0.0, lt=1.0)
        )
        as_int(
            self.max_seq_len,
            "max_seq_len",
            ge=8,
            fix="use the longest example's token count, e.g. 1024",
        )
        as_bool(self.completion_only, "completion_only")
        as_choice(self.metric, "metric", DATASET_METRICS)
        as_int(self.seed, "seed", ge=0)

    def check_files(self) -> None:
        """Raise :class:`ConfigError` unless the files training needs exist."""
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value is not None and not Path(value).expanduser().exists():
                raise ConfigError("dataset file not found", key=key, value=value,
                                  fix="create it or fix the path (relative paths are relative to the sweep file)")  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareConfig:
    """The accelerators a sweep may use (one node)."""

    num_gpus: int = 1
    """GPUs the planner may use at once (for ``gpu_type: cpu``, CPU worker slots)."""
    gpu_type: str = "H200"
    """Accelerator name, e.g. A100-40GB, H100, H200, A10 or cpu; sets the memory default."""
    gpu_memory_gib: float | None = None
    """Memory per GPU in GiB; defaults from :data:`GPU_MEMORY_GIB` for a known ``gpu_type``."""
    load_factor: float = 0.9
    """C in (0, 1]: the fraction of GPU memory the planner may fill (fragmentation headroom)."""
    peak_tflops: float | None = None
    """Dense bf16 peak TFLOP/s of one GPU; only needed for a ``gpu_type`` the cost model does
    not know (``plora.cost.throughput.GPU_TYPES``)."""

    def __post_init__(self) -> None:
        as_int(self.num_gpus, "num_gpus", ge=1, fix="use at least 1 GPU")
        gpu_type = as_str(self.gpu_type, "gpu_type", fix="e.g. A100-40GB, H100 or cpu")
        canonical = _GPU_LOOKUP.get(_gpu_key(gpu_type))
        if canonical:
            object.__setattr__(self, "gpu_type", canonical)
        if self.gpu_memory_gib is None:
            if canonical is None:
                raise ConfigError("unknown gpu_type and no gpu_memory_gib", key="gpu_type", value=gpu_type,
                                  fix=f"set gpu_memory_gib, or use one of {', '.join(GPU_MEMORY_GIB)}")  # fmt: skip
            object.__setattr__(self, "gpu_memory_gib", GPU_MEMORY_GIB[canonical])
        mem = as_float(
            self.gpu_memory_gib,
            "gpu_memory_gib",
            gt=0.0,
            fix="give the memory of one GPU in GiB, e.g. 80",
        )
        object.__setattr__(self, "gpu_memory_gib", mem)
        lf = as_float(
            self.load_factor,
            "load_factor",
            gt=0.0,
            le=1.0,
            fix="use a fraction in (0, 1], e.g. 0.9",
        )
        object.__setattr__(self, "load_factor", lf)
        if self.peak_tflops is not None:
            tf = as_float(
                self.peak_tflops, "peak_tflops", gt=0.0, fix="give the datasheet dense bf16 TFLOP/s"
            )
            object.__setattr__(self, "peak_tflops", tf)

    @property
    def is_cpu(self) -> bool:
        """Whether the 'GPUs' are CPU worker slots."""
        return self.gpu_type == "cpu"

    @property
    def usable_gib(self) -> float:
        """C * M_gpu: GiB per GPU the planner may fill."""
        return self.load_factor * float(self.gpu_memory_gib or 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerOptions:
    """How the job planner runs."""

    solver: str = "auto"
    """Knapsack backend of the ILPs: auto | bnb (exact branch and bound, then HiGHS) | highs |
    cvxpy | gurobi (if installed and licensed, else HiGHS)."""
    strategies: tuple[Any, ...] = ()
    """Multi-GPU strategies (``plora.cost.Strategy``: tp | fsdp | pp) jobs with d > 1 may use;
    empty: every strategy the runtime supports."""
    seq_len: int | None = None
    """Sequence length to plan with; default ``dataset.max_seq_len``."""
    time_limit_s: float = 60.0
    """Wall-clock budget of one ILP solve (reserved: the planner bounds its search by node
    counts today and does not read it yet)."""

    def __post_init__(self) -> None:
        from plora.cost import Strategy

        as_choice(self.solver, "solver", PLANNER_SOLVERS)
        raw = self.strategies
        if isinstance(raw, str) or not isinstance(raw, list | tuple):
            raise ConfigError(
                "must be a list", key="strategies", value=raw, fix="write e.g. [tp] or [tp, fsdp]"
            )
        out: list[Strategy] = []
        for i, s in enumerate(raw):
            key = join_key("strategies", i)
            out.append(
                Strategy(
                    as_choice(
                        str(s) if isinstance(s, Strategy) else s, key, [m.value for m in Strategy]
                    )
                )
            )
        object.__setattr__(self, "strategies", tuple(dict.fromkeys(out)))
        if self.seq_len is not None:
            as_int(self.seq_len, "seq_len", ge=8)
        object.__setattr__(
            self, "time_limit_s", as_float(self.time_limit_s, "time_limit_s", gt=0.0)
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingOptions:
    """How every job of the sweep trains (the same for all configs; planning assumes it too)."""

    gradient_checkpointing: bool = False
    """Recompute the frozen base's layer activations in backward: activation memory drops from
    all layers to one layer plus the layer inputs, for about one extra forward of compute.
    Needed for large batches at long sequences (e.g. the paper's batch 32 at 1024 tokens)."""

    def __post_init__(self) -> None:
        as_bool(self.gradient_checkpointing, "gradient_checkpointing")


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepConfig:
    """A whole sweep: what to fine-tune, on what, over which space, on which hardware.

    Read from YAML with :meth:`from_yaml`; :meth:`to_yaml` writes it back (round trip).
    Configs come from :func:`plora.space.expand` (grid/random) or a Ray Tune searcher
    (optuna/hyperopt, via :func:`plora.space.to_tune_param_space`).
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
    source: str | None = field(default=None, compare=False)
    """The YAML file this sweep was read from (for error messages); not part of the sweep."""

    def __post_init__(self) -> None:
        from plora.space import SearchSpace

        name = as_str(self.name, "name")
        if not re.fullmatch(r"[A-Za-z0-9][\w.\-]*", name):
            raise ConfigError("must be letters, digits, '.', '_' or '-'", key="name", value=name,
                              fix="it names the sweep directory; e.g. qwen-lr-rank")  # fmt: skip
        for key, cls in (("model", ModelRef), ("dataset", DatasetSpec), ("space", SearchSpace),
                         ("hardware", HardwareConfig), ("planner", PlannerOptions), ("training", TrainingOptions)):  # fmt: skip
            if not isinstance(getattr(self, key), cls):
                raise ConfigError(f"must be a {cls.__name__}", key=key, value=getattr(self, key))
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
                **{k: getattr(self.planner, k) for k in _fields(PlannerOptions)},
                "strategies": [str(s) for s in self.planner.strategies],
            },
            "training": {k: getattr(self.training, k) for k in _fields(TrainingOptions)},
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
        from plora.space import SearchSpace

        try:
            return _parse_sweep(cls, data, SearchSpace, source=source, base_dir=base_dir)
        except ConfigError as err:
            raise err.located(file=source, lines=lines) from None


_TOP_KEYS = ("name", "model", "dataset", "space", "search", "num_samples", "metric", "mode",
             "seed", "hardware", "planner", "training", "seq_len")  # fmt: skip


def _or_empty(section: Any) -> Any:
    """An absent or empty (``key:`` with no value) section means all defaults."""
    return {} if section is None else section


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
    model = dict(expect_mapping(model, "model", what="name_or_path, dtype, trust_remote_code"))
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


def __getattr__(name: str) -> Any:  # ``plora.config.SearchSpace`` without an import cycle
    if name == "SearchSpace":
        from plora.space import SearchSpace

        return SearchSpace
    raise AttributeError(f"module 'plora.config' has no attribute {name!r}")


__all__ = [
    "BUILTIN_DATASETS",
    "BUILTIN_MODELS",
    "DATASET_FORMATS",
    "DATASET_METRICS",
    "DTYPES",
    "GPU_MEMORY_GIB",
    "PLANNER_SOLVERS",
    "PROJECTIONS",
    "PROJECTION_ALIASES",
    "SWEEP_METRICS",
    "ConfigError",
    "DatasetSpec",
    "HardwareConfig",
    "LoRAConfig",
    "ModelRef",
    "PlannerOptions",
    "Schedule",
    "SearchAlgo",
    "SearchSpace",
    "SweepConfig",
    "TrainingOptions",
    "looks_like_path",
    "normalize_targets",
]
