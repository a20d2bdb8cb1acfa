"""The sweep's cost model: what the planner asks, answered from App. A memory and fitted step times.

:class:`SweepCostModel` implements :class:`plora.cost.CostModel`. For a job ``(pack, d, s)``:

* memory per GPU: ``base_memory(d, s) + Σ_k config_memory(k, d, s) <= capacity(d)``
  (:mod:`plora.cost.memory`; the model's memory answers, micro-batched packs included, are
  :class:`~plora.cost.sweep_memory.SweepMemory`'s);
* time, every second of it (:mod:`plora.cost.overheads` for the terms outside steps)::

      job_time = fixed_time(n_max, d, s) + Σ_k config_time(k, d, s)
      fixed_time(n)  = job_start_s + n·t_fixed(d, s) + checkpoint_writes(n)·checkpoint_s
      config_time(k) = n_k·t_k(d, s) + E_k + export_s + max(0, 4·P_k·w - E_k)
                       + active_checkpoints(n_k)·12·P_k·w
      E_k            = R·(eval_s_per_row [+ generate_s_per_row])

  with ``n_max = max_k n_k`` (steps), ``t_fixed``/``t_k`` from
  :class:`~plora.cost.throughput.StepTimeModel`, ``R`` eval rows, ``P_k`` LoRA parameters and
  ``w`` write seconds per byte: a config pays for its own tokens for the steps it trains and
  for its evaluation and export (its write overlaps its evaluation: only the excess counts),
  the job pays its start, its per-step overhead until its longest config is done and its
  checkpoint writes. ``fixed_time`` is non-decreasing in ``n`` and
  ``config_time`` depends on the config alone, so T stays affine in the pack for a fixed
  longest config (what the planner's exact ILP needs). A cold worker group first pays
  :meth:`SweepCostModel.startup_time` (worker start + model load), once per group: the
  planner charges it (:mod:`plora.planner.groups`), not ``job_time``.

Every per-config answer is cached by the config's shape (rank, targets, batch size, dropout,
steps) and ``(d, strategy)``: the planner asks thousands of times, and configs differing only
in lr, alpha, schedule or seed share an entry. :meth:`SweepCostModel.refit` returns a new
model whose coefficients (and activation scale, when peaks were measured) come from measured
steps, with a :class:`RefitReport`; :meth:`SweepCostModel.refit_overheads` does the same for
the overheads from :class:`~plora.cost.overheads.OverheadSample` s.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any, cast

import numpy as np

from plora.config import ConfigError, LoRAConfig
from plora.cost import Strategy
from plora.cost.asha_survival import EarlyStopLike, expected_steps
from plora.cost.fit import fit, relative_errors
from plora.cost.jobterms import JobTimeTerms, SweepOverheads
from plora.cost.memory import base_weight_bytes, projection_params
from plora.cost.memory_options import GIB, Loss, MemoryOptions
from plora.cost.microbatch import MAX_MICRO_BATCHES, check_micro_batches
from plora.cost.overheads import EvalMetric, Overheads, OverheadSample
from plora.cost.priors import peft_prior, step_prior
from plora.cost.profile import Profile
from plora.cost.recency import fit_by_sweep
from plora.cost.refit import RefitReport, activation_scale
from plora.cost.sweep_memory import SweepMemory
from plora.cost.throughput import (
    AdapterLoad,
    Coefficients,
    GPUSpec,
    LoRALayout,
    StepSample,
    StepTimeModel,
    gpu_spec,
)
from plora.model_spec import ModelSpec


class SweepCostModel(SweepMemory):
    """:class:`plora.cost.CostModel` of one sweep: one base model, one GPU type.

    Args:
        spec: the base model's shapes.
        seq_len: the padded sequence length every row's memory is planned at (the longest).
        dataset_size: training examples (for ``epochs`` configs).
        hardware: a ``plora.config.HardwareConfig`` (``gpu_type``, ``gpu_memory_gib``,
            ``load_factor``, ``is_cpu``).
        gpu: speed of the GPU; default from ``hardware.gpu_type``.
        coefficients: step-time coefficients; default the GPU type's measured prior
            (:func:`plora.cost.priors.step_prior`, with Liger's ops when
            ``memory.fused_kernels``), or the profile's when
            ``profile`` holds samples (fitted sweep by sweep and weighed by sweep age:
            :mod:`plora.cost.recency`).
        profile: measured steps (and overheads) of this model on this GPU type.
        memory: memory options (precision, checkpointing, loss kernel, ZeRO stage).
        cuda_graphs: one-GPU jobs replay their steady step as CUDA graphs
            (``training.cuda_graphs`` resolved: :func:`plora.cost.build.plan_cuda_graphs`):
            d = 1 jobs start from the graphed prior, d > 1 jobs (always eager) and evaluation
            (eager forwards) from the eager one. Measured steps refit each set apart: d = 1
            steps the graphed one, d > 1 steps the eager one (:attr:`eager_coefficients`); a
            set no sample measured keeps what it had.
        eager_coefficients: with ``cuda_graphs``, the eager set (default: the eager prior while
            ``coefficients`` is the prior, else ``coefficients`` themselves).
        strategies: strategies the runtime supports for d > 1 (empty: only d = 1).
        overheads: seconds outside steps; default :meth:`Overheads.default` for this model,
            GPU and metric, refit with the profile's overhead samples when it has some (the
            median per kind, weighed by sweep age).
        eval_rows: eval rows each config is evaluated on after training (0: no evaluation).
        eval_metric: the task metric (:class:`~plora.cost.overheads.EvalMetric`).
        checkpoint_every: train-state checkpoint every this many steps (None: at the end only).
        early_stop: the sweep's ``early_stop:`` (ASHA): a config's rows are charged for its
            expected steps (:mod:`plora.cost.asha_survival`; ``population``: the sweep's number of
            configs), a pack's per-step overhead for the longest budget.
        max_micro_batches: the most forwards per step the planner may give a pack that does
            not fit with every row live (:mod:`plora.cost.microbatch`); 1: never.
        step_seq_len: the padded width a step's rows are expected to have, for time (steps,
            evaluation): rows are padded to the longest row of their step, not to
            ``seq_len`` (:func:`plora.cost.build.step_seq_len` of the tokenized data); default
            ``seq_len``.
        layout: who pays the per-projection launch cost ``m``
            (:class:`~plora.cost.throughput.LoRALayout`): plora's packed layers (default), or
            each adapter its own modules (PEFT: :meth:`for_peft`).
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
        cuda_graphs: bool = False,
        eager_coefficients: Coefficients | None = None,
        strategies: Sequence[Strategy] = (),
        overheads: Overheads | None = None,
        eval_rows: int = 0,
        eval_metric: EvalMetric | str = EvalMetric.NONE,
        checkpoint_every: int | None = None,
        early_stop: EarlyStopLike | None = None,
        population: int | None = None,
        max_micro_batches: int = MAX_MICRO_BATCHES,
        step_seq_len: int | None = None,
        layout: LoRALayout = LoRALayout.PACKED,
    ) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ConfigError(f"cost model: seq_len={seq_len!r} must be an integer >= 1")
        if not isinstance(dataset_size, int) or dataset_size < 1:
            raise ConfigError(f"cost model: dataset_size={dataset_size!r} must be an integer >= 1")
        self.spec, self.seq_len, self.dataset_size = spec, seq_len, dataset_size
        if step_seq_len is not None and not (isinstance(step_seq_len, int) and step_seq_len >= 1):
            raise ConfigError(f"cost model: step_seq_len={step_seq_len!r} must be an integer >= 1")
        self.step_seq_len = min(step_seq_len or seq_len, seq_len)
        self.max_micro_batches = check_micro_batches(max_micro_batches)
        self.hardware = hardware
        self.early_stop, self.population = early_stop, population
        self.gpu = gpu if gpu is not None else gpu_spec(hardware.gpu_type)
        self.memory, self.layout = memory, LoRALayout(layout)
        self._strategies = tuple(Strategy(s) for s in strategies)
        self.profile = profile
        self.last_refit: RefitReport | None = None
        given = overheads if overheads is not None else Overheads.zero()  # defaults below
        self._use(SweepOverheads(overheads=given, eval_rows=eval_rows, eval_metric=cast(EvalMetric, eval_metric),  # validated by SweepOverheads
                                 checkpoint_every=checkpoint_every))  # fmt: skip
        self.cuda_graphs = bool(cuda_graphs)
        # the prior follows the GPU type, the kernels the engine runs on the base and whether
        # its one-GPU steps are graphed; d > 1 steps (and evaluation) are eager
        self._from_prior = coefficients is None
        coef = coefficients or step_prior(
            self.gpu.name, memory.fused_kernels, self.cuda_graphs, spec
        )
        self.timer = self._timer_with(coef)
        self._eager_timer = self.timer
        if self.cuda_graphs and eager_coefficients is not None:
            self._eager_timer = self._timer_with(eager_coefficients)
        elif self.cuda_graphs and self._from_prior:
            self._eager_timer = self._timer_with(
                step_prior(self.gpu.name, memory.fused_kernels, spec=spec)
            )
        self._capacity = float(hardware.load_factor) * float(hardware.gpu_memory_gib) * GIB
        self._clear()
        if coefficients is None and profile is not None and profile.samples:
            # Plan from the measurements: the profile's coefficients (or a fit of its samples)
            # and the activation scale its measured peaks imply.
            fitted = self.refit(profile.samples, by_sweep=True)
            self.timer.coefficients = profile.coefficients or fitted.coefficients
            eager = None if profile.coefficients else fitted.eager_coefficients
            self._eager_timer = self.timer if eager is None else self._timer_with(eager)
            self._from_prior = False
            self.memory = fitted.memory
            self.last_refit = fitted.last_refit
            self._clear()
        if overheads is None:  # physics defaults, then what the profile measured
            default = Overheads.default(
                spec,
                self._eager_timer,  # evaluation's forwards are not graphed
                seq_len=self.step_seq_len,
                metric=self.eval_metric,
                weight_bytes=base_weight_bytes(spec, self.memory.precision),
                cpu=bool(getattr(hardware, "is_cpu", False)),
            )
            measured = default
            if profile is not None:  # weighed by sweep age (plora.cost.recency)
                measured = default.refit(profile.overhead_samples, profile.overhead_weights())
            self._use(replace(self.sweep_overheads, overheads=measured))

    def _timer_with(self, coefficients: Coefficients) -> StepTimeModel:
        return StepTimeModel(
            self.spec,
            self.gpu,
            coefficients,
            weight_bytes=base_weight_bytes(self.spec, self.memory.precision),
            layout=self.layout,
            recompute=self.memory.checkpointing,
            dequant_bytes=projection_params(self.spec) * self.memory.precision.dequant_bytes,
        )

    def _mean_error(self, samples: Sequence[StepSample]) -> float:
        """Mean ``|predicted - measured| / measured`` of ``samples``, each by its d's model."""
        errors = [relative_errors([s], self._timer_for(s.d))[0] for s in samples]
        return float(np.abs(errors).mean())

    def _timer_for(self, d: int) -> StepTimeModel:
        """The step-time model of a job of ``d`` GPUs: d > 1 jobs never graph their step."""
        return self.timer if d == 1 else self._eager_timer

    def _use(self, terms: SweepOverheads) -> None:
        self.sweep_overheads = terms
        self.overheads, self.eval_rows = terms.overheads, terms.eval_rows
        self.eval_metric, self.checkpoint_every = terms.eval_metric, terms.checkpoint_every
        self._clear()

    def _clear(self) -> None:
        self._cache = {}

    @property
    def coefficients(self) -> Coefficients:
        """The step-time coefficients in use (d > 1 jobs: :attr:`eager_coefficients`)."""
        return self.timer.coefficients

    @property
    def eager_coefficients(self) -> Coefficients | None:
        """The eager steps' own coefficients (d > 1 jobs of a graphed sweep), or None when one
        set serves every d."""
        return None if self._eager_timer is self.timer else self._eager_timer.coefficients

    # ----------------------------------------------------------------- time
    def steps(self, config: LoRAConfig) -> int:
        """``max_steps``, or ``ceil(epochs · dataset_size / batch_size)``."""
        if config.max_steps is not None:
            return config.max_steps
        epochs = float(config.epochs or 0.0)  # LoRAConfig: exactly one of max_steps, epochs
        return max(1, math.ceil(epochs * self.dataset_size / config.batch_size))

    def price_key(self, config: LoRAConfig) -> Hashable:
        """What this model's answers about ``config`` depend on: configs of equal keys (lr,
        alpha, seed, schedule aside) are priced alike by every method (the planner prices one)."""
        return (config.rank, config.target_modules, config.batch_size, config.dropout,
                self.steps(config))  # fmt: skip

    def expected_steps(self, config: LoRAConfig) -> float:
        """:meth:`steps` under the sweep's early stopping, in expectation (its budget without)."""
        return expected_steps(self.steps(config), self.early_stop, population=self.population)

    def step_fixed_time(
        self, steps: int, d: int, strategy: Strategy | None = None, *, micro_batches: int = 1
    ) -> float:
        """``steps · m · t_fixed(d, strategy)``: the job's per-step overhead (training steps
        only), paid once per forward: ``m`` times a step of ``micro_batches`` m."""
        strat = self._key(d, strategy)
        key = ("fixed", d, strat)
        if key not in self._cache:
            self._cache[key] = self._timer_for(d).fixed_step_time(d, strat)
        m = check_micro_batches(micro_batches)
        if m == 1:
            return steps * cast(float, self._cache[key])
        return steps * (m * cast(float, self._cache[key]))

    def job_overhead_time(self, steps: int) -> float:
        """``job_start_s + checkpoint_writes(steps) · checkpoint_s``: a job's own overheads."""
        return self.sweep_overheads.per_job(steps).total_s

    def fixed_time(
        self, steps: int, d: int, strategy: Strategy | None = None, *, micro_batches: int = 1
    ) -> float:
        """What a job whose longest config runs ``steps`` steps pays regardless of its pack:
        :meth:`job_overhead_time` + :meth:`step_fixed_time` (non-decreasing in ``steps``)."""
        return self.job_overhead_time(steps) + self.step_fixed_time(
            steps, d, strategy, micro_batches=micro_batches
        )

    def config_step_time(
        self, config: LoRAConfig, d: int, strategy: Strategy | None = None
    ) -> float:
        """``steps_k · t_k(d, strategy)``: what config k's rows add to the steps of its job
        (``steps_k`` expected under early stopping)."""
        strat = self._key(d, strategy)
        key = ("step", config.rank, config.target_modules, config.batch_size, d, strat)
        if key not in self._cache:
            load = AdapterLoad.of(config)
            timer = self._timer_for(d)
            self._cache[key] = timer.adapter_step_time(load, self.step_seq_len, d, strat)
        return self.expected_steps(config) * cast(float, self._cache[key])

    def config_overhead_time(self, config: LoRAConfig) -> float:
        """Config k's evaluation, PEFT export and share of checkpoint bytes (any d: the group
        evaluates and writes at the single-GPU rate, an upper estimate for d > 1)."""
        return self.config_terms(config).total_s

    def config_terms(self, config: LoRAConfig) -> JobTimeTerms:
        """The terms of :meth:`config_overhead_time` one by one."""
        steps = self.steps(config)
        key = ("over", config.rank, config.target_modules, steps)
        if key not in self._cache:
            params = self.spec.lora_params(config.rank, config.target_modules)
            self._cache[key] = self.sweep_overheads.per_config(params, steps)
        return cast(JobTimeTerms, self._cache[key])

    def config_time(self, config: LoRAConfig, d: int, strategy: Strategy | None = None) -> float:
        """Everything config k adds to any job it is in: :meth:`config_step_time` +
        :meth:`config_overhead_time`."""
        return self.config_step_time(config, d, strategy) + self.config_overhead_time(config)

    def job_time(
        self,
        pack: Sequence[LoRAConfig],
        d: int,
        strategy: Strategy | None = None,
        *,
        micro_batches: int = 1,
    ) -> float:
        """``fixed_time(max steps) + Σ config_time`` on a warm group; 0 for an empty pack
        (``micro_batches``: forwards per step, each paying the fixed part)."""
        if not pack:
            return 0.0
        longest = max(self.steps(k) for k in pack)
        return self.fixed_time(longest, d, strategy, micro_batches=micro_batches) + sum(
            self.config_time(k, d, strategy) for k in pack
        )

    def job_terms(
        self,
        pack: Sequence[LoRAConfig],
        d: int,
        strategy: Strategy | None = None,
        *,
        micro_batches: int = 1,
    ) -> JobTimeTerms:
        """:meth:`job_time` split by kind (the terms sum to it)."""
        if not pack:
            return JobTimeTerms()
        longest = max(self.steps(k) for k in pack)
        train = self.step_fixed_time(longest, d, strategy, micro_batches=micro_batches)
        train += sum(self.config_step_time(k, d, strategy) for k in pack)
        terms = self.sweep_overheads.per_job(longest) + JobTimeTerms(train_s=train)
        return sum((self.config_terms(k) for k in pack), terms)

    def startup_time(self, d: int) -> float:
        """A cold group of d GPUs before its first job: ``worker_start_s + model_load_s``
        (the workers start and load in parallel, so the same for every d)."""
        self.capacity(d)  # validates d
        return self.overheads.startup_s

    def config_work(self, config: LoRAConfig) -> float:
        """Single-GPU seconds of the config's own rows, evaluation and export (no job overhead):
        what every schedule pays for it (lower-bound work)."""
        return self.config_time(config, 1, None)

    def strategies(self) -> Sequence[Strategy]:
        """Strategies allowed for d > 1."""
        return self._strategies

    # ---------------------------------------------------------------- refit
    def _copy(self, **changes: Any) -> SweepCostModel:
        args: dict[str, Any] = {
            "gpu": self.gpu,
            # still the prior: the copy derives it again (and its eager twin for d > 1)
            "coefficients": None if self._from_prior else self.coefficients,
            "eager_coefficients": None if self._from_prior else self.eager_coefficients,
            "profile": self.profile,
            "memory": self.memory,
            "cuda_graphs": self.cuda_graphs,
            "strategies": self._strategies,
            "overheads": self.overheads,
            "eval_rows": self.eval_rows,
            "eval_metric": self.eval_metric,
            "checkpoint_every": self.checkpoint_every,
            "early_stop": self.early_stop,
            "population": self.population,
            "max_micro_batches": self.max_micro_batches,
            "step_seq_len": self.step_seq_len,
            "layout": self.layout,
        }
        new = SweepCostModel(
            self.spec, self.seq_len, self.dataset_size, self.hardware, **{**args, **changes}
        )
        new.last_refit = self.last_refit
        return new

    def for_peft(self) -> SweepCostModel:
        """This sweep as Ray Tune + PEFT trials run it (the Tune baseline's cost model): one
        PEFT adapter per trial on the stock HF base -- eager (no CUDA graphs), no Liger, each
        adapter its own modules (``m`` per target module and layer:
        :attr:`~plora.cost.throughput.LoRALayout.PER_ADAPTER`) -- stepping at PEFT's measured
        step (:func:`plora.cost.priors.peft_prior`) whatever this model's coefficients or
        profile (those are plora's engine). Memory: HF's unfused kernels and loss
        (``fused_kernels`` off, :attr:`~plora.cost.memory_options.Loss.EAGER`). The sequence
        length, overheads (evaluation, export, checkpoints, start-up), strategies and early
        stopping are this model's."""
        new = self._copy(
            coefficients=peft_prior(self.gpu.name, self.spec),
            eager_coefficients=None,
            profile=None,
            cuda_graphs=False,
            memory=replace(self.memory, fused_kernels=False, loss=Loss.EAGER),
            layout=LoRALayout.PER_ADAPTER,
        )
        new.last_refit = None
        return new

    def with_overheads(self, overheads: Overheads | None = None, **changes: Any) -> SweepCostModel:
        """A new model with ``overheads`` (default: these) and any of ``eval_rows``,
        ``eval_metric``, ``checkpoint_every`` changed; step times and memory unchanged."""
        allowed = {"eval_rows", "eval_metric", "checkpoint_every"}
        if set(changes) - allowed:
            raise TypeError(f"with_overheads: unexpected {sorted(set(changes) - allowed)}")
        return self._copy(overheads=self.overheads if overheads is None else overheads, **changes)

    def refit_overheads(self, samples: Sequence[OverheadSample]) -> SweepCostModel:
        """A new model whose measured overhead kinds come from ``samples`` (median per unit);
        the rest keep this model's values (:meth:`Overheads.refit`)."""
        return self.with_overheads(self.overheads.refit(samples))

    def refit(
        self,
        measurements: Sequence[StepSample],
        *,
        prior_weight: float = 1e-3,
        by_sweep: bool = False,
    ) -> SweepCostModel:
        """A new model fitted to ``measurements`` (this model's coefficients are the prior; with
        ``by_sweep`` the profile store's sweeps apart, weighed by age:
        :func:`~plora.cost.recency.fit_by_sweep`).

        Step times refit every coefficient the samples identify; measured peaks (d = 1)
        rescale the activation memory by the smallest factor that covers every measured peak
        (mLoRA's ``β0 + β1·B·L + β2·B·L²`` fit of the peaks goes into the report).
        Overheads, eval rows and checkpoint interval carry over unchanged.
        The result's :attr:`last_refit` says what changed.
        """
        samples = list(measurements)
        if not samples:
            raise ConfigError("cost-model refit: no measurements")

        def fitted(subset: list[StepSample], timer: StepTimeModel) -> Coefficients:
            if by_sweep:
                return fit_by_sweep(subset, timer, prior_weight=prior_weight)
            return fit(subset, timer, prior_weight=prior_weight)

        if self.cuda_graphs:  # graphed d = 1 steps and eager d > 1 steps: each set its own
            one = [s for s in samples if s.d == 1]
            many = [s for s in samples if s.d > 1]
            new_coef = fitted(one, self.timer) if one else self.coefficients
            eager = fitted(many, self._eager_timer) if many else self.eager_coefficients
            new = self._copy(coefficients=new_coef, eager_coefficients=eager)
        else:
            new_coef = fitted(samples, self.timer)
            new = self._copy(coefficients=new_coef)
        scale, mfit = activation_scale(self.spec, self.memory, samples)
        if scale is not None:
            new.memory = replace(self.memory, activation_scale=scale)
            new._clear()
        new.last_refit = RefitReport(
            old=self.coefficients,
            new=new_coef,
            num_samples=len(samples),
            error_before=self._mean_error(samples),
            error_after=new._mean_error(samples),
            activation_scale_old=self.memory.activation_scale,
            activation_scale_new=new.memory.activation_scale,
            memory_fit=mfit,
        )
        return new


__all__ = ["RefitReport", "SweepCostModel"]
