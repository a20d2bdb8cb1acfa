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
* ``steps-NxG``: Table-1 configs whose ``max_steps`` is drawn per config from U(0.2, 1.8) x 100
  (every config its own step count) on the real cost model.

Each row also times the coordinator's re-plan halfway through the first wave of jobs (every
other config queued; :func:`mid_sweep_replan`) -- ``replan_*`` -- since the coordinator re-plans
on the same path while the sweep runs.

Each instance runs in a child process and its row is printed as soon as it ends; one that
passes ``--timeout`` seconds is stopped and printed with the phases it finished (``-`` for the
rest, its status ``timeout``).

Usage::

    python benchmarks/planner.py                 # all instances, a table on stdout
    python benchmarks/planner.py --markdown      # the same as a Markdown table
    python benchmarks/planner.py --only 10000x256  # instances whose name contains it
    python benchmarks/planner.py --timeout 120   # stop an instance after 120 s
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing as mp
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


def own_step_configs(n: int, seed: int = 0) -> list[LoRAConfig]:
    """:func:`table1_configs` with ``max_steps`` drawn per config from U(0.2, 1.8) x 100 (every
    config its own step count: the case that made F(d, K)'s knapsacks slow, issue 44)."""
    rng = random.Random(seed + 1)
    return [
        dataclasses.replace(c, epochs=None, max_steps=max(2, round(100 * rng.uniform(0.2, 1.8))))
        for c in table1_configs(n, seed)
    ]


def instances():
    """(name, a function building (configs, cost model, GPUs)) for every benchmark instance."""
    sweep = SweepConfig.from_yaml(ROOT / "sweeps" / "paper-table1.yaml")

    def real(g: int):
        hw = dataclasses.replace(sweep.hardware, num_gpus=g)
        return build_cost_model(dataclasses.replace(sweep, hardware=hw), use_profile=False)

    yield "table1 (yaml)", lambda: (expand(sweep), real(8), sweep.hardware.num_gpus)
    for n, g in SIZES:
        yield f"table1-{n}x{g}", lambda n=n, g=g: (table1_configs(n), real(g), g)
    for n, g in SIZES:
        cost = AffineCostModel(dataset_size=sweep.dataset.num_examples)
        yield f"affine-{n}x{g}", lambda n=n, g=g, cost=cost: (table1_configs(n), cost, g)
    for n, g in STEP_SIZES:
        yield f"steps-{n}x{g}", lambda n=n, g=g: (own_step_configs(n), real(g), g)


#: (configs, GPUs) of the sampled instances.
SIZES = ((120, 8), (500, 32), (1000, 64), (2000, 64), (5000, 128), (10000, 256), (100000, 1024))

#: (configs, GPUs) of the instances whose configs each have their own step count.
STEP_SIZES = ((200, 6), (1000, 32))


def measure(name: str, build, send) -> None:
    """Plan one instance, ``send`` its row after each phase (plan, re-plan, each baseline)."""
    configs, cost, gpus = build()
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
    }
    print(f"# {name}: {wall:.2f} s wall, {cpu:.2f} s CPU, notes: {'; '.join(plan.notes)}",
          file=sys.stderr, flush=True)  # fmt: skip
    send(row)
    row.update(mid_sweep_replan(configs, cost, gpus, plan))
    send(row)
    for kind in Baseline:
        try:
            base = baseline_plan(configs, cost, gpus, kind)
            row[str(kind)] = base.makespan_s / plan.makespan_s
        except Exception:  # max_gpu/sequential need a multi-GPU strategy
            row[str(kind)] = float("nan")
        send(row)


def run(only: str = "", timeout_s: float = 900.0, *, markdown: bool = False) -> list[dict]:
    """Every instance whose name contains ``only``, each in a child process stopped after
    ``timeout_s``; each row is printed as soon as its instance ends (or times out: then with
    the phases it finished)."""
    ctx = mp.get_context("fork")
    rows = []
    print_header(markdown)
    for name, build in instances():
        if only not in name:
            continue
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=measure, args=(name, build, send.send), daemon=True)
        child.start()
        send.close()
        row: dict = {"instance": name}
        deadline = time.monotonic() + timeout_s
        ended = False
        while not ended and (left := deadline - time.monotonic()) > 0:
            if recv.poll(min(left, 1.0)):
                try:
                    row = recv.recv()
                except EOFError:  # the child ended: every row it sent is in
                    ended = True
            elif not child.is_alive():
                ended = True
        if not ended:
            child.kill()
        child.join()
        if not ended:
            row["status"] = f"timeout {timeout_s:g} s"
        else:
            row["status"] = "done" if child.exitcode == 0 else f"failed (exit {child.exitcode})"
        rows.append(row)
        print_row(row, markdown)
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
    ("tune", "{:.2f}x"),
    ("status", "{}"),
]


def print_header(markdown: bool) -> None:
    head = [k for k, _ in COLUMNS]
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head), flush=True)
    else:
        print("  ".join(h.rjust(_width(h)) for h in head), flush=True)


def print_row(row: dict, markdown: bool) -> None:
    """One row, now: a phase the instance did not reach prints as ``-``."""
    cells = [fmt.format(row[k]) if k in row else "-" for k, fmt in COLUMNS]
    if markdown:
        print("| " + " | ".join(cells) + " |", flush=True)
    else:
        print("  ".join(c.rjust(_width(k)) for c, (k, _) in zip(cells, COLUMNS, strict=True)),
              flush=True)  # fmt: skip


def _width(key: str) -> int:
    return 22 if key in ("instance", "status") else max(len(key), 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--only", default="", help="run the instances whose name contains this")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds per instance (plan, re-plan and baselines) before it is "
                        "stopped and printed with the phases it finished")  # fmt: skip
    args = parser.parse_args()
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout:g}")
    run(args.only, args.timeout, markdown=args.markdown)


if __name__ == "__main__":
    main()
