"""Shared by the Ray Tune tests (test_tune*.py): the packfn-backed sweep, its cost model, the
Tuners they fit, and the decisions-log check that freed slots are refilled."""

from __future__ import annotations

from pathlib import Path

from packfn import PackFnEngine

from plora.config import SweepConfig
from plora.runtime.driver import RunOptions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MAX_STEPS = 60
LRS = [2e-4, 5e-4, 1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3]


def tune_sweep(name: str = "tunetest", num_gpus: int = 2) -> SweepConfig:
    """A sweep whose cost model packs three configs per job (1.14 GiB per logical GPU)."""
    return SweepConfig.from_dict(
        {
            "name": name,
            "model": "tiny-qwen2",
            "dataset": {"builtin": "arithmetic", "num_examples": 200, "max_seq_len": 32},
            "space": {"lr": LRS, "rank": [4, 8], "alpha": 16, "batch_size": 32,
                      "max_steps": MAX_STEPS},
            "hardware": {"gpu_type": "cpu", "num_gpus": num_gpus, "gpu_memory_gib": 1.14},
        }
    )  # fmt: skip


def cost_of(sweep: SweepConfig):
    from plora.cost.build import build_cost_model

    return build_cost_model(sweep, use_profile=False)


def asha_tuner(storage: Path, name: str, trainable, *, lrs: list[float] = LRS):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from plora.tune.scheduler import PLoRAScheduler

    asha = ASHAScheduler(time_attr="adapter_step", max_t=MAX_STEPS, grace_period=10,
                         reduction_factor=2)  # fmt: skip
    return tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search(lrs), "rank": tune.grid_search([4, 8])},
        tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=PLoRAScheduler(asha)),
        run_config=tune.RunConfig(storage_path=str(storage), name=name, verbose=0),
    )


def searched_tuner(storage: Path, name: str, trainable, search_alg):
    """Four trials of lr (log-uniform) x rank drawn by ``search_alg``, two at a time."""
    from ray import tune

    return tune.Tuner(
        trainable,
        param_space={"lr": tune.loguniform(2e-4, 6e-3), "rank": tune.choice([4, 8])},
        tune_config=tune.TuneConfig(metric="loss", mode="min", num_samples=4,
                                    max_concurrent_trials=2, search_alg=search_alg),
        run_config=tune.RunConfig(storage_path=str(storage), name=name, verbose=0),
    )  # fmt: skip


def trainable_for(name: str):
    """The packfn-backed trainable of the restore test (the killed driver and the restore)."""
    from plora.tune.trainable import plora_trainable

    sweep = tune_sweep(name)
    options = RunOptions(engine=PackFnEngine, calibration_steps=0, checkpoint_every=5)
    return plora_trainable(sweep, options=options, cost=cost_of(sweep), settle_s=1.0,
                           linger_s=5.0)  # fmt: skip


def every_freed_slot_refilled_while_queued(decisions: list[dict]) -> None:
    """Every adapter stopped while configs were queued had its slot refilled (a ``refill`` of
    its job) before that job ended, unless the queue emptied first; a job whose adapters all
    stopped ends at once and its GPU takes a queued config next (``start_job`` on the warm
    worker) before anything else happens."""
    queued: set[str] = set()
    job_of: dict[str, str] = {}
    owed: dict[str, int] = {}  # job -> slots freed by a stop and not refilled yet
    restart = None  # a job that ended with owed slots: the next launch must take queued configs
    for d in decisions:
        kind, ids, job = d["kind"], set(d["config_ids"]), d["job_id"]
        if restart and kind in ("refill", "stop_config", "job_done"):
            raise AssertionError(f"{restart} ended with freed slots and no queued config started")
        if kind == "ask":
            queued |= ids
        elif kind in ("start_job", "refill"):
            restart = None
            queued -= ids
            job_of.update(dict.fromkeys(ids, job))
            if kind == "refill":
                owed[job] = max(0, owed.get(job, 0) - 1)
            if not queued:
                owed.clear()  # nothing left to refill with
        elif kind == "stop_config" and d["inputs"]["was"] == "running" and queued:
            (cid,) = ids
            owed[job_of[cid]] = owed.get(job_of[cid], 0) + 1
        elif kind == "stop_config":
            queued -= ids
        elif kind == "job_done" and owed.pop(job, 0):
            restart = job
    assert not restart and not queued, f"configs never started: {sorted(queued)}"
