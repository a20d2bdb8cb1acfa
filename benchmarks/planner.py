"""Planner benchmark: wall and CPU seconds and makespan / lower bound, paper to cluster scale.

Instances (targets from DESIGN.md: 120 x 8 <= 5 s; 100,000 x 1,024 <= 60 s on 2 CPU cores with a
makespan <= 1.05x its lower bound):

* ``table1``: ``sweeps/paper-table1.yaml`` (120 configs, Qwen2.5-7B, 8x A100-40GB, TP) on
  the real cost model (``plora.cost.build.build_cost_model``, no profile).
* ``table1-NxG``: N configs sampled from the paper's Table-1 ranges (lr 2e-5..4e-4, batch
  1..32, rank 8..128, alpha r/4..4r, all projections, 1 epoch) on the same cost model with G
  GPUs (TP allowed), N x G from 120 x 8 to 100,000 x 1,024.
* ``affine-NxG``: the same configs on :class:`plora.planner.synthetic.AffineCostModel`
  (7B-on-H200-like magnitudes, TP and FSDP).

Each row also times the coordinator's re-plan halfway through the first wave of jobs (every
other config queued; :func:`mid_sweep_replan`) -- ``replan_*`` -- since the coordinator re-plans
on the same path while the sweep runs.

Usage::

    python benchmarks/planner.py                 # all instances, a table on stdout
    python benchmarks/planner.py --markdown      # the same as a Markdown table
    python benchmarks/planner.py --only 10000x256  # instances whose name contains it
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from pathlib import Path

from plora.config import PROJECTIONS, LoRAConfig, SweepConfig
from plora.cost.build import build_cost_model
from plora.planner import Baseline, baseline_plan, choose_plan, continue_plan, plan_sweep, replan
from plora.planner.synthetic import AffineCostModel
from plora.tune.space import expand

ROOT = Path(__file__).resolve().parents[1]


def table1_configs(n: int, seed: int = 0) -> list[LoRAConfig]:
    """n configs drawn from the paper's Table-1 ranges."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rank = rng.choice([8, 16, 32, 64, 128])
        out.append(
            LoRAConfig(
                config_id=f"t1-{i:04d}",
                rank=rank,
                alpha=rank * rng.choice([0.25, 0.5, 1.0, 2.0, 4.0]),
                lr=10 ** rng.uniform(math.log10(2e-5), math.log10(4e-4)),
                batch_size=rng.choice([1, 2, 4, 8, 16, 32]),
                target_modules=PROJECTIONS,
                epochs=1.0,
            )
        )
    return out


def instances():
    """(name, configs, cost model, GPUs) for every benchmark instance."""
    sweep = SweepConfig.from_yaml(ROOT / "sweeps" / "paper-table1.yaml")
    real = build_cost_model(sweep, use_profile=False)
    yield "table1 (yaml)", expand(sweep), real, sweep.hardware.num_gpus
    for n, g in SIZES:
        hw = dataclasses.replace(sweep.hardware, num_gpus=g)
        cost = build_cost_model(dataclasses.replace(sweep, hardware=hw), use_profile=False)
        yield f"table1-{n}x{g}", table1_configs(n), cost, g
    for n, g in SIZES:
        cost = AffineCostModel(dataset_size=sweep.dataset.num_examples)
        yield f"affine-{n}x{g}", table1_configs(n), cost, g


#: (configs, GPUs) of the sampled instances.
SIZES = ((120, 8), (500, 32), (1000, 64), (2000, 64), (5000, 128), (10000, 256), (100000, 1024))


def run(only: str = "") -> list[dict]:
    rows = []
    for name, configs, cost, gpus in instances():
        if only not in name:
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_sweep(configs, cost, gpus)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        row = {
            "instance": name,
            "configs": len(configs),
            "gpus": gpus,
            "wall_s": wall,
            "cpu_s": cpu,
            "jobs": len(plan.jobs),
            "makespan_h": plan.makespan_s / 3600,
            "lb_h": plan.lower_bound_s / 3600,
            "ratio": plan.lb_ratio,
            "thm61": plan.ratio_bound,
            **mid_sweep_replan(configs, cost, gpus, plan),
        }
        for kind in Baseline:
            try:
                base = baseline_plan(configs, cost, gpus, kind)
                row[str(kind)] = base.makespan_s / plan.makespan_s
            except Exception:  # max_gpu/sequential need a multi-GPU strategy
                row[str(kind)] = float("nan")
        rows.append(row)
        print(
            f"# {name}: {wall:.2f} s wall, {cpu:.2f} s CPU, notes: {'; '.join(plan.notes)}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def mid_sweep_replan(configs, cost, gpus: int, plan) -> dict:
    """The coordinator's re-plan in the middle of the first wave (``plora.runtime.coordinator.scheduling.
    plan``): the jobs starting at 0 run on their resident groups, every other config is
    queued, and the re-plan (``replan``) is weighed against the plan in force re-timed
    (``continue_plan``, ``choose_plan``). Returns its wall and CPU seconds, the re-plan's
    makespan / lower bound and which plan the guard kept."""
    first = [j for j in plan.jobs if j.start_s == 0.0]
    busy = {c for j in first for c in j.config_ids}
    queued = [c for c in configs if c.config_id not in busy]
    now = min(j.end_s for j in first) / 2
    resident = [j.gpu_ids for j in first]
    t0, c0 = time.perf_counter(), time.process_time()
    candidate = replan(queued, 0, first, now, cost, gpus, resident=resident)
    pending = [j for j in plan.jobs if j.start_s > 0.0]
    current = continue_plan(pending, queued, cost, gpus, now=now, running=first, free_gpus=0,
                            resident=resident)  # fmt: skip
    _, choice = choose_plan(current, candidate)
    return {
        "replan_wall_s": time.perf_counter() - t0,
        "replan_cpu_s": time.process_time() - c0,
        "replan_ratio": candidate.lb_ratio,
        "replan_choice": str(choice.kind),
    }


COLUMNS = [
    ("instance", "{}"),
    ("configs", "{}"),
    ("gpus", "{}"),
    ("wall_s", "{:.2f}"),
    ("cpu_s", "{:.2f}"),
    ("jobs", "{}"),
    ("makespan_h", "{:.3f}"),
    ("lb_h", "{:.3f}"),
    ("ratio", "{:.4f}"),
    ("thm61", "{:.3f}"),
    ("replan_wall_s", "{:.2f}"),
    ("replan_cpu_s", "{:.2f}"),
    ("replan_ratio", "{:.4f}"),
    ("replan_choice", "{}"),
    ("min_gpu", "{:.2f}x"),
    ("max_gpu", "{:.2f}x"),
    ("sequential", "{:.2f}x"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--only", default="", help="run the instances whose name contains this")
    args = parser.parse_args()
    rows = run(args.only)
    cells = [[fmt.format(r[k]) for k, fmt in COLUMNS] for r in rows]
    head = [k for k, _ in COLUMNS]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for c in cells:
            print("| " + " | ".join(c) + " |")
    else:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
        print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
        for c in cells:
            print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


if __name__ == "__main__":
    main()
