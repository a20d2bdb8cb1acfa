"""Ray Tune + ASHA over 16 LoRA configs, trained packed by plora underneath.

A Tune user's script: ``tune.Tuner``, a grid over lr x rank x target modules, ASHA stopping
the lagging configs -- and ``plora_trainable`` as the trainable, so the 16 trials are 16
configs of the packed sweep in ``<storage>/<name>/plora/`` (ASHA's STOP stops one adapter
inside its pack and the slot is refilled). The ``ResultGrid`` has one row per config; the
best result's checkpoint is that adapter's PEFT directory.

Runs on CPU with the built-in tiny model and arithmetic task (a few minutes on 2 cores)::

    python examples/tune_asha.py --storage-path /tmp/plora-tune
    python -c "from ray.tune import ExperimentAnalysis as E; print(E('/tmp/plora-tune/asha').dataframe())"

``Tuner.restore`` continues a killed run: rerun with ``--restore``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--storage-path",
        type=Path,
        required=True,
        help="Tune's storage path (local or shared; the experiment goes under it)",
    )
    parser.add_argument("--name", default="asha", help="the experiment's name")
    parser.add_argument(
        "--sweep",
        type=Path,
        default=ROOT / "sweeps" / "quickstart.yaml",
        help="base model, dataset and hardware (its space gives fixed values)",
    )
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--restore", action="store_true", help="Tuner.restore the experiment")
    args = parser.parse_args(argv)

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from plora.config import SweepConfig
    from plora.tune.scheduler import PLoRAScheduler
    from plora.tune.trainable import plora_trainable

    data = SweepConfig.from_yaml(args.sweep).to_dict()
    data["space"].update(max_steps=args.max_steps, warmup_steps=0)
    sweep = SweepConfig.from_dict(data, source=str(args.sweep))
    trainable = plora_trainable(sweep)
    path = args.storage_path.absolute() / args.name
    if args.restore:
        tuner = tune.Tuner.restore(str(path), trainable=trainable, resume_unfinished=True)
    else:
        asha = ASHAScheduler(time_attr="adapter_step", max_t=args.max_steps, grace_period=10,
                             reduction_factor=2)  # fmt: skip
        tuner = tune.Tuner(
            trainable,
            param_space={
                "lr": tune.grid_search([3e-4, 1e-3, 3e-3, 3e-2]),
                "rank": tune.grid_search([4, 16]),
                "target_modules": tune.grid_search(["q_proj,v_proj", "all"]),
            },
            tune_config=tune.TuneConfig(metric="loss", mode="min",
                                        scheduler=PLoRAScheduler(asha)),
            run_config=tune.RunConfig(storage_path=str(args.storage_path.absolute()),
                                      name=args.name, verbose=1),
        )  # fmt: skip
    results = tuner.fit()
    df = results.get_dataframe()
    cols = ["config_id", "config/lr", "config/rank", "config/target_modules", "status", "steps",
            "loss", "eval_loss", "eval_metric"]  # fmt: skip
    print(df[[c for c in cols if c in df]].sort_values("eval_loss").to_string(index=False))
    best = results.get_best_result(metric="eval_loss", mode="min", scope="last")
    print(f"\n{int(df['early_stopped'].sum())} of {len(df)} configs stopped early by ASHA")
    print(f"best: {best.config} eval_loss={best.metrics['eval_loss']:.4f}")
    print(f"its adapter (PEFT): {best.checkpoint.path if best.checkpoint else None}")
    print(f"the packed sweep: {path / 'plora'} (plora status / plora report read it)")
    return 0 if not results.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
