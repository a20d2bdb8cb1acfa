"""Plan and run a plora sweep from Python, then read its results.

The same steps as ``plora plan`` + ``plora sweep`` + ``plora status``, through the library API
(:mod:`plora.api`, which the CLI calls too):

1. load a sweep YAML (:meth:`plora.config.SweepConfig.from_yaml`), optionally overriding keys;
2. plan it (:func:`plora.api.plan`: expand into configs, build the cost model, pack the jobs)
   and compare with the Min-GPU baseline;
3. run the sweep on Ray (:func:`plora.api.run`; a local Ray when no address is given);
4. load the sweep directory (:func:`plora.api.load`) and print the best config.

Runs on CPU with the defaults (the built-in tiny model and arithmetic task, under a minute)::

    python examples/programmatic.py --out runs/programmatic
    python examples/programmatic.py --sweep sweeps/quickstart.yaml --max-steps 20 --out /tmp/qs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from plora import analysis, api
from plora.config import ConfigError, SweepConfig
from plora.utils import fmt_duration

ROOT = Path(__file__).resolve().parents[1]


def load_sweep(path: Path, *, max_steps: int | None, num_examples: int | None) -> SweepConfig:
    """The sweep in ``path``, with ``space.max_steps`` / ``dataset.num_examples`` overridden."""
    sweep = SweepConfig.from_yaml(path)
    if max_steps is None and num_examples is None:
        return sweep
    data = sweep.to_dict()
    if max_steps is not None:
        data["space"]["max_steps"] = max_steps
        data["space"].pop("epochs", None)
    if num_examples is not None:
        data["dataset"]["num_examples"] = num_examples
    # validated again, so a bad override is a ConfigError naming the key
    return SweepConfig.from_dict(data, source=str(path), base_dir=path.parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", type=Path, default=ROOT / "sweeps" / "quickstart.yaml")
    parser.add_argument("--out", type=Path, default=Path("runs/programmatic"),
                        help="sweep directory to create (must not exist)")  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=None,
                        help="override space.max_steps (e.g. 10 for a smoke run)")  # fmt: skip
    parser.add_argument("--num-examples", type=int, default=None,
                        help="override dataset.num_examples")  # fmt: skip
    parser.add_argument("--resume", action="store_true",
                        help="continue the sweep in --out (its saved sweep.yaml is run)")  # fmt: skip
    parser.add_argument("--address", default=None,
                        help="Ray address (auto, host:port); default: a local Ray")  # fmt: skip
    args = parser.parse_args(argv)

    try:
        sweep = load_sweep(args.sweep, max_steps=args.max_steps, num_examples=args.num_examples)
        report = api.plan(sweep)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    plan, min_gpu, g = report.plan, report.baselines["min_gpu"], sweep.hardware.num_gpus
    print(
        f"{sweep.name}: {len(report.configs)} configs of {sweep.model.name_or_path} on {g} GPU(s)"
    )
    print(f"{'job':<8} {'configs':>7} {'gpus':>4} {'start':>9} {'end':>9}  config ids")
    for job in plan.jobs:
        print(f"{job.job_id:<8} {len(job.config_ids):>7} {job.gpus:>4} "
              f"{fmt_duration(job.start_s):>9} {fmt_duration(job.end_s):>9}  "
              f"{' '.join(job.config_ids)}")  # fmt: skip
    print(f"planned makespan {fmt_duration(plan.makespan_s)} (solver {plan.solver}); "
          f"min-gpu baseline {fmt_duration(min_gpu.makespan_s)}; "
          f"lower bound {fmt_duration(plan.lower_bound_s)}")  # fmt: skip

    try:
        summary = api.run(sweep, args.out, address=args.address, resume=args.resume)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"ran in {summary.wall_s:.1f}s: {summary.counts}")

    res = api.load(summary.out)
    facts = analysis.summary(res)
    print(f"measured makespan {facts.get('makespan_s', float('nan')):.1f}s over "
          f"{facts['jobs']} job(s), GPU utilization {facts.get('gpu_utilization', float('nan')):.2f}")  # fmt: skip
    top = res.best(k=1)
    if top.empty:
        print("no config finished", file=sys.stderr)
        return 1
    row = top.iloc[0]
    print(f"best by {res.metric} ({res.mode}): {row['config_id']} "
          f"{res.metric}={row[res.metric]:.4g}")  # fmt: skip
    table = analysis.best_config_table(res.results, res.metric, res.mode, k=3)
    print(table.to_string(index=False))
    print(f"adapter: {row['adapter_path']}  (base model: {summary.out / 'base_model'})")
    return 0 if summary.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
