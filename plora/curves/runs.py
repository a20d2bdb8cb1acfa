"""What every sink logs, and under which names: one run per config, the same tags everywhere.

A run is named ``<config_id>_<hp>=<value>,...`` with the hyperparameters the sweep's space varies
(Ray Tune names its trial folders the same way), e.g.
``c3f2a9e01b7_lr=0.001,rank=16,target_modules=all``. Its hyperparameters are the config's
(:meth:`plora.config.LoRAConfig.hparams`, target modules joined by ``,``).

Tags (TensorBoard's, MLflow's and W&B's metric names), at the adapter's own optimizer step:

=====================  ======================================================================
``train/loss``         mean token loss of the adapter's batch (``metrics.parquet``'s ``loss``)
``train/lr``           the learning rate of the step
``train/grad_norm``    the adapter's gradient norm before clipping
``train/tokens_per_s`` the adapter's tokens of the step over the packed step's wall time
``eval/loss``          eval loss when the config ends (``results.parquet``), at its last step
``eval/<metric>``      the dataset's task metric (``eval/exact_match``, ...), likewise
=====================  ======================================================================
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from plora.config import LoRAConfig, SearchSpace
from plora.config.space import targets_yaml

TRAIN_TAGS: dict[str, str] = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
}
"""``metrics.parquet`` column -> tag."""
TOKENS_PER_S = "train/tokens_per_s"
EVAL_LOSS = "eval/loss"


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One config's run in every sink."""

    config_id: str
    name: str
    """``<config_id>_<varied hp>=<value>,...`` (see the module docstring)."""
    hparams: dict[str, str | float | int | bool]
    """The config's hyperparameters as plain scalars (target modules joined by ``,``)."""


def varied_params(space: SearchSpace) -> tuple[str, ...]:
    """The hyperparameters ``space`` varies (a range, or more than one value; ``alpha_ratio``
    names ``alpha``), in its order."""
    names = [n for n, dom in space.domains().items() if not dom.is_fixed and len(dom.values) != 1]
    return tuple(dict.fromkeys("alpha" if n == "alpha_ratio" else n for n in names))


def run_info(config: LoRAConfig, varied: Sequence[str]) -> RunInfo:
    """The run of ``config``, named by its id and the ``varied`` hyperparameters' values."""
    hp = config.hparams()
    parts = [f"{k}={_short(k, hp[k])}" for k in varied if k in hp]
    name = config.config_id + ("_" + ",".join(parts) if parts else "")
    plain = {k: _plain(v) for k, v in hp.items() if v is not None}
    return RunInfo(config_id=config.config_id, name=re.sub(r"[/\\\s]", "-", name), hparams=plain)


def metric_tag(metric_name: str | None) -> str | None:
    """The tag of the dataset's task metric (``eval/exact_match``); None when it has none."""
    return None if not metric_name or metric_name == "none" else f"eval/{metric_name}"


def step_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """A ``metrics.parquet`` row's tags and values (missing or non-finite values left out)."""
    out = {tag: float(row[k]) for k, tag in TRAIN_TAGS.items() if _finite(row.get(k))}
    tokens, seconds = row.get("tokens"), row.get("step_time_s")
    if _finite(tokens) and _finite(seconds) and float(seconds) > 0:
        out[TOKENS_PER_S] = float(tokens) / float(seconds)
    return out


def eval_scalars(result: Mapping[str, Any]) -> dict[str, float]:
    """A ``results.parquet`` row's eval tags and values (none for a config never evaluated)."""
    out = {EVAL_LOSS: float(result["eval_loss"])} if _finite(result.get("eval_loss")) else {}
    tag = metric_tag(result.get("metric_name"))
    if tag is not None and _finite(result.get("eval_metric")):
        out[tag] = float(result["eval_metric"])
    return out


def _finite(x: Any) -> TypeGuard[float]:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _plain(v: Any) -> str | float | int | bool:
    if isinstance(v, list | tuple):
        return ",".join(map(str, v))
    return v if isinstance(v, str | float | int | bool) else str(v)


def _short(key: str, v: Any) -> str:
    if key == "target_modules":
        t = targets_yaml(tuple(v))
        return t if isinstance(t, str) else "+".join(t)
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


__all__ = [
    "EVAL_LOSS",
    "TOKENS_PER_S",
    "TRAIN_TAGS",
    "RunInfo",
    "eval_scalars",
    "metric_tag",
    "run_info",
    "step_scalars",
    "varied_params",
]
