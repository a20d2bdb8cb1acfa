"""What the runtime asks of the cost model beyond the planner's Protocol: memory of a live pack,
a JSON view of its coefficients (for decision records) and online refits from measured jobs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from plora.config import LoRAConfig
from plora.cost import Strategy


def cost_strategy(d: int, strategy: str | Strategy | None) -> Strategy:
    """The strategy to pass the cost model: d = 1 jobs have none (TP is a no-op at d = 1)."""
    if strategy is None:
        return Strategy.TP
    return Strategy(strategy)


def job_memory(
    cost: Any, pack: Sequence[LoRAConfig], d: int, strategy: str | Strategy | None
) -> tuple[float, float]:
    """``(M_base(d) + Σ_k M_k(d), capacity(d))`` in bytes per GPU for ``pack`` on ``d`` GPUs."""
    s = cost_strategy(d, strategy)
    used = cost.base_memory(d, s) + sum(cost.config_memory(c, d, s) for c in pack)
    return float(used), float(cost.capacity(d))


def describe_cost(cost: Any) -> dict[str, Any]:
    """A JSON view of the cost model's fitted coefficients (what a refit changes)."""
    for name in ("coefficients", "describe", "to_json_dict", "to_dict"):
        fn = getattr(cost, name, None)
        if callable(fn):
            return _jsonable(fn())
    if dataclasses.is_dataclass(cost):
        return _jsonable(dataclasses.asdict(cost))
    return {"type": type(cost).__name__}


def refit_cost(
    cost: Any, measurements: Sequence[Mapping[str, Any]], configs: Mapping[str, LoRAConfig]
) -> tuple[Any | None, list[dict[str, Any]]]:
    """Refit ``cost`` from every measurement so far.

    Args:
        cost: The cost model; models without ``refit`` are left alone.
        measurements: One dict per job attempt: ``config_ids``, ``gpus``, ``strategy``, ``oom``
            and what the job's profile measured (``step_time_s``, ``peak_memory_bytes``, ...).
        configs: The configs by id (to hand the cost model whole configs).

    Returns:
        ``(new_cost, used)``: the refit model (None when nothing could be refit) and the
        measurements that went into it, as JSON.
    """
    refit = getattr(cost, "refit", None)
    if not callable(refit):
        return None, []
    used = [dict(m) for m in measurements if m.get("step_time_s") or m.get("oom")]
    if not used:
        return None, []
    fitted = refit([_with_configs(m, configs) for m in used])
    return (cost if fitted is None else fitted), _jsonable(used)


def _with_configs(m: Mapping[str, Any], configs: Mapping[str, LoRAConfig]) -> dict[str, Any]:
    return {**m, "configs": [configs[c] for c in m["config_ids"] if c in configs]}


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


__all__ = ["cost_strategy", "describe_cost", "job_memory", "refit_cost"]
