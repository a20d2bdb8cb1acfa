"""End to end: a whole LoRA sweep with plora vs what users run today (Ray Tune + PEFT).

One command, one machine, the same base model, data, configs and steps, each system run in
turn as its own process and timed from start until that process returns:

* ``plora`` -- ``plora sweep SWEEP.yaml --out DIR`` (the CLI, in a subprocess). It starts an
  embedded local Ray, plans the configs into packed jobs and trains each pack on one base-model
  copy. Read back: the first plan's predicted makespan (``DIR/plans/plan-000.json``; its clock
  starts when the coordinator plans, so it leaves out process start, imports, the dataset
  check and ``ray.init``), the coordinator-clock makespan actually measured (first plan ->
  last job end, ``jobs.parquet``), the jobs, and per-config ``eval_loss`` from
  ``results.parquet``. The sweep file's ``training.fused_kernels`` is ``--fused-kernels``
  (default auto: Liger-Kernel's fused RMSNorm/SwiGLU/RoPE on the base when ``liger_kernel`` is
  installed and the run is on a GPU -- the runtime's own path,
  :func:`plora.engine.liger.apply_fused_kernels`); the JSON records the setting and what plora
  resolved it to. The Tune baselines run the stock HF base, as their users write them. Its
  ``training.cuda_graphs`` is ``--plora-graphs`` (default auto: one-GPU jobs replay their steady
  step as CUDA graphs on a GPU; ``off``: the eager step), recorded in the JSON; compare the two
  with two runs (``scripts/gpu_graphs.sh``, ``PART=e2e``).
* ``plora-single`` -- the same ``plora sweep`` of the sweep file with
  ``planner.max_pack_size: 1``: one config per job, every job on plora's resident workers (the
  Min-GPU baseline run for real, not estimated).
* ``tune`` -- ``benchmarks/e2e_tune.py``: Ray Tune's ``Tuner`` over a ``grid_search`` of the
  same configs, one function trial per config with ``{"gpu": 1}``; each trial loads the model
  with ``from_pretrained`` (bf16 on GPU), wraps it with PEFT's ``get_peft_model``, trains with
  ``torch.optim.AdamW`` + transformers' schedule under bf16 autocast, clips like plora, then
  evaluates and ``tune.report``s ``eval_loss``. See that file's docstring.
* ``tune-frac`` -- the same script with ``{"gpu": --gpu-fraction}`` (default 0.25: four
  trials, four processes and four model copies share each GPU).

Each system gets its own cold ``ray.init`` (shut down when it ends; ``RAY_USAGE_STATS_ENABLED=0``,
no dashboard). On a machine without CUDA Ray gets ``--gpus`` logical GPUs and everything trains
in float32 on the CPU (the dry run of ``tests/unit/test_e2e_benchmark.py``).

Model (never downloaded): ``--model Qwen/Qwen2.5-1.5B`` (default; also ``Qwen/Qwen2.5-7B`` or
any model with a config in ``plora/models/configs/``) is a **random-weight** model of that
architecture, built once (seed 0, bf16, on the GPU when there is one) and saved with
``save_pretrained`` under ``--work``, next to plora's byte-level ``Qwen2Tokenizer`` (259 ids,
``plora/models/tokenizer.py``). The model keeps the config's vocabulary (151,936 rows for
Qwen2.5): the tokenizer's ids are valid rows of it, so the embedding, the tied LM head and the
cross-entropy over the full vocabulary cost what they cost in the real model, and the directory
loads unchanged with ``AutoModelForCausalLM`` / ``AutoTokenizer`` in plora and in PEFT (only
``bos/eos/pad_token_id`` are set to the tokenizer's). ``--model tiny-qwen2`` uses plora's
built-in tiny pretrained model (the CPU dry run).

Data: deterministic ``copy`` / ``reverse`` tasks on random letters, prompt/completion JSONL
(``--train-rows`` training rows, ``--eval-rows`` eval rows, about ``--tokens`` tokens each: one
byte is one token), ``max_seq_len = tokens + 40``, loss on the completion only; the sweep
scores ``eval_loss`` (``dataset.metric: none``: no generation in either system). ``--data
gsm8k``: GSM8K-like word problems and worked answers instead, each row's length lognormal with
median ``--tokens`` (shape 0.6) cut at ``--max-seq-len`` (``e2e_setup.gsm8k_rows``).

Configs: the grid ``--lrs`` x ``--ranks`` (default 1e-4, 3e-4, 1e-3, 3e-3 x 8, 16, 32, 64: 16
configs), alpha = 2 rank, batch ``--batch-size`` 4, all seven projections, ``--steps`` 40,
cosine with 5 warm-up steps, clipping at 1.0, no weight decay, no dropout, seed 0; ``--configs
K`` keeps a K-config sub-grid (the first ranks, then the first lrs). ``--draw K`` replaces the
grid with K configs drawn from the paper's Table 1 ranges (``e2e_setup.TABLE1``: lr
log-uniform in [2e-5, 4e-4], batch size 1..32, rank 8..128, alpha r/4..4r): plora's sweep file
says ``search: random``, ``num_samples: K``, ``seed: --draw-seed``, and its expansion is the
list both systems train (Tune's ``grid_search`` over those config dicts, alpha per config);
a config is then named ``lr=...,r=...,bs=...,a=...``.

Cases (``--case``; each sets the flags' defaults): issue 27's ``L`` (a 32B shape, plora vs Ray
Train FSDP2 and ``device_map`` trials of 2 GPUs) and ``M`` (7B, one and 0.25-GPU trials) on 4
GPUs; issue 31's ``T`` on 8 GPUs: the paper's setting, 48 configs of the 7B shape drawn from
Table 1's ranges, 1,024 tokens, 20 steps each, plora vs one Tune trial per GPU (8 at a time;
gradient checkpointing in the trials); issue 42's ``S`` on one GPU: a 16-config slice of
``sweeps/paper-table1.yaml`` (7B shape; lr {1e-4, 2e-4} × rank {8, 32} × batch {1, 4} × alpha
{r/4, 4r}, dropout 0.05) on GSM8K-like rows around 250 tokens cut at 1,024, ``--steps`` 100 each,
run four ways: ``plora``, ``plora-single``, ``tune`` and ``tune-frac``. ``--smoke`` runs L and M
on the CPU with tiny shapes; ``--smoke --case T`` runs T's code path (4 drawn configs, 8 logical
GPUs), ``--smoke --case S`` S's (2 configs, 1 logical GPU).

Before any system runs, ``plora plan`` plans each plora system's sweep file with the same cost
model and profile store (``e2e_systems.plan_systems``): the makespan predicted for ``plora``, for
``plora-single`` and -- its Tune baseline row -- for ``tune``. Reported per system: wall
seconds, that predicted makespan, GPU-busy fraction (``nvidia-smi`` utilization sampled every
0.5 s while the system runs, summed over the GPUs the run may use / 100·N; null without
nvidia-smi), per-config eval loss and configs finished; plora's predicted and measured
makespan; the speedups of plora over each baseline; the worst relative eval-loss disagreement
of one config across systems. Checks (``e2e_report.compare``; exit status 2 when one fails,
after the JSON is written): every system finished every config; every eval loss is below the
base model's (an adapter that did not train fails); losses agree within ``--rtol`` (default
0.05; loose because PEFT draws LoRA A from ``torch.manual_seed(0)`` and plora from its
seed-keyed generator: same data order, different init); and each system's drop below the
base model is at least ``--min-drop-ratio`` (0.5) of another's (fails a system that trains at
a fraction of the others' pace). Issue 42's targets are reported, not enforced
(``e2e_report.targets``): plora's speedup over ``plora-single`` measured on the coordinator's
clock within 10 % of the ratio of the two plans' makespans, and plora at least 4× faster than
each Tune system.

On a GPU machine (torch, transformers, peft, pandas; Ray installed), with plora importable
(installed, or a copy of ``plora/`` with ``kernels/`` as ``plora/kernels`` on ``PYTHONPATH``;
the children import the same copy)::

    python benchmarks/e2e.py --model Qwen/Qwen2.5-1.5B --out e2e.json
    python benchmarks/e2e.py --model Qwen/Qwen2.5-7B --configs 8 --out e2e7b.json

Measured (2026-11-24, ``benchmarks/RESULTS.md`` "End to end"): the default 1.5B run takes about
20 minutes on one H100 (plora 2 min, Tune one trial per GPU 14 min, fractional Tune 4 min) and 17
on one H200, longer than the device's 10-minute limit on one command: start it in a session of
its own (``setsid``) and collect the JSON in later calls. For the 7B, ``--configs 8`` keeps the
run shorter; expect the 0.25-GPU trials to run out of memory on an 80 GB GPU (four 15 GB copies plus
activations and full-vocabulary logits -- what a user would meet), so also run it with
``--gpu-fraction 0.5``. A system that fails leaves ``null`` losses, and the checks above fail.

The JSON goes to ``--out`` (atomically); a Markdown section for ``benchmarks/RESULTS.md``
(GPU, date, command, tables) is printed and stored in the JSON under ``markdown``.

This file is the run's order; ``e2e_args.py`` is its command line (the systems, the cases, the
smoke run), ``e2e_setup.py`` picks the GPUs and builds the model, data and sweep,
``e2e_systems.py`` runs each system and reads back what it produced, ``e2e_tune.py`` is the Ray
Tune + PEFT script (``e2e_trial.py`` one trial's fine-tune), ``e2e_report.py`` the checks, JSON
and Markdown.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml
from e2e_args import PLORA_CAPS, SMOKE_CASES, SYSTEMS, parse_args
from e2e_report import fmt, report, versions
from e2e_setup import (
    TABLE1,
    TINY,
    choose_gpus,
    ensure_model,
    grid,
    key,
    make_data,
    plora_engine,
    sweep_dict,
    tune_spec,
    varies_alpha,
    write_jsonl,
)
from e2e_systems import base_eval_loss, child_env, plan_systems, run_plora, run_tune


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not args.smoke:
        return 0 if run_case(args, argv, args.out)["agreement"]["ok"] else 2
    from plora.utils import atomic_write_json

    cases = {}
    for case in SMOKE_CASES if args.case is None else [args.case]:
        out = args.out.with_name(f"{args.out.stem}-{case}.json")
        cases[case] = run_case(parse_args([*argv, "--case", case]), argv, out)
    ok = all(rep["agreement"]["ok"] for rep in cases.values())
    atomic_write_json(args.out, {"benchmark": "e2e", "smoke": True, "ok": ok, "cases": cases})
    return 0 if ok else 2


def run_case(args: argparse.Namespace, argv: list[str], out: Path) -> dict[str, Any]:
    """One run of ``args.systems`` (a case of ``--case``, or the flags as given); its report,
    written to ``out`` after every system."""
    from plora.config import SweepConfig
    from plora.tune.space import expand
    from plora.utils import atomic_write_json, atomic_write_text

    device, gpus, gpu, gpu_type = choose_gpus(args.gpus, args.gpu_type)
    stamp = dt.datetime.now(dt.UTC)
    work = (args.work or args.out.absolute().parent / "e2e-work").absolute()
    run_dir = work / f"run-{stamp:%Y%m%dT%H%M%S}-{args.case or 'custom'}"
    run_dir.mkdir(parents=True, exist_ok=False)
    env = child_env(profile_dir=run_dir / "profiles" if args.fresh_profile else None)
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))

    print(
        f"e2e: {args.model} on {gpu} x {args.gpus}; work dir {run_dir}",
        flush=True,
    )
    model_dir, facts = ensure_model(args.model, work)
    data = {"train": run_dir / "data" / "train.jsonl", "eval": run_dir / "data" / "eval.jsonl"}
    write_jsonl(data["train"], make_data(args, args.train_rows, seed=1))
    write_jsonl(data["eval"], make_data(args, args.eval_rows, seed=2))
    lrs, ranks = ([], []) if args.draw else grid(args)
    sweep = sweep_dict(args, model_dir, data, lrs, ranks, gpu_type)
    sweep_yaml = run_dir / "sweep.yaml"
    atomic_write_text(sweep_yaml, yaml.safe_dump(sweep, sort_keys=False))
    parsed = SweepConfig.from_yaml(sweep_yaml)  # fails here on a bad sweep
    # each plora system's sweep file: the same sweep with its planner.max_pack_size
    sweeps = {"plora": sweep_yaml}
    for name in args.systems:
        if PLORA_CAPS.get(name) is not None:
            capped = {**sweep, "planner": {**sweep.get("planner", {}),
                                           "max_pack_size": PLORA_CAPS[name]}}  # fmt: skip
            sweeps[name] = run_dir / f"sweep-{name}.yaml"
            atomic_write_text(sweeps[name], yaml.safe_dump(capped, sort_keys=False))
            SweepConfig.from_yaml(sweeps[name])
    # the configs plora trains (its expansion of the sweep file: the grid, or --draw's seeded
    # draws) are Tune's grid too; alpha names a config only when the sweep varies it
    configs = expand(parsed)
    rows = [
        {
            "key": key(c.lr, c.rank, c.batch_size, c.alpha if varies_alpha(args) else None),
            "config_id": c.config_id,
            "lr": c.lr,
            "rank": c.rank,
            "batch_size": c.batch_size,
            "alpha": c.alpha,
        }
        for c in configs
    ]
    keys = [r["key"] for r in rows]
    if len(set(keys)) < len(keys):
        dup = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise SystemExit(
            f"--draw-seed {args.draw_seed}: config {dup} drawn twice; use another seed"
        )
    spec = run_dir / "tune_spec.json"
    atomic_write_json(
        spec, tune_spec(sweep, rows, gradient_checkpointing=args.gradient_checkpointing)
    )
    ctx = {
        "run_dir": run_dir,
        "sweeps": sweeps,
        "spec": spec,
        "env": env,
        "gpus": gpus,
        "device": device,
        "num_gpus": args.gpus,
        "timeout_s": args.timeout_s,
        "keys": {r["config_id"]: r["key"] for r in rows},
    }
    info: dict[str, Any] = {
        "benchmark": "e2e",
        "date": stamp.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python benchmarks/e2e.py " + shlex.join(argv),
        "case": args.case,
        "gpu": gpu,
        "gpu_type": gpu_type,
        "num_gpus": args.gpus,
        "device": device,
        "software": versions(),
        # what plora's engine runs: training.fused_kernels (its plan assumes it too), cuda_graphs
        **plora_engine(args, parsed),
        "model": {
            "name": args.model,
            "path": str(model_dir),
            "random_weights": args.model not in TINY,
            **facts,
        },
        "data": {
            "train": str(data["train"]),
            "eval": str(data["eval"]),
            "train_rows": args.train_rows,
            "eval_rows": args.eval_rows,
            "kind": args.data,
            # --data gsm8k: the median of lognormal row lengths, cut at max_seq_len
            "tokens_per_row": args.tokens,
            "max_seq_len": args.max_seq_len,
        },
        "training": {
            "steps": args.steps,
            "batch_sizes": sorted({c.batch_size for c in configs}),
            "gradient_checkpointing_in_tune": args.gradient_checkpointing,
            "warmup_steps": args.warmup_steps,
            "schedule": args.schedule,
            "lrs": sorted({c.lr for c in configs}),
            "ranks": sorted({c.rank for c in configs}),
            "alpha_ratio": None if args.draw else args.alpha_ratios,
            # --draw: the domains and seed of the draws (plora's search: random)
            "draw": {"configs": args.draw, "seed": args.draw_seed, "space": TABLE1}
            if args.draw
            else None,
            "target_modules": "all",
            "max_grad_norm": 1.0,
            "weight_decay": 0.0,
            "dropout": args.dropout,
        },
        "configs": rows,
        "work_dir": str(run_dir),
    }
    systems: dict[str, dict[str, Any]] = {}

    def save(base: float | None, *, complete: bool) -> dict[str, Any]:
        """Write the JSON as it stands (after every system: a killed run keeps what it has)."""
        rep = report(info, systems, keys, base, rtol=args.rtol,
                     min_drop_ratio=args.min_drop_ratio, complete=complete)  # fmt: skip
        atomic_write_json(out, rep)
        return rep

    # what plora's planner predicts before anything runs, for every system it models (the same
    # cost model and profile store for all): `plora plan` of each plora system's sweep file
    print("e2e: plans", flush=True)
    info["plans"] = plan_systems(ctx, args.systems)
    print("e2e: base model eval loss", flush=True)
    base = base_eval_loss(ctx)
    save(base, complete=False)
    for name in args.systems:
        print(f"e2e: {name} ...", flush=True)
        trial = SYSTEMS[name]
        if trial is None:
            systems[name] = run_plora(ctx, name)
        else:
            mode, flag = trial
            systems[name] = run_tune(ctx, name, mode, 1.0 if flag is None else getattr(args, flag))
        row = systems[name]
        planned = row.get("predicted_makespan_s", info["plans"]["predicted_makespan_s"].get(name))
        print(
            f"e2e: {name}: {row['wall_s']:.1f} s (planned {fmt(planned)} s), "
            f"GPU busy {fmt(row['gpu_busy'], '.2f')}, "
            f"{sum(v is not None for v in row['eval_loss'].values())}/{len(configs)} configs",
            flush=True,
        )
        rep = save(base, complete=name == args.systems[-1])
    print(rep["markdown"])
    agr = rep["agreement"]
    print(
        f"e2e: worst eval-loss disagreement {100 * agr['worst']['rel_diff']:.2f} % "
        f"({agr['worst']['config']}); missing {agr['missing'] or 'none'}; not below the base model "
        f"{agr['not_trained'] or 'none'} -> {'ok' if agr['ok'] else 'FAILED'}; JSON in {out}"
    )
    return rep


if __name__ == "__main__":
    sys.exit(main())
