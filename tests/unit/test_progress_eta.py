"""The progress line (issue 14, item 6): it names workers on CPU, and its ETA comes from the cost
model's plan and moves only for a reason it states (a new plan, a job behind its plan)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from test_sweep_cli import run, sweep_file

from plora.runtime.progress import EtaTracker, Progress

sys.path.insert(0, str(Path(__file__).parent))


def snap(now: float, *, plan: int = 1, trigger: str = "start", running=None, pending=200.0):
    counts = {"done": 0, "stopped": 0, "running": 2, "queued": 2, "failed": 0,
              "jobs_running": 1, "gpus_busy": 1}  # fmt: skip
    if running is None:
        running = {"j0": {"started_s": 0.0, "planned_start_s": 0.0, "planned_end_s": 100.0}}
    return {"now_s": now, "num_gpus": 1, "counts": counts, "running": running,
            "pending_end_s": pending, "plan_index": plan, "plan_trigger": trigger, "done": False}  # fmt: skip


def test_eta_counts_down_and_moves_only_with_a_reason() -> None:
    eta = EtaTracker()
    assert eta.update(snap(0.0)) == "3m20s (plan 1: start)"
    assert eta.update(snap(50.0)) == "2m30s (plan 1: start)"  # the clock, not the estimate
    # j0 overran its planned end (100 s) by 20 s: the rest of the plan waits for it
    assert eta.update(snap(120.0)) == "1m40s (j0 0m20s behind plan)"
    assert eta.update(snap(121.0)) == "1m39s (j0 0m20s behind plan)"  # 1 s more: within slack
    # a job that started 30 s late runs its planned 100 s from there: due at 130, not 100
    late = {"j0": {"started_s": 30.0, "planned_start_s": 0.0, "planned_end_s": 100.0}}
    assert eta.update(snap(122.0, running=late)) == "1m48s (j0 0m30s behind plan)"
    # the estimate never drops between plans (a job removed from the snapshot ...)
    assert eta.update(snap(130.0, running={}, pending=150.0)) == "1m40s (j0 0m30s behind plan)"
    # ... only a new plan may bring it forward, and says so
    assert eta.update(snap(130.0, plan=2, trigger="job j0 done", running={}, pending=170.0)) == (
        "0m40s (plan 2: job j0 done)"
    )
    assert eta.update({**snap(171.0, plan=2), "done": True}) == "done"


def test_eta_moved_by_a_refit_says_so_not_none_behind() -> None:
    """A refit from the first measured steps stretches the running job's planned end with no
    job late: the reason names the refit (it printed ``None 0m00s behind plan``)."""
    eta = EtaTracker()
    assert eta.update(snap(0.0, pending=None)) == "1m40s (plan 1: start)"
    longer = {"j0": {"started_s": 0.0, "planned_start_s": 0.0, "planned_end_s": 130.0}}
    assert eta.update(snap(10.0, running=longer, pending=None)) == (
        "2m00s (re-estimated from measured steps)"
    )


def test_eta_from_a_real_coordinator_plan() -> None:
    from runtime_fakes import AffineCost, GreedyPlanner, lora

    from plora.runtime.coordinator import Coordinator

    t = [0.0]
    coord = Coordinator(cost=AffineCost(), num_gpus=1, configs=[lora(i) for i in range(3)],
                        planner=GreedyPlanner(), clock=lambda: t[0])  # fmt: skip
    coord.start()
    s = coord.snapshot()
    (job,) = s["running"].values()
    assert (
        job["planned_end_s"] is not None and s["plan_index"] == 1 and s["plan_trigger"] == "start"
    )
    eta = EtaTracker()
    text = eta.update(s)
    assert text.endswith("(plan 1: start)")
    assert eta.finish_s == pytest.approx(max(job["planned_end_s"], s["pending_end_s"] or 0.0))
    assert eta.finish_s == pytest.approx(s["eta_s"])  # on time: the plan's own end


@pytest.mark.parametrize(
    ("workers", "want"), [("workers", "workers busy 1/1"), ("GPUs", "GPUs busy 1/1")]
)
def test_progress_line_names_what_runs_jobs(workers, want) -> None:
    buf = io.StringIO()
    Progress(stream=buf, live=False, workers=workers)(snap(0.0))
    assert want in buf.getvalue() and "ETA 3m20s (plan 1: start)" in buf.getvalue()


def test_cpu_sweep_progress_says_workers(tmp_path, monkeypatch) -> None:
    """``plora sweep`` of a ``gpu_type: cpu`` sweep shows "workers busy", not "GPUs busy"."""
    import plora.api
    from plora.runtime.driver import SweepSummary

    def fake_run(spec, out, *, on_update, **kwargs):
        on_update(snap(0.0))
        counts = {"done": 8, "stopped": 0, "failed": 0}
        return SweepSummary(out=Path(out), counts=counts, wall_s=1.0)

    monkeypatch.setattr(plora.api, "run", fake_run)
    result = run("sweep", str(sweep_file(tmp_path)), "--out", str(tmp_path / "o"))
    assert result.exit_code == 0, result.output
    assert "workers busy 1/1" in result.output and "GPUs busy" not in result.output


def _ask(ids, dups=None):
    return {"kind": "ask", "config_ids": list(ids), "inputs": {"duplicates": dups or {}}}


@pytest.mark.parametrize(
    ("search", "asked", "decisions", "finished", "want"),
    [
        ("grid", 8, [_ask(["a"])], True, None),  # a grid has no draws
        ("optuna", 2, [_ask(["a"]), _ask(["b"])], True, None),  # got what it asked
        ("hyperopt", 5, [_ask(["a", "b"], {"c": "a"}), _ask(["d"], {"e": "b"})], True,
         "search: 3 distinct configs of the 5 asked of hyperopt; 2 repeated a config already "
         "asked (c = a, e = b), trained once"),
        ("optuna", 4, [_ask(["a"])], True,
         "search: 1 distinct configs of the 4 asked of optuna; 3 never came: the searcher "
         "finished early"),
        ("optuna", 4, [_ask(["a"])], False, None),  # still running: more may come
        ("random", 6, [_ask(["a", "b"], {"c": "a", "d": "a", "e": "b", "f": "b"})], True,
         "search: 2 distinct configs of the 6 asked of random; 4 repeated a config already "
         "asked (c = a, d = a, e = b, +1 more), trained once"),
    ],
)  # fmt: skip
def test_fewer_distinct_configs_than_asked_is_one_line(search, asked, decisions, finished, want):
    from plora.runtime.progress import samples_line

    plan = {"kind": "plan", "config_ids": ["x"], "inputs": {}}  # other decisions do not count
    got = samples_line([plan, *decisions], search=search, asked=asked, finished=finished)
    assert got == want


def test_status_shows_an_infinite_plan_bound_as_unknown(tmp_path) -> None:
    """A plan's lower bound may be infinite (a kept plan re-timed by ``continue_plan`` under the
    unit tests' cost model has one): ``plora status`` shows it as ``?`` instead of failing."""
    from plora.runtime.progress import status_text
    from plora.sweepdir.store import SweepStore

    SweepStore(tmp_path).write_plan({"jobs": [], "makespan_s": 70.0, "lower_bound_s": float("inf")})
    assert "latest plan: 0 jobs, makespan 1m10s (lower bound ?)" in status_text(str(tmp_path))
