"""``decisions.jsonl`` parsed once per version of the file in a process, and plan files numbered
by a counter."""

from __future__ import annotations

import json

from plora.sweepdir import decisions as decision_log
from plora.sweepdir import store as store_module
from plora.sweepdir.decisions import read_records
from plora.sweepdir.store import SweepStore


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
