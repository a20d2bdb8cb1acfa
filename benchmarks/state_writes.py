"""The driver's sweep-directory writes as a sweep grows, without Ray: ``state.json`` (and its
log) and ``results.parquet``, one write a turn while configs arrive, train and end.

Each turn one config arrives, eight running configs report 5 more steps to the early stopper
(``plora.tune.adapter_stopper.AdapterEarlyStopper``, ASHA with grace 10 and factor 2: the
state's rungs), and the config that arrived 20 turns before ends with a result (done, or
stopped); then the
coordinator's state is written with ``SweepStore.write_state`` and the results with
``write_results``, as ``plora.runtime.coordinator.recording.persist`` does. The shape of the
state is the coordinator's (``CoordinatorState.get_state(live=True)``: tracked books where the
tree has them, ``plora.sweepdir.tracked``); its numbers are made up.

Usage::

    python benchmarks/state_writes.py --configs 2000                 # this checkout
    python benchmarks/state_writes.py --trees /tmp/old .             # two checkouts, one run

``--trees``: each tree's ``plora`` is imported in a child process of its own (side by side in
one run); prints a row per tree: ms per write by tenth of the sweep, totals, the sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(configs: int) -> dict:
    """Run the writes in this process (the ``plora`` on ``sys.path``); their times and sizes."""
    from plora.config.asha_options import EarlyStopConfig
    from plora.sweepdir.store import SweepStore
    from plora.tune.adapter_stopper import AdapterEarlyStopper

    try:  # the coordinator's books are tracked (what changed is told, not found by comparing)
        from plora.sweepdir.tracked import TrackedDict, TrackedList
    except ImportError:  # a tree from before: plain containers, compared in full at each write
        TrackedDict, TrackedList = dict, list  # type: ignore[misc,assignment]
    tracked = TrackedDict is not dict
    rng = random.Random(0)
    stopper = AdapterEarlyStopper(EarlyStopConfig(grace_steps=10, reduction_factor=2))
    ids: list[str] = []
    status: dict[str, str] = TrackedDict()
    progress: dict[str, int] = TrackedDict()
    results: dict[str, dict] = TrackedDict()
    rows: dict[str, list] = {"configs": TrackedList(), "job_rows": TrackedList(),
                             "steps": TrackedList()}  # fmt: skip
    state_ms: list[float] = []
    results_ms: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        store = SweepStore(d)
        (Path(d) / "adapters").mkdir()
        for turn in range(configs):
            cid = f"cfg-{turn:05d}"
            ids.append(cid)
            status[cid], progress[cid] = "queued", 0
            rows["configs"].append({"config_id": cid, "rank": 16, "alpha": 32.0, "lr": 1e-4,
                                    "batch_size": 4, "target_modules": ["q_proj", "v_proj"]})  # fmt: skip
            running = [c for c in ids[-20:] if status[c] in ("queued", "running")]
            for c in rng.sample(running, min(8, len(running))):
                progress[c] += 5
                status[c] = "running"
                if stopper.on_step(c, progress[c], rng.random()):
                    status[c] = "stopped"
            if turn >= 20:  # it trained to its end, or the stopper stopped it
                done = ids[turn - 20]
                status[done] = "stopped" if status[done] == "stopped" else "done"
                results[done] = {"config_id": done, "status": status[done], "steps": progress[done],
                                 "eval_loss": rng.random(),
                                 "adapter_path": str(Path(d) / "adapters" / done)}  # fmt: skip
            rows["job_rows"].append({"job_id": f"j{turn}", "attempt": 0, "start": float(turn)})
            rows["steps"].append({"job_id": f"j{turn}", "config_ids": [cid], "time_s": 0.1})
            state = {
                "version": 1, "elapsed_s": float(turn), "configs": rows["configs"],
                "status": status, "progress": progress, "results": results,
                "job_rows": rows["job_rows"], "measurements": {"steps": rows["steps"]},
                "early_stop": stopper.live_state() if tracked else stopper.get_state(),
            }  # fmt: skip
            t = time.perf_counter()
            store.write_state(state)
            t1 = time.perf_counter()
            if tracked:  # as the coordinator hands them over: the mapping, and its order
                store.write_results(results, order=ids)
            else:
                store.write_results([results[c] for c in ids if c in results])
            t2 = time.perf_counter()
            state_ms.append(1000 * (t1 - t))
            results_ms.append(1000 * (t2 - t1))
        parts = Path(d) / "state.parts"
        return {
            "configs": configs,
            "state_total_s": sum(state_ms) / 1000,
            "state_ms_by_tenth": _tenths(state_ms),
            "results_total_s": sum(results_ms) / 1000,
            "results_ms_by_tenth": _tenths(results_ms),
            "head_kb": (Path(d) / "state.json").stat().st_size / 1024,
            "parts_kb": sum(p.stat().st_size for p in parts.iterdir()) / 1024
            if parts.is_dir()
            else 0.0,
        }


def _tenths(ms: list[float]) -> list[float]:
    n = max(1, len(ms) // 10)
    return [round(sum(ms[i * n : (i + 1) * n]) / n, 2) for i in range(10)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=2000, help="configs (= writes)")
    parser.add_argument("--trees", nargs="*", default=[str(ROOT)],
                        help="checkouts whose plora to measure, each in a child process")  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.configs < 10:
        parser.error(f"--configs must be at least 10, got {args.configs}")
    if args.child:
        print(json.dumps(measure(args.configs)))
        return
    for tree in args.trees:
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        out = subprocess.run([sys.executable, __file__, "--child", "--configs", str(args.configs)],
                             env=env, check=True, capture_output=True, text=True)  # fmt: skip
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{tree}: state.json {row['state_total_s']:.2f} s in all, ms a write by tenth "
              f"{row['state_ms_by_tenth']}; results.parquet {row['results_total_s']:.2f} s, "
              f"{row['results_ms_by_tenth']}; head {row['head_kb']:.0f} KB, "
              f"log(s) {row['parts_kb']:.0f} KB", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
