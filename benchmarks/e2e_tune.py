"""The baselines of ``benchmarks/e2e.py``: a LoRA sweep the way users write it today.

Ray Tune + PEFT, one trial per config. Each trial is an ordinary single-adapter fine-tune
(``benchmarks/e2e_trial.py``: load, ``get_peft_model``, the seeded batches, AdamW and
transformers' schedule, the eval loss) reported to Tune as ``{"eval_loss": ...}``.

How a trial holds its GPUs (``--mode``):

* ``single`` -- the model on the one GPU (or fraction, ``--gpu-per-trial``) Ray gave the trial,
  bf16 autocast: ``tune.with_resources(train_lora, {"gpu": g, "cpu": c})``; ``g = 1`` is one
  trial per GPU, ``g = 0.25`` packs four trials (four processes, four model copies) onto a GPU.
* ``fsdp`` -- each trial is a Ray Train ``TorchTrainer`` with ``--gpu-per-trial`` GPU workers
  (Ray Train V2's Tune integration: the Tune trial is the trainer's driver, its workers reserve
  the GPUs, ``TuneReportCallback`` hands rank 0's report to Tune). Every worker loads the model
  on the host, wraps it with PEFT and shards it with torch FSDP2 (``fully_shard`` per decoder
  layer, then the root; bf16 parameters, fp32 gradient reduction), the batch split over the
  ranks; the eval rows split too, sums all-reduced. ``max_concurrent_trials`` = GPUs / workers.
* ``devmap`` -- HF's naive model parallelism: ``from_pretrained(..., device_map="auto")`` over the
  trial's ``--gpu-per-trial`` GPUs (layers placed in order, one GPU busy at a time), bf16.

The grid is ``tune.grid_search`` over the spec's ``configs``: one dict per config (``key``,
``lr``, ``rank``, ``batch_size``, ``alpha``), the list plora expanded from the same sweep file
(a grid, or seeded random draws), under the trial config's ``hp``. ``c`` (CPUs per trial or per
worker) defaults to ``min(1, CPUs / (trials or workers at once))``.

This file is run as a script by ``benchmarks/e2e.py`` (which times it from start to exit)::

    python benchmarks/e2e_tune.py --spec SPEC.json --out RESULT.json --gpu-per-trial 1
    python benchmarks/e2e_tune.py --spec SPEC.json --out R.json --mode fsdp --gpu-per-trial 2
    python benchmarks/e2e_tune.py --spec SPEC.json --out BASE.json --base-eval   # no adapter

``SPEC.json`` holds the model directory, the data files and the training settings (see
``benchmarks/e2e_setup.py``'s ``tune_spec``). Ray puts this script's directory on its workers'
path, so the trials import ``e2e_trial`` as the script does. It imports nothing from plora.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from e2e_trial import eval_loss, load_base, load_rows, timed_trial, with_lora


def train_lora(config: dict, spec: dict, mode: str = "single") -> None:
    """The Tune trainable of ``single`` and ``devmap``: one config on the trial's GPUs (under
    ``devmap`` the inputs go to the first GPU, which holds the embedding; HF's loss moves the
    labels to the logits' GPU)."""
    from ray import tune

    config = config["hp"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    place = {"device_map": "auto"} if mode == "devmap" else {}

    def load():
        model, tok = load_base(spec, device, **place)
        return with_lora(model, config, spec), tok

    tune.report(timed_trial(config, spec, load, device))


def fsdp_worker(loop_config: dict) -> None:
    """One Ray Train worker of an ``fsdp`` trial (see the module docstring)."""
    import ray.train
    import ray.train.torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config, spec = loop_config["config"], loop_config["spec"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)  # FSDP2 moves each layer to the current device

    def load():
        # on the host, every rank the whole model (as users write it), then sharded to the GPU
        model, tok = load_base(spec, "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
        model = with_lora(model, config, spec)
        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if cuda else None,
            reduce_dtype=torch.float32 if cuda else None,
        )
        for layer in model.get_base_model().model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model, tok

    ray.train.report(timed_trial(config, spec, load, device, rank=rank, world=world))


def fsdp_trial(config: dict, spec: dict, workers: int, use_gpu: bool, cpus: float, storage: str):
    """The Tune trainable of ``fsdp``: drive a ``TorchTrainer`` of ``workers`` GPU workers."""
    from ray import tune
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    resources = {"CPU": cpus, **({"GPU": 1} if use_gpu else {})}
    trainer = TorchTrainer(
        fsdp_worker,
        train_loop_config={"config": config["hp"], "spec": spec},
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=f"train-{tune.get_context().get_trial_id()}",
            storage_path=storage,
            callbacks=[TuneReportCallback()],
        ),
    )
    trainer.fit()


def run_tune(spec: dict, args: argparse.Namespace) -> dict:
    import ray
    from ray import tune

    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    ray.init(
        num_gpus=args.gpus,
        num_cpus=args.ray_cpus,
        include_dashboard=False,
        runtime_env={
            "env_vars": {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
        },
    )
    t1 = time.perf_counter()
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    per_trial = args.gpu_per_trial
    concurrent = max(1, int(args.gpus // per_trial)) if per_trial >= 1 else args.gpus / per_trial
    storage = str(Path(args.storage).absolute())
    if args.mode == "fsdp":
        workers = int(per_trial)
        cpu_each = args.cpus_per_trial or min(1.0, cpus / (concurrent * (workers + 1)))
        trainable = tune.with_resources(
            tune.with_parameters(
                fsdp_trial,
                spec=spec,
                workers=workers,
                use_gpu=cuda,
                cpus=cpu_each,
                storage=storage + "/train",
            ),
            {"cpu": cpu_each},  # the driver; the workers reserve the GPUs
        )
    else:
        cpu_each = args.cpus_per_trial or min(1.0, cpus / concurrent)
        trainable = tune.with_resources(
            tune.with_parameters(train_lora, spec=spec, mode=args.mode),
            {"gpu": per_trial, "cpu": cpu_each},
        )
    tuner = tune.Tuner(
        trainable,
        param_space={"hp": tune.grid_search(spec["configs"])},
        tune_config=tune.TuneConfig(
            metric="eval_loss",
            mode="min",
            max_concurrent_trials=int(concurrent) if args.mode == "fsdp" else None,
        ),
        run_config=tune.RunConfig(name=args.name, storage_path=storage, verbose=1),
    )
    grid = tuner.fit()
    t2 = time.perf_counter()
    trials = []
    for result in grid:
        cfg, m = result.config["hp"], result.metrics or {}
        trials.append(
            {
                "key": cfg["key"],
                "lr": cfg["lr"],
                "rank": cfg["rank"],
                "batch_size": cfg["batch_size"],
                "alpha": cfg["alpha"],
                "eval_loss": m.get("eval_loss"),
                "train_loss": m.get("train_loss"),
                "load_s": m.get("load_s"),
                "train_s": m.get("train_s"),
                "eval_s": m.get("eval_s"),
                "error": None if result.error is None else str(result.error).splitlines()[0][:300],
            }
        )
    ray.shutdown()
    return {
        "device": "cuda" if cuda else "cpu",
        "mode": args.mode,
        "gpu_per_trial": per_trial,
        "cpu_per_trial": cpu_each,
        "ray_init_s": t1 - t0,
        "fit_s": t2 - t1,
        "shutdown_s": time.perf_counter() - t2,
        "trials": trials,
    }


def run_base_eval(spec: dict, args: argparse.Namespace) -> dict:
    """The base model's eval loss; on GPUs spread with ``device_map="auto"`` (a 32B base and
    its full-vocabulary logits do not fit one 80 GB GPU)."""
    model, tok = load_base(
        spec, args.device, **({"device_map": "auto"} if args.device == "cuda" else {})
    )
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = load_rows(spec["eval"], tok, spec["max_seq_len"])
    return {"eval_loss": eval_loss(model, rows, pad_id, args.device, spec["eval_batch_size"])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="JSON: model, data files, training settings")
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--gpus", type=int, default=1, help="GPUs Ray may use (logical on CPU)")
    ap.add_argument(
        "--mode",
        choices=("single", "fsdp", "devmap"),
        default="single",
        help="how a trial holds GPUs",
    )
    ap.add_argument(
        "--gpu-per-trial", type=float, default=1.0, help="single: 1 or a fraction; fsdp/devmap: N"
    )
    ap.add_argument(
        "--cpus-per-trial", type=float, default=None, help="default min(1, CPUs/trials at once)"
    )
    ap.add_argument("--ray-cpus", type=int, default=None, help="CPUs Ray may use (default all)")
    ap.add_argument("--storage", default="tune_results", help="Tune storage_path")
    ap.add_argument("--name", default="e2e-tune", help="Tune experiment name")
    ap.add_argument("--base-eval", action="store_true", help="only the base model's eval loss")
    args = ap.parse_args(argv)
    if args.mode != "single" and (args.gpu_per_trial < 1 or args.gpu_per_trial % 1):
        ap.error(f"--gpu-per-trial {args.gpu_per_trial}: --mode {args.mode} needs whole GPUs")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    spec = json.loads(Path(args.spec).read_text())
    result = run_base_eval(spec, args) if args.base_eval else run_tune(spec, args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    bad = [
        t
        for t in result.get("trials", [])
        if t["eval_loss"] is None or not math.isfinite(t["eval_loss"])
    ]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
