"""Searchers as config sources: grid/random expansion, or a Ray Tune ``Searcher`` in ask/tell mode.

The runtime's coordinator pulls configs in waves (``ask``) and pushes each finished config's
metrics back (``tell``); here that becomes ``Searcher.suggest(trial_id)`` and
``Searcher.on_trial_complete(trial_id, result)`` on Ray Tune's own ``OptunaSearch`` or
``HyperOptSearch``. One proxy trial id per config (``t0000``, ``t0001``, ...). The searcher is
wrapped, not subclassed, and never sees more than ``max_concurrent`` configs in flight, so later
waves are proposed from the results of earlier ones.
"""

from __future__ import annotations

import base64
import math
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from plora.config import ConfigError, LoRAConfig, SweepConfig
from plora.tune.source import StaticSource


def default_max_concurrent(num_samples: int) -> int:
    """Configs an adaptive searcher may have in flight: half the budget (two or more waves)."""
    return max(1, math.ceil(num_samples / 2))


class SearcherSource:
    """A Ray Tune ``Searcher`` driven in ask/tell mode, one trial per config.

    Args:
        sweep: the sweep (space, ``num_samples``, ``metric``, ``mode``).
        searcher: a Tune searcher already given the space, metric and mode.
        max_concurrent: most configs asked but not yet told.
    """

    def __init__(self, sweep: SweepConfig, searcher: Any, *, max_concurrent: int) -> None:
        if max_concurrent < 1:
            raise ConfigError(f"max_concurrent={max_concurrent} must be >= 1")
        self.sweep = sweep
        self.searcher = searcher
        self.max_concurrent = max_concurrent
        self._asked = 0
        self._trial_of: dict[str, str] = {}
        self._pending: set[str] = set()
        self._exhausted = False

    def ask(self, n: int) -> list[LoRAConfig]:
        from ray.tune.search import Searcher

        from plora.tune.space import config_from_tune

        out: list[LoRAConfig] = []
        while len(out) < n and not self.is_finished() and len(self._pending) < self.max_concurrent:
            trial_id = f"t{self._asked:04d}"
            params = self.searcher.suggest(trial_id)
            if params is None:  # the searcher waits for results
                break
            if params == Searcher.FINISHED:
                self._exhausted = True
                break
            config = config_from_tune(params, self.sweep, index=self._asked)
            self._asked += 1
            self._trial_of[config.config_id] = trial_id
            self._pending.add(config.config_id)
            out.append(config)
        return out

    def tell(self, config_id: str, metrics: Mapping[str, Any]) -> None:
        """Report a finished (or failed/stopped) config; unknown ids are ignored."""
        trial_id = self._trial_of.get(config_id)
        if trial_id is None or config_id not in self._pending:
            return
        self._pending.discard(config_id)
        value = metrics.get(self.sweep.metric)
        if metrics.get("status") == "failed" or value is None or value != value:  # NaN too
            self.searcher.on_trial_complete(trial_id, None, error=True)
            return
        result = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        result[self.sweep.metric] = float(value)
        self.searcher.on_trial_complete(trial_id, result)

    def is_finished(self) -> bool:
        return self._exhausted or self._asked >= self.sweep.num_samples

    def get_state(self) -> dict[str, Any]:
        """JSON-able state; the searcher's own state as base64 of its ``save`` file."""
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "searcher.pkl")
            self.searcher.save(path)
            with open(path, "rb") as f:
                blob = base64.b64encode(f.read()).decode()
        return {
            "asked": self._asked,
            "trial_of": dict(self._trial_of),
            "pending": sorted(self._pending),
            "exhausted": self._exhausted,
            "searcher": blob,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "searcher.pkl")
            with open(path, "wb") as f:
                f.write(base64.b64decode(state["searcher"]))
            self.searcher.restore(path)
        self._asked = int(state["asked"])
        self._trial_of = dict(state["trial_of"])
        self._pending = set(state["pending"])
        self._exhausted = bool(state["exhausted"])


def make_searcher(sweep: SweepConfig) -> Any:
    """The Ray Tune searcher named by ``sweep.search``, given the space, metric, mode and seed."""
    from plora.tune.space import to_tune_param_space

    space = to_tune_param_space(sweep.space, grid_as_choice=True)
    mode = sweep.mode or ("max" if sweep.metric == "eval_metric" else "min")
    where = f"{sweep.source or 'sweep'}: search"
    if str(sweep.search) == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch
        except ImportError as e:  # pragma: no cover - optuna is a dependency
            raise ConfigError(f"{where}: optuna needs `pip install optuna` ({e})") from None
        # converted here: given Tune's domains, the searcher warns on the console and converts
        space = OptunaSearch.convert_search_space(space)
        return OptunaSearch(space=space, metric=sweep.metric, mode=mode, seed=sweep.seed)
    if str(sweep.search) == "hyperopt":
        try:
            from ray.tune.search.hyperopt import HyperOptSearch
        except ImportError as e:  # pragma: no cover - hyperopt is a dependency
            raise ConfigError(f"{where}: hyperopt needs `pip install hyperopt` ({e})") from None
        n_initial = max(1, min(20, sweep.num_samples // 2))
        return HyperOptSearch(
            space=HyperOptSearch.convert_search_space(space),  # as Optuna's, above
            metric=sweep.metric,
            mode=mode,
            random_state_seed=sweep.seed,
            n_initial_points=n_initial,
        )
    raise ConfigError(
        f"{where}={sweep.search!s} is not a Ray Tune searcher; use optuna or hyperopt"
    )


def make_config_source(
    sweep: SweepConfig, *, max_concurrent: int | None = None
) -> StaticSource | SearcherSource:
    """The sweep's config source: grid/random expansion or an adaptive Tune searcher."""
    if str(sweep.search) in ("grid", "random"):
        from plora.tune.space import expand

        return StaticSource(expand(sweep))
    limit = max_concurrent or default_max_concurrent(sweep.num_samples)
    return SearcherSource(sweep, make_searcher(sweep), max_concurrent=limit)


__all__ = [
    "SearcherSource",
    "default_max_concurrent",
    "make_config_source",
    "make_searcher",
]
