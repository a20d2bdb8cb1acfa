"""Steps and evaluation are timed at the width a step's rows pad to (plora.cost.build)."""

from __future__ import annotations

import random

import pytest

from plora.config import SweepConfig
from plora.cost.build import build_cost_model, rows_per_step, step_seq_len
from plora.tune.space import expand

QUICKSTART = SweepConfig.from_yaml("sweeps/quickstart.yaml")


def _monte_carlo(lengths, rows, cap, trials=20000, seed=0) -> float:
    rng = random.Random(seed)
    return sum(min(cap, max(rng.choices(lengths, k=rows))) for _ in range(trials)) / trials


@pytest.mark.parametrize("rows", [1, 4, 32, 128])
def test_step_width_is_the_expected_longest_row(rows) -> None:
    rng = random.Random(1)
    lengths = [rng.randint(20, 600) for _ in range(500)] + [900] * 5  # a few rows over the cap
    got = step_seq_len(lengths, rows, 640)
    assert got == pytest.approx(_monte_carlo(lengths, rows, 640), abs=6)
    assert got <= 640
    # one row: the mean length; many rows: the longest (cut at the cap)
    if rows == 1:
        assert got == pytest.approx(sum(min(x, 640) for x in lengths) / len(lengths), abs=1)
    assert step_seq_len([7] * 50, rows, 32) == 7
    assert step_seq_len([], rows, 32) == 32


def test_rows_per_step_is_a_typical_pack_of_typical_batches() -> None:
    assert rows_per_step(QUICKSTART) == 16 * 8  # batch 16, 8 configs (< 16 per pack)


def test_time_at_the_data_width_memory_at_max_seq_len() -> None:
    configs = expand(QUICKSTART)
    full = build_cost_model(QUICKSTART, use_profile=False)
    short = build_cost_model(QUICKSTART, use_profile=False, train_lengths=[7] * 100)
    assert (full.step_seq_len, short.step_seq_len) == (32, 7)
    c = configs[0]
    assert short.config_step_time(c, 1) < 0.9 * full.config_step_time(c, 1)
    assert short.overheads.eval_s_per_row < full.overheads.eval_s_per_row
    assert short.config_memory(c, 1) == full.config_memory(c, 1)  # the longest row still fits
    assert short._copy().step_seq_len == 7  # refits and copies keep the width
