"""The searcher bridge: Ray Tune's Optuna/HyperOpt searchers driven in ask/tell mode."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from plora.config import LoRAConfig, SweepConfig
from plora.runtime.records import StaticSource
from plora.tune.search import SearcherSource, make_config_source
from plora.tune.space import expand

SWEEPS = Path(__file__).resolve().parents[2] / "sweeps"


def _sweep(search: str, num_samples: int = 8, metric: str = "eval_loss") -> SweepConfig:
    base = SweepConfig.from_yaml(SWEEPS / "optuna-tiny.yaml")
    d = base.to_dict()
    d.update(search=search, num_samples=num_samples, metric=metric, mode="")
    return SweepConfig.from_dict(d)


def _objective(c: LoRAConfig) -> float:
    """A known bowl in log-lr: best at lr = 3e-3."""
    return (math.log10(c.lr) - math.log10(3e-3)) ** 2


def test_grid_source_is_the_expansion() -> None:
    sweep = SweepConfig.from_yaml(SWEEPS / "quickstart.yaml")
    src = make_config_source(sweep)
    assert isinstance(src, StaticSource)
    got = src.ask(3) + src.ask(100)
    assert [c.config_id for c in got] == [c.config_id for c in expand(sweep)]
    assert src.is_finished()


@pytest.mark.parametrize("search", ["optuna", "hyperopt"])
def test_ask_tell_gives_num_samples_distinct_valid_configs_in_waves(search: str) -> None:
    sweep = _sweep(search, num_samples=8)
    src = make_config_source(sweep)
    assert isinstance(src, SearcherSource)
    seen: list[LoRAConfig] = []
    waves = 0
    while not src.is_finished():
        wave = src.ask(100)
        assert wave, "the searcher stalled with configs left and none in flight"
        assert len(wave) <= src.max_concurrent
        waves += 1
        for c in wave:
            assert 3e-4 <= c.lr <= 1e-2 and c.rank in (4, 8, 16)
            assert 0.5 * c.rank <= c.alpha <= 4.0 * c.rank
            assert c.target_modules == (
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            )
            src.tell(c.config_id, {"status": "done", "eval_loss": _objective(c)})
        seen += wave
    assert len(seen) == 8 and len({c.config_id for c in seen}) == 8
    assert waves >= 2  # results came back before the last configs were proposed
    assert src.ask(5) == []


def test_optuna_learns_from_tells() -> None:
    """With a known objective, TPE's later proposals beat its random start-up ones."""
    sweep = _sweep("optuna", num_samples=40)
    src = make_config_source(sweep, max_concurrent=1)
    values = []
    while not src.is_finished():
        (c,) = src.ask(1)
        values.append(_objective(c))
        src.tell(c.config_id, {"status": "done", "eval_loss": values[-1]})
    first, last = sorted(values[:10]), sorted(values[-10:])
    assert sum(last[:5]) < sum(first[:5]) or min(values[10:]) < min(values[:10])


def test_failed_config_is_an_error_trial_and_state_round_trips() -> None:
    sweep = _sweep("optuna", num_samples=6)
    src = make_config_source(sweep)
    wave = src.ask(2)
    src.tell(wave[0].config_id, {"status": "failed", "eval_loss": None})
    src.tell(wave[1].config_id, {"status": "done", "eval_loss": 0.5})
    state = src.get_state()
    again = make_config_source(sweep)
    again.set_state(state)
    assert again.get_state()["asked"] == 2 and not again.is_finished()
    rest = again.ask(100)
    assert rest and all(c.config_id not in {w.config_id for w in wave} for c in rest)
