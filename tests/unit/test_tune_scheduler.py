"""``PLoRAScheduler`` and the proxy trials' config source, without a Ray cluster.

Trials are stand-ins with ``trial_id``/``config``/``storage`` (what Tune's hooks read); the
relay is a recording fake put where ``ray.get_actor`` looks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.tune.schedulers import (
    ASHAScheduler,
    HyperBandScheduler,
    MedianStoppingRule,
    PopulationBasedTraining,
    TrialScheduler,
)
from runtime_fakes import lora

from plora.config import ConfigError
from plora.tune.scheduler import STATE_FILE, PLoRAScheduler
from plora.tune.source import RegistrationSource


@dataclass(eq=False)  # hashable by identity, as Tune's Trial
class Trial:
    trial_id: str
    storage: object = None
    config: dict = field(default_factory=dict)
    status: str = "PENDING"


def tune_storage(path: Path) -> SimpleNamespace:
    """A Tune trial's storage as the wrapper reads it: the driver's staging directory (its
    state file) and the experiment directory (``path / "exp"``)."""
    return SimpleNamespace(experiment_driver_staging_path=str(path),
                           experiment_fs_path=str(path / "exp"))  # fmt: skip


class Relay:
    def __init__(self) -> None:
        self.stops: list[tuple[str, str]] = []
        self.pauses: list[tuple[str, str]] = []
        self.stop_config = SimpleNamespace(remote=lambda c, r: self.stops.append((c, r)))
        self.pause_config = SimpleNamespace(remote=lambda c, r: self.pauses.append((c, r)))


@pytest.fixture
def relay(monkeypatch):
    import ray

    fake = Relay()
    monkeypatch.setattr(ray, "get_actor", lambda name: fake)
    return fake


def asha() -> ASHAScheduler:
    return ASHAScheduler(time_attr="adapter_step", metric="loss", mode="min", max_t=8,
                         grace_period=2, reduction_factor=2)  # fmt: skip


def result(trial: Trial, step: int, loss: float, **extra) -> dict:
    return {"adapter_step": step, "loss": loss, "config_id": f"t-{trial.trial_id}",
            "plora_relay": "relay", "max_steps": 8, **extra}  # fmt: skip


LOSS = {"a": 1.0, "b": 3.0, "c": 2.0, "d": 0.5, "e": 2.5, "f": 0.8}


def drive(sched: PLoRAScheduler, trials: list[Trial], steps: range) -> list[tuple[str, int]]:
    """Results step by step; the (trial, step) pairs the wrapped scheduler stopped."""
    stopped = []
    for step in steps:
        for t in trials:
            if t.trial_id in sched.stopped:
                continue
            decision = sched.on_trial_result(
                None, t, result(t, step, LOSS[t.trial_id] - 0.01 * step)
            )
            assert decision == TrialScheduler.CONTINUE  # Tune never kills a proxy itself
            if t.trial_id in sched.stopped:
                stopped.append((t.trial_id, step))
    return stopped


def test_stop_becomes_a_stop_of_that_adapter_and_tune_continues(relay, tmp_path) -> None:
    storage = tune_storage(tmp_path)
    trials = [Trial(t, storage) for t in "abcd"]
    sched = PLoRAScheduler(asha())
    for t in trials:
        sched.on_trial_add(None, t)
    stopped = drive(sched, trials, range(1, 5))
    # rung 2: b (2.98) is worse than a (0.98); c (1.98) ties the median of {a, b}: on.
    # rung 4: c (1.96) is worse than a (0.96), the only one recorded there before it
    assert stopped == [("b", 2), ("c", 4)]
    assert relay.stops == [("t-b", "early_stop"), ("t-c", "early_stop")]
    # the stopped trial's later results (until its adapter stops) change nothing
    assert sched.on_trial_result(None, trials[1], result(trials[1], 3, 9.0)) == "CONTINUE"
    assert relay.stops == [("t-b", "early_stop"), ("t-c", "early_stop")]
    # ASHA's STOP at the last step (max_t) is no early stop: nothing sent
    sched.on_trial_result(None, trials[0], result(trials[0], 8, 0.1))
    assert len(relay.stops) == 2
    saved = json.loads((tmp_path / STATE_FILE).read_text())
    assert saved["stopped"] == {"b": 2, "c": 4}


def test_restored_state_decides_exactly_as_the_uninterrupted_scheduler(relay, tmp_path) -> None:
    trials = [Trial(t, tune_storage(tmp_path / "x")) for t in LOSS]
    whole = PLoRAScheduler(asha())
    for t in trials:
        whole.on_trial_add(None, t)
    reference = drive(whole, trials, range(1, 9))

    (tmp_path / "y").mkdir()
    storage = tune_storage(tmp_path / "y")
    trials = [Trial(t.trial_id, storage) for t in trials]
    first = PLoRAScheduler(asha())
    for t in trials:
        first.on_trial_add(None, t)
    before = drive(first, trials, range(1, 4))
    import pickle

    restored = pickle.loads(pickle.dumps(first))  # what Tuner.restore unpickles (tuner.pkl)
    assert not restored.stopped and restored.restores == 0
    for t in trials:
        restored.on_trial_add(None, t)  # reads plora-scheduler.json before the first trial
    after = drive(restored, trials, range(4, 9))
    assert reference and before + after == reference
    assert restored.restores == 1 and first.restores == 0
    forgetful = PLoRAScheduler(asha())  # the check has teeth: without the state it differs
    for t in trials:
        forgetful.inner.on_trial_add(None, t)
    assert before + drive(forgetful, trials, range(4, 9)) != reference


def test_median_stopping_rule_stops_adapters_too(relay) -> None:
    sched = PLoRAScheduler(MedianStoppingRule(time_attr="adapter_step", metric="loss",
                                              mode="min", grace_period=1, min_samples_required=1))  # fmt: skip
    # a pending trial makes the rule PAUSE (yield time) while it has too few samples: CONTINUE
    pending = [SimpleNamespace(status="PENDING")]
    controller = SimpleNamespace(get_trials=lambda: trials, get_live_trials=lambda: pending)
    trials = [Trial(t) for t in "abc"]
    for t in trials:
        sched.on_trial_add(controller, t)
    decisions = {
        sched.on_trial_result(controller, t, result(t, step, LOSS[t.trial_id]))
        for step in range(1, 5)
        for t in trials
    }
    assert decisions == {TrialScheduler.CONTINUE}  # a's first result was a PAUSE: continued
    # b (3.0) is worse than a's running mean (1.0) at its first step; c (2.0) at its second,
    # when only a (1.0) reached step 2 (b stopped at 1)
    assert sched.stopped == {"b": 1, "c": 2}
    assert relay.stops == [("t-b", "early_stop"), ("t-c", "early_stop")]


def test_a_median_rule_pause_pauses_the_adapter_and_a_later_result_resumes_it(relay) -> None:
    """``MedianStoppingRule(hard_stop=False)``: its PAUSE of a lagging trial pauses that adapter
    (Tune is told PAUSE and stops the proxy); its yield-PAUSE (too few samples, trials pending)
    stays a CONTINUE; the resumed trial's results continue it (the rule lets it run on)."""
    rule = MedianStoppingRule(time_attr="adapter_step", metric="loss", mode="min",
                              grace_period=1, min_samples_required=1, hard_stop=False)  # fmt: skip
    sched = PLoRAScheduler(rule)
    pending = [SimpleNamespace(status="PENDING")]
    trials = [Trial(t) for t in "abc"]
    controller = SimpleNamespace(get_trials=lambda: trials, get_live_trials=lambda: pending)
    for t in trials:
        sched.on_trial_add(controller, t)
    a, b, c = trials
    assert sched.on_trial_result(controller, a, result(a, 1, 1.0)) == TrialScheduler.CONTINUE
    assert relay.pauses == []  # a's yield (no sample yet) paused nothing
    assert sched.on_trial_result(controller, b, result(b, 1, 3.0)) == TrialScheduler.PAUSE
    assert relay.pauses == [("t-b", "pause")] and sched.paused == {"b": 1}
    assert sched.on_trial_result(controller, c, result(c, 1, 0.5)) == TrialScheduler.CONTINUE
    # Tune resumes b later: its proxy reports again and it trains on
    assert sched.on_trial_result(controller, b, result(b, 2, 2.9)) == TrialScheduler.CONTINUE
    assert sched.paused == {} and sched.pauses == 1 and relay.stops == []
    # a pause at the adapter's last step pauses nothing: the proxy is about to finish
    assert sched.on_trial_result(controller, a, result(a, 8, 9.0)) == TrialScheduler.CONTINUE
    assert relay.pauses == [("t-b", "pause")]


def test_a_trial_stopped_while_paused_stops_its_adapter_and_the_state_keeps_pauses(
    relay, tmp_path
) -> None:
    storage = tune_storage(tmp_path)
    rule = MedianStoppingRule(time_attr="adapter_step", metric="loss", mode="min",
                              grace_period=1, min_samples_required=1, hard_stop=False)  # fmt: skip
    sched = PLoRAScheduler(rule)
    a, b = Trial("a", storage), Trial("b", storage)
    controller = SimpleNamespace(get_trials=lambda: [a, b], get_live_trials=lambda: [])
    for t in (a, b):
        sched.on_trial_add(controller, t)
    sched.on_trial_result(controller, a, result(a, 1, 1.0))
    assert sched.on_trial_result(controller, b, result(b, 1, 3.0)) == TrialScheduler.PAUSE
    saved = json.loads((tmp_path / STATE_FILE).read_text())
    assert saved["paused"] == {"b": 1} and saved["pauses"] == 1
    restored = PLoRAScheduler(MedianStoppingRule(hard_stop=False))
    restored.set_state(saved)
    assert restored.paused == {"b": 1}
    sched.on_trial_remove(controller, b)  # what Tune's stop_trial calls for a PAUSED trial
    assert relay.stops == [("t-b", "stopped_while_paused")]
    assert sched.paused == {} and sched.stopped == {"b": 1}


def test_a_paused_trial_stopped_while_still_saving_its_pause_stops_its_adapter(relay) -> None:
    """HyperBand stops a bracket loser that is still saving its pause (Tune status RUNNING);
    Tune's ``stop_trial`` then calls ``on_trial_complete``, not ``on_trial_remove`` (a
    fresh-clone CI run on 2026-11-28 ended such a config ``paused``)."""
    # max_t 8, factor 2: trials 0-3 fill a bracket with no milestone before step 8, trials
    # 4-7 one whose first milestone is step 4, where it keeps the better half
    hyperband = HyperBandScheduler(time_attr="adapter_step", metric="loss", mode="min",
                                   max_t=8, reduction_factor=2)  # fmt: skip
    sched = PLoRAScheduler(hyperband)
    trials = [Trial(str(i)) for i in range(8)]

    def stop_trial(trial: Trial) -> None:  # Tune's stop_trial for a RUNNING trial
        sched.on_trial_complete(controller, trial, result(trial, 4, 3.0))

    controller = SimpleNamespace(get_trials=lambda: trials, get_live_trials=lambda: trials,
                                 stop_trial=stop_trial)  # fmt: skip
    for t in trials:
        t.status, t.is_saving = "RUNNING", False
        sched.on_trial_add(controller, t)
    for t, loss in zip(trials[4:7], (3.0, 1.0, 1.5), strict=True):  # each waits at step 4
        assert sched.on_trial_result(controller, t, result(t, 4, loss)) == TrialScheduler.PAUSE
    assert sched.paused == {"4": 4, "5": 4, "6": 4}
    trials[4].is_saving = True  # Tune is still saving this paused proxy when the bracket ends
    for t in trials[5:7]:
        t.status = "PAUSED"
    sched.on_trial_result(controller, trials[7], result(trials[7], 4, 2.0))
    # 4 (a loser) ends stopped at its pause step, 7 (the other) stops in its pack
    assert relay.stops == [("t-4", "stopped_while_paused"), ("t-7", "early_stop")]
    assert sched.stopped == {"4": 4, "7": 4} and "4" not in sched.paused


@pytest.mark.parametrize(
    ("make", "fix"),
    [
        (
            lambda: PopulationBasedTraining(
                time_attr="adapter_step", hyperparam_mutations={"lr": [1e-3, 1e-2]}
            ),
            "use ASHAScheduler",
        ),
        (lambda: PLoRAScheduler(), "wrap a Tune scheduler once"),
    ],
)
def test_schedulers_plora_cannot_carry_out_are_refused_at_the_door(make, fix) -> None:
    with pytest.raises(ConfigError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        PLoRAScheduler(make())


def test_hyperband_and_soft_median_rule_are_accepted() -> None:
    for inner in (HyperBandScheduler(time_attr="adapter_step", max_t=8),
                  MedianStoppingRule(hard_stop=False)):  # fmt: skip
        assert PLoRAScheduler(inner).inner is inner


def test_registration_source_settles_lingers_and_merges_restored_configs() -> None:
    now = [0.0]
    src = RegistrationSource(settle_s=1.0, linger_s=5.0, clock=lambda: now[0])
    assert src.add(lora(0)) and src.add(lora(1)) and src.add(lora(0))  # a known id: no-op
    assert src.ask(10) == [] and not src.has_waiting()  # not settled yet
    now[0] = 1.5
    assert [c.config_id for c in src.ask(10)] == ["c00", "c01"] and src.ask(10) == []
    assert not src.is_finished()  # asked, not ended
    src.tell("c00", {})
    src.tell("c01", {})
    now[0] = 3.0
    assert not src.is_finished()  # ended, but lingering for more trials
    now[0] = 7.0
    assert src.is_finished() and not src.add(lora(2))  # finished for good: refuses
    state = json.loads(json.dumps(src.get_state()))
    again = RegistrationSource(settle_s=0.0, linger_s=5.0, clock=lambda: now[0])
    again.add(lora(3))  # a trial registered before the resumed coordinator restored its state
    again.set_state(state)
    assert [c.config_id for c in again.ask(10)] == ["c03"] and not again.is_finished()


def test_registration_source_waits_for_announced_configs_then_settles() -> None:
    """Trials Tune added (announced) are planned with the first ones to register, however long
    their start takes; one that never registers is waited for ``expect_s`` at most."""
    now = [0.0]
    src = RegistrationSource(settle_s=1.0, linger_s=5.0, expect_s=60.0, clock=lambda: now[0])
    src.expect(["c00", "c01", "c02"])
    src.add(lora(0))
    now[0] = 30.0  # long settled, but c01 and c02 are still starting
    assert src.ask(10) == [] and not src.has_waiting()
    src.add(lora(1))
    src.add(lora(2))
    assert src.ask(10) == []  # every announced one is here: settling from the last
    now[0] = 31.0
    assert [c.config_id for c in src.ask(10)] == ["c00", "c01", "c02"]
    src.expect(["c01", "c03"])  # a registered one announced again is not awaited
    for cid in ("c00", "c01", "c02"):
        src.tell(cid, {})
    now[0] = 40.0
    assert not src.is_finished()  # c03 is still starting: not finished however long the idle
    now[0] = 31.0 + 60.0
    assert src.is_finished()  # c03 never came: not waited for past expect_s


def test_trials_tune_will_start_are_announced_to_their_sweep(monkeypatch, tmp_path) -> None:
    """``on_trial_add`` announces a pending trial to the sweeps of this driver (with its
    experiment directory); a trial restored finished or paused will not register: not announced."""
    import plora.tune.services as services

    calls: list[tuple[list[str], str]] = []
    monkeypatch.setattr(services, "announce_trials", lambda ids, d: calls.append((ids, d)))
    sched = PLoRAScheduler(asha())
    storage = tune_storage(tmp_path)
    for tid, status in (("a", "PENDING"), ("b", "TERMINATED"), ("c", "PAUSED")):
        sched.on_trial_add(None, Trial(tid, storage=storage, status=status))
    assert calls == [(["a"], str(tmp_path / "exp"))]
