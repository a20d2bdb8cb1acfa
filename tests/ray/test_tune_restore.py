"""Ray Tune restore: a driver killed mid-sweep, then ``tune.Tuner.restore`` keeps the finished
configs (not retrained) and ASHA's rungs and stops (``PLoRAScheduler``'s saved state).

Trials train with ``packfn.PackFnEngine`` (tests/ray/packfn.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tune_helpers import HERE, ROOT, trainable_for
from waits import driver_actors_gone

from plora.sweepdir.store import SweepStore

#: The driver's sweep: until the gate file exists, only the first job to end returns and the others
#: wait at their end (packfn's ``PACKFN_GATE``), so the moment to kill it (a job ended, ASHA
#: stopped some configs and Tune synced that, other configs not ended) is an event the test waits
#: for, however fast or slow the box. Raced against 0.15 s steps instead, three fresh-clone CI
#: runs in a row (2026-11-29) saw every config end before the kill.
DRIVER = """
import os
import sys
os.environ["TUNE_GLOBAL_CHECKPOINT_S"] = "0.5"  # Tune syncs its state (and the scheduler's) often
import ray
ray.init(address={address!r}, runtime_env={{"env_vars": {{"PYTHONPATH": {here!r}, "PACKFN_GATE": {gate!r}}}}})
sys.path.insert(0, {here!r})
from pathlib import Path
from packfn import PackFnEngine
from tune_helpers import LRS, asha_tuner, trainable_for
asha_tuner(Path({storage!r}), "restore", trainable_for("restoretest"), lrs=LRS[::2]).fit()
"""


def _rungs(path: Path | dict) -> dict[tuple[float, str], float]:
    """ASHA's recorded values by (milestone, trial) in a scheduler state (file or parsed)."""
    state = (path if isinstance(path, dict) else json.loads(path.read_text()))["inner"]
    return {(m, t): v for bracket in state["rungs"] for m, rec in bracket for t, v in rec.items()}


def _kill_mid_sweep(storage: Path, address: str) -> None:
    """Run the driver's sweep into ``storage`` and SIGKILL it once a job ended and ASHA stopped
    some configs (Tune synced the scheduler's state); the gate holds the other jobs open."""
    from plora.tune.scheduler import STATE_FILE

    exp = storage / "restore"
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{ROOT}"}
    gate = storage / "gate"
    code = DRIVER.format(here=str(HERE), storage=str(storage), address=address, gate=str(gate))
    storage.mkdir(parents=True)
    err = (storage / "driver.err").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, start_new_session=True, stderr=err
    )
    state_json = exp / "plora" / "state.json"
    seen = "nothing"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, "driver exited before it could be killed"
            assert time.monotonic() < deadline, f"no job end and ASHA stop seen: {seen}"
            if state_json.is_file() and (exp / STATE_FILE).is_file():
                status = SweepStore(exp / "plora").read_state()["status"].values()
                try:  # Tune's sync copies the file in place: it may be half-written right now
                    sched = json.loads((exp / STATE_FILE).read_text())
                except json.JSONDecodeError:
                    sched = {"stopped": {}, "inner": {"rungs": []}}
                ended = {"done", "stopped"} & set(status)
                seen = f"statuses {sorted(status)}, scheduler stopped {sched['stopped']}"
                if ended and sched["stopped"] and _rungs(sched):
                    assert {"running", "queued"} & set(status), seen  # the gate held them
                    break
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        err.close()
        gate.touch()
    # the scheduler's state reaches Tune's sync whole (its temporary is written elsewhere)
    assert "Last sync command failed" not in (storage / "driver.err").read_text()
    driver_actors_gone("plora-tune-restoretest-")


def test_killed_driver_then_tuner_restore_keeps_finished_and_asha_rungs(
    ray_cluster, tmp_path
) -> None:
    import ray
    from ray import tune

    from plora.tune.scheduler import STATE_FILE

    storage = tmp_path / "run"
    _kill_mid_sweep(storage, ray.get_runtime_context().gcs_address)
    exp = storage / "restore"
    state = SweepStore(exp / "plora").read_state()
    ended = {c for c, s in state["status"].items() if s in ("done", "stopped")}
    killed_at = state["elapsed_s"]
    rungs_before = _rungs(exp / STATE_FILE)
    stopped_before = json.loads((exp / STATE_FILE).read_text())["stopped"]
    assert ended and rungs_before and stopped_before

    results = tune.Tuner.restore(
        str(exp), trainable=trainable_for("restoretest"), resume_unfinished=True
    ).fit()
    assert len(results) == 8 and not results.errors
    store = SweepStore(exp / "plora")
    m = store.read_metrics()
    again = m[(m["time"] >= killed_at) & m["config_id"].isin(ended)]
    assert again.empty, f"finished configs were retrained: {sorted(set(again['config_id']))}"
    res = store.read_results().set_index("config_id")
    assert len(res) == 8 and set(res["status"]) <= {"done", "stopped"}
    assert "resume" in [d["kind"] for d in store.read_decisions()]
    # ASHA's rungs survived the restore: every value recorded before the kill is still there
    rungs_after = _rungs(exp / STATE_FILE)
    assert {k: rungs_after.get(k) for k in rungs_before} == rungs_before
    # and who it stopped; the scheduler that wrote it started from the saved state (a fresh one,
    # re-fed the replayed trials, could write the same rungs for those: restores says which)
    after = json.loads((exp / STATE_FILE).read_text())
    assert {t: after["stopped"].get(t) for t in stopped_before} == stopped_before
    assert after["restores"] == 1
    stops = [
        c for d in store.read_decisions() if d["kind"] == "stop_config" for c in d["config_ids"]
    ]
    assert len(stops) == len(set(stops))  # no adapter stopped twice
    df = results.get_dataframe()
    assert df["early_stopped"].sum() == (res["status"] == "stopped").sum()
