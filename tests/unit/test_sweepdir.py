"""The sweep directory: atomic creation, plan history, parquet tables, torn decision lines."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from plora.config import ConfigError
from plora.sweepdir.schema import SCHEMA_VERSION
from plora.sweepdir.store import SweepStore, check_out_dir, create_sweep_dir


def test_create_sweep_dir_is_atomic(tmp_path) -> None:
    out = tmp_path / "sweep"
    with pytest.raises(RuntimeError), create_sweep_dir(out) as store:
        store.write_state({"x": 1})
        assert store.root != out and store.state_json.is_file()
        raise RuntimeError("planner failed")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with create_sweep_dir(out) as store:
        store.write_state({"x": 2})
    state = json.loads((out / "state.json").read_text())
    assert store.root == out and state == {"x": 2, "sweepdir_version": SCHEMA_VERSION}
    assert [p.name for p in tmp_path.iterdir()] == ["sweep"]


def test_plan_history_and_latest(tmp_path) -> None:
    store = SweepStore(tmp_path)
    assert store.write_plan({"jobs": [], "n": 0}) == 0
    assert store.write_plan({"jobs": [], "n": 1}) == 1
    assert store.read_plan() == {"jobs": [], "n": 1}
    assert json.loads((tmp_path / "plans" / "plan-000.json").read_text())["n"] == 0


def test_metrics_accumulate_across_flushes_and_reopen(tmp_path) -> None:
    store = SweepStore(tmp_path)
    rows = [
        {"config_id": "a", "job_id": "j1", "step": s, "loss": 1.0 / s, "time": float(s)}
        for s in (1, 2)
    ]
    store.append_metrics(rows[:1])
    store.flush_metrics()
    store.append_metrics(rows[1:])
    assert list(store.read_metrics()["step"]) == [1, 2]  # buffered rows are visible
    store.flush_metrics()
    again = SweepStore(tmp_path)  # a resumed driver sees the rows on disk and appends to them
    again.append_metrics([{"config_id": "b", "job_id": "j2", "step": 1, "loss": 0.5, "time": 3.0}])
    again.flush_metrics()
    df = pd.read_parquet(tmp_path / "metrics.parquet")
    assert list(df["config_id"]) == ["a", "a", "b"] and list(df["step"]) == [1, 2, 1]


def test_decisions_skip_a_torn_last_line(tmp_path) -> None:
    store = SweepStore(tmp_path)
    store.append_decision({"kind": "plan"})
    store.append_decision({"kind": "start_job"})
    with open(store.decisions_jsonl, "a") as f:
        f.write('{"kind": "job_d')  # driver killed mid-write
    assert [d["kind"] for d in store.read_decisions()] == ["plan", "start_job"]


def test_jobs_table_keeps_lists(tmp_path) -> None:
    store = SweepStore(tmp_path)
    store.write_jobs([{"job_id": "j1", "config_ids": ["a", "b"], "gpus": 1, "gpu_ids": [3],
                       "node": "n", "start": 0.0, "end": 1.0, "status": "done", "attempt": 0,
                       "strategy": None}])  # fmt: skip
    jobs = store.read_jobs()
    assert list(jobs.loc[0, "config_ids"]) == ["a", "b"] and list(jobs.loc[0, "gpu_ids"]) == [3]


def test_check_out_dir(tmp_path) -> None:
    assert check_out_dir(tmp_path / "new" / "deeper", resume=False) == tmp_path / "new" / "deeper"
    (tmp_path / "old").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        check_out_dir(tmp_path / "old", resume=False)
    with pytest.raises(ConfigError, match="no sweep to resume"):
        check_out_dir(tmp_path / "old", resume=True)
    (tmp_path / "old" / "state.json").write_text("{}")
    assert check_out_dir(tmp_path / "old", resume=True) == tmp_path / "old"
    with pytest.raises(ConfigError, match="not a plora sweep"):
        SweepStore(tmp_path / "new").read_state()


def test_a_newer_sweep_dir_is_refused(tmp_path) -> None:
    (tmp_path / "state.json").write_text(json.dumps({"sweepdir_version": SCHEMA_VERSION + 1}))
    with pytest.raises(ConfigError, match="newer than this plora"):
        SweepStore(tmp_path).read_state()


def test_the_schema_lists_a_configs_hparams_and_every_table() -> None:
    """The schema's dtypes are the ones a real sweep writes (the Ray quickstart test checks a
    fresh run); here: the schema is self-consistent and names every table once."""
    from plora.sweepdir import schema

    assert schema.RESULT_COLUMNS[: 1 + len(schema.HPARAM_COLUMNS)] == (
        "config_id",
        *schema.HPARAM_COLUMNS,
    )
    from plora.config import LoRAConfig

    cfg = LoRAConfig(rank=4, alpha=8, lr=1e-3, batch_size=2, max_steps=3)
    assert tuple(cfg.hparams()) == schema.HPARAM_COLUMNS
    assert set(schema.TABLES) == {"results.parquet", "metrics.parquet", "jobs.parquet"}


def test_a_copied_sweep_dir_names_its_own_adapters(tmp_path) -> None:
    """Issue 29: paths inside the sweep directory are stored relative to it and resolved on
    read, so ``plora status``, :func:`plora.analysis.load` and ``--resume`` on a copy name the
    copy's adapters, not those of the place where the sweep ran."""
    import shutil
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from runtime_fakes import finish, lora, make
    from test_sweep_cli import run, sweep_file

    from plora import analysis

    root = tmp_path / "ran" / "sweep"
    root.mkdir(parents=True)
    (root / "sweep.yaml").write_text(sweep_file(tmp_path).read_text())
    store = SweepStore(root)
    coord, _ = make([lora(0, rank=30), lora(1, rank=30)], gpus=2, store=store)
    for spec in coord.start():  # the worker reports the adapter where it wrote it: absolute
        finish(coord, spec)
    for cid, r in coord.results.items():
        r["adapter_path"] = str(root / "adapters" / cid)
    coord.persist()
    assert set(pd.read_parquet(root / "results.parquet")["adapter_path"]) == {
        "adapters/c00",
        "adapters/c01",
    }
    copy = tmp_path / "copied" / "sweep"
    shutil.copytree(root, copy)
    shutil.rmtree(tmp_path / "ran")

    status = run("status", str(copy))
    assert status.exit_code == 0, status.output
    assert str(copy / "adapters" / "c00") in status.output
    assert str(tmp_path / "ran") not in status.output
    paths = analysis.load(copy).results.set_index("config_id")["adapter_path"].to_dict()
    assert paths == {c: str(copy / "adapters" / c) for c in ("c00", "c01")}
    state = SweepStore(copy).read_state()  # what --resume continues from
    assert {c: r["adapter_path"] for c, r in state["results"].items()} == paths
    assert SweepStore(copy).read_results()["adapter_path"].tolist() == list(paths.values())


def test_results_and_jobs_are_written_again_only_when_their_rows_changed(tmp_path, monkeypatch):
    """Most persists are metric flushes that change neither table; a changed row (a nested
    value changed in place too) is written, and reads back as given."""
    import pandas as pd

    import plora.sweepdir.store as store_mod

    writes: list[str] = []
    real = store_mod._write_parquet
    monkeypatch.setattr(store_mod, "_write_parquet",
                        lambda path, df: (writes.append(path.name), real(path, df)))  # fmt: skip
    store = SweepStore(tmp_path)
    row = {"config_id": "c0", "status": "done", "eval_loss": 0.5, "tags": ["a"]}
    job = {"job_id": "j0", "attempt": 0, "start": 0.0}
    for _ in range(3):
        store.write_results([row])
        store.write_jobs([job])
    assert writes == ["results.parquet", "jobs.parquet"]
    row["tags"].append("b")  # changed in place: seen
    store.write_results([row])
    job["status"] = "done"
    store.write_jobs([job])
    assert writes[2:] == ["results.parquet", "jobs.parquet"]
    assert pd.read_parquet(tmp_path / "results.parquet")["tags"][0].tolist() == ["a", "b"]


def test_jobs_are_rewritten_amortized_and_whole_at_a_flush(tmp_path, monkeypatch):
    """``jobs.parquet`` as ``results.parquet``: rewritten once an eighth of its rows (job
    attempts) changed, in place or new, or at a flush; a retry (same job, next attempt) is a row
    of its own."""
    import plora.sweepdir.store as store_mod

    writes: list[int] = []
    real = store_mod._write_parquet
    monkeypatch.setattr(store_mod, "_write_parquet",
                        lambda path, df: (writes.append(len(df)), real(path, df)))  # fmt: skip
    store = SweepStore(tmp_path)
    rows = [{"job_id": f"j{i}", "attempt": 0, "status": "running", "config_ids": ["a"]}
            for i in range(16)]  # fmt: skip
    store.write_jobs(rows)
    assert writes == [16]
    rows[0]["status"] = "done"  # 1 of 16 changed in place: waits
    store.write_jobs(rows)
    assert writes == [16]
    rows.append({"job_id": "j0", "attempt": 1, "status": "running", "config_ids": ["a"]})
    rows[1]["status"] = "done"
    store.write_jobs(rows)  # 3 of 17: an eighth
    assert writes == [16, 17]
    rows[5]["config_ids"].append("b")
    store.write_jobs(rows)
    store.flush_results(force=False)  # not due
    assert writes == [16, 17]
    store.flush_results()
    store.flush_results()
    assert writes == [16, 17, 17]
    jobs = store.read_jobs().set_index(["job_id", "attempt"])
    assert list(jobs.loc[("j5", 0), "config_ids"]) == ["a", "b"]
    assert jobs.loc[("j0", 0), "status"] == "done" and jobs.loc[("j0", 1), "status"] == "running"
    assert list(store.read_jobs().columns) == list(store_mod.JOB_COLUMNS)


def test_results_are_rewritten_amortized_and_whole_at_a_flush(tmp_path, monkeypatch):
    """``results.parquet`` is rewritten once an eighth of its rows changed (or its last write
    went stale); the rows in between are in ``state.json`` at once, and a flush (the sweep's
    end) writes the table whole. A row changed in place, one gone and one new all count."""
    import plora.sweepdir.store as store_mod

    writes: list[int] = []
    real = store_mod._write_parquet
    monkeypatch.setattr(store_mod, "_write_parquet",
                        lambda path, df: (writes.append(len(df)), real(path, df)))  # fmt: skip
    store = SweepStore(tmp_path)
    rows = [{"config_id": f"c{i}", "status": "done", "tags": ["a"]} for i in range(16)]
    store.write_results(rows)
    assert writes == [16]
    rows[3]["tags"].append("b")  # 1 of 16 changed: the table waits
    store.write_results(rows)
    store.write_state({"results": {r["config_id"]: r for r in rows}})
    assert writes == [16]
    assert store.read_state()["results"]["c3"]["tags"] == ["a", "b"]
    rows.pop(0)  # 2 of 16: an eighth, written
    store.write_results(rows)
    assert writes == [16, 15]
    rows.append({"config_id": "c16", "status": "running", "tags": []})
    store.write_results(rows)
    store.write_results(rows)
    store.flush_results()
    store.flush_results()  # nothing changed since: not written again
    assert writes == [16, 15, 16]
    assert store.read_results().set_index("config_id").loc["c16", "status"] == "running"
    rows[0]["status"] = "failed"
    store.write_results(rows)
    store.flush_results(force=False)  # not due yet
    assert writes == [16, 15, 16]
    monkeypatch.setattr(store_mod, "RESULTS_STALE_S", 0.0)  # the last write is stale: written
    monkeypatch.setattr(store_mod, "RESULTS_STALE_FACTOR", 0)
    store.flush_results(force=False)
    assert writes == [16, 15, 16, 16]
    assert store.read_results().set_index("config_id").loc["c1", "status"] == "failed"
    rows[1]["status"] = "failed"
    store.write_results(rows)
    assert writes == [16, 15, 16, 16, 16]
