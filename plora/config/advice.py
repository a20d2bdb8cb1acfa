"""Settings of a valid sweep that cannot take effect as written (:func:`sweep_warnings`).

Such a sweep still runs -- the values are legal -- but part of what it says would silently do
nothing: a warm-up as long as training, an eval metric with no eval split, more samples than
the space has distinct configs. ``plora validate`` and ``plora sweep`` print each as one
``warning:`` line naming the key, its value and what to change.
"""

from __future__ import annotations

import math
from typing import Any

from plora.config.space import Domain, Kind
from plora.config.sweep import SweepConfig

_LISTED = (Kind.FIXED, Kind.GRID, Kind.CHOICE)


def sweep_warnings(sweep: SweepConfig) -> list[str]:
    """One line per setting of ``sweep`` that cannot take effect (empty: none)."""
    doms = sweep.space.domains()
    out: list[str] = []
    steps, warmup = doms.get("max_steps"), doms.get("warmup_steps")
    if steps is not None and warmup is not None and _high(warmup) >= _low(steps):
        out.append(
            f"space.warmup_steps={_show(warmup)} reaches space.max_steps={_show(steps)}: a config "
            "whose warm-up is as long as its training never trains at its lr (nor decays); keep "
            "warmup_steps below max_steps"
        )
    ds = sweep.dataset
    one_file = ds.builtin is not None or str(ds.path or "").endswith((".jsonl", ".json"))
    no_eval = ds.eval_path is None and ds.eval_fraction == 0 and one_file
    if no_eval and sweep.metric in ("eval_loss", "eval_metric"):
        out.append(
            f"metric={sweep.metric} with dataset.eval_fraction=0 and no eval_path: there is no "
            "eval split, so no config gets a value to rank by; set dataset.eval_fraction > 0 or "
            "metric: train_loss"
        )
    if sweep.metric == "eval_metric" and ds.metric == "none":
        out.append(
            "metric=eval_metric with dataset.metric=none: no config gets an eval_metric to rank "
            "by; use metric: eval_loss or a dataset metric (exact_match, accuracy)"
        )
    distinct = _distinct_configs(doms)
    sampled = str(sweep.search) != "grid"
    if sampled and distinct is not None and sweep.num_samples > distinct:
        out.append(
            f"num_samples={sweep.num_samples} but the space has {distinct} distinct configs: "
            f"{sweep.search} search repeats some, and a repeat is not trained again; lower "
            f"num_samples to {distinct} or use search: grid"
        )
    strategies = [str(s) for s in sweep.planner.strategies]
    if strategies and sweep.hardware.num_gpus == 1:
        out.append(
            f"planner.strategies={strategies} with hardware.num_gpus=1: a multi-GPU job needs 2 "
            "GPUs or more, so every job runs on one GPU; raise hardware.num_gpus or drop "
            "planner.strategies"
        )
    return out


def _low(d: Domain) -> float:
    return float(min(d.values)) if d.kind in _LISTED else float(d.low or 0)


def _high(d: Domain) -> float:
    return float(max(d.values)) if d.kind in _LISTED else float(d.high or 0)


def _show(d: Domain) -> str:
    if d.kind is Kind.FIXED:
        return str(d.values[0])
    if d.kind in _LISTED:
        return "[" + ", ".join(str(v) for v in d.values) + "]"
    return f"{d.kind}({d.low:g}, {d.high:g})"


def _distinct_configs(doms: dict[str, Domain]) -> int | None:
    """Distinct points of a space of listed values (None: a continuous or wide one)."""
    sizes: list[int] = []
    for d in doms.values():
        if d.kind not in _LISTED:
            return None
        sizes.append(len({_key(v) for v in d.values}))
    return math.prod(sizes)


def _key(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value


__all__ = ["sweep_warnings"]
