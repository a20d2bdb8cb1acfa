"""Typed, frozen, self-validating configuration; plain data (no torch, no Ray).

Two levels:

* :class:`LoRAConfig` (:mod:`.lora`) -- one *config*: a point of the search space (rank,
  alpha, lr, batch size, target modules, ...) with a stable ``config_id``. The planner, the
  engine and the runtime all speak in these.
* :class:`SweepConfig` (:mod:`.sweep`) -- a whole sweep read from YAML: model (:mod:`.model`),
  dataset (:mod:`.dataset`), search space (:mod:`.space`), search algorithm, hardware
  (:mod:`.hardware`, the one table of known GPUs) and planner options. Bad values fail here,
  before any Ray or GPU work, with a :class:`ConfigError` (:mod:`.errors`) naming the file, key
  and value.
"""

from plora.config.dataset import BUILTIN_DATASETS, DATASET_FORMATS, DATASET_METRICS, DatasetSpec
from plora.config.errors import ConfigError
from plora.config.hardware import (
    FSDP_STRATEGIES,
    GPU_TYPES,
    JOB_STRATEGIES,
    SUPPORTED_STRATEGIES,
    GPUSpec,
    HardwareConfig,
    Strategy,
    gpu_spec,
)
from plora.config.lora import (
    PROJECTION_ALIASES,
    PROJECTIONS,
    LoRAConfig,
    Schedule,
    normalize_targets,
)
from plora.config.model import BUILTIN_MODELS, DTYPES, QUANTIZATIONS, ModelRef, looks_like_path
from plora.config.space import SearchSpace
from plora.config.sweep import (
    PLANNER_SOLVERS,
    SWEEP_METRICS,
    CpuOffload,
    CudaGraphs,
    PlannerOptions,
    SearchAlgo,
    SweepConfig,
    TrainingOptions,
)
from plora.config.tracking import LoggingOptions, MlflowOptions, WandbOptions

__all__ = [
    "BUILTIN_DATASETS",
    "BUILTIN_MODELS",
    "DATASET_FORMATS",
    "DATASET_METRICS",
    "DTYPES",
    "FSDP_STRATEGIES",
    "GPU_TYPES",
    "JOB_STRATEGIES",
    "PLANNER_SOLVERS",
    "PROJECTIONS",
    "PROJECTION_ALIASES",
    "QUANTIZATIONS",
    "SUPPORTED_STRATEGIES",
    "SWEEP_METRICS",
    "ConfigError",
    "CpuOffload",
    "CudaGraphs",
    "DatasetSpec",
    "GPUSpec",
    "HardwareConfig",
    "LoRAConfig",
    "LoggingOptions",
    "MlflowOptions",
    "ModelRef",
    "PlannerOptions",
    "Schedule",
    "SearchAlgo",
    "SearchSpace",
    "Strategy",
    "SweepConfig",
    "TrainingOptions",
    "WandbOptions",
    "gpu_spec",
    "looks_like_path",
    "normalize_targets",
]
