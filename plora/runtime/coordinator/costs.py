"""What the runtime asks of the cost model beyond the planner's Protocol: memory of a live pack,
a JSON view of its coefficients (for decision records) and online refits from measured jobs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from plora.config import LoRAConfig
from plora.cost import Strategy
from plora.cost.asha_survival import expected_steps, expected_steps_left
from plora.planner.types import call_strategy


def cost_strategy(d: int, strategy: str | Strategy | None) -> Strategy:
    """The strategy to pass the cost model for a job's (possibly string) strategy: the
    planner's rule (:func:`plora.planner.types.call_strategy`: d = 1 jobs have none, TP)."""
    return call_strategy(d, None if strategy is None else Strategy(strategy))


def job_memory(
    cost: Any,
    pack: Sequence[LoRAConfig],
    d: int,
    strategy: str | Strategy | None,
    *,
    micro_batches: int = 1,
) -> tuple[float, float]:
    """``(M_base(d) + Σ_k M_k(d), capacity(d))`` in bytes per GPU for ``pack`` on ``d`` GPUs
    (``micro_batches`` > 1: the states plus one micro-batch's rows, when the cost model
    prices micro-batches)."""
    s = cost_strategy(d, strategy)
    if micro_batches > 1 and hasattr(cost, "config_memory_parts"):
        used = cost.pack_memory(pack, d, s, micro_batches=micro_batches)
    else:
        used = cost.base_memory(d, s) + sum(cost.config_memory(c, d, s) for c in pack)
    return float(used), float(cost.capacity(d))


def micro_kwargs(cost: Any, micro_batches: int) -> dict[str, int]:
    """``{"micro_batches": m}`` for a cost model that prices micro-batches and m > 1, else {}."""
    if micro_batches > 1 and hasattr(cost, "config_memory_parts"):
        return {"micro_batches": micro_batches}
    return {}


def remaining_job_time(
    cost: Any,
    pack: Sequence[LoRAConfig],
    progress: Mapping[str, int],
    d: int,
    strategy: str | Strategy | None,
    *,
    micro_batches: int = 1,
) -> float:
    """Predicted seconds a running job still needs: its per-step overhead until its longest
    config is done, each config's own steps left, and what the cost model charges beyond the
    steps (evaluation, export, checkpoints; not the job's start, already paid) -- what
    ``job_time`` charges, with the steps already done taken off. ``micro_batches`` > 1: the
    per-step overhead is paid once per forward (a cost model that prices micro-batches)."""
    if not pack:
        return 0.0
    s = cost_strategy(d, strategy)
    steps = {c.config_id: max(1, int(cost.steps(c))) for c in pack}
    left = {c.config_id: max(0, steps[c.config_id] - progress.get(c.config_id, 0)) for c in pack}
    # a SweepCostModel splits steps from overheads; a bare CostModel charges only steps
    step_fixed = getattr(cost, "step_fixed_time", cost.fixed_time)
    config_steps = getattr(cost, "config_step_time", cost.config_time)
    stepped = [config_steps(c, d, s) for c in pack]
    longest = max(steps.values())
    micro = micro_kwargs(cost, micro_batches)
    rest = cost.job_time(pack, d, s, **micro) - step_fixed(longest, d, s, **micro) - sum(stepped)
    terms = getattr(cost, "sweep_overheads", None)
    if terms is not None:  # the start is paid; the checkpoint writes still to come are not
        rest += terms.per_job(max(left.values())).checkpoint_s - terms.per_job(longest).total_s
    # a config's rows: its expected steps left (under early stopping: given it still trains)
    stop, n = getattr(cost, "early_stop", None), getattr(cost, "population", None)
    own = 0.0
    for c, t in zip(pack, stepped, strict=True):
        total, done = steps[c.config_id], progress.get(c.config_id, 0)
        still = expected_steps_left(total, done, stop, population=n)
        own += t * still / max(expected_steps(total, stop, population=n), 1e-9)
    return float(step_fixed(max(left.values()), d, s, **micro) + own + max(0.0, rest))


def describe_cost(cost: Any) -> dict[str, Any]:
    """A JSON view of the cost model's fitted coefficients (what a refit changes)."""
    for name in ("coefficients", "describe", "to_json_dict", "to_dict"):
        value = getattr(cost, name, None)
        if value is None:
            continue
        value = value() if callable(value) else value
        view: dict[str, Any] = _jsonable(value.to_dict() if hasattr(value, "to_dict") else value)
        return view
    if dataclasses.is_dataclass(cost) and not isinstance(cost, type):
        whole: dict[str, Any] = _jsonable(dataclasses.asdict(cost))
        return whole
    return {"type": type(cost).__name__}


def refit_cost(
    cost: Any, measurements: Sequence[Mapping[str, Any]], configs: Mapping[str, LoRAConfig]
) -> tuple[Any | None, dict[str, Any]]:
    """Refit ``cost`` from every measurement so far.

    Args:
        cost: The cost model; models without ``refit`` are left alone.
        measurements: One dict per job attempt: ``config_ids`` (the pack its profile measured),
            ``gpus``, ``strategy``, ``device`` and ``steps``: measured steps as
            ``{"time_s", "seq_len", "peak_memory_bytes"}`` (warm-up step already dropped).
        configs: The configs by id.

    Returns:
        ``(new_cost, report)``: the refit model (None when there was nothing to fit) and what
        went in / changed, as JSON.
    """
    refit = getattr(cost, "refit", None)
    if not callable(refit):
        return None, {}
    samples = step_samples(cost, measurements, configs)
    if not samples:
        return None, {}
    fitted = refit(samples)
    fitted = cost if fitted is None else fitted
    report = getattr(fitted, "last_refit", None)
    out = {"num_samples": len(samples)}
    if report is not None and hasattr(report, "to_dict"):
        out.update(_jsonable(report.to_dict()))
    return fitted, out


def step_samples(
    cost: Any, measurements: Sequence[Mapping[str, Any]], configs: Mapping[str, LoRAConfig]
) -> list[Any]:
    """The measurements as ``plora.cost.throughput.StepSample`` s (one per measured step)."""
    from plora.cost.throughput import StepSample

    seq_default = int(getattr(cost, "seq_len", 0) or 0)
    out = []
    for m in measurements:
        pack = [configs[c] for c in m.get("config_ids", ()) if c in configs]
        if not pack:
            continue
        gpu = str(m.get("device", "")).startswith("cuda")
        for st in m.get("steps", ()):
            if not st.get("time_s") or st["time_s"] <= 0:
                continue
            d = int(m.get("gpus", 1))
            out.append(
                StepSample.from_configs(
                    pack,
                    seq_len=int(st.get("seq_len") or seq_default or 1),
                    step_time_s=float(st["time_s"]),
                    d=d,
                    strategy=None if d == 1 else m.get("strategy"),
                    # on CPU the engine reports process RSS: not a model of activations
                    peak_memory_bytes=st.get("peak_memory_bytes") if gpu else None,
                )
            )
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Enum):
        return str(x.value)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return repr(x)


__all__ = [
    "cost_strategy",
    "describe_cost",
    "job_memory",
    "micro_kwargs",
    "record_profile",
    "refit_cost",
    "remaining_job_time",
    "step_samples",
]


def record_profile(
    sweep: Any,
    cost: Any,
    measurements: Sequence[Mapping[str, Any]],
    configs: Mapping[str, LoRAConfig],
    overheads: Sequence[Any] = (),
    *,
    profile_dir: Any = None,
) -> int:
    """Append a sweep's measured steps and overhead samples (worker start, model load, eval,
    export, checkpoint: :class:`~plora.cost.overheads.OverheadSample`) to the (model, GPU type)
    profile store, so the next sweep on the same model and GPU plans from measurements
    (``build_cost_model`` reads it).

    Returns:
        How many samples were recorded (0: nothing measured, nothing written).
    """
    from plora.config.fused import fused_profile_key
    from plora.cost.profile import ProfileStore

    samples = step_samples(cost, measurements, configs)
    if samples or overheads:
        # under the key build_cost_model reads: steps with Liger's fused base ops, and those of
        # a sweep whose one-GPU steps were graphed, kept apart
        fused = bool(getattr(getattr(cost, "memory", None), "fused_kernels", False))
        graphs = bool(getattr(cost, "cuda_graphs", False))
        key = fused_profile_key(sweep.model.profile_key, fused, graphs)
        ProfileStore(profile_dir).record(key, sweep.hardware.gpu_type, samples, overheads=overheads)
    return len(samples) + len(overheads)
