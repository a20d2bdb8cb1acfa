"""How ``benchmarks/e2e.py`` runs each system, and what it reads back.

Each system runs as a child process (:func:`run_logged`: its output in a log, its wall seconds,
``nvidia-smi`` sampled while it runs, stopped cleanly past ``--timeout-s``) with the
environment of :func:`child_env` (the same plora as this process, no network):

* :func:`run_system` -- one system's command, and the first fields of its row;
* :func:`plan_systems` -- ``plora plan`` of each plora system's sweep file before anything runs:
  the makespans its planner predicts for plora, for plora one config per job
  (``planner.max_pack_size: 1``) and for Tune (its baseline row);
* :func:`run_plora` -- ``plora sweep`` (``plora``, or ``plora-single``: the same sweep with
  ``planner.max_pack_size: 1``); the first plan, the jobs and the eval losses from its sweep
  directory;
* :func:`run_tune` -- ``e2e_tune.py`` (Ray Tune + PEFT): trials on a GPU (or a fraction), Ray
  Train FSDP trials, or ``device_map`` trials; its trials;
* :func:`base_eval_loss` -- the base model's eval loss with the trainables' own eval code.

See ``benchmarks/e2e.py`` for the benchmark itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from e2e_report import failed_trials, finite
from e2e_setup import GpuSampler

HERE = Path(__file__).resolve().parent


def run_logged(
    cmd: list[str], env: dict[str, str], log: Path, gpus: list[int], timeout_s: float | None = None
) -> tuple[int, float, GpuSampler]:
    """Run ``cmd`` with its output in ``log``; returns (exit status, wall seconds, sampler).

    Past ``timeout_s`` the child is stopped (:func:`stop`) and the status is 124.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f, GpuSampler(gpus) as sampler:
        t0 = time.perf_counter()
        # in the log's folder: a child's sys.path starts with its working directory, and the
        # repo root there would shadow the plora the driver chose (and transformers' `kernels`)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = 124
            stop(proc)
        wall = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        print(f"  exit status {rc}; last lines of {log}:\n{tail}", file=sys.stderr)
    return rc, wall, sampler


def stop(proc: subprocess.Popen) -> None:
    """Stop a system's process: SIGINT first (Tune and ``plora sweep`` then stop their trials
    and shut Ray down), after 30 s SIGKILL to what is left of its process tree (Ray's workers
    run in sessions of their own, so a process-group kill would miss them). Without psutil only
    the child itself is killed."""
    try:
        import psutil

        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except Exception:  # no psutil, or the child is gone already
        tree = []
    proc.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    for p in tree:
        with contextlib.suppress(Exception):  # psutil checks the pid was not reused
            p.kill()
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def run_system(
    ctx: dict[str, Any], cmd: list[str], name: str, env: dict[str, str] | None = None, **fields: Any
) -> dict[str, Any]:
    """Run one system's ``cmd`` (output in ``NAME.log`` of the run dir; ``env``: default the
    systems' own); its row: exit status, wall seconds, GPU busy fraction and samples,
    ``fields``, the log, and ``eval_loss`` (empty, for the caller to fill)."""
    log = ctx["run_dir"] / f"{name}.log"
    rc, wall, sampler = run_logged(cmd, env or ctx["env"], log, ctx["gpus"], ctx["timeout_s"])
    return {
        "returncode": rc,
        "wall_s": wall,
        "gpu_busy": sampler.busy,
        "gpu_samples": len(sampler.samples),
        **fields,
        "log": str(log),
        "eval_loss": {},
    }


PLORA_CLI = [sys.executable, "-c", "from plora.cli import app; app()"]


def plan_systems(ctx: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``plora plan`` of each plora system's sweep file (``ctx["sweeps"]``), in a subprocess with
    the systems' environment (their profile store), before any system runs: the makespan each
    plan predicts (``plora``, ``plora-single``), the Tune baseline row for ``tune`` (one trial
    per GPU, each a new process), and Min GPU's; None for a system plora does not model
    (``tune-frac``) or a plan that failed. ``plora plan`` reads no data, so it times every row
    at ``max_seq_len``; ``plora sweep``'s own first plan pads to the data's lengths (the row's
    ``predicted_makespan_s``)."""
    out: dict[str, Any] = {}
    for name, sweep in ctx["sweeps"].items():
        path = ctx["run_dir"] / f"plan-{name}.json"
        cmd = [*PLORA_CLI, "plan", str(sweep), "--out", str(path)]
        rc, _, _ = run_logged(cmd, ctx["env"], ctx["run_dir"] / f"plan-{name}.log", [])
        plan = json.loads(path.read_text()) if rc == 0 and path.is_file() else None
        out[name] = None if plan is None else {
            "makespan_s": plan["makespan_s"],
            "jobs": len(plan["jobs"]),
            "largest_pack": max(len(j["config_ids"]) for j in plan["jobs"]),
            "baselines": {k: v.get("makespan_s") for k, v in plan["baselines"].items()},
        }  # fmt: skip
    base = out.get("plora")
    predicted = {n: (out.get(n) or {}).get("makespan_s") for n in names if n in out}
    if base is not None and "tune" in names:
        predicted["tune"] = base["baselines"].get("tune")
    return {"files": out, "predicted_makespan_s": predicted}


def run_plora(ctx: dict[str, Any], name: str = "plora") -> dict[str, Any]:
    """``plora sweep`` of system ``name``'s sweep file (``ctx["sweeps"][name]``) in a
    subprocess; plan, jobs and eval losses from its sweep directory. With ``--fresh-profile``
    each plora system plans from a profile store of its own (``profiles/NAME``), so that the
    first plans of ``plora`` and ``plora-single`` start from the same knowledge."""
    from plora.analysis import load
    from plora.sweepdir.store import SweepStore

    out = ctx["run_dir"] / name
    cmd = [*PLORA_CLI, "sweep", str(ctx["sweeps"][name]), "--out", str(out)]
    env = dict(ctx["env"])
    if "PLORA_PROFILE_DIR" in env:
        env["PLORA_PROFILE_DIR"] = str(Path(env["PLORA_PROFILE_DIR"]) / name)
    row = run_system(ctx, cmd, name, env=env, sweep_dir=str(out))
    if not (out / "plan.json").is_file():
        return row
    store = SweepStore(out)
    first = json.loads((store.plans_dir / "plan-000.json").read_text())
    jobs = store.read_jobs()  # start/end on the coordinator's clock, as the plans
    measured = float(jobs["end"].max()) - float(first["time_s"]) if len(jobs) else None
    row.update(
        predicted_makespan_s=float(first["makespan_s"]),
        # the plan's clock starts when the coordinator plans: after process start, imports,
        # the dataset check and ray.init
        predicted_makespan_includes_ray_start=False,
        measured_makespan_s=measured,
        # DESIGN.md's promise: within 10 % (1.0 = the plan was exact)
        measured_over_predicted=None if measured is None else measured / first["makespan_s"],
        startup_and_teardown_s=None if measured is None else row["wall_s"] - measured,
        plans=len(list(store.plans_dir.glob("plan-*.json"))),
        planned_jobs=[
            {
                "configs": len(j["config_ids"]),
                "gpus": j["gpus"],
                "strategy": j.get("strategy"),
                "start_s": j["start_s"],
                "end_s": j["end_s"],
            }
            for j in first["jobs"]
        ],
        jobs=[
            {
                "job_id": j.job_id,
                "configs": len(list(j.config_ids)),
                "gpus": j.gpus,
                "strategy": j.strategy if isinstance(j.strategy, str) else None,  # d=1: none
                "start_s": float(j.start),
                "end_s": float(j.end),
                "status": j.status,
                "load_s": float(j.load_s),
                "train_s": float(j.train_s),
                "eval_s": float(j.eval_s),
            }
            for j in jobs.itertuples()
        ],
    )
    res = load(out).results
    for r in res.itertuples():
        ok = str(r.status) in ("done", "completed") and finite(r.eval_loss)
        row["eval_loss"][ctx["keys"][r.config_id]] = float(r.eval_loss) if ok else None
    return row


def run_tune(ctx: dict[str, Any], name: str, mode: str, per_trial: float) -> dict[str, Any]:
    """``e2e_tune.py`` (Ray Tune + PEFT) in a subprocess: trials of ``mode`` (single, fsdp,
    devmap) with ``per_trial`` GPUs each."""
    result = ctx["run_dir"] / f"{name}.json"
    cmd = [
        sys.executable,
        str(HERE / "e2e_tune.py"),
        "--spec",
        str(ctx["spec"]),
        "--out",
        str(result),
        "--device",
        ctx["device"],
        "--gpus",
        str(ctx["num_gpus"]),
        "--mode",
        mode,
        "--gpu-per-trial",
        str(per_trial),
        "--storage",
        str(ctx["run_dir"] / "tune_storage"),
        "--name",
        name,
    ]
    row = run_system(ctx, cmd, name, mode=mode, gpu_per_trial=per_trial)
    if not result.is_file():
        return row
    data = json.loads(result.read_text())
    trials = data.pop("trials")
    row.update(data, trials=trials)
    for t in trials:
        loss = t["eval_loss"]
        row["eval_loss"][t["key"]] = float(loss) if finite(loss) else None
    row["failed_trials"] = failed_trials(row)
    for part in ("load_s", "train_s", "eval_s"):
        values = [t[part] for t in trials if t.get(part) is not None]
        row[f"mean_trial_{part}"] = sum(values) / len(values) if values else None
    return row


def base_eval_loss(ctx: dict[str, Any]) -> float | None:
    """The base model's eval loss (``e2e_tune.py --base-eval``: the trainables' own eval code).

    On a GPU in a child process, so this one never holds a CUDA context; on the CPU in process.
    """
    spec = json.loads(Path(ctx["spec"]).read_text())
    if ctx["device"] == "cpu":
        import e2e_tune

        return e2e_tune.run_base_eval(spec, argparse.Namespace(device="cpu"))["eval_loss"]
    out = ctx["run_dir"] / "base_eval.json"
    cmd = [sys.executable, str(HERE / "e2e_tune.py"), "--spec", str(ctx["spec"])]
    cmd += ["--out", str(out), "--device", "cuda", "--base-eval"]
    run_logged(cmd, ctx["env"], ctx["run_dir"] / "base_eval.log", [])
    return json.loads(out.read_text())["eval_loss"] if out.is_file() else None


def plora_home() -> Path:
    """The folder holding the ``plora`` package this process imports (children import the same)."""
    import plora

    # plora is a namespace package (no __init__.py): the first real folder of its path
    folder = next(p for p in plora.__path__ if Path(p).is_dir())
    return Path(folder).resolve().parent


def child_env(*, profile_dir: Path | None) -> dict[str, str]:
    """The systems' environment: this one, offline, no Ray usage stats, unbuffered output, the
    plora this process imports first on ``PYTHONPATH``; ``PLORA_PROFILE_DIR`` = ``profile_dir``
    when given (an empty profile store)."""
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # the folder that holds the plora being run (the repo root for an editable install, a
        # copy of the package on a GPU machine: never put the repo root there by default, its
        # top-level ``kernels/`` shadows the PyPI package transformers looks for)
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(plora_home()), os.environ.get("PYTHONPATH")) if p
        ),
    }
    if profile_dir is not None:
        env["PLORA_PROFILE_DIR"] = str(profile_dir)
    return env
