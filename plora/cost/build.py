"""``build_cost_model``: the :class:`~plora.cost.model.SweepCostModel` of a sweep definition.

Reads the sweep's model shapes, GPU, dataset (training rows, eval split and metric) and the
stored (model, GPU type) profile -- measured steps and overheads -- so a second sweep on the
same model and GPU plans from measurements. Also importable as
``plora.cost.model.build_cost_model``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plora.config import ConfigError
from plora.config import fused as fused_switch
from plora.config.fused import FusedKernels, fused_profile_key, use_fused_kernels
from plora.config.sweep_options import CudaGraphs, cuda_graphs_resolved
from plora.cost.jobterms import DEFAULT_CHECKPOINT_EVERY, eval_defaults
from plora.cost.memory_options import FULL_FP32, Loss, MemoryOptions, quantized
from plora.cost.microbatch import MAX_MICRO_BATCHES
from plora.cost.model import SweepCostModel
from plora.cost.overheads import EvalMetric, Overheads
from plora.cost.profile import ProfileStore
from plora.cost.throughput import gpu_spec
from plora.model_spec import ModelSpec


def build_cost_model(
    sweep: Any,
    *,
    dataset_size: int | None = None,
    eval_rows: int | None = None,
    eval_metric: EvalMetric | str | None = None,
    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
    overheads: Overheads | None = None,
    profile_dir: str | Path | None = None,
    use_profile: bool = True,
    memory: MemoryOptions | None = None,
    fused_kernels: bool | None = None,
    cuda_graphs: bool | None = None,
    train_lengths: Sequence[int] | None = None,
) -> SweepCostModel:
    """The cost model of a ``plora.config.SweepConfig``.

    Args:
        sweep: the sweep (model, dataset, hardware, planner options).
        dataset_size: training examples; default ``dataset.num_examples`` (the training
            rows; held-out rows come on top).
        eval_rows: eval rows per config; default from the dataset spec
            (:func:`~plora.cost.overheads.eval_defaults`). The runtime passes
            ``len(data.eval)`` once the data is read.
        eval_metric: ``none`` | ``exact_match`` | ``accuracy``; default the dataset's
            (``auto``: the builtin task's, ``exact_match`` for a file).
        checkpoint_every: train-state checkpoint interval in steps (None: at the end only);
            default ``plora sweep``'s.
        overheads: default physics defaults, refit with the profile's measured overheads.
        profile_dir: profile store directory (default ``~/.cache/plora/profiles``).
        use_profile: read the stored (model, GPU type) profile, if any, and plan from it.
        memory: memory options; default: plora's engine (bf16 autocast with fp32 LoRA state
            on GPUs, fp32 on CPU; chunked recomputed cross-entropy; activation checkpointing
            as ``training.gradient_checkpointing`` says; ``model.quantization: nf4``: NF4 base
            projections at ~0.52 byte/weight, :func:`~plora.cost.memory_options.quantized`).
        fused_kernels: whether the engine runs Liger-Kernel's fused ops on the base; default
            :func:`plan_fused_kernels` of the sweep (what the engine will resolve). Sets
            ``memory.fused_kernels``, the step-time prior (:func:`plora.cost.priors.step_prior`) and the
            profile the model plans from (fused steps are profiled apart).
        cuda_graphs: whether one-GPU jobs replay their steady step as CUDA graphs; default
            :func:`plan_cuda_graphs` of the sweep. Sets ``SweepCostModel.cuda_graphs``: the
            graphed prior for d = 1 jobs (:func:`plora.cost.priors.step_prior`) and a profile
            of its own (graphed steps are profiled apart).
        train_lengths: the tokenized training rows' lengths (the runtime passes them once
            the data is read): steps and evaluation are then timed at the width a step's rows
            are expected to pad to (:func:`step_seq_len`), memory still at ``seq_len``;
            without them every row is timed at ``seq_len``.
    """
    hw = sweep.hardware
    spec = ModelSpec.from_hf_config(sweep.model.name_or_path)
    gpu = gpu_spec(hw.gpu_type, peak_tflops=getattr(hw, "peak_tflops", None))
    if dataset_size is None:
        dataset_size = int(sweep.dataset.num_examples)
    rows, metric = eval_defaults(sweep.dataset)
    quantization = str(getattr(sweep.model, "quantization", "none"))
    fused = plan_fused_kernels(sweep, spec) if fused_kernels is None else bool(fused_kernels)
    graphs = plan_cuda_graphs(sweep) if cuda_graphs is None else bool(cuda_graphs)
    if memory is None:
        fp32 = getattr(hw, "is_cpu", False) or sweep.model.dtype == "float32"
        ckpt = bool(getattr(getattr(sweep, "training", None), "gradient_checkpointing", False))
        memory = MemoryOptions(loss=Loss.FUSED, checkpointing=ckpt, fused_kernels=fused)
        if fp32:
            memory = dataclasses.replace(memory, precision=FULL_FP32)
        memory = dataclasses.replace(memory, precision=quantized(memory.precision, quantization))
    # empty: d = 1 jobs only (opt-in); planner.cpu_offload may add or swap in fsdp_offload
    strategies = tuple(getattr(sweep, "job_strategies", sweep.planner.strategies))
    if quantization != "none" and strategies:  # tp/fsdp/pp are not built for a 4-bit base yet
        raise ConfigError(
            f"not supported with model.quantization: {quantization} (QLoRA jobs run on "
            "one GPU each)",
            key="planner.strategies",
            value=[str(s) for s in sweep.planner.strategies],
            fix="remove planner.strategies, or set model.quantization: none",
        )
    profile = None
    if use_profile:
        key = fused_profile_key(_profile_key(sweep.model), memory.fused_kernels, graphs)
        profile = ProfileStore(profile_dir).load(key, hw.gpu_type)
    return SweepCostModel(
        spec,
        int(sweep.seq_len),
        int(dataset_size),
        hw,
        gpu=gpu,
        profile=profile,
        memory=memory,
        cuda_graphs=graphs,
        strategies=strategies,
        overheads=overheads,
        eval_rows=rows if eval_rows is None else int(eval_rows),
        eval_metric=metric if eval_metric is None else eval_metric,
        checkpoint_every=checkpoint_every,
        early_stop=getattr(sweep, "early_stop", None),
        population=sweep.num_configs if getattr(sweep, "early_stop", None) else None,
        max_micro_batches=micro_batch_limit(hw),
        step_seq_len=(
            None
            if not train_lengths
            else step_seq_len(train_lengths, rows_per_step(sweep), int(sweep.seq_len))
        ),
    )


#: A pack the planner forms holds up to about this many configs (for a step's rows).
TYPICAL_PACK_CONFIGS = 16


def rows_per_step(sweep: Any) -> int:
    """Rows a packed step typically holds: a typical batch size (the middle value of the
    space's ``batch_size``) times the configs of a typical pack (the sweep's, at most
    :data:`TYPICAL_PACK_CONFIGS`)."""
    domain = sweep.space.batch_size
    if domain.values:
        batch = float(np.median([float(v) for v in domain.values]))
    else:
        batch = float(np.sqrt(float(domain.low) * float(domain.high)))
    return max(1, round(batch * min(int(sweep.num_configs), TYPICAL_PACK_CONFIGS)))


def step_seq_len(lengths: Sequence[int], rows: int, cap: int) -> int:
    """The expected padded width of a step of ``rows`` rows drawn from rows of ``lengths``
    tokens (each cut at ``cap``): a batch is padded to its longest row, so the width is the
    expected maximum of ``rows`` draws, ``Σ_l l·(F(l)^rows − F(l⁻)^rows)`` over the empirical
    distribution F of the lengths, rounded up."""
    if not len(lengths):
        return int(cap)
    values, counts = np.unique(
        np.minimum(np.asarray(lengths, dtype=np.int64), cap), return_counts=True
    )
    cdf = np.cumsum(counts) / counts.sum()
    below = np.concatenate([[0.0], cdf[:-1]])
    expected = float(np.sum(values * (cdf**rows - below**rows)))
    return int(min(cap, max(1, int(np.ceil(expected - 1e-9)))))


def micro_batch_limit(hardware: Any) -> int:
    """The most forwards per step a pack may be planned with on ``hardware``: on GPUs
    :data:`~plora.cost.microbatch.MAX_MICRO_BATCHES` (a pack too big for one GPU with every
    row live may train in micro-batches: :mod:`plora.cost.microbatch`); on the CPU 1 -- its
    ``gpu_memory_gib`` is a packing budget, not a device whose memory the rows must fit."""
    return 1 if getattr(hardware, "is_cpu", False) else MAX_MICRO_BATCHES


def plan_fused_kernels(sweep: Any, spec: ModelSpec | None = None) -> bool:
    """Whether the sweep's engine will run Liger-Kernel's fused ops (``training.fused_kernels``
    resolved as the engine resolves it: :func:`plora.config.fused.use_fused_kernels`).

    The sweep runs on CUDA unless ``hardware.gpu_type`` is ``cpu``; ``auto`` counts on
    ``liger_kernel`` being importable here, as on the workers (the embedded Ray shares this
    environment; a cluster installs the same extras on every node). ``on`` plans fused even
    where Liger is not installed (planning only); ``plora sweep`` refuses it there
    (``plora.runtime.prepare.check_inputs``).
    """
    setting = FusedKernels.parse(getattr(getattr(sweep, "training", None), "fused_kernels", "off"))
    if spec is None:
        spec = ModelSpec.from_hf_config(sweep.model.name_or_path)
    cpu = bool(getattr(sweep.hardware, "is_cpu", False))
    installed = fused_switch.liger_installed() or setting is FusedKernels.ON
    return use_fused_kernels(setting, cuda=not cpu, model_type=spec.model_type, installed=installed)


def plan_cuda_graphs(sweep: Any) -> bool:
    """Whether the sweep's one-GPU jobs will replay their steady step as CUDA graphs
    (``training.cuda_graphs`` resolved as the engine resolves it:
    :func:`plora.config.sweep_options.cuda_graphs_resolved`).

    ``auto``: on unless ``hardware.gpu_type`` is ``cpu`` or this process's environment sets
    ``PLORA_CUDA_GRAPHS`` to ``0``/``off``/``false``/``no`` (the workers inherit it: the
    embedded Ray starts them from this environment). ``on`` plans graphed steps even on the CPU,
    where the engine runs the static-buffer step eagerly (its prior is the eager one there).
    """
    setting = CudaGraphs.parse(getattr(getattr(sweep, "training", None), "cuda_graphs", "auto"))
    cpu = bool(getattr(sweep.hardware, "is_cpu", False))
    return cuda_graphs_resolved(setting.trainer_arg, cuda=not cpu)


def _profile_key(model: Any) -> str:
    """The model's profile name: a quantized base is profiled apart (``ModelRef.profile_key``)."""
    return str(getattr(model, "profile_key", model.name_or_path))


__all__ = [
    "build_cost_model",
    "micro_batch_limit",
    "plan_cuda_graphs",
    "plan_fused_kernels",
    "rows_per_step",
    "step_seq_len",
]
