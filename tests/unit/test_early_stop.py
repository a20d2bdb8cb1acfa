"""``early_stop:``: the config section, the ASHA stopper and the coordinator stopping + refilling.

The stopper is Ray Tune's ``ASHAScheduler`` driven per streamed step; these tests check the
decisions against ASHA's rule computed by hand (the worse half at each rung), that its saved
state decides exactly as the uninterrupted stopper, and that the coordinator stops a lagging
config inside its pack and refills the slot.
"""

from __future__ import annotations

import json

import pytest
from runtime_fakes import AffineCost, GreedyPlanner, lora, report

from plora.config import ConfigError, SweepConfig
from plora.config.asha_options import EarlyStopConfig
from plora.runtime.coordinator import Coordinator
from plora.runtime.records import ConfigStatus, Decision
from plora.tune.adapter_stopper import AdapterEarlyStopper
from plora.tune.asha_state import inner_state

SWEEP = {
    "name": "es",
    "model": "tiny-qwen2",
    "dataset": {"builtin": "arithmetic"},
    "space": {"lr": 1e-3, "rank": 4, "alpha": 8, "batch_size": 4, "max_steps": 10},
}


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"grace_steps": 0}, "early_stop.grace_steps=0: must be >= 1"),
        ({"kind": "median"}, "early_stop.kind='median': must be one of asha"),
        ({"metric": "eval_loss"}, "early_stop.metric='eval_loss': must be one of loss"),
        ({"reduction_factor": 1}, "early_stop.reduction_factor=1: must be > 1"),
        ({"grace": 3}, "early_stop.grace=3: unknown key (did you mean 'grace_steps'?)"),
    ],
)
def test_bad_early_stop_sections_are_one_line_errors(section, message) -> None:
    with pytest.raises(ConfigError) as err:
        SweepConfig.from_dict({**SWEEP, "early_stop": section})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_early_stop_section_round_trips() -> None:
    sweep = SweepConfig.from_dict({**SWEEP, "early_stop": {"grace_steps": 3}})
    assert sweep.early_stop == EarlyStopConfig(grace_steps=3, reduction_factor=2.0)
    assert SweepConfig.from_dict(sweep.to_dict()) == sweep
    assert SweepConfig.from_dict(SWEEP).early_stop is None
    assert "early_stop" not in SweepConfig.from_dict(SWEEP).to_dict()


def _feed(stopper: AdapterEarlyStopper, losses: dict[str, list[float]], steps: range) -> list:
    out = []
    for step in steps:
        for cid, curve in losses.items():
            if step <= len(curve) and stopper.on_step(cid, step, curve[step - 1]):
                out.append((cid, step))
    return out


LOSSES = {f"c{i}": [2.0 + i * 0.1 - 0.01 * s + (0.3 if i % 3 == 0 and s > 4 else 0)
                    for s in range(12)] for i in range(8)}  # fmt: skip


def test_asha_stops_the_worse_half_at_each_rung_never_before_grace() -> None:
    stopper = AdapterEarlyStopper(EarlyStopConfig(grace_steps=2, reduction_factor=2))
    stops = _feed(stopper, {"a": [1.0] * 4, "b": [2.0] * 4, "c": [3.0] * 4, "d": [0.5] * 4},
                  range(1, 5))  # fmt: skip
    # rung 2: a=1 recorded; b=2 is worse than the median of {a} -> stop; c=3 worse than the
    # median of {a, b}=1.5 -> stop; d=0.5 better -> on. Rung 4: a, then d better than a -> on.
    assert stops == [("b", 2), ("c", 2)]
    assert all(step >= 2 for _, step in _feed(AdapterEarlyStopper(EarlyStopConfig(grace_steps=2)),
                                              LOSSES, range(1, 13)))  # fmt: skip


def test_saved_state_decides_exactly_as_the_uninterrupted_stopper() -> None:
    config = EarlyStopConfig(grace_steps=2, reduction_factor=2)
    whole = AdapterEarlyStopper(config)
    reference = _feed(whole, LOSSES, range(1, 13))
    first = AdapterEarlyStopper(config)
    before = _feed(first, LOSSES, range(1, 6))
    restored = AdapterEarlyStopper(config)
    restored.set_state(json.loads(json.dumps(first.get_state())))  # through state.json
    after = _feed(restored, LOSSES, range(6, 13))
    assert reference and before + after == reference
    # a sweep directory of before version 4 saved the rungs nested and the known configs listed
    old = AdapterEarlyStopper(config)
    saved = {"known": sorted(first._known), "stopped": dict(first.stopped),
             "asha": inner_state(first.asha)}  # fmt: skip
    old.set_state(json.loads(json.dumps(saved)))
    assert before + _feed(old, LOSSES, range(6, 13)) == reference
    # and the check has teeth: a stopper that forgot its rungs decides differently
    fresh = AdapterEarlyStopper(config)
    assert before + _feed(fresh, LOSSES, range(6, 13)) != reference


def test_coordinator_stops_a_lagging_config_in_its_pack_and_refills_the_slot() -> None:
    configs = [lora(i, rank=10, steps=40) for i in range(4)]  # three fit a job; c03 waits
    stopper = AdapterEarlyStopper(EarlyStopConfig(grace_steps=2, reduction_factor=2))
    coord = Coordinator(cost=AffineCost(), num_gpus=1, configs=configs, planner=GreedyPlanner(),
                        metrics_flush_s=0.0, early_stop=stopper)  # fmt: skip
    (spec,) = coord.start()
    assert set(spec.config_ids) == {"c00", "c01", "c02"} and coord.queued_ids() == ["c03"]
    for step in (1, 2):
        coord.on_reports(spec.job_id, [report(*({"config_id": c, "step": step,
                                                 "loss": {"c00": 1.0, "c01": 3.0, "c02": 2.0}[c]}
                                                for c in spec.config_ids))])  # fmt: skip
    stop = next(d for d in coord.decisions if d.kind is Decision.STOP_CONFIG)
    assert stop.config_ids == ("c01",) and stop.inputs["reason"] == "early_stop"
    assert stop.inputs["step"] == 2
    ctl = coord.poll(spec.job_id)
    assert ctl.stop == frozenset({"c01"}) and [c.config_id for c in ctl.add] == ["c03"]
    assert coord.status["c03"] is ConfigStatus.RUNNING
    assert coord.get_state()["early_stop"]["stopped"] == {"c01": 2}


def test_a_stop_shortens_the_running_jobs_predicted_end() -> None:
    """The ETA accounts for early stopping: once the stop is sent, the job is re-timed without
    the stopped adapter (a smaller pack steps faster)."""
    configs = [lora(i, rank=10, steps=40) for i in range(3)]
    coord = Coordinator(cost=AffineCost(), num_gpus=1, configs=configs, planner=GreedyPlanner(),
                        metrics_flush_s=0.0, refill=False)  # fmt: skip
    (spec,) = coord.start()
    coord.on_reports(spec.job_id, [report(*({"config_id": c, "step": 2} for c in spec.config_ids))])
    coord.retime_running()
    end = coord.running[spec.job_id].plan_job.end_s
    coord.stop_config("c01", reason="early_stop")
    coord.poll(spec.job_id)
    assert coord.running[spec.job_id].plan_job.end_s < end


def test_a_stop_after_the_last_step_leaves_the_config_done() -> None:
    """A scheduler's stop can arrive after the adapter trained all its steps: it is done (and
    evaluated), not stopped; one that came in time is stopped."""
    from runtime_fakes import outcome

    configs = [lora(i, rank=10, steps=40) for i in range(2)]
    coord = Coordinator(cost=AffineCost(), num_gpus=1, configs=configs, planner=GreedyPlanner(),
                        metrics_flush_s=0.0, refill=False)  # fmt: skip
    (spec,) = coord.start()
    coord.stop_config("c00", reason="early_stop")
    coord.stop_config("c01", reason="early_stop")
    results = {
        "c00": {"config_id": "c00", "status": "completed", "steps": 40, "eval_loss": 1.0},
        "c01": {"config_id": "c01", "status": "stopped", "steps": 12},
    }
    coord.on_job_finished(spec.job_id, outcome(spec.job_id, results))
    assert coord.status["c00"] is ConfigStatus.DONE and coord.status["c01"] is ConfigStatus.STOPPED
