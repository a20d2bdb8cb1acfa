"""``state.json`` in parts (issue 44, item 3): the growing sections as append-only logs.

Each write must read back as the whole state it was given (the reference: the state itself),
append only what changed, and leave a directory a reader can trust at any point.
"""

from __future__ import annotations

import copy
import json
import random

import pytest

from plora.config import ConfigError
from plora.sweepdir import reader
from plora.sweepdir.schema import SCHEMA_VERSION
from plora.sweepdir.state_parts import COMPACT_FACTOR, PARTS_DIR
from plora.sweepdir.store import SweepStore


def a_state(n: int, rng: random.Random) -> dict:
    return {
        "version": 1,
        "elapsed_s": rng.random(),
        "configs": [{"config_id": f"c{i}", "rank": 8 * (i % 3 + 1)} for i in range(n)],
        "status": {f"c{i}": rng.choice(["queued", "running", "done"]) for i in range(n)},
        "results": {f"c{i}": {"loss": rng.random(), "ids": (i, i + 1)} for i in range(0, n, 2)},
        "job_rows": [{"job_id": f"j{i}", "attempt": 0} for i in range(n // 3)],
        "measurements": {"steps": [{"s": i} for i in range(n // 2)], "calibrated": True},
        "progress": {f"c{i}": rng.randrange(100) for i in range(n)},
        "early_stop": {
            "known": {f"c{i}": 1 for i in range(n)},
            "stopped": {f"c{i}": 10 for i in range(0, n, 5)},
            "asha": {
                "kind": "asha",
                "num_stopped": n // 5,
                "milestones": [[40, 20, 10]],
                "trial_bracket": {f"c{i}": 0 for i in range(n)},
                "records": {json.dumps([0, 2, f"c{i}"]): rng.random() for i in range(n)},
            },
        },
    }


def read_back(store: SweepStore) -> dict:
    state = store.read_state()
    state.pop("sweepdir_version")
    return state


def as_json(state: dict) -> dict:
    return json.loads(json.dumps(state, default=str))


def test_every_write_reads_back_whole_and_appends_only_what_changed(tmp_path) -> None:
    rng = random.Random(0)
    store = SweepStore(tmp_path)
    state = a_state(30, rng)
    appended = 0
    for turn in range(60):
        store.write_state(state)
        assert read_back(store) == as_json(state), turn
        assert reader.read_state(tmp_path) == {**as_json(state), "sweepdir_version": SCHEMA_VERSION}
        (log,) = (tmp_path / PARTS_DIR).iterdir()
        size = log.stat().st_size
        state = copy.deepcopy(state)
        # one result changes, a config and a step measurement arrive, a result may go
        state["results"][rng.choice(sorted(state["results"]))]["loss"] = rng.random()
        n = len(state["configs"])
        state["configs"].append({"config_id": f"c{n}", "rank": 8})
        state["measurements"]["steps"].append({"s": n})
        state["status"][f"c{n}"] = "queued"
        state["progress"][rng.choice(sorted(state["progress"]))] += 1
        state["early_stop"]["asha"]["records"][json.dumps([0, 1, f"c{n - 1}"])] = rng.random()
        if turn % 7 == 3:
            state["results"].pop(next(iter(state["results"])))
        store.write_state(state)
        assert read_back(store) == as_json(state), turn
        if log.exists():  # not compacted: it grew by one line per change alone
            appended += 1
            with open(log, "rb") as f:
                f.seek(size)
                lines = [json.loads(line) for line in f.read().decode().splitlines()]
            assert sorted(line[0] for line in lines) == sorted(
                ["configs", "measurements.steps", "status", "progress", "results",
                 "early_stop.asha.records"] + (["results"] if turn % 7 == 3 else [])
            )  # fmt: skip
    assert appended > 50  # compactions are rare
    head = json.loads((tmp_path / "state.json").read_text())  # what stays in the head: small
    assert {"status", "progress", "configs", "results"}.isdisjoint(head)
    assert set(head["early_stop"]) == {"asha"} and "records" not in head["early_stop"]["asha"]


def test_a_change_made_in_place_is_never_missed(tmp_path) -> None:
    """The same state object, changed in place between writes (a nested value, a key deleted, a
    list cut short, a record replaced by an equal one): each write reads back as the state."""
    rng = random.Random(2)
    store = SweepStore(tmp_path)
    state = a_state(40, rng)
    changes = [
        lambda s: s["results"]["c4"].update(loss=0.25),
        lambda s: s["configs"][7].update(rank=64),
        lambda s: s["configs"][3].setdefault("targets", []).append("q_proj"),
        lambda s: s["configs"][3]["targets"].append("v_proj"),
        lambda s: s["status"].pop("c9"),
        lambda s: s["progress"].update(c1=s["progress"]["c1"] + 1, c2=0),
        lambda s: s["job_rows"].pop(),
        lambda s: s["job_rows"].pop(0),
        lambda s: s["measurements"]["steps"].clear(),
        lambda s: s["measurements"]["steps"].append({"s": 0}),
        lambda s: s["results"].update(c6=dict(s["results"]["c6"])),  # equal: nothing to write
        lambda s: s["early_stop"]["asha"]["records"].clear(),
        lambda s: s["early_stop"]["stopped"].update(c1=11),
        lambda s: s["results"].pop("c0"),
        lambda s: s["results"].update(c0={"loss": 0.5}),  # back: written again
    ]
    store.write_state(state)
    for i, change in enumerate(changes):
        change(state)
        store.write_state(state)
        assert read_back(store) == as_json(state), i
        log = store._state_parts._log
        assert log is not None and log.live_bytes == sum(sum(b.values()) for b in log.live.values())


def test_logs_are_compacted_and_replaced_logs_deleted(tmp_path) -> None:
    """Churn on one record compacts its log (bounded size); only the current logs remain."""
    store = SweepStore(tmp_path)
    state = a_state(10, random.Random(1))
    for i in range(1500):
        state["results"]["c0"] = {"loss": float(i), "pad": "x" * 40}
        store.write_state(state)
    (log,) = (tmp_path / PARTS_DIR).iterdir()
    live = len(json.dumps(state))
    assert log.stat().st_size <= COMPACT_FACTOR * live * 2 + (1 << 16) + 200
    assert read_back(store) == as_json(state)


def test_a_killed_writer_leaves_the_last_head_readable(tmp_path) -> None:
    """Lines appended after the last head (a torn one too) are not read; a new writer on the
    directory starts fresh logs and removes the old ones."""
    store = SweepStore(tmp_path)
    state = a_state(12, random.Random(2))
    store.write_state(state)
    for log in (tmp_path / PARTS_DIR).iterdir():
        with open(log, "a") as f:
            f.write('["c99", {"loss": 1.0}]\n["c1", {"lo')
    assert read_back(store) == as_json(state)
    old = set((tmp_path / PARTS_DIR).iterdir())
    again = SweepStore(tmp_path)
    state["status"]["c0"] = "done"
    again.write_state(state)
    assert read_back(again) == as_json(state)
    assert not old & set((tmp_path / PARTS_DIR).iterdir())


def test_a_whole_state_json_of_before_is_read_as_it_is(tmp_path) -> None:
    state = a_state(5, random.Random(3))
    (tmp_path / "state.json").write_text(json.dumps({**state, "sweepdir_version": 2}))
    assert read_back(SweepStore(tmp_path)) == as_json(state)


def test_a_directory_of_layout_version_3_reads_as_written(tmp_path) -> None:
    """Version 3 kept a log per section, its lines ``[key, value]``."""
    state = a_state(6, random.Random(7))
    head, parts = copy.deepcopy(state), {}
    (tmp_path / PARTS_DIR).mkdir()
    for name, value in [("configs", head.pop("configs")), ("results", head.pop("results"))]:
        items = enumerate(value) if isinstance(value, list) else value.items()
        text = "".join(json.dumps([k, v]) + "\n" for k, v in items) + '["gone", 1]\n["gone"]\n'
        (tmp_path / PARTS_DIR / f"{name}.ab12.jsonl").write_text(text)
        parts[name] = {"file": f"{PARTS_DIR}/{name}.ab12.jsonl", "bytes": len(text.encode())}
        if isinstance(value, list):
            parts[name]["count"] = len(value)
    (tmp_path / "state.json").write_text(
        json.dumps({**head, "parts": parts, "sweepdir_version": 3})
    )
    assert read_back(SweepStore(tmp_path)) == as_json(state)
    some = reader.read_state(tmp_path, sections=("results",))
    assert some["results"] == as_json(state)["results"] and "configs" not in some


def test_a_reader_may_take_only_some_sections(tmp_path) -> None:
    """``plora status`` reads only ``status``: the same values as the whole state's, with the
    head's own keys, and no other logged section (a nested one is kept beside its head keys)."""
    rng = random.Random(8)
    state = a_state(12, rng)
    store = SweepStore(tmp_path)
    for turn in range(4):  # the log holds changes and a removal of each section
        state = copy.deepcopy(state)
        state["status"][f"c{turn}"] = "done"
        state["status"].pop(f"c{turn + 6}")
        state["early_stop"]["known"].pop(f"c{turn}")
        store.write_state(state)
    whole = reader.read_state(tmp_path)
    some = reader.read_state(tmp_path, sections=("status", "early_stop.known"))
    assert some["status"] == whole["status"] == as_json(state)["status"]
    assert set(some["early_stop"]) == {"known", "asha"}
    assert some["early_stop"]["known"] == whole["early_stop"]["known"]
    assert set(some["early_stop"]["asha"]) == {"kind", "num_stopped", "milestones"}  # head keys
    assert {"configs", "results", "progress", "job_rows"}.isdisjoint(some)
    assert some["elapsed_s"] == whole["elapsed_s"] and "steps" not in some["measurements"]


def test_a_short_log_is_a_damaged_directory(tmp_path) -> None:
    store = SweepStore(tmp_path)
    store.write_state(a_state(8, random.Random(4)))
    log = next((tmp_path / PARTS_DIR).glob("state.*"))
    log.write_text(log.read_text()[:10])
    with pytest.raises(ConfigError, match="damaged"):
        SweepStore(tmp_path).read_state()


def test_a_new_directory_renamed_into_place_keeps_its_logs(tmp_path) -> None:
    """``create_sweep_dir`` writes the first state in a hidden temporary directory and renames
    it: the logs move with it and later writes append there."""
    from plora.sweepdir.store import create_sweep_dir

    state = a_state(6, random.Random(5))
    with create_sweep_dir(tmp_path / "sweep") as store:
        store.write_state(state)
    state["configs"].append({"config_id": "c6", "rank": 8})
    store.write_state(state)
    assert read_back(SweepStore(tmp_path / "sweep")) == as_json(state)


def test_a_reader_whose_head_went_stale_reads_the_new_one(tmp_path) -> None:
    """A writer's compaction deletes the log the head read just before named: the reader reads
    the head again (``plora status`` on a live sweep), and a damaged log still raises."""
    from plora.sweepdir.state_parts import assemble_live

    store = SweepStore(tmp_path)
    state = a_state(10, random.Random(6))
    store.write_state(state)
    stale = json.loads((tmp_path / "state.json").read_text())
    for i in range(1500):  # churn until the results log is written anew and the old deleted
        state["results"]["c0"] = {"loss": float(i), "pad": "x" * 40}
        store.write_state(state)
    current = json.loads((tmp_path / "state.json").read_text())
    assert stale["parts"]["file"] != current["parts"]["file"]
    whole = assemble_live(
        tmp_path, stale, lambda: json.loads((tmp_path / "state.json").read_text())
    )
    assert {**whole, "sweepdir_version": 0} == {**as_json(state), "sweepdir_version": 0}
    with pytest.raises(ValueError, match="state log"):
        assemble_live(tmp_path, stale, lambda: stale)
