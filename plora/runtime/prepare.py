"""What the driver checks and builds before any Ray work: the dataset, the cost model, the
config source, and whether one-GPU worker groups are likely (so they may start early).

Nothing here starts Ray or writes to disk; every problem a user can fix is a
:class:`~plora.config.ConfigError`.
"""

from __future__ import annotations

import importlib
from typing import Any

from plora.config import ConfigError, SweepConfig
from plora.cost.jobterms import DEFAULT_CHECKPOINT_EVERY
from plora.runtime.actors.group import check_strategies
from plora.runtime.records import ConfigSource


def prepare(
    sweep: SweepConfig,
    *,
    source: ConfigSource | None = None,
    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
) -> tuple[Any, ConfigSource, str, Any]:
    """Check the sweep's inputs and build its cost model and config source (no Ray, no disk).

    The cost model charges what this sweep will run: its training rows, its eval rows and
    metric (each config's evaluation), and train-state writes every ``checkpoint_every`` steps.

    Returns:
        ``(cost, source, metric_name, data_report)``: the last is the dataset's
        :class:`~plora.engine.data_report.DataReport` (rows cut and left out per split).

    Raises:
        ConfigError: missing dataset files, an empty dataset, configs that fit no GPU, ...
    """
    from plora.cost.build import build_cost_model

    data = check_inputs(sweep)
    with sweep.located():
        cost = build_cost_model(
            sweep,
            dataset_size=len(data.train),
            eval_rows=len(data.eval),
            eval_metric=data.metric,
            checkpoint_every=checkpoint_every,
            train_lengths=[len(ex.input_ids) for ex in data.train],
        )
    check_jobs_fit(sweep, cost)
    if source is None:
        source = config_source(sweep)
    # The sweep directory's tables need pandas (and pyarrow), which the driver no longer imports
    # before Ray's start: load them here, on the prepare thread, so the first write finds them.
    importlib.import_module("pandas")
    return cost, source, data.metric, data.report


def check_inputs(sweep: SweepConfig) -> Any:
    """What training reads, checked the way training reads it: the dataset files exist, the base
    model can be loaded (:func:`plora.models.hub.check_hub_model`: seconds, never a minute of
    retries), its tokenizer loads, and the dataset's rows parse into at least one training
    example. ``plora validate`` runs exactly this, so it rejects what ``plora sweep`` would.

    Returns:
        The tokenized dataset (:class:`plora.engine.data.TokenizedDataset`).

    Raises:
        ConfigError: naming the sweep file, key and value.
    """
    from plora.engine.data import load_dataset
    from plora.models.hub import check_hub_model

    sweep.check_trainable()
    check_hub_model(sweep.model, file=sweep.source)
    check_fused_kernels(sweep)
    problem = None
    try:
        tokenizer = load_tokenizer(sweep.model)
        if not tokenizer("a b 1").get("input_ids"):  # transformers builds an empty one silently
            problem = "its tokenizer has no vocabulary (no tokenizer files)"
    except OSError as err:  # a model directory or cache entry without tokenizer files
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        problem = f"cannot load its tokenizer ({first[:200]})"
    if problem:
        raise ConfigError(
            problem, key="model.name_or_path", value=sweep.model.name_or_path, file=sweep.source,
            fix="point to a model directory with tokenizer files (save_pretrained of the tokenizer)",
        )  # fmt: skip
    try:
        data = load_dataset(sweep.dataset, tokenizer)
    except ConfigError as err:
        raise err.located(file=sweep.source) from None
    if not data.train:
        raise ConfigError(
            f"{sweep.source or 'sweep'}: dataset has no training examples; "
            "point dataset.path at a non-empty file or raise dataset.num_examples"
        )
    return data


def check_jobs_fit(sweep: SweepConfig, cost: Any = None, configs: Any = None) -> None:
    """Every config of the sweep fits one job it allows, and the runtime runs its
    ``planner.strategies``: :func:`plora.planner.fits.check_fits` over ``configs`` (default: the
    sweep's; for a searcher a sample of the space, as ``plora plan`` draws), with ``cost`` or
    the sweep's own cost model. ``plora validate`` and ``plora sweep`` (beside Ray's start,
    before the sweep directory) both ask it.

    Raises:
        ConfigError: naming the sweep file, line, key and value (``hardware.gpu_memory_gib``,
            or ``planner.strategies`` when the model can take none of the multi-GPU jobs).
    """
    from plora.cost.build import build_cost_model
    from plora.planner.fits import check_fits
    from plora.tune.space import expand

    with sweep.located():
        cost = build_cost_model(sweep) if cost is None else cost
        check_strategies(cost.strategies())
    if configs is None:
        configs = expand(sweep, sample_adaptive=True)
    check_fits(sweep, configs, cost, spec=cost.spec)


def check_fused_kernels(sweep: SweepConfig) -> bool:
    """``training.fused_kernels: on`` can run here: Liger-Kernel is installed, the sweep runs on
    CUDA and the model type is one it patches (the engine resolves the same way on the workers).

    Returns:
        Whether the engine will run Liger-Kernel's fused ops.

    Raises:
        ConfigError: ``on`` where it cannot run, naming the sweep file, key and what to do.
    """
    from plora.config.fused import FusedKernels, use_fused_kernels
    from plora.model_spec import ModelSpec

    setting = sweep.training.fused_kernels
    if setting is FusedKernels.OFF:
        return False
    try:
        model_type = ModelSpec.from_hf_config(sweep.model.name_or_path).model_type
        return use_fused_kernels(setting, cuda=not sweep.hardware.is_cpu, model_type=model_type)
    except ConfigError as err:
        raise err.located(file=sweep.source) from None


def config_source(sweep: SweepConfig) -> ConfigSource:
    """The sweep's config source: grid/random expansion or a Ray Tune searcher in ask/tell
    mode (:func:`plora.tune.search.make_config_source`)."""
    from plora.tune.search import make_config_source

    return make_config_source(sweep)


def fits_one_gpu(sweep: SweepConfig) -> bool:
    """Whether the frozen base leaves room for adapters on one GPU (bf16 weights under 3/4 of
    its memory), i.e. one-GPU jobs are likely; built-in tiny models always fit."""
    if getattr(sweep.model, "is_builtin", False) or sweep.hardware.is_cpu:
        return True
    from plora.model_spec import ModelSpec

    try:
        spec = ModelSpec.from_hf_config(sweep.model.name_or_path)
    except Exception:  # the dataset check and the plan report a model that cannot be read
        return False
    memory_gib = float(sweep.hardware.gpu_memory_gib or 0.0)  # set by HardwareConfig
    return 2.0 * spec.total_params < 0.75 * memory_gib * 2**30


def load_tokenizer(ref: Any) -> Any:
    """The base model's tokenizer alone (no weights): built-ins resolve to their local dir."""
    from transformers import AutoTokenizer

    from plora.models import resolve_model_path

    return AutoTokenizer.from_pretrained(
        resolve_model_path(ref), trust_remote_code=ref.trust_remote_code
    )


__all__ = [
    "check_fused_kernels",
    "check_inputs",
    "check_jobs_fit",
    "config_source",
    "fits_one_gpu",
    "load_tokenizer",
    "prepare",
]
