"""Does every config of a sweep fit some job the sweep allows? One line when not.

:func:`check_fits` runs the planner's own feasibility test (:func:`~plora.planner.timeline.
check_feasible` over :func:`~plora.planner.ilp.build_classes`: a config fits when, alone, it
fits the memory of one allowed ``(d, strategy)``) before anything is planned, started or
written; :func:`no_fit_error` turns its failure into the sweep's one-line
:class:`~plora.config.ConfigError` (``FILE:LINE: KEY=VALUE: PROBLEM; FIX``). ``plora plan``,
``plora validate`` and ``plora sweep`` all ask it, so they refuse the same sweeps.

A ``(d, strategy)`` the model cannot take (:meth:`plora.model_spec.ModelSpec.parallel_problem`:
tp where ``d`` does not divide the heads or MLP features, pp with more stages than layers) never
fits in the cost model, so the planner never picks it; the error names it, and when every
multi-GPU job the sweep allows is such a one it names ``planner.strategies`` rather than the
GPU memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from plora.config import ConfigError, LoRAConfig, Strategy, SweepConfig
from plora.cost import CostModel
from plora.model_spec import ModelSpec
from plora.planner.ilp import build_classes, degrees
from plora.planner.timeline import check_feasible
from plora.planner.types import NoFeasibleJobError


def check_fits(
    sweep: SweepConfig,
    configs: Sequence[LoRAConfig],
    cost: CostModel,
    *,
    spec: ModelSpec | None = None,
    memory_key: str = "hardware.gpu_memory_gib",
) -> None:
    """Raise :func:`no_fit_error` when a config of ``configs`` fits no ``(d, strategy)`` the
    sweep allows on ``sweep.hardware.num_gpus`` GPUs (``spec``: the model, to say which
    degrees it cannot take; ``memory_key``: the key the GPU memory came from)."""
    num_gpus = sweep.hardware.num_gpus
    try:
        check_feasible(build_classes(configs, cost, num_gpus), num_gpus)
    except NoFeasibleJobError as err:
        strategies = cost.strategies()
        raise no_fit_error(
            sweep, err, spec=spec, memory_key=memory_key, strategies=strategies
        ) from None


def refused_degrees(
    spec: ModelSpec, strategies: Sequence[Strategy], num_gpus: int
) -> dict[Strategy, tuple[int, str]]:
    """Per strategy, the smallest ``d`` in 2, 4, ... <= ``num_gpus`` the model cannot take and
    why (every larger ``d`` is refused too: a degree that does not divide ``n`` has no multiple
    that does, and more stages than layers stay more)."""
    out: dict[Strategy, tuple[int, str]] = {}
    for d, s in degrees(num_gpus, strategies):
        if s is not None and s not in out and (why := spec.parallel_problem(s, d)):
            out[s] = (d, why)
    return out


def widest_degree(spec: ModelSpec | None, strategies: Sequence[Strategy], num_gpus: int) -> int:
    """The most GPUs one job of the sweep may span: the largest ``d`` in 1, 2, 4, ... <=
    ``num_gpus`` that some allowed strategy runs the model on (without ``spec``: any)."""
    return max(
        d
        for d, s in degrees(num_gpus, strategies)
        if s is None or spec is None or not spec.parallel_problem(s, d)
    )


def no_fit_error(
    sweep: SweepConfig,
    err: NoFeasibleJobError,
    *,
    spec: ModelSpec | None = None,
    memory_key: str = "hardware.gpu_memory_gib",
    strategies: Sequence[Strategy] | None = None,
) -> ConfigError:
    """The sweep's one line for a config that fits no allowed job (located in its file).

    Keyed ``planner.strategies`` when the sweep allows multi-GPU jobs but the model can take
    none of them (every strategy refused from d = 2), else ``memory_key`` with the GPU memory,
    naming the degrees the model cannot take, if any. ``strategies``: those the plan was made
    with (the cost model's), default the sweep's ``planner.strategies``."""
    hw, listed = sweep.hardware, tuple(sweep.planner.strategies)
    strategies = listed if strategies is None else tuple(strategies)
    head, _, fix = err.problem.partition("; ")
    refused = refused_degrees(spec, strategies, hw.num_gpus) if spec is not None else {}
    widest = max(d for d, _ in degrees(hw.num_gpus, strategies))
    cannot = ", ".join(
        f"{s} on {d}{'+' if d < widest else ''} GPUs ({why})" for s, (d, why) in refused.items()
    )
    fsdp = "add fsdp to planner.strategies (it shards any model), "
    fsdp = "" if any(str(s).startswith("fsdp") for s in (*listed, *strategies)) else fsdp
    model = sweep.model.name_or_path
    if refused and all(refused.get(s, (0, ""))[0] == 2 for s in strategies):
        problem = f"{head}, and {model} cannot run the multi-GPU jobs these strategies allow"
        fix = f"{fsdp}use GPUs with more memory, or a smaller rank/batch_size/seq_len"
        values = [str(s) for s in listed]
        return sweep.locate(
            ConfigError(f"{problem}: {cannot}", key="planner.strategies", value=values, fix=fix)
        )
    if refused:
        head += f", and {model} cannot take {cannot}"
        fix = f"use GPUs with more memory, {fsdp}or a smaller rank/batch_size/seq_len"
    if not fix:  # not check_feasible's own line
        fix = (f"use GPUs with more memory, more GPUs (now {hw.num_gpus}), a smaller model, "
               "shorter dataset.max_seq_len or smaller batch_size/rank")  # fmt: skip
    return sweep.locate(ConfigError(head, key=memory_key, value=hw.gpu_memory_gib, fix=fix))


__all__ = ["check_fits", "no_fit_error", "refused_degrees", "widest_degree"]
