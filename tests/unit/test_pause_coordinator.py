"""The coordinator's PAUSE and resume (``plora.runtime.coordinator.pause``), stepped by hand, no Ray.

A paused config leaves its job (its slot is refilled), is ``paused`` without the searcher being
told, is queued again on resume and packed by the next plan or refill, and ends stopped at its
pause step when nobody resumes it before the sweep ends.
"""

from __future__ import annotations

from typing import Any

from runtime_fakes import AffineCost, GreedyPlanner, lora, outcome, report

from plora.engine.checkpoint import save_train_state
from plora.engine.pause import paused_dir
from plora.runtime.coordinator import Coordinator
from plora.runtime.coordinator.machine import apply_request
from plora.runtime.coordinator.pause import ConfigRequest, RequestKind
from plora.runtime.progress import summary_line
from plora.runtime.records import ConfigStatus, Decision, StaticSource
from plora.sweepdir.store import SweepStore


class Told(StaticSource):
    """A fixed source that records what it is told and stays open (as a Tune experiment's
    registrations do) until ``closing``."""

    def __init__(self, configs: Any) -> None:
        super().__init__(configs)
        self.told: dict[str, Any] = {}
        self.closing = False

    def is_finished(self) -> bool:
        return self.closing and super().is_finished()

    def tell(self, config_id: str, metrics: dict[str, Any]) -> None:
        self.told[config_id] = metrics
        super().tell(config_id, metrics)


def _coord(n: int = 4, *, store: SweepStore | None = None, **kw: Any) -> tuple[Coordinator, Told]:
    source = Told([lora(i, rank=10, steps=40) for i in range(n)])  # three fit a job
    coord = Coordinator(cost=AffineCost(), num_gpus=1, source=source, planner=GreedyPlanner(),
                        metrics_flush_s=0.0, store=store, **kw)  # fmt: skip
    return coord, source


def _pause(coord: Coordinator, cid: str) -> None:
    apply_request(coord, ConfigRequest(cid, "hyperband", RequestKind.PAUSE))


def _resume(coord: Coordinator, cid: str) -> None:
    apply_request(coord, ConfigRequest(cid, "trial resumed", RequestKind.RESUME))


def _write_paused_state(root, cid: str, step: int) -> None:
    """What the worker writes as the adapter leaves (the engine's test covers its content)."""
    save_train_state(paused_dir(root, cid), {"global_step": step, "adapters": {}})


def test_a_paused_config_leaves_its_pack_is_refilled_and_rejoins_on_resume() -> None:
    coord, source = _coord()
    (spec,) = coord.start()
    assert set(spec.config_ids) == {"c00", "c01", "c02"} and coord.queued_ids() == ["c03"]
    coord.on_reports(spec.job_id, [report(*({"config_id": c, "step": 5} for c in spec.config_ids))])
    _pause(coord, "c01")
    ctl = coord.poll(spec.job_id)
    assert ctl.pause == frozenset({"c01"}) and not ctl.stop
    assert [c.config_id for c in ctl.add] == ["c03"]  # its slot is refilled from the queue
    assert coord.status["c01"] is ConfigStatus.PAUSED
    assert " paused 1 " in summary_line(coord.snapshot())  # the progress line counts it
    assert coord.poll(spec.job_id).pause == frozenset()  # delivered once
    results = {
        "c00": {"status": "done", "steps": 40, "eval_loss": 1.0},
        "c01": {"status": "paused", "steps": 6, "eval_loss": 2.5, "adapter_path": "a/c01"},
        "c02": {"status": "done", "steps": 40, "eval_loss": 1.5},
        "c03": {"status": "done", "steps": 40, "eval_loss": 1.2},
    }
    assert coord.on_job_finished(spec.job_id, outcome(spec.job_id, results)) == []
    assert coord.status["c01"] is ConfigStatus.PAUSED and "c01" not in source.told
    assert coord.results["c01"]["status"] == "paused" and coord.results["c01"]["steps"] == 6
    assert not coord.is_done()  # a paused config may still be resumed
    _resume(coord, "c01")
    assert coord.status["c01"] is ConfigStatus.QUEUED
    (again,) = coord.tick()  # the planner packs it again
    assert again.config_ids == ("c01",)
    coord.on_job_finished(
        again.job_id, outcome(again.job_id, {"c01": {"status": "done", "steps": 40}})
    )
    assert coord.status["c01"] is ConfigStatus.DONE and source.told["c01"]["status"] == "done"
    kinds = [d.kind for d in coord.decisions if "c01" in d.config_ids]
    assert kinds.index(Decision.PAUSE_CONFIG) < kinds.index(Decision.CONFIG_PAUSED)
    assert kinds.index(Decision.CONFIG_PAUSED) < kinds.index(Decision.RESUME_CONFIG)
    source.closing = True
    assert coord.is_done()


def test_a_config_nobody_resumes_ends_stopped_at_its_pause_step() -> None:
    coord, source = _coord(3)
    (spec,) = coord.start()
    source.closing = True  # the experiment ended: no trial will resume it
    _pause(coord, "c02")
    coord.poll(spec.job_id)
    results = {
        "c00": {"status": "done", "steps": 40},
        "c01": {"status": "done", "steps": 40},
        "c02": {"status": "paused", "steps": 9, "eval_loss": 3.0, "adapter_path": "a/c02"},
    }
    coord.on_job_finished(spec.job_id, outcome(spec.job_id, results))
    assert coord.status["c02"] is ConfigStatus.STOPPED and coord.is_done()
    row = coord.results["c02"]
    assert (row["status"], row["steps"], row["eval_loss"]) == ("stopped", 9, 3.0)
    assert row["adapter_path"] == "a/c02" and source.told["c02"]["status"] == "stopped"


def test_a_resume_waits_until_the_worker_wrote_the_train_state(tmp_path) -> None:
    store = SweepStore(tmp_path)
    coord, _ = _coord(store=store)
    (spec,) = coord.start()
    coord.on_reports(
        spec.job_id, [report(*({"config_id": c, "step": 12} for c in spec.config_ids))]
    )
    _write_paused_state(tmp_path, "c00", 5)  # left by an earlier pause of c00, at step 5
    _pause(coord, "c00")
    ctl = coord.poll(spec.job_id)  # delivered at step 12; the worker pauses it at its next step
    assert ctl.pause == {"c00"} and [c.config_id for c in ctl.add] == ["c03"]  # slot refilled
    _resume(coord, "c00")  # the trial is resumed before this pause's state is on disk
    assert coord.status["c00"] is ConfigStatus.PAUSED  # not queued: it would start from 5
    coord.poll(spec.job_id)
    assert coord.status["c00"] is ConfigStatus.PAUSED
    _write_paused_state(tmp_path, "c00", 13)
    coord.poll(spec.job_id)  # now it is queued (its old slot is c03's: it waits for the next)
    assert coord.status["c00"] is ConfigStatus.QUEUED and coord.queued_ids() == ["c00"]
    assert any(d.kind is Decision.RESUME_CONFIG for d in coord.decisions)


def test_a_resumed_config_its_old_job_took_back_but_never_trained_is_queued_again(
    tmp_path,
) -> None:
    """Resumed while its pack still ran, a config can be refilled into that same job, which may
    end before training it again: the job's row for it is still the pause's. It must be queued
    again (a CI run on 2026-11-28 left such a config running in no job, and the sweep hung)."""
    store = SweepStore(tmp_path)
    coord, _ = _coord(store=store)
    (spec,) = coord.start()
    coord.on_reports(spec.job_id, [report(*({"config_id": c, "step": 5} for c in spec.config_ids))])
    _pause(coord, "c01")
    assert coord.poll(spec.job_id).pause == {"c01"}
    _write_paused_state(tmp_path, "c01", 6)
    _resume(coord, "c01")
    coord.on_reports(spec.job_id, [report({"config_id": "c00", "step": 40})])
    assert [c.config_id for c in coord.poll(spec.job_id).add] == ["c01"]  # taken back
    results = {
        "c00": {"status": "done", "steps": 40},
        "c01": {"status": "paused", "steps": 6, "eval_loss": 2.5},  # ended before retaking it
        "c02": {"status": "done", "steps": 40},
        "c03": {"status": "done", "steps": 40},
    }
    (again,) = coord.on_job_finished(spec.job_id, outcome(spec.job_id, results))
    assert again.config_ids == ("c01",)
    assert coord.results["c01"]["steps"] == 6  # its row until the next pack's comes


def test_stop_while_paused_and_pause_of_a_queued_config() -> None:
    coord, _ = _coord()
    (spec,) = coord.start()
    _pause(coord, "c03")  # still queued: it leaves the plan at once, nothing to save
    assert coord.status["c03"] is ConfigStatus.PAUSED and coord.queued_ids() == []
    _pause(coord, "c00")
    coord.poll(spec.job_id)
    apply_request(coord, ConfigRequest("c00", "hyperband", RequestKind.STOP))  # its row pending
    results = {c: {"status": "done", "steps": 40} for c in ("c01", "c02")}
    results["c00"] = {"status": "paused", "steps": 4, "eval_loss": 2.0}
    coord.on_job_finished(spec.job_id, outcome(spec.job_id, results))
    assert coord.status["c00"] is ConfigStatus.STOPPED and coord.results["c00"]["steps"] == 4
    assert coord.results["c00"]["eval_loss"] == 2.0
    _resume(coord, "c03")
    (again,) = coord.tick()
    assert again.config_ids == ("c03",)
    # a stop that overtakes a pause not delivered yet is a plain stop
    _pause(coord, "c03")
    apply_request(coord, ConfigRequest("c03", "hyperband", RequestKind.STOP))
    ctl = coord.poll(again.job_id)
    assert ctl.stop == {"c03"} and ctl.pause == frozenset()
    assert coord.status["c03"] is ConfigStatus.RUNNING  # until its job reports it stopped


def test_a_pause_in_a_multi_gpu_job_is_deferred() -> None:
    source = Told([lora(0, rank=10, steps=40)])
    coord = Coordinator(cost=AffineCost(), num_gpus=2, source=source, planner=GreedyPlanner(),
                        metrics_flush_s=0.0)  # fmt: skip
    (spec,) = coord.start()
    coord.running[spec.job_id].spec = type(spec)(**{**_fields(spec), "gpus": 2})
    _pause(coord, "c00")
    assert coord.poll(spec.job_id).pause == frozenset()
    assert coord.status["c00"] is ConfigStatus.RUNNING
    (d,) = [d for d in coord.decisions if d.kind is Decision.PAUSE_CONFIG]
    assert d.inputs["deferred"] is True


def _fields(spec: Any) -> dict[str, Any]:
    return {k: getattr(spec, k) for k in type(spec).__dataclass_fields__}
