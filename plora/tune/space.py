"""From a search space to configs: :func:`expand`, and the bridge to Ray Tune searchers.

:func:`expand` turns a grid/random sweep into configs like Ray Tune's
``BasicVariantGenerator``: the Cartesian product of the grid parameters, repeated
``num_samples`` times, each variant drawing its random parameters afresh; ``random`` draws
``num_samples`` variants (grids count as uniform choices). Draws are seeded by
``(sweep.seed, variant index, parameter)`` only, so adding a parameter never changes the others.
:func:`to_tune_param_space` / :func:`config_from_tune` bridge to Ray Tune searchers (Ray is
imported only by :func:`to_tune_param_space`).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any

from plora.config import ConfigError, LoRAConfig, SearchAlgo, SearchSpace, SweepConfig
from plora.config.space import PARAMS, TARGET_PRESETS, Kind, plain_value


def _rng(seed: int, index: int, name: str) -> random.Random:
    return random.Random(f"plora:{seed}:{index}:{name}")  # str seeds hash with SHA-512: stable


def _make_config(values: Mapping[str, Any], template: str | None) -> LoRAConfig:
    """A config from parameter values; ``template`` is the id with ``{hash}`` for 6 hash digits
    (None: the config's full fingerprint)."""
    hp = dict(values)
    if "alpha_ratio" in hp:
        hp["alpha"] = float(hp.pop("alpha_ratio")) * hp["rank"]
    cfg = LoRAConfig(**hp)
    if template is None:
        return cfg
    return dataclasses.replace(cfg, config_id=template.format(hash=cfg.fingerprint()[1:7]))


def expand(sweep: SweepConfig, *, sample_adaptive: bool = False) -> list[LoRAConfig]:
    """All configs of a grid or random sweep, in a deterministic order with stable ids.

    Ids are ``c<index>-<hash>`` (index zero-padded to 4+ digits, hash of the hyperparameters),
    so they sort in expansion order and change when the values do.

    Args:
        sweep: the sweep.
        sample_adaptive: for optuna/hyperopt sweeps, return ``num_samples`` random draws as a
            planning estimate (their searchers propose configs adaptively at run time).

    Raises:
        ConfigError: an adaptive search without ``sample_adaptive``.
    """
    space = sweep.space
    doms = space.domains()
    if sweep.search in (SearchAlgo.OPTUNA, SearchAlgo.HYPEROPT) and not sample_adaptive:
        raise ConfigError(
            "configs are proposed by the searcher at run time", key="search", value=str(sweep.search),
            file=sweep.source, fix="use to_tune_param_space() with a Ray Tune searcher, or sample_adaptive=True to estimate",
        )  # fmt: skip
    if sweep.search is SearchAlgo.GRID:
        grid_names = [n for n, d in doms.items() if d.kind is Kind.GRID]
        points = list(itertools.product(*(doms[n].values for n in grid_names)))
        variants = [
            dict(zip(grid_names, pt, strict=True))
            for _ in range(sweep.num_samples)
            for pt in points
        ]
        repeat_of = [i // len(points) for i in range(len(variants))]
    else:
        variants = [{} for _ in range(sweep.num_samples)]
        repeat_of = [0] * len(variants)
    width = max(4, len(str(len(variants) - 1)))
    out = []
    for i, fixed in enumerate(variants):
        values = {
            n: fixed[n] if n in fixed else d.sample(_rng(sweep.seed, i, n)) for n, d in doms.items()
        }
        if doms["seed"].is_fixed:
            values["seed"] += repeat_of[i]  # grid repeats are distinct runs (seed averaging)
        try:
            out.append(_make_config(values, f"c{i:0{width}d}-{{hash}}"))
        except ConfigError as err:
            raise ConfigError(err.problem, key="space", value=err.value if err.has_value else values,
                              file=sweep.source, fix="narrow the space so every combination is valid") from None  # fmt: skip
    return out


# ------------------------------------------------------------------------------ Ray Tune bridge


def _tune_value(name: str, v: Any) -> Any:
    if name == "target_modules":
        return ",".join(v)  # searchers (Optuna) want primitive categories
    return plain_value(v)


def to_tune_param_space(space: SearchSpace, *, grid_as_choice: bool = False) -> dict[str, Any]:
    """``ray.tune`` domains for ``Tuner(param_space=...)`` or a searcher's ``space``.

    Fixed values stay constants, grids become ``tune.grid_search`` (or ``tune.choice`` with
    ``grid_as_choice``, which Optuna/HyperOpt need), distributions their ``tune`` namesakes.
    ``target_modules`` values are encoded as comma-joined strings; :func:`config_from_tune`
    decodes them.
    """
    from ray import tune

    out: dict[str, Any] = {}
    for name, d in space.domains().items():
        vals = [_tune_value(name, v) for v in d.values]
        if d.kind is Kind.FIXED:
            out[name] = vals[0]
        elif d.kind is Kind.GRID and not grid_as_choice:
            out[name] = tune.grid_search(vals)
        elif d.kind in (Kind.GRID, Kind.CHOICE):
            out[name] = tune.choice(vals)
        elif d.kind in (Kind.UNIFORM, Kind.LOGUNIFORM, Kind.RANDINT, Kind.LOGRANDINT):
            out[name] = getattr(tune, str(d.kind))(d.low, d.high)
        else:
            out[name] = getattr(tune, str(d.kind))(d.low, d.high, d.q)
    return out


def config_from_tune(
    params: Mapping[str, Any],
    sweep: SweepConfig,
    *,
    index: int | None = None,
    config_id: str | None = None,
) -> LoRAConfig:
    """The config a Ray Tune trial's ``params`` stand for.

    Parameters absent from ``params`` take the space's value: a fixed one, or the first of a
    list the sweep file varies (a Tune ``param_space`` that leaves it out holds it there); a
    range left out is an error. ``alpha_ratio`` becomes ``alpha``. The id is ``config_id``, else ``c<index>-<hash>`` with ``index``, else the hash.
    """
    doms = sweep.space.domains()
    values: dict[str, Any] = {}
    for key, v in params.items():
        if key.startswith("__"):
            continue
        if key not in doms:
            raise ConfigError("not a parameter of this sweep's space", key=f"params.{key}", value=v,
                              file=sweep.source, fix=f"use {', '.join(doms)}")  # fmt: skip
        if key == "target_modules" and isinstance(v, str) and v not in TARGET_PRESETS:
            v = v.split(",")
        values[key] = PARAMS[key].check(v, f"params.{key}")
    for name, d in doms.items():
        if name not in values:
            if not d.values:  # a range: no value stands for it
                raise ConfigError("missing from the trial's params", key=f"params.{name}", file=sweep.source,
                                  fix="give it in param_space, or a list of values in the sweep file")  # fmt: skip
            values[name] = d.values[0]
    if config_id is not None:
        return dataclasses.replace(_make_config(values, None), config_id=config_id)
    return _make_config(values, None if index is None else f"c{index:04d}-{{hash}}")


def configs_table(configs: Sequence[LoRAConfig]) -> list[dict[str, Any]]:
    """One JSON-able row per config (id + hyperparameters), e.g. for plan.json."""
    return [c.to_dict() for c in configs]


__all__ = ["config_from_tune", "configs_table", "expand", "to_tune_param_space"]
