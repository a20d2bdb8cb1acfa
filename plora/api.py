"""The library API: plan, run and load a sweep -- what the CLI, examples and notebooks call.

::

    from plora import api
    sweep = api.load_sweep("sweeps/quickstart.yaml", gpus=1)
    report = api.plan(sweep)                 # PlanReport: the plan, both baselines, overheads
    summary = api.run(sweep, "runs/qs")      # SweepSummary (Ray: local unless address is given)
    results = api.load("runs/qs")            # SweepResults: configs, jobs, metrics, plans

Every function raises :class:`~plora.config.ConfigError` for bad input and prints nothing.
Heavy modules (torch, ray, cvxpy, matplotlib, pandas) are imported inside the functions that
need them, so ``import plora.api`` is light.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plora.config import ConfigError, SweepConfig

if TYPE_CHECKING:
    from plora.analysis import SweepResults
    from plora.planner import Plan
    from plora.runtime.driver import RunOptions, SweepSummary


def load_sweep(
    path: str | os.PathLike[str], *, gpus: int | None = None, gpu_memory_gib: float | None = None
) -> SweepConfig:
    """Read a sweep file and apply the command-line hardware overrides (validated, keyed by
    the option name). Raises :class:`ConfigError`."""
    sweep = SweepConfig.from_yaml(path)
    overrides: dict[str, Any] = {"num_gpus": gpus, "gpu_memory_gib": gpu_memory_gib}
    options = {"num_gpus": "--gpus", "gpu_memory_gib": "--gpu-memory-gib"}
    for key, value in overrides.items():
        if value is None:
            continue
        try:
            hw = dataclasses.replace(sweep.hardware, **{key: value})
        except ConfigError as err:
            raise ConfigError(
                err.problem, key=options[key], value=value, fix=err.fix, file=path
            ) from None
        sweep = dataclasses.replace(sweep, hardware=hw)
    return sweep


@dataclasses.dataclass(frozen=True, slots=True)
class InputsReport:
    """What :func:`check` found: the sweep's size and its data as training will read it."""

    sweep: SweepConfig
    num_configs: int
    """Configs (grid/random) or trials (optuna/hyperopt) the sweep will train."""
    train_rows: int
    """Training examples after tokenizing (rows left without a target token are not counted)."""
    eval_rows: int
    """Evaluation examples."""
    metric: str
    """The dataset's task metric (``none`` when it has none)."""


def check(sweep: SweepConfig) -> InputsReport:
    """Check everything ``run`` would reject before training, without Ray or a GPU: the space
    expands into valid configs, the dataset files exist and their rows parse, the base model
    (directory, cache or hub, with a short timeout) and its tokenizer load. What ``plora
    validate`` calls. Raises :class:`ConfigError`."""
    from plora.runtime.prepare import check_inputs
    from plora.tune.space import expand

    n = len(expand(sweep, sample_adaptive=True))
    data = check_inputs(sweep)
    return InputsReport(sweep=sweep, num_configs=n, train_rows=len(data.train),
                        eval_rows=len(data.eval), metric=str(data.metric))  # fmt: skip


class BaselineOption(StrEnum):
    """A baseline schedule to output instead of PLoRA's plan."""

    MIN_GPU = "min-gpu"
    MAX_GPU = "max-gpu"
    TUNE = "tune"


@dataclasses.dataclass(frozen=True, slots=True)
class PlanReport:
    """What ``plora plan`` computed: the plan it outputs and the schedules it compares."""

    sweep: SweepConfig
    configs: tuple[Any, ...]
    plan: Plan
    plora: Plan
    baselines: dict[str, Plan]
    skipped: dict[str, str]
    seconds: float
    overheads: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The cost model's per-unit overheads (``Overheads.to_dict``) and, under ``totals``, the
    plan's seconds by kind summed over its jobs (:func:`time_terms`)."""

    @property
    def plan_name(self) -> str:
        """``plora``, ``min-gpu`` or ``max-gpu``: which schedule :attr:`plan` is."""
        return next(
            (k.replace("_", "-") for k, p in self.baselines.items() if p is self.plan), "plora"
        )

    def to_json_dict(self) -> dict[str, Any]:
        """``plan.json``: the plan (contract keys) plus sweep name, baselines and configs."""
        return {
            **self.plan.to_json_dict(),
            "sweep": self.sweep.name,
            "schedule": self.plan_name,
            "seq_len": self.sweep.seq_len,
            "hardware": dataclasses.asdict(self.sweep.hardware),
            "baselines": {
                **{k: {"makespan_s": p.makespan_s, "num_jobs": len(p.jobs)} for k, p in self.baselines.items()},
                **{k: {"makespan_s": None, "skipped": why} for k, why in self.skipped.items()},
            },
            "plora_makespan_s": self.plora.makespan_s,
            "overheads": self.overheads,
            "configs": [c.to_dict() for c in self.configs],
        }  # fmt: skip


def make_plan(
    sweep: SweepConfig,
    *,
    baseline: BaselineOption | None = None,
    memory_key: str = "hardware.gpu_memory_gib",
) -> PlanReport:
    """Expand the sweep, build its cost model and plan it (plus both baselines).

    ``memory_key`` names the GPU memory in the error for a config that fits no GPU (the
    command-line option when it overrode the file).

    Raises:
        ConfigError: bad sweep, unknown model shape, or a config that fits no GPU count.
    """
    from plora.cost.build import build_cost_model
    from plora.planner import Baseline, NoFeasibleJobError, baseline_plan, plan_sweep
    from plora.tune.space import expand

    t0 = time.perf_counter()
    configs = expand(sweep, sample_adaptive=True)
    cost = build_cost_model(sweep)
    g = sweep.hardware.num_gpus
    try:
        plora = plan_sweep(configs, cost, g, solver=sweep.planner.solver)
        baselines: dict[str, Plan] = {}
        skipped: dict[str, str] = {}
        for b in (Baseline.MIN_GPU, Baseline.MAX_GPU, Baseline.TUNE):
            try:
                baselines[str(b)] = baseline_plan(configs, cost, g, b)
            except NoFeasibleJobError:
                raise
            except ConfigError as err:  # e.g. max_gpu without a multi-GPU strategy
                skipped[str(b)] = err.problem
    except NoFeasibleJobError as err:
        hw = sweep.hardware
        fix = None if "; " in err.problem else (
            f"use GPUs with more memory, more GPUs (now {hw.num_gpus}), a smaller model, "
            "shorter dataset.max_seq_len or smaller batch_size/rank"
        )  # fmt: skip
        raise ConfigError(
            err.problem,
            key=memory_key,
            value=hw.gpu_memory_gib,
            file=sweep.source,
            fix=fix,
        ) from None
    chosen = plora
    if baseline is not None:
        name = str(baseline).replace("-", "_")
        if name in skipped:
            raise ConfigError(f"cannot build this baseline: {skipped[name]}", key="--baseline",
                              value=str(baseline), file=sweep.source, fix="choose the other baseline")  # fmt: skip
        chosen = baselines[name]
    overheads = {**cost.overheads.to_dict(), "totals": time_terms(chosen, configs, cost)}
    return PlanReport(sweep=sweep, configs=tuple(configs), plan=chosen, plora=plora, baselines=baselines,
                      skipped=skipped, seconds=time.perf_counter() - t0, overheads=overheads)  # fmt: skip


def time_terms(plan: Plan, configs: Any, cost: Any) -> dict[str, float]:
    """GPU-group seconds of ``plan`` by kind, summed over its jobs: ``startup_s`` (cold worker
    groups; ``startups`` counts them), then ``job_start_s``, ``train_s``, ``eval_s``,
    ``export_s``, ``checkpoint_s`` (``SweepCostModel.job_terms``)."""
    from plora.planner.types import call_strategy

    by_id = {c.config_id: c for c in configs}
    out = {"startups": 0.0, "startup_s": 0.0, "job_start_s": 0.0, "train_s": 0.0,
           "eval_s": 0.0, "export_s": 0.0, "checkpoint_s": 0.0}  # fmt: skip
    for job in plan.jobs:
        out["startups"] += job.startup_s > 0
        out["startup_s"] += job.startup_s
        pack = [by_id[c] for c in job.config_ids]
        terms = cost.job_terms(pack, job.gpus, call_strategy(job.gpus, job.strategy))
        for key in ("job_start_s", "train_s", "eval_s", "export_s", "checkpoint_s"):
            out[key] += getattr(terms, key)
    return out


def run(
    sweep: SweepConfig | None,
    out: str | os.PathLike[str],
    *,
    address: str | None = None,
    resume: bool = False,
    options: RunOptions | None = None,
    on_update: Callable[..., Any] | None = None,
) -> SweepSummary:
    """Run ``sweep`` on Ray into the sweep directory ``out``; with ``resume`` (and ``sweep``
    None) continue the sweep saved there. See :func:`plora.runtime.driver.run_sweep`."""
    from plora.runtime.driver import run_sweep

    kwargs: dict[str, Any] = {"address": address, "resume": resume, "on_update": on_update}
    if options is not None:
        kwargs["options"] = options
    return run_sweep(sweep, Path(out), **kwargs)


def load(sweep_dir: str | os.PathLike[str]) -> SweepResults:
    """Read a sweep directory (finished or running): :func:`plora.analysis.load`."""
    from plora.analysis import load as load_results

    return load_results(Path(sweep_dir))


#: ``api.plan(sweep)`` reads as the verb; ``make_plan`` is the same function.
plan = make_plan

__all__ = [
    "BaselineOption",
    "InputsReport",
    "PlanReport",
    "check",
    "load",
    "load_sweep",
    "make_plan",
    "plan",
    "run",
    "time_terms",
]
