"""Search space: parsing, grid/random expansion, and the Ray Tune bridge."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re
import statistics
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from plora.config import PROJECTIONS, ConfigError, SearchAlgo, SweepConfig
from plora.config.space import Domain, Kind, SearchSpace
from plora.tune.space import config_from_tune, expand, to_tune_param_space

REPO = Path(__file__).resolve().parents[2]
BASE = {"name": "t", "model": "tiny-qwen2", "dataset": "arithmetic"}
REQUIRED = {"lr": 1e-3, "batch_size": 8, "rank": 8, "alpha_ratio": 2.0, "max_steps": 10}


def sweep_of(space: dict[str, Any], **top: Any) -> SweepConfig:
    return SweepConfig.from_dict({**BASE, "space": {**REQUIRED, **space}, **top})


def space_error(space: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        sweep_of(space)
    return str(info.value)


# ----------------------------------------------------------------------------------- parsing


def test_forms_of_a_parameter() -> None:
    s = sweep_of({
        "lr": [1e-4, 2e-4], "rank": {"grid_search": [8, 16]}, "dropout": {"choice": [0.0, 0.1]},
        "batch_size": {"qrandint": {"low": 2, "high": 16, "q": 2}}, "weight_decay": {"uniform": [0.0, 0.1]},
    }).space  # fmt: skip
    assert s.lr == Domain(kind=Kind.GRID, values=(1e-4, 2e-4))
    assert s.rank == Domain(kind=Kind.GRID, values=(8, 16))
    assert s.dropout.kind is Kind.CHOICE
    assert s.batch_size == Domain(kind=Kind.QRANDINT, low=2, high=16, q=2)
    assert s.weight_decay == Domain(kind=Kind.UNIFORM, low=0.0, high=0.1)
    assert s.grid_size == 4


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("all", Domain(kind=Kind.FIXED, values=(PROJECTIONS,))),
        (["v", "q_proj"], Domain(kind=Kind.FIXED, values=(("q_proj", "v_proj"),))),
        (
            [["q", "v"], "mlp"],
            Domain(kind=Kind.GRID, values=(("q_proj", "v_proj"), PROJECTIONS[4:])),
        ),
        (
            {"choice": ["attention", "all"]},
            Domain(kind=Kind.CHOICE, values=(PROJECTIONS[:4], PROJECTIONS)),
        ),
    ],
)
def test_target_modules_forms(raw: Any, expected: Domain) -> None:
    assert sweep_of({"target_modules": raw}).space.target_modules == expected


@pytest.mark.parametrize(
    ("space", "needles"),
    [
        ({"rank": {"uniform": [8, 64]}}, ("space.rank.uniform", "randint")),
        ({"lr": {"loguniform": [0.0, 1e-3]}}, ("space.lr.low=0.0", "must be > 0")),
        ({"lr": {"uniform": [1e-3, 1e-4]}}, ("space.lr.high=0.0001", "must be > low")),
        ({"batch_size": {"randint": [4, 4]}}, ("space.batch_size.high=4", "exclusive")),
        ({"rank": [8, 16, 8]}, ("space.rank=8", "duplicate")),
        ({"rank": {"grid": []}}, ("space.rank.grid=[]", "empty grid")),
        ({"rank": [8, "x"]}, ("space.rank[1]='x'", "integer")),
        ({"lr": {"quniform": [1e-4, 1e-3]}}, ("space.lr.quniform", "needs [low, high, q]")),
        ({"lr": {"uniform": {"low": 1e-4, "hihg": 1e-3}}}, ("space.lr.hihg", "did you mean 'high'")),
        ({"lr": {"uniform": [1e-4, 1e-3], "choice": [1]}}, ("space.lr=", "one key")),
        ({"schedule": {"uniform": [0, 1]}}, ("space.schedule.uniform", "listed values only")),
        ({"schedule": "cosine_with_restarts"}, ("space.schedule='cosine_with_restarts'", "constant, linear, cosine")),
        ({"use_rslora": "yes"}, ("space.use_rslora='yes'", "true or false")),
        ({"target_modules": ["q_proj", "all"]}, ("space.target_modules=", "mixes module names")),
        ({"target_modules": {"grid": [["q"], ["z_proj"]]}}, ("space.target_modules.grid[1]", "z_proj")),
        ({"lr": {"qloguniform": [1e-4, 1.5e-4, 1e-3]}}, ("space.lr.q=0.001", "no multiple of q")),
        ({"r": 8}, ("space.r=8", "did you mean 'rank'")),
        ({"max_grad_norm": 0}, ("space.max_grad_norm=0", "or null")),
    ],
)  # fmt: skip
def test_space_errors(space: dict[str, Any], needles: tuple[str, ...]) -> None:
    msg = space_error(space)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_required_parameters() -> None:
    with pytest.raises(ConfigError, match=r"space\.rank: missing required parameter"):
        SweepConfig.from_dict(
            {**BASE, "space": {"lr": 1e-3, "batch_size": 8, "alpha": 8, "epochs": 1}}
        )


def test_programmatic_domains_are_validated() -> None:
    good = sweep_of({}).space
    with pytest.raises(ConfigError, match=r"rank=0"):
        dataclasses.replace(good, rank=Domain(kind=Kind.FIXED, values=(0,)))
    with pytest.raises(ConfigError, match=r"lr\.high"):
        dataclasses.replace(good, lr=Domain(kind=Kind.UNIFORM, low=1e-3, high=1e-4))


def test_space_round_trips_through_yaml() -> None:
    space = {"lr": {"qloguniform": [1e-5, 1e-3, 1e-5]}, "rank": {"lograndint": [4, 129]},
             "target_modules": {"grid": [["q", "v"], "all"]}, "schedule": ["linear", "cosine"],
             "max_grad_norm": [1.0, None], "seed": {"randint": [0, 100]}}  # fmt: skip
    s = sweep_of(space).space
    again = SearchSpace.from_dict(yaml.safe_load(yaml.safe_dump(s.to_dict())))
    assert again == s


# --------------------------------------------------------------------------------- expansion


def test_grid_is_the_cartesian_product_times_num_samples() -> None:
    lrs, ranks, ratios = [1e-4, 2e-4, 4e-4], [8, 16], [0.5, 2.0]
    sweep = sweep_of(
        {"lr": lrs, "rank": ranks, "alpha_ratio": ratios, "dropout": {"uniform": [0.0, 0.2]}},
        num_samples=2,
    )
    configs = expand(sweep)
    assert len(configs) == 3 * 2 * 2 * 2
    expected = sorted(
        (lr, r, q * r, rep)
        for rep in range(2)
        for lr, r, q in itertools.product(lrs, ranks, ratios)
    )
    got = sorted((c.lr, c.rank, c.alpha, c.seed) for c in configs)
    assert got == expected  # repeats differ by their seed
    assert len({c.config_id for c in configs}) == len(configs)
    assert all(re.fullmatch(r"c\d{4}-[0-9a-f]{6}", c.config_id) for c in configs)
    assert [c.config_id[:5] for c in configs] == [f"c{i:04d}" for i in range(len(configs))]
    assert all(0.0 <= c.dropout <= 0.2 for c in configs)
    assert len({c.dropout for c in configs}) == len(configs)  # each variant draws afresh


def test_expand_is_deterministic_and_seeded() -> None:
    space = {"lr": {"loguniform": [1e-5, 1e-3]}, "rank": [8, 16]}
    a, b = expand(sweep_of(space)), expand(sweep_of(space))
    assert a == b
    c = expand(sweep_of(space, seed=1))
    assert [x.rank for x in c] == [x.rank for x in a]
    assert [x.lr for x in c] != [x.lr for x in a]


def test_adding_a_parameter_does_not_change_other_draws() -> None:
    space = {"lr": {"loguniform": [1e-5, 1e-3]}}
    a = expand(sweep_of(space, search="random", num_samples=5))
    b = expand(
        sweep_of({**space, "dropout": {"uniform": [0.0, 0.1]}}, search="random", num_samples=5)
    )
    assert [x.lr for x in a] == [x.lr for x in b]


def test_ids_are_stable_across_runs() -> None:
    # ids hash the hyperparameters: pinned so a change of hashing or ordering is noticed
    configs = expand(sweep_of({"lr": [1e-4, 2e-4]}))
    assert [c.config_id[:6] for c in configs] == ["c0000-", "c0001-"]
    assert configs[0].config_id[6:] == configs[0].fingerprint()[1:7]


def test_random_search_draws_num_samples_within_bounds() -> None:
    space = {"lr": {"loguniform": [1e-5, 1e-2]}, "rank": [4, 8, 16], "batch_size": {"randint": [1, 4]},
             "warmup_steps": {"qrandint": [0, 10, 5]}, "weight_decay": {"quniform": [0.0, 0.1, 0.025]}}  # fmt: skip
    sweep = sweep_of(space, search="random", num_samples=2000)
    configs = expand(sweep)
    assert len(configs) == 2000
    assert {c.rank for c in configs} == {4, 8, 16}
    assert {c.batch_size for c in configs} == {1, 2, 3}  # randint: high exclusive
    assert {c.warmup_steps for c in configs} == {0, 5, 10}  # qrandint: high inclusive
    assert {c.weight_decay for c in configs} == {0.0, 0.025, 0.05, 0.075, 0.1}
    logs = [math.log10(c.lr) for c in configs]
    assert min(logs) >= -5 and max(logs) <= -2
    # log-uniform: log10(lr) ~ U(-5, -2): mean -3.5, sd 3/sqrt(12); 2000 draws -> se 0.019
    assert statistics.fmean(logs) == pytest.approx(-3.5, abs=0.08)
    assert statistics.pstdev(logs) == pytest.approx(3 / math.sqrt(12), abs=0.05)


def test_domain_sampling_against_ray_semantics() -> None:
    rng = random.Random(0)
    lograndint = Domain(kind=Kind.LOGRANDINT, low=1, high=8)
    assert {lograndint.sample(rng) for _ in range(500)} == set(range(1, 8))
    qlog = Domain(kind=Kind.QLOGUNIFORM, low=1e-4, high=1e-2, q=1e-4)
    for _ in range(200):
        v = qlog.sample(rng)
        assert 1e-4 <= v <= 1e-2 and abs(v / 1e-4 - round(v / 1e-4)) < 1e-6


def test_alpha_absolute_and_grid_of_alpha() -> None:
    raw = {**REQUIRED, "alpha": [8, 32], "rank": [8, 16]}
    del raw["alpha_ratio"]
    sweep = SweepConfig.from_dict({**BASE, "space": raw})
    assert sorted((c.rank, c.alpha) for c in expand(sweep)) == [(8, 8), (8, 32), (16, 8), (16, 32)]


def test_paper_table1_expands_to_120_configs_in_the_papers_ranges() -> None:
    sweep = SweepConfig.from_yaml(REPO / "sweeps" / "paper-table1.yaml")
    configs = expand(sweep)
    assert len(configs) == 120 == len({c.config_id for c in configs})
    assert len({c.fingerprint() for c in configs}) == 120
    assert min(c.lr for c in configs) == 2e-5 and max(c.lr for c in configs) == 4e-4
    assert {c.batch_size for c in configs} <= set(range(1, 33))
    assert min(c.rank for c in configs) == 8 and max(c.rank for c in configs) == 128
    assert all(c.rank / 4 <= c.alpha <= 4 * c.rank for c in configs)
    assert {c.alpha / c.rank for c in configs} == {0.25, 4.0}


def test_adaptive_search_needs_the_searcher() -> None:
    sweep = SweepConfig.from_yaml(REPO / "sweeps" / "optuna-tiny.yaml")
    assert sweep.search is SearchAlgo.OPTUNA
    with pytest.raises(ConfigError, match="search='optuna'"):
        expand(sweep)
    assert len(expand(sweep, sample_adaptive=True)) == sweep.num_samples == 8


# -------------------------------------------------------------------------- Ray Tune bridge


def test_tune_grid_matches_ray_basic_variant_generator() -> None:
    """Ray's own BasicVariantGenerator is the reference for grid x num_samples semantics."""
    from ray.tune.search.variant_generator import generate_variants

    space = {"lr": [1e-4, 3e-4], "rank": [8, 16, 32], "target_modules": [["q", "v"], "all"],
             "dropout": {"uniform": [0.0, 0.1]}}  # fmt: skip
    sweep = sweep_of(space, num_samples=2)
    param_space = to_tune_param_space(sweep.space)
    ray_keys = []
    for _ in range(sweep.num_samples):
        for _, params in generate_variants(param_space):
            cfg = config_from_tune(params, sweep)
            ray_keys.append((cfg.lr, cfg.rank, cfg.alpha, cfg.target_modules))
            assert 0.0 <= cfg.dropout <= 0.1
    ours = [(c.lr, c.rank, c.alpha, c.target_modules) for c in expand(sweep)]
    assert sorted(ray_keys) == sorted(ours)


def test_tune_domains_sample_inside_our_bounds() -> None:
    from ray.tune.search.sample import Categorical, Float, Integer

    sweep = sweep_of({"lr": {"qloguniform": [1e-5, 1e-3, 1e-5]}, "rank": {"qrandint": [8, 64, 8]},
                      "batch_size": {"randint": [1, 5]}, "schedule": ["linear", "cosine"]})  # fmt: skip
    ps = to_tune_param_space(sweep.space, grid_as_choice=True)
    assert isinstance(ps["lr"], Float) and isinstance(ps["rank"], Integer)
    assert isinstance(ps["schedule"], Categorical) and ps["max_steps"] == 10
    for _ in range(50):
        params = {k: (v.sample() if hasattr(v, "sample") else v) for k, v in ps.items()}
        cfg = config_from_tune(params, sweep, index=3)
        assert 1e-5 <= cfg.lr <= 1e-3 and cfg.rank % 8 == 0 and 8 <= cfg.rank <= 64
        assert 1 <= cfg.batch_size <= 4 and cfg.alpha == 2.0 * cfg.rank
        assert cfg.config_id.startswith("c0003-")


def test_config_from_tune_round_trips_expanded_configs() -> None:
    sweep = sweep_of(
        {"lr": [1e-4, 2e-4], "target_modules": {"grid": [["q", "v"], "mlp"]}, "seed": [0, 1]}
    )
    for i, cfg in enumerate(expand(sweep)):
        params = {k: cfg.hparams()[k] for k in ("lr", "seed")}
        params["target_modules"] = ",".join(cfg.target_modules)
        params["alpha_ratio"] = cfg.alpha / cfg.rank
        again = config_from_tune(params, sweep, index=i)
        assert again == cfg
    # a listed parameter left out takes the sweep file's first value
    assert config_from_tune({"seed": 0, "target_modules": "all"}, sweep).lr == 1e-4
    with pytest.raises(ConfigError, match=r"params\.rnk"):
        config_from_tune({"rnk": 8}, sweep)
    assert (
        config_from_tune(
            {"lr": 1e-4, "seed": 0, "target_modules": "all", "__trial_index__": 1},
            sweep,
            config_id="x",
        ).config_id
        == "x"
    )


def test_optuna_searcher_proposes_valid_configs() -> None:
    from ray.tune.search.optuna import OptunaSearch

    sweep = SweepConfig.from_yaml(REPO / "sweeps" / "optuna-tiny.yaml")
    searcher = OptunaSearch(space=to_tune_param_space(sweep.space, grid_as_choice=True), metric="eval_loss",
                            mode="min", seed=sweep.seed)  # fmt: skip
    for i in range(4):
        params = searcher.suggest(f"t{i}")
        cfg = config_from_tune(params, sweep, index=i)
        assert 3e-4 <= cfg.lr <= 1e-2 and cfg.rank in (4, 8, 16)
        assert 0.5 * cfg.rank <= cfg.alpha <= 4.0 * cfg.rank
        searcher.on_trial_complete(f"t{i}", {"eval_loss": cfg.lr})


@given(
    kind=st.sampled_from([Kind.UNIFORM, Kind.QUNIFORM, Kind.LOGUNIFORM, Kind.QLOGUNIFORM,
                          Kind.RANDINT, Kind.QRANDINT, Kind.LOGRANDINT, Kind.QLOGRANDINT]),
    low=st.integers(1, 1000), width=st.integers(1, 1000), q=st.integers(1, 50), seed=st.integers(0, 10**6),
)  # fmt: skip
@settings(max_examples=200, deadline=None)
def test_every_draw_respects_its_domain(
    kind: Kind, low: int, width: int, q: int, seed: int
) -> None:
    """Property: parsed through the YAML path, every draw lies in the domain (Ray's bounds)."""
    high = low + width
    quantized = kind.value.startswith("q")
    if quantized and high // q < -(-low // q):
        return  # no multiple of q in range: rejected at parse time (tested above)
    is_int = kind.value.endswith("randint")
    name = "warmup_steps" if is_int else "weight_decay"
    body = [low, high, q] if quantized else [low, high]
    dom = sweep_of({name: {kind.value: body}}).space.domains()[name]
    rng = random.Random(seed)
    for _ in range(20):
        v = dom.sample(rng)
        assert isinstance(v, int) if is_int else isinstance(v, float)
        upper_ok = v < high if kind in (Kind.RANDINT, Kind.LOGRANDINT) else v <= high + 1e-9
        assert low - 1e-9 <= v and upper_ok, (v, low, high)
        if quantized:
            assert abs(v / q - round(v / q)) < 1e-6


def test_a_listed_parameter_tune_leaves_out_takes_the_sweeps_first_value() -> None:
    """The README's Tune snippet gives lr and rank; the quickstart's sweep file also varies
    target_modules: it takes the file's first list, [q_proj, v_proj] (each of 16 trials failed
    with "missing from the trial's params" before). A range left out has no such value."""
    root = Path(__file__).resolve().parents[2]
    sweep = SweepConfig.from_yaml(root / "sweeps" / "quickstart.yaml")
    cfg = config_from_tune({"lr": 2e-3, "rank": 4}, sweep)
    assert tuple(cfg.target_modules) == ("q_proj", "v_proj") and cfg.lr == 2e-3 and cfg.rank == 4
    ranged = sweep_of({"lr": {"loguniform": [1e-4, 1e-2]}})
    with pytest.raises(ConfigError, match=r"params.lr.*missing from the trial's params"):
        config_from_tune({}, ranged)
