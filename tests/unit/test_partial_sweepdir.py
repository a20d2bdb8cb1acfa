"""Readers on an interrupted or partial sweep directory (issue 14, item 4): ``plora status``,
``plora report`` and :func:`plora.analysis.load` show what there is and say what is missing or
damaged; ``report`` with nothing to report is one line and exit 2; an ``--out`` that cannot be
written is one line naming ``--out``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_sweep_cli import assert_one_error, run, sweep_file

from plora import analysis

sys.path.insert(0, str(Path(__file__).parent))


def _sweep_dir(tmp_path: Path, *, finish_one: bool) -> Path:
    """A sweep directory as the coordinator writes it: started, and one job done if asked."""
    from runtime_fakes import AffineCost, GreedyPlanner, lora, outcome, report

    from plora.runtime.coordinator import Coordinator
    from plora.sweepdir.store import SweepStore

    root = tmp_path / "sweep"
    root.mkdir()
    (root / "sweep.yaml").write_text(sweep_file(tmp_path).read_text())
    store = SweepStore(root)
    configs = [lora(i, rank=30) for i in range(3)]
    coord = Coordinator(
        cost=AffineCost(), num_gpus=2, configs=configs, planner=GreedyPlanner(), store=store
    )
    spec = coord.start()[0]
    if finish_one:
        for step in (1, 2):
            rows = [
                {"config_id": c.config_id, "step": step, "loss": 2.0 / step} for c in spec.configs
            ]
            coord.on_reports(spec.job_id, [report(*rows)])
        res = {c.config_id: {"status": "completed", "steps": 10, "eval_metric": 0.5, "eval_loss": 1.0}
               for c in spec.configs}  # fmt: skip
        coord.on_job_finished(spec.job_id, outcome(spec.job_id, res))
    store.flush_metrics()
    return root


def test_report_without_results_is_one_line_exit_2(tmp_path) -> None:
    root = _sweep_dir(tmp_path, finish_one=False)
    result = run("report", str(root))
    assert_one_error(result, "nothing to report yet", "queued or running", "plora status")
    assert not (root / "report.html").exists()


def _damage(root: Path, how: str) -> str:
    name, kind = how.split(":")
    if kind == "gone":
        (root / name).unlink()
        return f"{name} ("
    (root / name).write_text("{oops" if name.endswith(".json") else "not parquet")
    return f"{name} ("


@pytest.mark.parametrize(
    "how",
    ["results.parquet:gone", "jobs.parquet:gone", "state.json:gone", "state.json:damaged",
     "jobs.parquet:damaged", "plan.json:damaged", "results.parquet:damaged"],
)  # fmt: skip
def test_status_report_and_load_say_what_is_missing(tmp_path, how) -> None:
    root = _sweep_dir(tmp_path, finish_one=True)
    needle = _damage(root, how)
    status = run("status", str(root))
    assert status.exit_code == 0, status.output
    last = status.output.strip().splitlines()[-1]
    assert last.startswith("missing: ") and needle in last, status.output
    assert ("unreadable" in last) == how.endswith("damaged")
    if how.startswith("state.json"):  # the results table still gives the counts
        assert "done 1" in status.output
    report = run("report", str(root), "--out", str(tmp_path / "r.html"))
    assert report.exit_code == 0, report.output
    assert (tmp_path / "r.html").is_file()
    if not how.startswith("state.json"):  # the analysis (and report) does not read state.json
        res = analysis.load(root)
        assert needle.split(" ")[0] in res.missing and res.missing_note.startswith("missing: ")
        assert "note: " in report.output and needle in report.output
        assert "missing" in (tmp_path / "r.html").read_text()


def test_unwritable_out_is_one_line_naming_the_option(tmp_path) -> None:
    root = _sweep_dir(tmp_path, finish_one=True)
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    assert_one_error(run("report", str(root), "--out", str(blocker / "r.html")),
                     "--out=", "cannot write there", "not a directory")  # fmt: skip
    path = str(sweep_file(tmp_path))
    assert_one_error(run("plan", path, "--out", str(blocker / "sub" / "p.json")), "--out=")
    assert_one_error(run("plan", path, "--gantt", str(blocker / "g.png")), "--gantt=")
    if Path("/proc/self").is_dir():  # writable for os.access as root, yet no file can be made
        assert_one_error(run("plan", path, "--out", "/proc/plora-test.json"), "--out=", "/proc")
