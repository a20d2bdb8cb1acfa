"""Issue 41: ``plora sweep`` measures its timeline (Ray, inputs, workers, first and last step,
evaluation, export, exit), logs it last in ``decisions.jsonl`` and prints it as its last line."""

from __future__ import annotations

from test_quickstart import ROOT, plora

from plora.runtime.timeline import Phase, timeline_line
from plora.sweepdir.store import SweepStore


def test_a_tiny_sweep_logs_and_prints_its_phases_in_order(ray_cluster, tmp_path) -> None:
    import yaml

    sweep = yaml.safe_load((ROOT / "sweeps" / "quickstart.yaml").read_text())
    sweep["dataset"]["num_examples"] = 200
    sweep["space"].update(max_steps=3, warmup_steps=0, lr=[1e-3], rank=[4, 8])
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(sweep))
    address = ray_cluster.get_runtime_context().gcs_address
    out = tmp_path / "tiny"
    proc = plora("sweep", str(path), "--out", str(out), "--address", address)
    assert proc.returncode == 0, proc.stderr[-2000:]

    store = SweepStore(out)
    decisions = store.read_decisions()
    assert [d["kind"] for d in decisions[-2:]] == ["sweep_done", "timeline"]
    phases = decisions[-1]["inputs"]["phases"]
    notes = decisions[-1]["inputs"]["notes"]
    assert list(phases) == [str(p) for p in Phase]  # every phase, in order
    at = {Phase(k): v for k, v in phases.items()}
    # Ray first; the inputs (the first plan) and the workers' load overlap; then in order
    assert 0 < at[Phase.RAY] <= at[Phase.INPUTS] and at[Phase.RAY] <= at[Phase.WORKERS]
    assert max(at[Phase.INPUTS], at[Phase.WORKERS]) <= at[Phase.FIRST_STEP]
    order = [Phase.FIRST_STEP, Phase.LAST_STEP, Phase.EVAL, Phase.EXPORT, Phase.EXIT]
    assert [at[p] for p in order] == sorted(at[p] for p in order)
    assert 0 < notes["driver"] <= at[Phase.RAY] and notes["prepared"] <= at[Phase.INPUTS]
    # ... and `plora sweep` ends with it
    assert proc.stdout.strip().splitlines()[-1] == timeline_line(phases)

    jobs = store.read_jobs()  # each job's first step, from its start on the worker
    assert len(jobs) >= 1 and jobs["first_step_s"].notna().all()
    assert ((jobs["start_s"] > 0) & (jobs["start_s"] <= jobs["first_step_s"])).all()
    done = [d["inputs"] for d in decisions if d["kind"] == "job_done"]
    assert done and all(
        d["started_at"] > 0 and d["first_step_s"] <= d["last_step_s"] <= d["eval_end_s"]
        for d in done
    )
