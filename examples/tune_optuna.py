"""Ray Tune + Optuna (TPE) over LoRA hyperparameters, trained packed by plora underneath.

Optuna proposes configs as results come back (``max_concurrent_trials`` at a time); each
proposal is a proxy trial whose config joins the packed sweep in ``<storage>/<name>/plora/``
(a new pack, or a slot freed by a finished config). The searcher is told each trial's last
result: its training ``loss`` at the last step (Tune needs the metric in every report, and the
eval loss only exists at the end); the best adapter is then picked by ``eval_loss``. Swap in
``HyperOptSearch`` with ``--search hyperopt``.

Runs on CPU with the built-in tiny model and arithmetic task (a few minutes on 2 cores)::

    python examples/tune_optuna.py --storage-path /tmp/plora-tune --num-samples 12
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", type=Path, required=True)
    parser.add_argument("--name", default="optuna")
    parser.add_argument("--sweep", type=Path, default=ROOT / "sweeps" / "quickstart.yaml")
    parser.add_argument("--num-samples", type=int, default=12)
    parser.add_argument("--concurrent", type=int, default=6, help="trials Optuna has in flight")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--search", choices=["optuna", "hyperopt"], default="optuna")
    args = parser.parse_args(argv)

    from ray import tune

    from plora.config import SweepConfig
    from plora.tune.trainable import plora_trainable

    data = SweepConfig.from_yaml(args.sweep).to_dict()
    data["space"].update(max_steps=args.max_steps, warmup_steps=0)
    sweep = SweepConfig.from_dict(data, source=str(args.sweep))
    if args.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search = OptunaSearch(seed=0)
    else:
        from ray.tune.search.hyperopt import HyperOptSearch

        search = HyperOptSearch(random_state_seed=0, n_initial_points=args.concurrent)
    tuner = tune.Tuner(
        plora_trainable(sweep),
        param_space={"lr": tune.loguniform(1e-4, 3e-2), "rank": tune.choice([4, 8, 16])},
        tune_config=tune.TuneConfig(metric="loss", mode="min", search_alg=search,
                                    num_samples=args.num_samples,
                                    max_concurrent_trials=args.concurrent),
        run_config=tune.RunConfig(storage_path=str(args.storage_path.absolute()),
                                  name=args.name, verbose=1),
    )  # fmt: skip
    results = tuner.fit()
    df = results.get_dataframe().sort_values("eval_loss")
    print(
        df[["config_id", "config/lr", "config/rank", "steps", "eval_loss"]].to_string(index=False)
    )
    best = results.get_best_result(metric="eval_loss", mode="min", scope="last")
    print(f"best: {best.config} eval_loss={best.metrics['eval_loss']:.4f}")
    print(f"its adapter (PEFT): {best.checkpoint.path if best.checkpoint else None}")
    return 0 if not results.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
