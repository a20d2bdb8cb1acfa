"""The sweep's cost model: what the planner asks, answered from App. A memory and fitted step times.

:class:`SweepCostModel` implements :class:`plora.cost.CostModel`. For a job ``(pack, d, s)``:

* memory per GPU: ``base_memory(d, s) + Σ_k config_memory(k, d, s) <= capacity(d)``
  (:mod:`plora.cost.memory`);
* time: ``job_time = fixed_time(max_k steps_k, d, s) + Σ_k config_time(k, d, s)`` with
  ``fixed_time(n) = n·t_fixed(d, s)`` and ``config_time(k) = steps_k·t_k(d, s)`` from
  :class:`~plora.cost.throughput.StepTimeModel`: a config pays for its own tokens for the
  steps it trains, the job pays its per-step overhead until its longest config is done.

Every per-config answer is cached by the config's shape (rank, targets, batch size, dropout)
and ``(d, strategy)``: the planner asks thousands of times, and configs differing only in
lr, alpha, schedule or seed share an entry. :meth:`SweepCostModel.refit` returns a new model
whose coefficients (and activation scale, when peaks were measured) come from measured steps,
with a :class:`RefitReport`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from plora.config import ConfigError, LoRAConfig
from plora.cost import Strategy
from plora.cost.memory import (
    FULL_FP32,
    GIB,
    Loss,
    MemoryOptions,
    adapter_memory,
    base_memory,
    base_weight_bytes,
    check_parallel,
)
from plora.cost.profile import MemoryFit, Profile, ProfileStore, fit_memory
from plora.cost.throughput import (
    DEFAULT_COEFFICIENTS,
    AdapterLoad,
    Coefficients,
    GPUSpec,
    StepSample,
    StepTimeModel,
    fit,
    gpu_spec,
    relative_errors,
)
from plora.model_spec import ModelSpec

#: Bounds of the activation scale a memory refit may set.
_SCALE_RANGE = (0.25, 4.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class RefitReport:
    """What a refit changed (for the coordinator's log)."""

    old: Coefficients
    new: Coefficients
    num_samples: int
    error_before: float
    """Mean |relative error| of step times under the old coefficients."""
    error_after: float
    """The same under the new coefficients."""
    activation_scale_old: float
    activation_scale_new: float
    memory_fit: MemoryFit | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary."""
        return {
            "num_samples": self.num_samples,
            "old": self.old.to_dict(),
            "new": self.new.to_dict(),
            "step_time_rel_error_before": self.error_before,
            "step_time_rel_error_after": self.error_after,
            "activation_scale_old": self.activation_scale_old,
            "activation_scale_new": self.activation_scale_new,
            "memory_fit": None
            if self.memory_fit is None
            else {"b0": self.memory_fit.b0, "b1": self.memory_fit.b1, "b2": self.memory_fit.b2},
        }


class SweepCostModel:
    """:class:`plora.cost.CostModel` of one sweep: one base model, one GPU type.

    Args:
        spec: the base model's shapes.
        seq_len: the padded sequence length every row is planned at.
        dataset_size: training examples (for ``epochs`` configs).
        hardware: a ``plora.config.HardwareConfig`` (``gpu_type``, ``gpu_memory_gib``,
            ``load_factor``).
        gpu: speed of the GPU; default from ``hardware.gpu_type``.
        coefficients: step-time coefficients; default the H200-derived defaults, or the
            profile's when ``profile`` holds samples.
        profile: measured steps of this model on this GPU type (refit on construction).
        memory: memory options (precision, checkpointing, loss kernel, ZeRO stage).
        strategies: strategies the runtime supports for d > 1 (empty: only d = 1).
    """

    def __init__(
        self,
        spec: ModelSpec,
        seq_len: int,
        dataset_size: int,
        hardware: Any,
        *,
        gpu: GPUSpec | None = None,
        coefficients: Coefficients | None = None,
        profile: Profile | None = None,
        memory: MemoryOptions = MemoryOptions(),
        strategies: Sequence[Strategy] = (),
    ) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ConfigError(f"cost model: seq_len={seq_len!r} must be an integer >= 1")
        if not isinstance(dataset_size, int) or dataset_size < 1:
            raise ConfigError(f"cost model: dataset_size={dataset_size!r} must be an integer >= 1")
        self.spec, self.seq_len, self.dataset_size = spec, seq_len, dataset_size
        self.hardware = hardware
        self.gpu = gpu if gpu is not None else gpu_spec(hardware.gpu_type)
        self.memory = memory
        self._strategies = tuple(Strategy(s) for s in strategies)
        self.profile = profile
        self.last_refit: RefitReport | None = None
        coef = coefficients or DEFAULT_COEFFICIENTS
        self.timer = StepTimeModel(
            spec,
            self.gpu,
            coef,
            weight_bytes=base_weight_bytes(spec, memory.precision),
            recompute=memory.checkpointing,
        )
        self._capacity = float(hardware.load_factor) * float(hardware.gpu_memory_gib) * GIB
        self._clear()
        if coefficients is None and profile is not None and profile.samples:
            # Plan from the measurements: the profile's coefficients (or a fit of its samples)
            # and the activation scale its measured peaks imply.
            fitted = self.refit(profile.samples)
            self.timer.coefficients = profile.coefficients or fitted.coefficients
            self.memory = fitted.memory
            self.last_refit = fitted.last_refit
            self._clear()

    def _clear(self) -> None:
        self._cache: dict[tuple, float] = {}

    @property
    def coefficients(self) -> Coefficients:
        """The step-time coefficients in use."""
        return self.timer.coefficients

    # ------------------------------------------------------------ validation
    def _key(self, d: int, strategy: Strategy | None) -> Strategy | None:
        strat = check_parallel(d, strategy)
        if strat is not None and strat not in self._strategies:
            supported = ", ".join(self._strategies) or "none (only d = 1)"
            raise ConfigError(
                f"d={d} with strategy {strat}: not supported; strategies: {supported}"
            )
        return strat

    # --------------------------------------------------------------- memory
    def base_memory(self, d: int, strategy: Strategy | None = None) -> float:
        """Frozen weights + fixed buffers per GPU, bytes."""
        strat = self._key(d, strategy)
        key = ("base_mem", d, strat)
        if key not in self._cache:
            self._cache[key] = base_memory(
                self.spec, d=d, strategy=strat, options=self.memory
            ).total
        return self._cache[key]

    def config_memory(self, config: LoRAConfig, d: int, strategy: Strategy | None = None) -> float:
        """Adapter state and the activations of the config's rows per GPU, bytes."""
        strat = self._key(d, strategy)
        # Memory depends on the shape of the config only: configs differing in lr, alpha,
        # schedule or seed share one entry.
        key = (
            "mem",
            config.rank,
            config.target_modules,
            config.batch_size,
            config.dropout > 0,
            d,
            strat,
        )
        if key not in self._cache:
            self._cache[key] = self.config_breakdown(config, d, strat).total
        return self._cache[key]

    def config_breakdown(self, config: LoRAConfig, d: int = 1, strategy: Strategy | None = None):
        """Per-component :class:`~plora.cost.memory.MemoryBreakdown` of one config."""
        return adapter_memory(
            self.spec,
            rank=config.rank,
            targets=config.target_modules,
            batch_size=config.batch_size,
            seq_len=self.seq_len,
            dropout=config.dropout,
            d=d,
            strategy=self._key(d, strategy),
            options=self.memory,
        )

    def capacity(self, d: int) -> float:
        """``C·M_gpu`` bytes usable per GPU."""
        if not isinstance(d, int) or d < 1 or d & (d - 1):
            raise ConfigError(f"parallel degree d={d!r} must be a power of two >= 1")
        return self._capacity

    def pack_memory(
        self, pack: Sequence[LoRAConfig], d: int, strategy: Strategy | None = None
    ) -> float:
        """Per-GPU bytes of a job: base + Σ configs."""
        return self.base_memory(d, strategy) + sum(self.config_memory(k, d, strategy) for k in pack)

    # ----------------------------------------------------------------- time
    def steps(self, config: LoRAConfig) -> int:
        """``max_steps``, or ``ceil(epochs · dataset_size / batch_size)``."""
        if config.max_steps is not None:
            return config.max_steps
        return max(1, math.ceil(float(config.epochs) * self.dataset_size / config.batch_size))

    def fixed_time(self, steps: int, d: int, strategy: Strategy | None = None) -> float:
        """``steps · t_fixed(d, strategy)``: the job's per-step overhead until its longest config ends."""
        strat = self._key(d, strategy)
        key = ("fixed", d, strat)
        if key not in self._cache:
            self._cache[key] = self.timer.fixed_step_time(d, strat)
        return steps * self._cache[key]

    def config_time(self, config: LoRAConfig, d: int, strategy: Strategy | None = None) -> float:
        """``steps_k · t_k(d, strategy)``: what config k's rows add to any job it is in."""
        strat = self._key(d, strategy)
        key = ("step", config.rank, config.target_modules, config.batch_size, d, strat)
        if key not in self._cache:
            load = AdapterLoad.of(config)
            self._cache[key] = self.timer.adapter_step_time(load, self.seq_len, d, strat)
        return self.steps(config) * self._cache[key]

    def job_time(
        self, pack: Sequence[LoRAConfig], d: int, strategy: Strategy | None = None
    ) -> float:
        """``fixed_time(max steps) + Σ config_time``; 0 for an empty pack."""
        if not pack:
            return 0.0
        longest = max(self.steps(k) for k in pack)
        return self.fixed_time(longest, d, strategy) + sum(
            self.config_time(k, d, strategy) for k in pack
        )

    def config_work(self, config: LoRAConfig) -> float:
        """Single-GPU seconds of the config's own rows (no job overhead): lower-bound work."""
        return self.config_time(config, 1, None)

    def strategies(self) -> Sequence[Strategy]:
        """Strategies allowed for d > 1."""
        return self._strategies

    # ---------------------------------------------------------------- refit
    def refit(
        self, measurements: Sequence[StepSample], *, prior_weight: float = 1e-3
    ) -> SweepCostModel:
        """A new model fitted to ``measurements`` (this model's coefficients are the prior).

        Step times refit every coefficient the samples identify; measured peaks (d = 1)
        rescale the activation memory by the smallest factor that covers every measured peak
        (mLoRA's ``β0 + β1·B·L + β2·B·L²`` fit of the peaks goes into the report).
        The result's :attr:`last_refit` says what changed.
        """
        samples = list(measurements)
        if not samples:
            raise ConfigError("cost-model refit: no measurements")
        new_coef = fit(samples, self.timer, prior_weight=prior_weight)
        new = SweepCostModel(
            self.spec,
            self.seq_len,
            self.dataset_size,
            self.hardware,
            gpu=self.gpu,
            coefficients=new_coef,
            profile=self.profile,
            memory=self.memory,
            strategies=self._strategies,
        )
        scale, mfit = self._refit_activation_scale(samples)
        if scale is not None:
            new.memory = replace(self.memory, activation_scale=scale)
            new._clear()
        new.last_refit = RefitReport(
            old=self.coefficients,
            new=new_coef,
            num_samples=len(samples),
            error_before=float(np.abs(relative_errors(samples, self.timer)).mean()),
            error_after=float(np.abs(relative_errors(samples, new.timer)).mean()),
            activation_scale_old=self.memory.activation_scale,
            activation_scale_new=new.memory.activation_scale,
            memory_fit=mfit,
        )
        return new

    def _refit_activation_scale(
        self, samples: Sequence[StepSample]
    ) -> tuple[float | None, MemoryFit | None]:
        unit = replace(self.memory, activation_scale=1.0, reserved_bytes=0.0)
        points, measured, predicted = [], [], []
        for s in samples:
            if s.peak_memory_bytes is None or s.d != 1:
                continue
            static = base_memory(self.spec, options=unit).total
            act = 0.0
            for a in s.adapters:
                m = adapter_memory(
                    self.spec,
                    rank=a.rank,
                    targets=a.targets,
                    batch_size=a.sequences,
                    seq_len=s.seq_len,
                    dropout=a.dropout,
                    options=unit,
                ).components
                static += (
                    m["lora_params"] + m["lora_grads"] + m["optimizer"] + m["lora_activations"]
                )
                act += m["base_activations"] + m["logits"]
            seqs = sum(a.sequences for a in s.adapters)
            points.append((seqs, s.seq_len, float(s.peak_memory_bytes) - static))
            measured.append(float(s.peak_memory_bytes) - static)
            predicted.append(act)
        if not points:
            return None, None
        try:  # mLoRA's fit, reported for the log
            mfit: MemoryFit | None = fit_memory(points)
        except ConfigError:  # a single batch x length size
            mfit = None
        # Conservative: the smallest scale under which every measured peak is covered. A
        # least-squares scale would under-predict half of the jobs, and under-predicting
        # memory means OOM, over-predicting only a smaller pack.
        scale = max(
            (m / p for m, p in zip(measured, predicted, strict=True) if p > 0), default=None
        )
        if scale is None:
            return None, mfit
        return float(min(max(scale, _SCALE_RANGE[0]), _SCALE_RANGE[1])), mfit


def _runtime_strategies() -> tuple[Strategy, ...]:
    """Strategies ``plora.parallel`` implements (``SUPPORTED_STRATEGIES``), if it says."""
    try:
        import plora.parallel as parallel
    except ImportError:  # pragma: no cover
        return ()
    return tuple(Strategy(s) for s in getattr(parallel, "SUPPORTED_STRATEGIES", ()))


def build_cost_model(
    sweep: Any,
    *,
    dataset_size: int | None = None,
    profile_dir: str | Path | None = None,
    use_profile: bool = True,
    memory: MemoryOptions | None = None,
) -> SweepCostModel:
    """The cost model of a ``plora.config.SweepConfig``.

    Args:
        sweep: the sweep (model, dataset, hardware, planner options).
        dataset_size: training examples; default ``dataset.num_examples`` (the training
            rows; held-out rows come on top).
        profile_dir: profile store directory (default ``~/.cache/plora/profiles``).
        use_profile: read the stored (model, GPU type) profile, if any, and plan from it.
        memory: memory options; default: plora's engine (bf16 autocast with fp32 LoRA state
            on GPUs, fp32 on CPU; chunked recomputed cross-entropy; activation checkpointing
            as ``training.gradient_checkpointing`` says).
    """
    hw = sweep.hardware
    spec = ModelSpec.from_hf_config(sweep.model.name_or_path)
    gpu = gpu_spec(hw.gpu_type, peak_tflops=getattr(hw, "peak_tflops", None))
    if dataset_size is None:
        dataset_size = int(sweep.dataset.num_examples)
    if memory is None:
        fp32 = getattr(hw, "is_cpu", False) or sweep.model.dtype == "float32"
        ckpt = bool(getattr(getattr(sweep, "training", None), "gradient_checkpointing", False))
        memory = MemoryOptions(
            loss=Loss.FUSED, checkpointing=ckpt, **({"precision": FULL_FP32} if fp32 else {})
        )
    strategies = tuple(sweep.planner.strategies) or _runtime_strategies()
    profile = None
    if use_profile:
        profile = ProfileStore(profile_dir).load(sweep.model.name_or_path, hw.gpu_type)
    return SweepCostModel(
        spec,
        int(sweep.seq_len),
        int(dataset_size),
        hw,
        gpu=gpu,
        profile=profile,
        memory=memory,
        strategies=strategies,
    )


__all__ = ["RefitReport", "SweepCostModel", "build_cost_model"]
