"""``decisions.jsonl`` at layout version 5: a re-plan's decision names its plan file instead of
listing it, the readers give the same answers for a directory written before (decisions that
list their jobs), the log is parsed once per version, and plan files are numbered by a counter."""

from __future__ import annotations

import json
import shutil

import pytest
from runtime_fakes import lora, make, run_to_end

from plora.analysis.load import load
from plora.analysis.plan_check import plan_check
from plora.runtime.progress import status_text
from plora.sweepdir import decisions as decision_log
from plora.sweepdir import store as store_module
from plora.sweepdir.decisions import decision_jobs, read_records
from plora.sweepdir.store import SweepStore

#: What a decision shows of a planned job (``scheduling._job_entry``), which the plan file has too.
JOB_KEYS = ("job_id", "config_ids", "gpus", "micro_batches", "max_rows")
PLANS = ("plan", "replan")


def _sweep(store: SweepStore | None) -> list[dict]:
    """A whole sweep of 8 configs on 2 GPUs, one config a job (several re-plans); its decision
    records as the log holds them."""
    coord, clock = make([lora(i, rank=64, steps=5 + i) for i in range(8)], gpus=2, store=store)
    run_to_end(coord, clock, coord.start())
    assert coord.is_done()
    if store is not None:
        coord.persist()
    return [d.to_json_dict() for d in coord.decisions]


@pytest.fixture
def new_and_old(tmp_path):
    """The sweep's directory as this plora writes it, and a copy whose log lists every plan's
    jobs and queued configs as directories of layout version 4 and before do (the same sweep
    run without a sweep directory lists them)."""
    new = tmp_path / "new"
    new.mkdir()
    _sweep(SweepStore(new))
    old = tmp_path / "old"
    shutil.copytree(new, old)
    listed = _sweep(None)
    for d in listed:
        for key in ("plan_file", "num_configs", "num_jobs"):
            d["inputs"].pop(key, None)
    (old / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in listed))
    return new, old


def test_a_replan_names_its_plan_file_and_lists_no_jobs(tmp_path) -> None:
    store = SweepStore(tmp_path)
    records = _sweep(store)
    assert records == store.read_decisions()
    plans = [d for d in records if d["kind"] in PLANS]
    assert [d["kind"] for d in plans[:2]] == ["plan", "replan"]
    for i, d in enumerate(plans):
        inputs = d["inputs"]
        assert inputs["plan_index"] == i and inputs["plan_file"] == f"plans/plan-{i:03d}.json"
        doc = json.loads((tmp_path / inputs["plan_file"]).read_text())
        assert doc["time_s"] == d["time_s"] and doc["kind"] == d["kind"]
        assert inputs["num_jobs"] == len(doc["jobs"])
        assert inputs["num_configs"] >= sum(len(j["config_ids"]) for j in doc["jobs"]) > 0
        if d["kind"] == "replan":
            assert "jobs" not in inputs and d["config_ids"] == []
        else:  # the first plan lists them still: the plan check reads its jobs
            assert len(inputs["jobs"]) == inputs["num_jobs"]
            assert len(d["config_ids"]) == inputs["num_configs"] == 8
    line = max(len(x) for x in store.decisions_jsonl.read_text().splitlines()[1:])
    first = len(store.decisions_jsonl.read_text().splitlines()[0])
    assert line < 2_000, (line, first)  # no re-plan repeats its queue


def test_readers_give_the_same_answers_for_old_and_new_directories(new_and_old) -> None:
    new, old = new_and_old
    listed = read_records(old / "decisions.jsonl")
    named = read_records(new / "decisions.jsonl")
    assert [d["kind"] for d in listed] == [d["kind"] for d in named]
    assert any("jobs" in d["inputs"] for d in listed if d["kind"] == "replan")
    pairs = [(a, b) for a, b in zip(listed, named, strict=True) if a["kind"] in PLANS]
    assert len(pairs) >= 3
    for a, b in pairs:
        from_log, from_file = decision_jobs(old, a), decision_jobs(new, b)
        assert [{k: j[k] for k in JOB_KEYS} for j in from_file] == from_log
    assert status_text(str(old)).replace(str(old), "DIR") == status_text(str(new)).replace(
        str(new), "DIR"
    )
    assert plan_check(old) == plan_check(new)
    kinds = [list(load(p).decisions["kind"]) for p in (old, new)]
    assert kinds[0] == kinds[1] and "replan" in kinds[0]


@pytest.mark.parametrize("listed", [True, False])
def test_the_plan_check_finds_the_first_plan_jobs_listed_or_in_its_file(tmp_path, listed) -> None:
    """Only the first plan's job (j0001, not a later plan's j0002) counts, whether the plan
    decision lists it or names the plan file that holds it."""
    store = SweepStore(tmp_path)
    plan = {"jobs": [{"job_id": "j0001", "config_ids": ["c0"], "gpus": 1}], "makespan_s": 8.0}
    index = store.write_plan(plan)
    shown = {"jobs": plan["jobs"]} if listed else {"plan_file": f"plans/plan-{index:03d}.json"}
    terms = {"train_s": 4.0, "eval_s": 1.0, "checkpoint_s": 0.5}
    for kind, t, job, inputs in [
        ("plan", 1.0, None, {**shown, "makespan_s": 8.0}),
        ("start_job", 1.0, "j0001", {"planned_terms": terms}),
        ("start_job", 2.0, "j0002", {"planned_terms": terms}),  # a later plan's job
        ("sweep_done", 11.0, None, {}),
    ]:
        store.append_decision({"kind": kind, "time_s": t, "job_id": job, "config_ids": [],
                               "inputs": inputs})  # fmt: skip
    store.write_jobs([{"job_id": j, "train_s": s, "eval_s": 0.5, "checkpoint_s": 0.25}
                      for j, s in (("j0001", 5.0), ("j0002", 9.0))])  # fmt: skip
    check = plan_check(tmp_path)
    assert check.planned_s == 8.0 and check.measured_s == 10.0
    assert check.terms == {"train_s": (4.0, 5.0), "eval_s": (1.0, 0.5), "checkpoint_s": (0.5, 0.25)}


def test_a_decision_without_jobs_or_a_plan_file_is_refused(tmp_path) -> None:
    record = {"kind": "refit", "time_s": 1.0, "config_ids": [], "inputs": {"cost": {}}}
    with pytest.raises(ValueError, match="lists no jobs and names no plan file"):
        decision_jobs(tmp_path, record)
    gone = {"kind": "replan", "time_s": 1.0, "inputs": {"plan_file": "plans/plan-004.json"}}
    with pytest.raises(FileNotFoundError):
        decision_jobs(tmp_path, gone)


def test_the_log_is_parsed_once_per_version_and_again_when_it_grows(tmp_path, monkeypatch) -> None:
    parsed = []
    parse = decision_log._parse
    monkeypatch.setattr(
        decision_log, "_parse", lambda data: parsed.append(len(data)) or parse(data)
    )
    store = SweepStore(tmp_path)
    store.append_decision({"kind": "ask", "time_s": 0.0, "config_ids": ["c0"], "inputs": {}})
    first = store.read_decisions()
    again = read_records(store.decisions_jsonl)  # the status text and the plan check: one parse
    assert again == first and again[0] is first[0] and len(parsed) == 1
    again.append({"kind": "not in the file"})  # a caller's list is its own
    assert read_records(store.decisions_jsonl) == first and len(parsed) == 1
    store.append_decision({"kind": "plan", "time_s": 1.0, "config_ids": [], "inputs": {}})
    with store.decisions_jsonl.open("a") as f:
        f.write('{"kind": "torn')  # the driver killed mid-write
    grown = read_records(store.decisions_jsonl)
    assert [d["kind"] for d in grown] == ["ask", "plan"] and len(parsed) == 2


def test_plan_files_are_numbered_from_the_directory_once(tmp_path, monkeypatch) -> None:
    first = SweepStore(tmp_path)
    assert [first.write_plan({"n": n}) for n in range(3)] == [0, 1, 2]
    (tmp_path / "plans" / "plan-001.json").unlink()  # a gap: the next is after the highest
    looks = []
    count = store_module._next_plan_index
    monkeypatch.setattr(store_module, "_next_plan_index", lambda d: looks.append(d) or count(d))
    resumed = SweepStore(tmp_path)  # --resume: a new store continues the numbering
    assert [resumed.write_plan({"n": n}) for n in (3, 4)] == [3, 4] and len(looks) == 1
    assert json.loads((tmp_path / "plans" / "plan-004.json").read_text()) == {"n": 4}
    assert resumed.read_plan() == {"n": 4}
    assert json.loads((tmp_path / "plans" / "plan-002.json").read_text()) == {"n": 2}
