"""What ``--resume`` keeps and changes, and searchers' repeated suggestions (coordinator, no Ray).

* a config whose hyperparameters equal a known config's is trained once; the source is told
  the result under every id it suggested it with;
* failed configs stay failed on resume unless ``retry_failed``;
* an interrupted job resumes as its next attempt, and its metric rows say so;
* a resume with an edited sweep (``changed``) trains what the edit added, keeps what finished
  and stops queued configs the edit removed.
"""

from __future__ import annotations

import dataclasses

import pytest
from runtime_fakes import AffineCost, Clock, GreedyPlanner, finish, lora, make, run_to_end

from plora.runtime.coordinator import Coordinator
from plora.runtime.records import ConfigStatus, FailureKind, StaticSource
from plora.sweepdir.store import SweepStore


class ScriptedSource:
    """Gives ``waves`` one at a time (the next once everything given was told); records tells."""

    def __init__(self, waves) -> None:
        self.waves, self.told, self.given = [list(w) for w in waves], {}, []

    def ask(self, n: int):
        if not self.waves or len(self.told) < len(self.given):
            return []
        wave = self.waves.pop(0)
        self.given += [c.config_id for c in wave]
        return wave

    def tell(self, config_id, metrics) -> None:
        assert config_id not in self.told, f"told twice: {config_id}"
        self.told[config_id] = metrics

    def is_finished(self) -> bool:
        return not self.waves and len(self.told) == len(self.given)

    def get_state(self):
        return {}

    def set_state(self, state) -> None:
        pass


def _twin(config, cid: str):
    return dataclasses.replace(config, config_id=cid)


def test_a_repeated_suggestion_is_trained_once_and_told_under_each_id() -> None:
    a, b = lora(0, rank=8), lora(1, rank=16)
    # wave 1: a, b and a again under another id; wave 2 (after results): a a third time
    source = ScriptedSource([[a, b, _twin(a, "again")], [_twin(a, "third")]])
    clock = Clock()
    coord = Coordinator(cost=AffineCost(), num_gpus=2, source=source, planner=GreedyPlanner(),
                        clock=clock)  # fmt: skip
    every = run_to_end(coord, clock, coord.start())
    trained = sorted(c for s in every for c in s.config_ids)
    assert trained == ["c00", "c01"]
    assert coord.is_done()
    assert set(source.told) == {"c00", "c01", "again", "third"}
    assert source.told["again"] == source.told["c00"] == source.told["third"]
    assert source.told["c00"]["eval_metric"] is not None
    asks = [d for d in coord.decisions if str(d.kind) == "ask"]
    assert {k: v for d in asks for k, v in d.inputs["duplicates"].items()} == {
        "again": "c00",
        "third": "c00",
    }


def _failed_state(tmp_path):
    store = SweepStore(tmp_path)
    configs = [lora(i, rank=64) for i in range(3)]
    coord, clock = make(configs, gpus=1, store=store, max_retries=0)
    first = coord.start()[0]
    clock.t = 2.0
    coord.on_job_failed(first.job_id, FailureKind.ERROR, "boom")
    failed = [c for c, s in coord.status.items() if s is ConfigStatus.FAILED]
    assert failed
    return store, configs, failed, store.read_state()


def test_failed_configs_stay_failed_on_resume_by_default(tmp_path) -> None:
    store, configs, failed, state = _failed_state(tmp_path)
    coord, clock = make(configs, gpus=1, store=store)
    coord.set_state(state)
    every = run_to_end(coord, clock, coord.start())
    assert not set(failed) & {c for s in every for c in s.config_ids}
    assert all(coord.status[c] is ConfigStatus.FAILED for c in failed)


def test_retry_failed_gives_them_another_attempt(tmp_path) -> None:
    store, configs, failed, state = _failed_state(tmp_path)
    coord, clock = make(configs, gpus=1, store=store)
    coord.set_state(state, retry_failed=True)
    every = run_to_end(coord, clock, coord.start())
    assert set(failed) <= {c for s in every for c in s.config_ids}
    assert all(coord.status[c] is ConfigStatus.DONE for c in coord.configs)
    assert coord.counts()["failed"] == 0
    results = store.read_results().set_index("config_id")
    assert (
        set(results.loc[failed, "status"]) == {"done"} and results.loc[failed, "error"].isna().all()
    )
    resume = [d for d in store.read_decisions() if d["kind"] == "resume"][-1]
    assert sorted(resume["inputs"]["retried_failed"]) == sorted(failed)


def test_a_resumed_job_is_its_next_attempt_in_jobs_and_metrics(tmp_path) -> None:
    from runtime_fakes import report

    store = SweepStore(tmp_path)
    configs = [lora(i, rank=64) for i in range(2)]
    coord, _ = make(configs, gpus=1, store=store)
    first = coord.start()[0]
    coord.on_reports(first.job_id, [report({"config_id": first.config_ids[0], "step": 1})])
    coord.flush_records()
    state = store.read_state()

    coord2, _ = make(configs, gpus=1, store=store)
    coord2.set_state(state)
    again = [s for s in coord2.start() if s.job_id == first.job_id]
    assert again and again[0].attempt == first.attempt + 1 and again[0].resume
    coord2.on_reports(first.job_id, [report({"config_id": first.config_ids[0], "step": 1})])
    coord2.flush_records()
    m = store.read_metrics()  # step 1 trained again: the new attempt's row replaced the first
    assert m["attempt"].tolist() == [1] and set(m["job_id"]) == {first.job_id}


def test_an_edited_space_keeps_finished_configs_and_stops_removed_ones(tmp_path) -> None:
    store = SweepStore(tmp_path)
    old = [lora(i, rank=64) for i in range(4)]  # one GPU, one config per job
    coord, clock = make(old, gpus=1, store=store)
    first = coord.start()[0]
    clock.t = 1.0
    finish(coord, first)  # the next job is running when the driver stops
    state = store.read_state()
    running = {c for c, s in state["status"].items() if s == "running"}
    done = set(first.config_ids)
    queued = {c.config_id for c in old} - done - running
    assert done and running and queued
    # the edited space: the finished config again (under a new id, as a re-expanded grid gives
    # it), one of the queued ones, and a new config
    keep = sorted(queued)[0]
    cfg = {c.config_id: c for c in old}
    edited = [_twin(cfg[next(iter(done))], "n-done"), _twin(cfg[keep], "n-keep"), lora(9, rank=64)]
    coord2 = Coordinator(cost=AffineCost(), num_gpus=1, source=StaticSource(edited),
                         planner=GreedyPlanner(), store=store, clock=Clock())  # fmt: skip
    coord2.set_state(state, changed=["space.rank: [64] -> [64, 8]"])
    every = run_to_end(coord2, Clock(), coord2.start())
    trained = {c for s in every for c in s.config_ids}
    assert trained == running | {keep, "c09"}
    assert "n-done" not in coord2.configs and "n-keep" not in coord2.configs
    for c in queued - {keep}:
        assert coord2.status[c] is ConfigStatus.STOPPED
        assert coord2.results[c]["error"] == "not in the edited sweep file"
    resume = [d for d in store.read_decisions() if d["kind"] == "resume"][-1]
    assert resume["inputs"]["changed"] and sorted(resume["inputs"]["dropped_by_edit"]) == sorted(
        queued - {keep}
    )


def test_readers_keep_the_latest_attempt_of_each_step(tmp_path) -> None:
    import pandas as pd

    from plora.sweepdir.reader import read_metrics

    rows = [  # c0 steps 1-3 by attempt 0; the resume from a step-1 checkpoint redid 2-3
        {"config_id": "c0", "job_id": "j1", "attempt": a, "step": s, "loss": 10.0 * a + s,
         "lr": 1e-3, "tokens": 1, "grad_norm": 0.0, "step_time_s": 0.1, "time": t}
        for a, s, t in [(0, 1, 1.0), (0, 2, 2.0), (0, 3, 3.0), (1, 2, 9.0), (1, 3, 10.0)]
    ]  # fmt: skip
    pd.DataFrame(rows).to_parquet(tmp_path / "metrics.parquet")
    latest = read_metrics(tmp_path)
    assert latest["step"].tolist() == [1, 2, 3] and latest["attempt"].tolist() == [0, 1, 1]
    assert len(read_metrics(tmp_path, all_attempts=True)) == 5


class _Restartable(ScriptedSource):
    """Records whether its state was restored."""

    restored = False

    def set_state(self, state) -> None:
        self.restored = True


@pytest.mark.parametrize(
    ("changed", "restored"),
    [([], True), (["hardware.num_gpus: 1 -> 2"], True), (["space.lr: [0.001] -> [0.01]"], False)],
)
def test_only_a_changed_space_restarts_the_source(tmp_path, changed, restored) -> None:
    store = SweepStore(tmp_path)
    a, b = lora(0, rank=8), lora(1, rank=16)
    clock = Clock()
    coord = Coordinator(cost=AffineCost(), num_gpus=2, source=ScriptedSource([[a, b]]),
                        planner=GreedyPlanner(), store=store, clock=clock)  # fmt: skip
    run_to_end(coord, clock, coord.start())
    state = store.read_state()
    # the same configs again, under their own ids: a restarted searcher proposing them anew
    source = _Restartable([[a, b]])
    again = Coordinator(cost=AffineCost(), num_gpus=2, source=source, planner=GreedyPlanner(),
                        store=store, clock=Clock())  # fmt: skip
    again.set_state(state, changed=changed)
    assert source.restored is restored
    launches = again.start()
    if not restored:  # asked again: known ids are told their results, nothing is trained
        assert not launches and set(source.told) == {"c00", "c01"}
        assert source.told["c01"]["eval_metric"] == coord.results["c01"]["eval_metric"]
