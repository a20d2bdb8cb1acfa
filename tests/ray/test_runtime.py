"""The runtime on a local Ray cluster with 8 logical GPUs (tests/ray/conftest.py).

Workers train with ``packfn.PackFnEngine`` (a small real engine with PackSession's interface) so these
tests exercise placement, streaming, control, checkpoints, retries and resume quickly; the
end-to-end test with plora's engine is in test_quickstart.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from packfn import PackFnEngine
from waits import driver_actors_gone

from plora.config import LoRAConfig, SweepConfig
from plora.runtime.driver import RunOptions, run_sweep
from plora.runtime.records import StaticSource
from plora.sweepdir.lock import SweepLockedError, read_owner
from plora.sweepdir.store import SweepStore

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def tiny_sweep(num_gpus: int = 8, name: str = "raytest") -> SweepConfig:
    return SweepConfig.from_dict(
        {
            "name": name,
            "model": "tiny-qwen2",
            "dataset": {"builtin": "arithmetic", "num_examples": 200, "max_seq_len": 32},
            "space": {"lr": [1.0e-3], "rank": [4], "alpha": 16, "batch_size": 4, "max_steps": 10},
            "hardware": {"gpu_type": "cpu", "num_gpus": num_gpus, "gpu_memory_gib": 8},
        }
    )


def configs(n: int, *, steps: int = 20) -> list[LoRAConfig]:
    ranks = [4, 8, 16]
    return [
        LoRAConfig(
            config_id=f"k{i:02d}",
            rank=ranks[i % 3],
            alpha=16,
            lr=1e-3 * (1 + i % 4),
            batch_size=4,
            max_steps=steps + (i % 3) * 5,
            seed=i,
        )
        for i in range(n)
    ]


def cost_of(sweep: SweepConfig):
    from plora.cost.build import build_cost_model

    return build_cost_model(sweep, use_profile=False)


def overlap_max(jobs: pd.DataFrame) -> tuple[int, int]:
    """(max jobs at once, max GPUs at once) from job intervals."""
    events = []
    for _, j in jobs.iterrows():
        events += [(j["start"], 1, j["gpus"]), (j["end"], -1, -j["gpus"])]
    n = g = n_max = g_max = 0
    for _, dn, dg in sorted(events, key=lambda e: (e[0], e[1])):
        n, g = n + dn, g + dg
        n_max, g_max = max(n_max, n), max(g_max, g)
    return n_max, g_max


def _find_worker(prefix: str) -> tuple[str, str] | None:
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(prefix) and a["name"].endswith("-w1-r0"):
            return a["name"], a["namespace"]
    return None


def test_killed_worker_resumes_from_checkpoint(ray_cluster, tmp_path) -> None:
    import ray

    sweep = tiny_sweep(num_gpus=1, name="killtest")
    cs = configs(3, steps=60)
    out = tmp_path / "sweep"
    killed: dict[str, object] = {}

    def killer() -> None:
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            ck = list(out.glob("checkpoints/*/state.json"))
            if ck:
                state = json.loads(ck[0].read_text())
                if min(s["step"] for s in state.values()) >= 10:
                    found = _find_worker("plora-killtest-")
                    if found:
                        ray.kill(ray.get_actor(found[0], namespace=found[1]), no_restart=True)
                        killed["name"] = found[0]
                        killed["steps"] = {c: s["step"] for c, s in state.items()}
                        return
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    summary = run_sweep(
        sweep, out, cost=cost_of(sweep), source=StaticSource(cs),
        options=RunOptions(engine=PackFnEngine, checkpoint_every=5, refill=False),
    )  # fmt: skip
    t.join(5)
    assert killed, "the test never found a worker to kill"
    assert summary.ok and summary.counts["done"] == 3  # 0 lost
    store = SweepStore(out)
    jobs = store.read_jobs().sort_values("start")
    assert list(jobs["status"]) == ["died", "done"] and list(jobs["attempt"]) == [0, 1]
    assert jobs.iloc[0]["job_id"] == jobs.iloc[1]["job_id"]
    kinds = [d["kind"] for d in store.read_decisions()]
    assert "retry" in kinds
    m = store.read_metrics()
    assert not m.duplicated(["config_id", "step"]).any()  # redone steps: the retry's rows only
    redo = [d for d in store.read_decisions() if d["kind"] == "redo_steps"]
    redone = {c: s for d in redo for c, s in d["inputs"]["steps"].items()}
    retry = m[m["job_id"] == jobs.iloc[1]["job_id"]]
    after = m[m["time"] >= jobs.iloc[1]["start"]]
    for c in cs:
        first = after[after["config_id"] == c.config_id]["step"].min()
        assert first > 1, "the restarted job trained from scratch instead of its checkpoint"
        # resumed exactly after a checkpoint (every 5 steps), one at least as late as the one
        # the killer saw (a newer one may land between reading it and the kill)
        assert (first - 1) % 5 == 0 and first - 1 >= killed["steps"][c.config_id]
        if c.config_id in redone:  # steps reported before the kill were trained again
            assert redone[c.config_id][0] == first
            assert (m[m["config_id"] == c.config_id]["attempt"] == 1).sum() > 0
    assert len(retry) and store.read_results().set_index("config_id")["steps"].to_dict() == {
        c.config_id: c.max_steps for c in cs
    }


DRIVER = """
import sys
import ray
ray.init(address={address!r}, runtime_env={{"env_vars": {{"PYTHONPATH": {here!r}, "PACKFN_STEP_S": "0.05"}}}})
from plora.config import LoRAConfig
from plora.runtime.records import StaticSource
from plora.runtime.driver import RunOptions, run_sweep
sys.path.insert(0, {here!r})
from test_runtime import configs, cost_of, tiny_sweep
from packfn import PackFnEngine
sweep = tiny_sweep(num_gpus=1, name="resumetest")
run_sweep(sweep, {out!r}, address={address!r}, cost=cost_of(sweep), source=StaticSource(configs(6, steps=30)),
          options=RunOptions(engine=PackFnEngine, checkpoint_every=5, refill=False, ask_batch=2))
"""


def _checkpointed_steps(out: Path) -> int:
    """The most steps a running job's PackFnEngine checkpoint holds for one config."""
    most = 0
    for f in out.glob("checkpoints/*/state.json"):
        with contextlib.suppress(ValueError, OSError):
            most = max([most, *(s["step"] for s in json.loads(f.read_text()).values())])
    return most


def test_driver_killed_then_resume_skips_finished(ray_cluster, tmp_path) -> None:
    import ray

    out = tmp_path / "sweep"
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{ROOT}"}
    code = DRIVER.format(here=str(HERE), out=str(out), address=address)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        deadline = time.time() + 150
        done_before: set[str] = set()
        while time.time() < deadline:
            if (out / "state.json").is_file():
                state = SweepStore(out).read_state()  # the head and its logs (state.parts/)
                done_before = {c for c, s in state["status"].items() if s == "done"}
                running = any(s == "running" for s in state["status"].values())
                # killed between checkpoints of a running job, rows since the last flush unsent
                if done_before and running and _checkpointed_steps(out) >= 10:
                    break
            assert proc.poll() is None, "driver exited before it could be killed"
            time.sleep(0.1)
        # a second writer (a --resume while the driver runs) is refused and changes nothing
        before = {p: p.stat().st_mtime_ns for p in [out / "state.json", out / "sweep.yaml"]}
        with pytest.raises(SweepLockedError, match=f"pid {proc.pid}"):
            run_sweep(None, out, resume=True)
        assert {p: p.stat().st_mtime_ns for p in before} == before
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
    assert done_before
    stale = read_owner(out)  # SIGKILL left the lock: a dead pid on this host, taken over below
    assert stale is not None and stale.pid == proc.pid
    state = SweepStore(out).read_state()
    done_before = {c for c, s in state["status"].items() if s == "done"}
    killed_at = state["elapsed_s"]
    sweep = tiny_sweep(num_gpus=1, name="resumetest")
    driver_actors_gone("plora-resumetest-")
    summary = run_sweep(
        None, out, resume=True, cost=cost_of(sweep), source=StaticSource(configs(6, steps=30)),
        options=RunOptions(engine=PackFnEngine, checkpoint_every=5, refill=False, ask_batch=2),
    )  # fmt: skip
    assert summary.ok and summary.counts["done"] == 6
    assert read_owner(out) is None
    store = SweepStore(out)
    m = store.read_metrics()
    again = m[(m["time"] >= killed_at) & m["config_id"].isin(done_before)]
    assert again.empty, f"finished configs were retrained: {sorted(set(again['config_id']))}"
    res = store.read_results().set_index("config_id")
    assert {c: int(s) for c, s in res["steps"].items()} == {
        c.config_id: c.max_steps for c in configs(6, steps=30)
    }
    assert "resume" in [d["kind"] for d in store.read_decisions()]
    # metrics complete: every config's curve has every step once (no hole where the killed
    # driver had buffered rows: workers sync them to disk before each checkpoint) ...
    from plora.sweepdir.reader import read_metrics

    curves = read_metrics(out)
    for c in configs(6, steps=30):
        steps = curves.loc[curves["config_id"] == c.config_id, "step"].tolist()
        assert steps == list(range(1, c.max_steps + 1)), (c.config_id, steps)
    # ... and a step trained twice (after the checkpoint it resumed from) keeps one row, the
    # resumed attempt's, with the redone range in the decisions
    assert not m.duplicated(["config_id", "step"]).any()
    for d in store.read_decisions():
        for cid, (first, last) in (
            d["inputs"]["steps"] if d["kind"] == "redo_steps" else {}
        ).items():
            redone = m[(m["config_id"] == cid) & m["step"].between(first, last)]
            assert (
                len(redone) == last - first + 1
                and (redone["attempt"] == d["inputs"]["attempt"]).all()
            )
    jobs = store.read_jobs()
    resumed = jobs[jobs["status"] == "interrupted"]["job_id"]
    assert len(resumed) and all(
        jobs[jobs["job_id"] == j]["attempt"].nunique() == 2 for j in resumed
    )


def test_rows_cut_or_left_out_are_reported_on_the_console_and_in_the_sweep_dir(
    ray_cluster, tmp_path, caplog
) -> None:
    """Nothing silently changed: a dataset whose long rows lose their target to max_seq_len
    says so, per split, in the log, the summary, ``data.json`` and ``plora status``."""
    from plora.runtime.progress import status_text

    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(30)]
    rows += [{"prompt": " ".join(["long"] * 80), "completion": "x"} for _ in range(6)]
    data_file = tmp_path / "d.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sweep = SweepConfig.from_dict(
        {
            "name": "cut",
            "model": "tiny-qwen2",
            "dataset": {"path": str(data_file), "max_seq_len": 32, "eval_fraction": 0.25},
            "space": {"lr": [1.0e-3], "rank": [4], "alpha": 16, "batch_size": 4, "max_steps": 5},
            "hardware": {"gpu_type": "cpu", "num_gpus": 1, "gpu_memory_gib": 8},
        }
    )
    out = tmp_path / "sweep"
    with caplog.at_level("INFO"):  # logged at info: plora sweep prints the summary's once
        summary = run_sweep(
            sweep, out, options=RunOptions(engine=PackFnEngine, record_profile=False)
        )
    assert summary.ok
    data = json.loads((out / "data.json").read_text())
    assert data["train"]["rows"] + data["eval"]["rows"] == 36
    assert data["train"]["dropped"] + data["eval"]["dropped"] == 6
    assert data["train"]["truncated"] == data["train"]["dropped"]  # the long rows, nothing else
    assert summary.data_lines and all("left out" in x for x in summary.data_lines)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("data:")] == list(
        summary.data_lines
    )
    assert "data: train" in status_text(str(out)) or "data: eval" in status_text(str(out))
    # and in the sweep's log file, logged before the directory existed
    log = (out / "plora.log").read_text()
    assert all(line in log for line in summary.data_lines), log[-2000:]
