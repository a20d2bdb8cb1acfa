"""Control-plane benchmark: plora's real driver, coordinator, dispatcher, workers and sweep
directory on a Ray cluster of many logical GPU nodes, trained by a TIMING SIMULATION engine.

What runs is ``plora.runtime.run_sweep`` as ``plora sweep`` runs it, on a
``ray.cluster_utils.Cluster`` of ``--nodes`` nodes with ``--gpus-per-node`` logical GPUs each
(``--cpus-per-node`` logical CPUs), with ``RunOptions(engine=SimEngine)``
(``benchmarks/control_plane_sim.py``): each packed step sleeps the step's booked time times a
scale, so ``--step-ms`` is how long one step of one median config takes. The sweep is
Qwen2.5-7B on A100-40GBs (the model's shape only: nothing is loaded), ``--configs`` configs of
``max_steps`` one of 0.5, 1, 1.5 x ``--steps``, ASHA early stopping (grace 10 steps, factor 2), so
configs stop inside their packs and queued configs refill the slots; ``--kill-at`` f kills one
worker node once a fraction f of the configs finished and adds a fresh node in its place.

Measured (in the driver's process, by timing wrappers around the runtime's functions):

* ``replan``: seconds of each plan / re-plan (``plora.runtime.coordinator.scheduling.plan``);
* ``events``: the coordinator's events (step reports, job ends and failures, polls, stops) and
  their seconds, per tenth of the sweep (configs finished): the driver's work per event should
  stay flat as the sweep grows;
* ``driver``: the driver process's CPU seconds and peak RSS (psutil);
* ``writes``: each ``metrics.parquet`` flush's seconds against the rows already on disk, and
  the other tables' writes (results, jobs, state.json);
* ``status_s`` (``plora status DIR``, a fresh process) and ``load_s`` (``plora.api.load``);
* ``lost``: configs with no finished row in ``results.parquet`` (must be 0).

Usage::

    python benchmarks/control_plane.py                          # 10,000 configs, 32 x 8 GPUs
    python benchmarks/control_plane.py --configs 200 --nodes 3 --gpus-per-node 2 --json r.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from control_plane_probe import Probe  # noqa: E402
from control_plane_sim import SCALE_ENV, SimEngine  # noqa: E402

from plora.config import PROJECTIONS, LoRAConfig, SweepConfig  # noqa: E402
from plora.cost.build import build_cost_model  # noqa: E402

TITLE = "TIMING SIMULATION (no training: workers sleep each step's booked time, scaled)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=int, default=10_000, help="configs in the sweep")
    p.add_argument("--steps", type=int, default=100, help="mean max_steps of a config")
    p.add_argument("--nodes", type=int, default=32, help="Ray nodes (the head counts)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="logical GPUs per node")
    p.add_argument("--cpus-per-node", type=float, default=1.0, help="logical CPUs per node")
    p.add_argument("--step-ms", type=float, default=200.0,
                   help="simulated milliseconds of one step of one median config")  # fmt: skip
    p.add_argument("--kill-at", type=float, default=0.3,
                   help="kill a worker node once this fraction of configs finished (0: never)")  # fmt: skip
    p.add_argument("--object-store-mb", type=int, default=0,
                   help="each node's object store in MiB (0: Ray's default, 30%% of memory a "
                        "node: many nodes on one machine need a small one)")  # fmt: skip
    p.add_argument("--snapshot-s", type=float, default=0.0,
                   help="also write the report so far to JSON.partial this often (a run cut "
                        "short by a time limit still tells what it measured; 0: never)")  # fmt: skip
    p.add_argument("--no-early-stop", action="store_true", help="train every config to the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="sweep directory (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the sweep directory")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    p.add_argument("--writes-only", type=int, default=0, metavar="ROWS",
                   help="only time the sweep directory's metric flushes up to ROWS rows (1,000 "
                        "rows a flush, as 10,000 configs x 100 steps would write), no Ray")  # fmt: skip
    return p.parse_args(argv)


def make_configs(n: int, steps: int, seed: int) -> list[LoRAConfig]:
    """``n`` configs over Table-1-like ranges, ``max_steps`` one of 0.5, 1, 1.5 x ``steps`` (few
    distinct lengths, as epochs over one dataset give: with a length per config the planner's
    knapsacks search far longer, see RESULTS.md)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rank = rng.choice([8, 16, 32, 64])
        out.append(
            LoRAConfig(
                config_id=f"c{i:05d}",
                rank=rank,
                alpha=rank * rng.choice([0.5, 1.0, 2.0]),
                lr=10 ** rng.uniform(math.log10(2e-5), math.log10(4e-4)),
                batch_size=rng.choice([1, 2, 4, 8]),
                target_modules=PROJECTIONS,
                max_steps=max(2, round(steps * rng.choice([0.5, 1.0, 1.5]))),
                seed=i,
            )
        )
    return out


def make_sweep(
    work: Path, num_gpus: int, *, early_stop: bool, gpu_type: str = "A100-40GB"
) -> SweepConfig:
    """Qwen2.5-7B (its config.json alone, in ``work``) on ``num_gpus`` ``gpu_type`` GPUs."""
    model = work / "Qwen2.5-7B"
    model.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "plora/models/configs/Qwen--Qwen2.5-7B.json", model / "config.json")
    data: dict[str, Any] = {
        "name": "control-plane-sim",
        "model": {"name_or_path": str(model), "dtype": "bfloat16"},
        "dataset": {"builtin": "arithmetic", "num_examples": 2000, "max_seq_len": 1024},
        "space": {
            "lr": [1e-4],
            "rank": [8],
            "alpha": 16,
            "batch_size": 1,
            "max_steps": 10,
        },  # configs come from the source
        "hardware": {"gpu_type": gpu_type, "num_gpus": num_gpus},
    }
    if early_stop:
        data["early_stop"] = {"kind": "asha", "grace_steps": 10, "reduction_factor": 2.0}
    return SweepConfig.from_dict(data)


def time_scale(cost: Any, configs: list[LoRAConfig], step_ms: float) -> float:
    """Simulated seconds per booked second: one step of the median config lasts ``step_ms``."""
    per = sorted(
        cost.step_fixed_time(1, 1) + cost.config_step_time(c, 1) / cost.expected_steps(c)
        for c in configs[:1000]
    )
    return step_ms / 1000.0 / per[len(per) // 2]


def start_cluster(args: argparse.Namespace, scale: float) -> Any:
    import ray
    from ray.cluster_utils import Cluster

    node = node_args(args)
    cluster = Cluster(initialize_head=True, head_node_args=node)
    try:
        forget_address(cluster)
        for _ in range(args.nodes - 1):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {"PYTHONPATH": path, SCALE_ENV: repr(scale), "RAY_USAGE_STATS_ENABLED": "0"}
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})  # fmt: skip
    return cluster


def node_args(args: argparse.Namespace) -> dict[str, Any]:
    """One node's resources (``Cluster.add_node``'s keywords)."""
    node: dict[str, Any] = {"num_cpus": args.cpus_per_node, "num_gpus": args.gpus_per_node}
    if args.object_store_mb:
        node["object_store_memory"] = args.object_store_mb * 2**20
    return node


def snapshots(probe: Any, path: Path, every_s: float) -> None:
    """Write ``probe``'s report so far to ``path`` every ``every_s`` seconds until the sweep
    ends (atomically: a reader never sees half a file)."""
    while not probe.done.wait(every_s):
        report = {"title": TITLE, "partial": True, "elapsed_s": probe.elapsed(),
                  "finished": probe.finished(), **probe.report()}  # fmt: skip
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, path)


def run_with_killer(
    cluster: Any, probe: Probe, args: argparse.Namespace, sweep_fn: Any
) -> tuple[Any, dict]:
    """Run ``sweep_fn`` in a thread; from this (the main) thread -- Ray adds nodes only from
    the main thread -- kill a worker node (not the head) once ``--kill-at`` of the configs
    finished and add a fresh node in its place 5 s later (a spot instance replaced). Returns
    the sweep's summary and what happened to the node, for the report."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["summary"] = sweep_fn()
        except BaseException as e:  # reported by the main thread
            box["error"] = e

    thread = threading.Thread(target=run, name="sweep")
    thread.start()
    killed: dict[str, Any] = {}
    want = args.kill_at > 0 and args.nodes > 1
    while thread.is_alive():
        thread.join(0.2)
        if want and not killed and probe.finished() >= args.kill_at * probe.total:
            killed.update(at_finished=probe.finished(), at_s=probe.elapsed(),
                          failures_before=probe.failures())  # fmt: skip
            node = victim(cluster)
            killed["node"] = node.node_id[:12]
            cluster.remove_node(node, allow_graceful=False)
            time.sleep(5.0)
            cluster.add_node(**node_args(args))
            killed["replaced_at_s"] = probe.elapsed()
    if "error" in box:
        raise box["error"]
    if killed:
        killed["failed_jobs"] = probe.failures() - killed["failures_before"]
    return box["summary"], killed


def forget_address(cluster: Any) -> None:
    """Remove the address file Ray's ``Cluster`` writes for its head (``/tmp/ray/
    ray_current_cluster``): while it names this cluster, any ``ray.init()`` on this machine
    without an address -- another user's tests, a ``plora sweep`` -- would join it. This
    benchmark passes its address explicitly."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    if path.is_file() and path.read_text().strip() == cluster.head_node.gcs_address:
        path.unlink()


def victim(cluster: Any) -> Any:
    """A node to kill: not the head and not the driver's (the relay actor lives there; losing
    the driver's node is the driver's death, a different failure)."""
    import ray

    mine = ray.get_runtime_context().get_node_id()
    relay = {a["Address"]["NodeID"] for a in ray._private.state.actors().values()
             if a["ActorClassName"] == "CoordinatorActor" and a["State"] == "ALIVE"}  # fmt: skip
    return next(n for n in cluster.worker_nodes if n.node_id != mine and n.node_id not in relay)


def timed_status(out: Path) -> tuple[float, bool]:
    """``plora status DIR`` in a fresh process: (wall seconds, exit 0)."""
    exe = Path(sys.executable).with_name("plora")
    # no console script (plora on PYTHONPATH, the device machine): the CLI's app, as the script
    # calls it (plora.cli has no __main__: `python -m plora.cli` exits at once, not timed)
    cli = [sys.executable, "-c", "from plora.cli import app; app()"]
    cmd = [*([str(exe)] if exe.exists() else cli), "status", str(out)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return time.perf_counter() - t, proc.returncode == 0


def lost_configs(out: Path, ids: list[str]) -> list[str]:
    """Configs with no row of a finished status (done / stopped / failed) in results.parquet."""
    import pandas as pd

    from plora.sweepdir.schema import ConfigStatus

    res = pd.read_parquet(out / "results.parquet")
    finished = {str(s) for s in (ConfigStatus.DONE, ConfigStatus.STOPPED, ConfigStatus.FAILED)}
    have = set(res.loc[res["status"].isin(finished), "config_id"])
    return sorted(set(ids) - have)


def write_cost(rows: int, batch: int = 1000) -> dict[str, Any]:
    """``SweepStore.append_metrics`` + ``flush_metrics`` of ``batch`` rows at a time up to
    ``rows``: milliseconds per flush in each tenth of the rows (flat: appending does not
    rewrite what is written), the total, and the files ``metrics.parquet`` ends as."""
    import pandas  # noqa: F401  (imported before the first flush is timed)

    from plora.sweepdir.store import SweepStore

    work = Path(tempfile.mkdtemp(prefix="plora-cp-writes-"))
    store = SweepStore(work)
    times: list[float] = []
    for b in range(rows // batch):
        store.append_metrics(
            {"config_id": f"c{(b * batch + i) // 100:05d}", "job_id": "j1", "attempt": 0,
             "step": (b * batch + i) % 100 + 1, "loss": 1.0, "lr": 1e-4, "tokens": 1024,
             "grad_norm": 1.0, "step_time_s": 0.1, "time": float(b)}
            for i in range(batch)
        )  # fmt: skip
        t = time.perf_counter()
        store.flush_metrics()
        times.append(time.perf_counter() - t)
    path = store.metrics_parquet
    files = [path] if path.is_file() else sorted(path.glob("*.parquet"))
    tenth = max(1, len(times) // 10)
    out = {
        "rows": rows,
        "flushes": len(times),
        "total_s": round(sum(times), 2),
        "ms_per_flush_by_tenth": [
            round(1e3 * sum(times[i : i + tenth]) / len(times[i : i + tenth]), 2)
            for i in range(0, len(times), tenth)
        ][:10],
        "max_ms": round(1e3 * max(times), 1),
        "files": len(files),
        "mib": round(sum(f.stat().st_size for f in files) / 2**20, 1),
    }
    shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.writes_only:
        report = {"title": "sweep-directory metric writes", **write_cost(args.writes_only)}
        print(json.dumps(report, indent=1))
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1))
        return report
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    num_gpus = args.nodes * args.gpus_per_node
    work = Path(tempfile.mkdtemp(prefix="plora-cp-"))
    out = (args.out or work / "sweep").absolute()
    sweep = make_sweep(work, num_gpus, early_stop=not args.no_early_stop)
    cost = build_cost_model(sweep, use_profile=False)
    configs = make_configs(args.configs, args.steps, args.seed)
    scale = time_scale(cost, configs, args.step_ms)
    print(f"{TITLE}\n{args.configs} configs, {args.nodes} nodes x {args.gpus_per_node} logical "
          f"GPUs, a median step {args.step_ms:.0f} ms (booked x {scale:.2e})", flush=True)  # fmt: skip

    import ray

    from plora.runtime.driver import RunOptions, run_sweep
    from plora.runtime.records import StaticSource

    cluster = start_cluster(args, scale)
    probe = Probe(total=len(configs))
    probe.install()
    if args.snapshot_s > 0 and args.json is not None:
        partial = args.json.with_name(args.json.name + ".partial")
        threading.Thread(
            target=snapshots, args=(probe, partial, args.snapshot_s), daemon=True
        ).start()
    options = RunOptions(engine=SimEngine, record_profile=False, checkpoint_every=20)
    try:
        summary, killed = run_with_killer(cluster, probe, args, lambda: run_sweep(
            sweep, out, address=cluster.address, cost=cost, source=StaticSource(configs),
            options=options))  # fmt: skip
    finally:
        probe.done.set()
        probe.uninstall()
        ray.shutdown()
        cluster.shutdown()
    status_s, status_ok = timed_status(out)
    t = time.perf_counter()
    from plora.api import load

    loaded = load(out)
    load_s = time.perf_counter() - t
    lost = lost_configs(out, [c.config_id for c in configs])
    report = {
        "title": TITLE,
        "configs": args.configs,
        "nodes": args.nodes,
        "gpus": num_gpus,
        "step_ms": args.step_ms,
        "time_scale": scale,
        "wall_s": round(summary.wall_s, 2),
        "counts": summary.counts,
        "lost": len(lost),
        "lost_ids": lost[:20],
        **probe.report(),
        "killed_node": killed,
        "status_s": round(status_s, 3),
        "status_ok": status_ok,
        "load_s": round(load_s, 3),
        "loaded_configs": len(loaded.results),
    }
    print(json.dumps(report, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    if not args.keep and args.out is None:
        shutil.rmtree(work, ignore_errors=True)
    return report


if __name__ == "__main__":
    main()
