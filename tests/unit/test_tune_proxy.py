"""The Tune proxy trial's loop (``plora.tune.trainable._follow``) with fake Ray actors: it reports
each new step, reads often while its adapter trains and backs off while it waits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import plora.tune.trainable as trainable
from plora.engine.reports import StepMetrics


def _call(value):
    """A fake actor method whose ``.remote(...)`` is ``value`` (``ray.get`` is the identity)."""
    return SimpleNamespace(remote=lambda *a, **k: value)


def _step(s: int) -> StepMetrics:
    return StepMetrics(config_id="t-x", step=s, loss=1.0, lr=1e-3, tokens=8, grad_norm=0.1,
                       time_s=0.1)  # fmt: skip


def test_a_waiting_proxy_backs_off_and_a_training_one_reads_at_poll_s(monkeypatch) -> None:
    import ray
    from ray import tune

    done = {"status": "done", "steps": 2, "eval_loss": 0.5, "adapter_path": None}
    # queued for five reads, then a step each read, then two empty reads and the end
    answers = iter([([], None)] * 5 + [([_step(1)], None), ([_step(2)], None), ([], None),
                                       ([], None), ([], done)])  # fmt: skip
    relay = SimpleNamespace(
        resume_config=_call(0), history=SimpleNamespace(remote=lambda cid, last: next(answers))
    )
    service = SimpleNamespace(register=_call(("t-x", "relay", 2, None)))
    monkeypatch.setattr(ray, "get_actor", lambda name: service if name == "svc" else relay)
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    monkeypatch.setattr(trainable, "_experiment_dir", lambda: "/exp")
    context = SimpleNamespace(get_trial_id=lambda: "x")
    monkeypatch.setattr(tune, "get_context", lambda: context)
    reports: list[dict] = []
    monkeypatch.setattr(tune, "report", lambda m, checkpoint=None: reports.append(m))
    waits: list[float] = []
    monkeypatch.setattr(trainable, "time", SimpleNamespace(sleep=waits.append))
    trainable._follow({}, service_name="svc", poll_s=0.2)
    assert [r["adapter_step"] for r in reports] == [1, 2, 2] and reports[-1]["status"] == "done"
    assert waits == pytest.approx([0.4, 0.8, 1.0, 1.0, 1.0, 0.2, 0.2, 0.4, 0.8])


def test_a_proxy_whose_sweep_run_ended_unread_gets_its_result_at_registration(monkeypatch) -> None:
    """The run of the sweep ended (its relay gone) before the proxy read its config's result:
    registering again answers with the result (no new run), and the trial ends with it."""
    import ray
    from ray import tune

    def gone(*a, **k):
        raise ray.exceptions.RayActorError()

    # the relay answers the resume, then its run ends before the history read
    relays = iter([SimpleNamespace(resume_config=_call(0), history=SimpleNamespace(remote=gone))])

    def get_actor(name):
        if name == "svc":
            return service
        relay = next(relays, None)
        if relay is None:
            raise ValueError(f"no actor {name}")
        return relay

    ended = {"status": "done", "steps": 2, "eval_loss": 0.5, "adapter_path": None}
    # step 2 was trained after the proxy's last read: it comes from the sweep directory
    registrations = iter(
        [("t-x", "relay-r1", 2, None), ("t-x", "relay-r1", 2, (ended, [_step(2)]))]
    )
    service = SimpleNamespace(register=SimpleNamespace(remote=lambda *a: next(registrations)))
    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    monkeypatch.setattr(trainable, "_experiment_dir", lambda: "/exp")
    monkeypatch.setattr(tune, "get_context", lambda: SimpleNamespace(get_trial_id=lambda: "x"))
    reports: list[dict] = []
    monkeypatch.setattr(tune, "report", lambda m, checkpoint=None: reports.append(m))
    monkeypatch.setattr(trainable, "time", SimpleNamespace(sleep=lambda s: None))
    trainable._follow({}, service_name="svc", poll_s=0.2)
    assert [r["adapter_step"] for r in reports] == [2, 2]
    assert (reports[-1]["status"], reports[-1]["steps"], reports[-1]["eval_loss"]) == (
        "done",
        2,
        0.5,
    )
