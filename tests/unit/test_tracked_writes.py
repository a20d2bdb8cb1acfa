"""The sweep directory's writes read only what changed (:mod:`plora.sweepdir.tracked`).

The reference is the full comparison the writers fall back to: every state written from the
tracked books must read back as the coordinator's whole state at that moment, and the tracked
containers must name exactly the keys changed.
"""

from __future__ import annotations

import copy
import json
import pickle
import random

import pytest
from runtime_fakes import lora, make, outcome, report

from plora.config.asha_options import EarlyStopConfig
from plora.runtime.records import FailureKind
from plora.sweepdir.state_parts import StateParts, assemble
from plora.sweepdir.store import SweepStore
from plora.sweepdir.tracked import MappedView, Tracked, TrackedDict, TrackedList
from plora.tune.adapter_stopper import AdapterEarlyStopper


def test_a_tracked_dict_names_the_keys_changed_since_a_version() -> None:
    d: TrackedDict[str, int] = TrackedDict({"a": 1, "b": 2})
    v0 = d.version
    d["c"] = 3
    d["a"] = 10
    v1 = d.version
    d.pop("b")
    d.setdefault("c", 99)  # present: no change
    d.setdefault("e", 5)
    d.update({"f": 6}, g=7)
    d |= {"a": 11}
    assert d.changed_since(v0) == ["c", "b", "e", "f", "g", "a"]  # each once, latest last
    assert d.changed_since(v1) == ["b", "e", "f", "g", "a"]
    assert d.changed_since(d.version) == []
    d.touch("c")
    assert d.changed_since(v1)[-1] == "c"
    del d["f"]
    d.clear()
    assert set(d.changed_since(v0)) == {"a", "b", "c", "e", "f", "g"} and d == {}
    assert d.changed_since(d.version + 1) is None  # a version it never had: unknown


def test_a_tracked_list_names_indices_and_says_when_it_cannot() -> None:
    items: TrackedList[int] = TrackedList([0, 1, 2])
    v0 = items.version
    items.append(3)
    items[1] = 10
    items.extend([4, 5])
    items += [6]
    items.touch(-1)
    assert items.changed_since(v0) == [3, 1, 4, 5, 6]
    v1 = items.version
    items.insert(0, -1)  # moves every index: unknown from here
    assert items.changed_since(v0) is None and items.changed_since(v1) is None
    v2 = items.version
    items[0] = 7
    assert items.changed_since(v2) == [0]


@pytest.mark.parametrize("kind", [TrackedDict, TrackedList])
def test_copies_are_plain_containers_with_the_items(kind) -> None:
    c = kind({"a": 1}) if kind is TrackedDict else kind([1, 2])
    for other in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c), copy.copy(c)):
        assert other == c and type(other) is kind and other.version == 0
    assert json.loads(json.dumps(c)) == c


def _random_state(rng: random.Random, n: int) -> tuple[dict, dict]:
    """Books like the coordinator's: tracked sections and their plain twins."""
    status = TrackedDict({f"c{i}": "queued" for i in range(n)})
    results = TrackedDict({f"c{i}": {"loss": float(i)} for i in range(n // 2)})
    rows = TrackedList({"job_id": f"j{i}", "steps": [i]} for i in range(n))
    return {"status": status, "results": results, "job_rows": rows}, {}


def _mutate(rng: random.Random, books: dict) -> None:
    status, results, rows = books["status"], books["results"], books["job_rows"]
    for _ in range(rng.randint(0, 6)):
        op = rng.randrange(7)
        key = f"c{rng.randrange(40)}"
        if op == 0:
            status[key] = rng.choice(["running", "done", "stopped"])
        elif op == 1:
            status.pop(key, None)
        elif op == 2:
            results[key] = {"loss": rng.random()}
        elif op == 3 and rows:
            i = rng.randrange(len(rows))
            rows[i]["steps"].append(rng.randrange(9))  # in place, told
            rows.touch(i)
        elif op == 4:
            rows.append({"job_id": f"j{rng.randrange(99)}", "steps": []})
        elif op == 5 and rows and rng.random() < 0.2:
            rows.pop()  # shortened: the writer compares the list in full
        else:
            status[key] = status.get(key, "queued")  # the same value again


def test_state_written_from_tracked_books_reads_back_whole(tmp_path) -> None:
    """Random changes to tracked sections, a write after each burst: the log read back is the
    state (the full comparison's answer), and a write appends only records that changed."""
    rng = random.Random(7)
    books, _ = _random_state(rng, 30)
    parts = StateParts(tmp_path)
    log_bytes = []
    for _turn in range(60):
        _mutate(rng, books)
        state = {"version": 1, **books}
        head = parts.split(state)
        parts.written()
        log_bytes.append(head["parts"]["bytes"])
        assert assemble(tmp_path, head) == json.loads(json.dumps(state))
    quiet = parts.split({"version": 1, **books})  # nothing changed: nothing appended
    assert quiet["parts"]["bytes"] == log_bytes[-1]


def test_an_untold_change_in_place_is_what_the_tracker_misses(tmp_path) -> None:
    """The writer trusts its tracker (so the test above is not vacuous): a row changed in place
    without ``touch`` is not written; a plain list of the same rows is compared in full."""
    rows = TrackedList([{"steps": [1]}])
    parts = StateParts(tmp_path)
    parts.split({"job_rows": rows})
    rows[0]["steps"].append(2)  # not touched
    head = parts.split({"job_rows": rows})
    assert assemble(tmp_path, head)["job_rows"] == [{"steps": [1]}]
    head = parts.split({"job_rows": list(rows)})  # another container: compared in full
    assert assemble(tmp_path, head)["job_rows"] == [{"steps": [1, 2]}]


def test_a_mapped_view_converts_only_what_is_read() -> None:
    seen = []
    source = TrackedDict({"a": 1, "b": 2})
    view = MappedView(source, lambda k, v: seen.append(k) or v * 10)
    v0 = view.version
    source["b"] = 3
    assert isinstance(view, Tracked) and view.tracker is source
    assert [view[k] for k in view.changed_since(v0)] == [30] and seen == ["b"]
    assert dict(view) == {"a": 10, "b": 30} and len(view) == 2 and "a" in view


def test_the_stoppers_live_state_is_its_saved_state() -> None:
    """ASHA's rungs kept as they change (``live_state``) equal those rebuilt from ASHA
    (``get_state``) after every step, and after a restore."""
    rng = random.Random(3)
    stopper = AdapterEarlyStopper(EarlyStopConfig(grace_steps=2, reduction_factor=2))
    ids = [f"c{i}" for i in range(12)]
    for step in range(1, 40):
        for cid in rng.sample(ids, 5):
            stopper.on_step(cid, step, rng.random())
        assert json.loads(json.dumps(stopper.live_state())) == stopper.get_state()
    assert stopper.stopped and len(stopper.live_state()["asha"]["records"]) > len(ids)
    again = AdapterEarlyStopper(EarlyStopConfig(grace_steps=2, reduction_factor=2))
    again.set_state(json.loads(json.dumps(stopper.get_state())))
    assert again.live_state() == stopper.live_state()


def test_every_state_the_coordinator_writes_reads_back_as_its_whole_state(tmp_path) -> None:
    """The coordinator with early stopping, stops, a died job retried and refills: after each
    of its writes, ``state.json`` read back equals ``get_state()`` built in full, and
    ``results.parquet`` / ``jobs.parquet`` at the end hold every row."""
    rng = random.Random(11)
    store = SweepStore(tmp_path)
    checked = []
    write_state = store.write_state

    def checking(state) -> None:
        write_state(state)
        whole = json.loads(json.dumps(coord.state.get_state(), default=str))
        back = json.loads(json.dumps(store.read_state(), default=str))
        whole["elapsed_s"] = back["elapsed_s"] = 0.0
        assert back.pop("sweepdir_version") >= 4 and back == whole
        checked.append(1)

    store.write_state = checking  # type: ignore[method-assign]
    configs = [lora(i, rank=8 * (1 + i % 3), steps=12) for i in range(14)]
    stopper = AdapterEarlyStopper(EarlyStopConfig(grace_steps=2, reduction_factor=2))
    coord, clock = make(configs, gpus=2, store=store, early_stop=stopper)
    queue = list(coord.start())
    died = False
    while queue:
        spec = queue.pop(0)
        clock.t += 1.0
        coord.on_job_started(spec.job_id, node="n0")
        live, stopped = list(spec.config_ids), {}
        for step in range(1, 13):
            with coord.batched_writes():
                ms = [{"config_id": c, "step": step, "loss": rng.random() + 1 / step} for c in live]
                queue += coord.on_reports(spec.job_id, [report(*ms)])
                ctl = coord.poll(spec.job_id)
            stopped |= {c: step for c in live if c in ctl.stop or c in ctl.pause}
            live = [c for c in live if c not in stopped] + [c.config_id for c in ctl.add]
            clock.t += 0.1
        if not died:
            died = True
            queue += coord.on_job_failed(spec.job_id, FailureKind.DIED, "node lost")
            continue
        if live and rng.random() < 0.3:
            coord.stop_config(live[0], reason="test")
        results = {c: {"status": "done", "steps": 12, "eval_loss": rng.random(),
                       "adapter_path": str(tmp_path / "adapters" / c)} for c in live}  # fmt: skip
        results |= {c: {"status": "stopped", "steps": s} for c, s in stopped.items()}
        queue += coord.on_job_finished(spec.job_id, outcome(spec.job_id, results))
    assert coord.is_done() and len(checked) > 20
    assert sorted(store.read_results()["config_id"]) == sorted(c.config_id for c in configs)
    jobs = store.read_jobs()
    assert len(jobs) == len(coord.job_rows) and set(jobs["status"]) >= {"done", "died"}
