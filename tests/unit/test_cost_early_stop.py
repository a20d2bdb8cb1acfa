"""The plan and the ETA under ``early_stop:`` (ASHA): expected adapter-steps, not the budget.

The prediction (``plora.cost.asha_survival``) is checked by hand on small cases and against Ray
Tune's own ASHA (``plora.tune.adapter_stopper.AdapterEarlyStopper``) stopping simulated packs; then
``plora plan``'s makespan and the coordinator's ETA (fake clock) are shown to use it.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from plora.config import SweepConfig
from plora.config.asha_options import EarlyStopConfig
from plora.cost.asha_survival import expected_steps, expected_steps_left, segments, survival
from plora.cost.build import build_cost_model
from plora.tune.adapter_stopper import AdapterEarlyStopper

ES = EarlyStopConfig(grace_steps=10, reduction_factor=2)


def test_expected_steps_by_hand() -> None:
    # rungs 10, 20 below 40: all train 10, half train 10 more, a quarter the last 20
    assert segments(40, ES) == [(0, 10, 1.0), (10, 20, 0.5), (20, 40, 0.25)]
    assert expected_steps(40, ES) == 10 + 5 + 5
    assert expected_steps(40, None) == 40
    assert expected_steps(8, ES) == 8  # the budget ends before the first rung
    assert expected_steps(27, EarlyStopConfig(grace_steps=3, reduction_factor=3)) == (
        3 + 6 / 3 + 18 / 9
    )
    # one that is still training at step 25 passed both rungs: it goes to the end
    assert expected_steps_left(40, 25, ES) == 15
    # at step 12 it passed the rung at 10: half of those go past 20
    assert expected_steps_left(40, 12, ES) == 8 + 20 * 0.5
    assert expected_steps_left(40, 0, ES) == expected_steps(40, ES)
    assert expected_steps_left(40, 40, ES) == 0
    # a sweep of 8 configs keeps more than the many-config limit: the early arrivals pass
    f = survival(8, 2.0, 2)
    assert f[0] > 0.5 and f[1] > 0.25 and f[0] >= f[1]
    assert segments(40, ES, population=8) == [(0, 10, 1.0), (10, 20, f[0]), (20, 40, f[1])]
    with pytest.raises(ValueError, match="reduction_factor"):
        segments(40, SimpleNamespace(grace_steps=10, reduction_factor=1.0))


@pytest.mark.parametrize(("grace", "eta", "steps"), [(10, 2, 80), (5, 3, 60), (4, 2, 40)])
def test_prediction_matches_ray_tunes_asha_on_simulated_packs(grace, eta, steps) -> None:
    """Sweeps of 8 configs whose losses are noisy levels, stepped together as a pack steps,
    stopped by the ASHA plora's sweeps run (Ray Tune's): their mean steps is the prediction for
    a population of 8 -- and well above the many-config limit, which the early arrivals at each
    rung beat."""
    config = EarlyStopConfig(grace_steps=grace, reduction_factor=eta)
    rng = random.Random(0)
    trained = []
    for _ in range(40):  # 40 sweeps of 8 configs
        stopper = AdapterEarlyStopper(config)
        level = {f"c{i}": rng.uniform(0.5, 2.0) for i in range(8)}
        alive = dict.fromkeys(level, 0)
        for step in range(1, steps + 1):
            for cid in list(alive):
                alive[cid] = step
                loss = level[cid] / step**0.3 + rng.gauss(0, 0.05)
                if stopper.on_step(cid, step, loss):
                    trained.append(alive.pop(cid))
        trained += list(alive.values())
    mean = sum(trained) / len(trained)
    predicted = expected_steps(steps, config, population=8)
    assert predicted < steps
    assert mean == pytest.approx(predicted, rel=0.1), (mean, predicted)
    assert expected_steps(steps, config) < 0.9 * mean  # the limit would promise too much


def _sweep(early_stop: dict | None) -> SweepConfig:
    raw = {
        "name": "es-plan",
        "model": "Qwen/Qwen2.5-0.5B",
        "dataset": {"builtin": "arithmetic", "num_examples": 2000, "max_seq_len": 512},
        "space": {"lr": [1e-4, 3e-4, 1e-3, 3e-3], "rank": [8, 16, 32, 64], "alpha": 16,
                  "batch_size": 8, "max_steps": 200},
        "hardware": {"gpu_type": "H200", "num_gpus": 2, "gpu_memory_gib": 80},
    }  # fmt: skip
    if early_stop is not None:
        raw["early_stop"] = early_stop
    return SweepConfig.from_dict(raw)


def test_plora_plan_makespan_charges_expected_steps() -> None:
    from plora.api import make_plan

    full = make_plan(_sweep(None))
    es = make_plan(_sweep({"grace_steps": 20, "reduction_factor": 3}))
    es_config = EarlyStopConfig(grace_steps=20, reduction_factor=3)
    ratio = expected_steps(200, es_config, population=16) / 200  # a 4 x 4 grid
    # every config's rows are charged for its expected steps, exactly
    cost_full, cost_es = build_cost_model(full.sweep), build_cost_model(es.sweep)
    for c in es.configs:
        assert cost_es.config_step_time(c, 1) == pytest.approx(
            cost_full.config_step_time(c, 1) * ratio, rel=1e-12
        )
        assert cost_es.config_overhead_time(c) == cost_full.config_overhead_time(c)
    # so the plan (and its lower bound) is shorter: not the full-steps number
    assert es.plora.makespan_s < 0.8 * full.plora.makespan_s
    assert es.plora.lower_bound_s < full.plora.lower_bound_s
    # the per-step overhead of a pack is still charged for its longest budget
    pack = list(es.configs[:4])
    fixed = cost_es.job_time(pack, 1) - sum(cost_es.config_time(c, 1) for c in pack)
    assert fixed == pytest.approx(
        cost_full.job_time(pack, 1) - sum(cost_full.config_time(c, 1) for c in pack)
    )


def test_coordinator_eta_counts_expected_steps_left_with_a_fake_clock() -> None:
    """Two coordinators plan the same sweep with and without ``early_stop:``; on a fake clock
    the ETA with early stopping is shorter, and once the running configs passed rungs (still
    training) their expected steps left grow back toward their budget."""
    from runtime_fakes import report

    from plora.runtime.coordinator import Coordinator
    from plora.runtime.coordinator.costs import remaining_job_time
    from plora.tune.space import expand

    def coord(early_stop):
        sweep = _sweep(early_stop)
        now = [0.0]
        c = Coordinator(cost=build_cost_model(sweep, use_profile=False), num_gpus=2,
                        configs=expand(sweep), clock=lambda: now[0], calibration_steps=0)  # fmt: skip
        return c, now

    full, _ = coord(None)
    es, clock = coord({"grace_steps": 20, "reduction_factor": 3})
    assert full.start() and es.start()
    eta_full, eta_es = full.snapshot()["eta_s"], es.snapshot()["eta_s"]
    assert eta_es < 0.8 * eta_full
    # 100 s later the running configs are at step 70, all still training (past rungs 20, 60)
    clock[0] = 100.0
    job_id, run = next(iter(es.running.items()))
    es.on_group_started(run.spec.gpu_ids)  # its workers are up: the job's end is start-up free
    es.on_group_ready(run.spec.gpu_ids, ready_s=1.0, load_s=1.0, node=None)
    es.on_reports(job_id, [report(*({"config_id": c, "step": 70} for c in run.config_ids))])
    es.retime_running()
    pack = [es.configs[c] for c in run.config_ids]
    progress = dict.fromkeys(run.config_ids, 70)
    left = remaining_job_time(es.cost, pack, progress, 1, None)
    assert run.plan_job.end_s == pytest.approx(clock[0] + left)  # the ETA's running job
    # against the same pack without early stopping: only the rows' steps left differ, each
    # config's by 130 - E[left | passed rung 60] (a share of those go on past 180)
    stay = expected_steps_left(200, 70, es.cost.early_stop, population=16)
    f60, f180 = (f for _, _, f in segments(200, es.cost.early_stop, population=16)[2:])
    assert stay == pytest.approx(110 + 20 * f180 / f60)
    no_stop = build_cost_model(_sweep(None), use_profile=False)
    rate = sum(no_stop.config_step_time(c, 1) / 200 for c in pack)
    assert remaining_job_time(no_stop, pack, progress, 1, None) - left == pytest.approx(
        rate * (130 - stay), rel=1e-9
    )
