"""``metrics.parquet`` as a directory of parts: appending writes the new rows, not the table
(issue 44: a million-row table rewritten at every flush made a sweep's writes quadratic), and
the coordinator writes its tables once per batch of events."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from runtime_fakes import lora, make

from plora.sweepdir import parts
from plora.sweepdir.parts import FANOUT, MAX_PARTS, PartTable, read_table
from plora.sweepdir.reader import read_metrics
from plora.sweepdir.store import SweepStore


def _batch(i: int, n: int) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "config_id": [f"c{i}"] * n,
            "step": range(n),
            "loss": [float(i)] * n,
            "time": [float(i)] * n,
        }
    )


@pytest.fixture
def written(monkeypatch):
    """Rows written to part files, per append (a merge's rows count for the append that made
    it)."""
    log: list[int] = []
    write = PartTable._write

    def counting(self, df, first, last):
        log[-1] += len(df)
        write(self, df, first, last)

    monkeypatch.setattr(PartTable, "_write", counting)
    return log


def test_a_row_is_written_a_logarithmic_number_of_times(tmp_path, written) -> None:
    """512 appends of 100 rows: after k appends the part files have been written
    (2 + log_8 k) x the rows so far at most -- 5 x at k = 512, where rewriting the table at
    every append writes each row k / 2 = 256 times on average -- and the table reads back every
    row in order."""
    table = PartTable(tmp_path / "m.parquet", ("config_id", "step", "loss", "time"), dedupe=None)
    for i in range(512):
        written.append(0)
        table.append(_batch(i, 100))
        k = i + 1
        assert sum(written) <= (2 + math.log(k, FANOUT)) * 100 * k
    total = 512 * 100
    assert len(parts._listed(tmp_path / "m.parquet")) <= MAX_PARTS
    df = read_table(tmp_path / "m.parquet", ())
    assert len(df) == total and df["loss"].tolist() == [float(i) for i in range(512) for _ in range(100)]  # fmt: skip
    assert len(pd.read_parquet(tmp_path / "m.parquet")) == total  # pandas reads the directory


def test_an_append_leaves_the_written_parts_alone(tmp_path) -> None:
    """Between merges an append adds a file and touches none of the others."""
    table = PartTable(tmp_path / "m.parquet", ("config_id",), dedupe=None)
    for i in range(FANOUT**2):  # two full tiers: one part of FANOUT**2 batches' rows
        table.append(_batch(i, 10))
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "m.parquet").iterdir()}
    table.append(_batch(999, 10))
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "m.parquet").iterdir()}
    assert len(before) == 1 and len(after) == 2
    assert all(after[name] == t for name, t in before.items())


def test_a_merge_keeps_the_last_row_of_a_step(tmp_path) -> None:
    table = PartTable(tmp_path / "m.parquet", ("config_id",), dedupe=["config_id", "step"])
    for i in range(FANOUT):  # the same (config, step) rows again: a job trained them again
        batch = _batch(0, 5)
        batch["loss"] = float(i)
        table.append(batch)
    df = read_table(tmp_path / "m.parquet", ())
    assert len(df) == 5 and set(df["loss"]) == {float(FANOUT - 1)}


def test_a_single_file_table_is_read_and_appended_to(tmp_path) -> None:
    """A sweep directory of schema 1 (one metrics.parquet file): read as it is; a resumed
    sweep's store turns it into parts, its rows first."""
    old = pd.DataFrame([{"config_id": "a", "job_id": "j1", "step": 1, "loss": 1.0, "time": 1.0}])
    old.to_parquet(tmp_path / "metrics.parquet")
    assert read_metrics(tmp_path)["step"].tolist() == [1]
    store = SweepStore(tmp_path)
    store.append_metrics([{"config_id": "a", "job_id": "j1", "step": 2, "loss": None, "time": 2.0}])
    store.flush_metrics()
    assert (tmp_path / "metrics.parquet").is_dir()
    df = read_metrics(tmp_path)
    assert df["step"].tolist() == [1, 2] and df["loss"].isna().tolist() == [False, True]


def test_events_of_a_batch_write_the_tables_once(tmp_path, monkeypatch) -> None:
    """Each stop writes results and state.json at once, except inside ``batched_writes``:
    there once, when the block ends (the driver posts the stops to the workers after it)."""
    store = SweepStore(tmp_path)
    coord, _ = make([lora(i) for i in range(6)], gpus=1, store=store)
    coord.start()
    writes: list[int] = []
    state = SweepStore.write_state
    monkeypatch.setattr(SweepStore, "write_state",
                        lambda self, s: (writes.append(1), state(self, s))[1])  # fmt: skip
    queued = coord.queued_ids()
    coord.stop_config(queued[0])
    assert len(writes) == 1
    with coord.batched_writes():
        for cid in queued[1:4]:
            coord.stop_config(cid)
        assert len(writes) == 1
    assert len(writes) == 2
    saved = SweepStore(tmp_path).read_state()
    assert {c for c, r in saved["results"].items() if r["status"] == "stopped"} >= set(queued[:4])
