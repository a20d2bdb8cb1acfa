"""What the coordinator records and tells: the sweep directory's files follow its decisions,
the searcher is told every ending, and the relay actor's logic (no Ray)."""

from __future__ import annotations

import json

import pytest
from runtime_fakes import AffineCost, Clock, GreedyPlanner, lora, make, report, run_to_end

from plora.runtime.coordinator import Coordinator
from plora.sweepdir.store import SweepStore


def test_store_files_follow_decisions(tmp_path) -> None:
    store = SweepStore(tmp_path)
    configs = [lora(i, rank=r) for i, r in enumerate([8, 32, 64, 16])]
    coord, clock = make(configs, gpus=2, store=store)
    launches = coord.start()
    for s in launches:
        coord.on_reports(
            s.job_id,
            [report(*({"config_id": c, "step": 1, "loss": 2.0} for c in s.config_ids), time_s=0.1)],
        )
    run_to_end(coord, clock, launches)
    lines = store.decisions_jsonl.read_text().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == [str(d.kind) for d in coord.decisions]
    results = store.read_results()
    assert sorted(results["config_id"]) == sorted(c.config_id for c in configs)
    assert set(results["status"]) == {"done"}
    assert results.set_index("config_id").loc["c02", "rank"] == 64
    metrics = store.read_metrics()
    assert len(metrics) >= len(launches) and set(metrics["step"]) == {1}
    plans = sorted(store.plans_dir.glob("plan-*.json"))
    assert len(plans) >= 2 and json.loads(store.plan_json.read_text()) == json.loads(
        plans[-1].read_text()
    )
    jobs = store.read_jobs()
    assert set(jobs["status"]) == {"done"} and (jobs["end"] >= jobs["start"]).all()


def test_decisions_of_a_batch_are_durable_when_it_ends(tmp_path) -> None:
    """Inside the driver's batch of events decisions wait for its end (one fsync), and are on
    disk, in order, once it ends; outside a batch each is on disk at once."""
    store = SweepStore(tmp_path)
    configs = [lora(i, rank=8, steps=50) for i in range(6)]
    coord, _ = make(configs, gpus=1, store=store)

    def on_disk() -> list[str]:
        if not store.decisions_jsonl.is_file():
            return []
        return [json.loads(x)["kind"] for x in store.decisions_jsonl.read_text().splitlines()]

    (spec,) = coord.start()
    assert on_disk() == [str(d.kind) for d in coord.decisions]  # no batch: written at once
    before = len(coord.decisions)
    with coord.batched_writes():
        coord.stop_config(spec.config_ids[0], reason="test")
        assert len(coord.decisions) == before + 1 and len(on_disk()) == before
    assert on_disk() == [str(d.kind) for d in coord.decisions]
    assert store.read_decisions()[-1]["kind"] == "stop_config"


class LimitedSource:
    """An adaptive-searcher stand-in: at most ``limit`` configs outstanding (ConcurrencyLimiter)."""

    def __init__(self, configs, limit: int = 2) -> None:
        self.configs, self.limit, self.told, self.given = list(configs), limit, {}, 0

    def ask(self, n: int):
        room = self.limit - (self.given - len(self.told))
        out = self.configs[self.given : self.given + max(0, min(n, room))]
        self.given += len(out)
        return out

    def tell(self, config_id, metrics) -> None:
        assert config_id not in self.told
        self.told[config_id] = metrics

    def is_finished(self) -> bool:
        return self.given == len(self.configs) and len(self.told) == self.given

    def get_state(self):
        return {"given": self.given, "told": self.told}

    def set_state(self, state) -> None:
        self.given, self.told = state["given"], dict(state["told"])


def test_searcher_is_told_every_ending_and_asked_again() -> None:
    configs = [lora(i, rank=30) for i in range(5)]
    source = LimitedSource(configs, limit=2)
    clock = Clock()
    coord = Coordinator(
        cost=AffineCost(), num_gpus=4, source=source, planner=GreedyPlanner(), clock=clock
    )
    launches = coord.start()
    assert sum(len(s.configs) for s in launches) == 2  # only what the searcher gave
    coord.stop_config(launches[0].config_ids[0])
    every = run_to_end(coord, clock, launches)
    assert coord.is_done() and source.is_finished()
    assert sorted(source.told) == sorted(c.config_id for c in configs)
    assert source.told[launches[0].config_ids[0]]["status"] == "stopped"
    done = [m for m in source.told.values() if m["status"] == "done"]
    assert len(done) == 4 and all(m["eval_metric"] == pytest.approx(0.3) for m in done)
    assert len({c for s in every for c in s.config_ids}) == 5


def test_relay_actor_logic_without_ray() -> None:
    from plora.engine.api import Control
    from plora.runtime.actors.relay import CoordinatorActor
    from plora.runtime.coordinator.pause import ConfigRequest

    relay = CoordinatorActor(keep_history=True)
    relay.push_reports(
        "j1", [report({"config_id": "a", "step": 1}), report({"config_id": "a", "step": 2})]
    )
    relay.push_reports("j2", [report({"config_id": "b", "step": 1})])
    relay.stop_config("a", "asha")
    ticket = relay.request_sync("j1")  # j1 is about to checkpoint after step 2
    reports, stops, syncs = relay.drain()
    assert [r.metrics[0].step for r in reports["j1"]] == [1, 2] and stops == [
        ConfigRequest("a", "asha")
    ]
    assert syncs == {"j1": ticket} and relay.synced("j1") < ticket
    relay.ack_sync(syncs)  # the driver wrote what it drained with the ticket
    assert relay.synced("j1") == ticket and relay.synced("j2") == 0
    assert relay.drain() == ({}, [], {})
    assert relay.config_view("a")["last"]["step"] == 2 and relay.config_view("a")["result"] is None
    # a follower (a Tune proxy trial) reads one config's stream after a step, then its result
    assert [m.step for m in relay.history("a", 0)[0]] == [1, 2] and relay.history("a")[1] is None
    assert [m.step for m in relay.history("a", 1)[0]] == [2]  # step 1 read: dropped
    relay.post_results({"a": {"status": "stopped", "steps": 2}})
    assert relay.history("a", 2) == ([], {"status": "stopped", "steps": 2})
    assert relay.history("b", 0)[0][0].config_id == "b" and relay.history("zz") == ([], None)
    plain = CoordinatorActor()  # plora sweep: nobody follows, nothing is kept
    plain.push_reports("j1", [report({"config_id": "a", "step": 1})])
    assert plain.history("a") == ([], None) and plain.config_view("a")["last"]["step"] == 1
    relay.post_control("j1", Control(stop=frozenset({"a"}), add=(lora(7),)))
    relay.post_control("j1", Control(stop=frozenset({"x"})))
    assert relay.poll("j1") == Control(stop=frozenset({"a", "x"}), add=(lora(7),))
    assert relay.poll("j1") == Control()  # delivered once
    relay.abort("j2")
    assert relay.poll("j2").abort is True
    relay.post_results({"a": {"status": "stopped"}})
    assert relay.config_view("a")["result"] == {"status": "stopped"}
