"""The command line of ``benchmarks/e2e.py``: its flags, the systems, the cases and the smoke run.

See ``benchmarks/e2e.py`` for what each flag does to the run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from e2e_setup import TINY

DESCRIPTION = "A whole LoRA sweep, plora against Ray Tune + PEFT (see benchmarks/e2e.py)."

#: The systems; for Tune, how a trial holds its GPUs (e2e_tune.py's --mode) and the flag that
#: says how many (None: one).
SYSTEMS: dict[str, tuple[str, str | None] | None] = {
    "plora": None,
    "plora-single": None,
    "tune": ("single", None),
    "tune-frac": ("single", "gpu_fraction"),
    "tune-fsdp": ("fsdp", "gpus_per_trial"),
    "tune-devmap": ("devmap", "gpus_per_trial"),
}
#: The plora systems (``plora sweep``) and the ``planner.max_pack_size`` each runs with:
#: ``plora-single`` is the Min-GPU baseline run for real, one config per job on plora's engine.
PLORA_CAPS: dict[str, int | None] = {"plora": None, "plora-single": 1}

#: Issue 27's two cases on a 4-GPU machine, issue 31's on an 8-GPU one and issue 42's slice of
#: Table 1 on one GPU (``--case``): their flags' defaults.
CASES: dict[str, dict[str, Any]] = {
    # a base one 80 GB GPU cannot train at 1,024 tokens: plora's planner picks each job's d and
    # strategy; users run a 2-GPU Ray Train FSDP trainer per trial, or device_map="auto"
    "L": {
        "model": "Qwen/Qwen2.5-32B",
        "lrs": [1e-4, 3e-4],
        "ranks": [8, 32],
        "batch_sizes": [2, 4],
        "tokens": 984,
        "steps": 20,
        "warmup_steps": 2,
        "systems": "plora,tune-fsdp,tune-devmap",
        "gpus_per_trial": 2,
        "gradient_checkpointing": True,
    },
    # a base that fits one GPU: one trial per GPU, or four 0.25-GPU trials per GPU
    "M": {
        "model": "Qwen/Qwen2.5-7B",
        "lrs": [1e-4, 3e-4, 1e-3, 3e-3],
        "ranks": [8, 16, 32, 64],
        "batch_sizes": [4],
        "tokens": 984,
        "steps": 30,
        "warmup_steps": 3,
        "systems": "plora,tune,tune-frac",
    },
    # the paper's setting (issue 31): a Table-1-style sweep on one 8-GPU node, 48 configs drawn
    # from Table 1's ranges; users run one trial per GPU, 8 at a time (gradient checkpointing
    # on: batch 32 x 1,024 tokens of a 7B does not fit an 80 GB GPU without it)
    "T": {
        "model": "Qwen/Qwen2.5-7B",
        "draw": 48,
        "draw_seed": 0,
        "tokens": 984,
        "steps": 20,
        "warmup_steps": 2,
        "systems": "plora,tune",
        "gpus": 8,
        "gradient_checkpointing": True,
    },
    # issue 42: a 16-config slice of Table 1 (sweeps/paper-table1.yaml) at batch 1 and 4 on one
    # GPU, GSM8K-like rows; plora as planned, plora one config per job (the Min-GPU baseline
    # run for real), one Tune + PEFT trial at a time and 0.25-GPU trials
    "S": {
        "model": "Qwen/Qwen2.5-7B",
        "lrs": [1e-4, 2e-4],
        "ranks": [8, 32],
        "batch_sizes": [1, 4],
        "alpha_ratios": [0.25, 4.0],
        "dropout": 0.05,
        "data": "gsm8k",
        "tokens": 250,
        "max_seq_len": 1024,
        "steps": 100,
        "warmup_steps": 10,
        "schedule": "linear",
        "systems": "plora,plora-single,tune,tune-frac",
        "gpus": 1,
        # both plora systems plan from the same (empty) profile store: their plans compare
        "fresh_profile": True,
    },
}
#: ``--smoke``: the cases' code paths on the CPU, tiny shapes, 4 logical GPUs (case T: 8, and
#: 4 drawn configs); without ``--case`` it runs :data:`SMOKE_CASES`.
SMOKE: dict[str, Any] = {
    "model": "tiny-qwen2",
    "lrs": [1e-3],
    "ranks": [8],
    "tokens": 48,
    "steps": 3,
    "warmup_steps": 1,
    "train_rows": 64,
    "eval_rows": 16,
    "gpus": 4,
}
SMOKE_CASE: dict[str, dict[str, Any]] = {
    "T": {"gpus": 8, "draw": 4},
    # two configs (batch 1 and 4), rows lognormal around 48 tokens cut at 160, one logical GPU
    "S": {"gpus": 1, "alpha_ratios": [4.0], "max_seq_len": 160},
}
#: What ``--smoke`` alone runs: issue 27's cases (case T's smoke is ``--smoke --case T``).
SMOKE_CASES = ("L", "M")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    floats = lambda s: [float(v) for v in s.split(",")]  # noqa: E731
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    ap.add_argument(
        "--model", default="Qwen/Qwen2.5-1.5B", help="shipped architecture or tiny-qwen2"
    )
    ap.add_argument("--out", type=Path, required=True, help="JSON result file")
    ap.add_argument(
        "--work", type=Path, default=None, help="models, data, sweep dirs (default: beside --out)"
    )
    ap.add_argument(
        "--case",
        choices=sorted(CASES),
        default=None,
        help="issue 27's case L or M, issue 31's T (defaults)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="cases L and M (or --case) on the CPU, tiny shapes (CI)",
    )
    ap.add_argument(
        "--systems", default="plora,tune,tune-frac", help=f"comma list of {', '.join(SYSTEMS)}"
    )
    ap.add_argument("--gpus", type=int, default=1, help="GPUs every system may use")
    ap.add_argument("--gpu-fraction", type=float, default=0.25, help="GPU per trial of tune-frac")
    ap.add_argument(
        "--gpus-per-trial", type=int, default=2, help="GPUs of a tune-fsdp / tune-devmap trial"
    )
    ap.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="the Tune baselines' model.gradient_checkpointing_enable() (plora decides its own)",
    )
    ap.add_argument(
        "--gpu-type", default=None, help="plora hardware.gpu_type (default: from nvidia-smi)"
    )
    ap.add_argument("--lrs", type=floats, default=[1e-4, 3e-4, 1e-3, 3e-3])
    ap.add_argument("--ranks", type=ints, default=[8, 16, 32, 64])
    ap.add_argument("--configs", type=int, default=None, help="keep a K-config sub-grid")
    ap.add_argument(
        "--draw",
        type=int,
        default=None,
        help="K configs drawn from Table 1's ranges instead of the grid (lr, batch, rank, alpha)",
    )
    ap.add_argument("--draw-seed", type=int, default=0, help="seed of --draw")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--schedule", default="cosine", choices=("constant", "linear", "cosine"))
    ap.add_argument("--batch-sizes", "--batch-size", type=ints, default=[4])
    ap.add_argument(
        "--alpha-ratios", type=floats, default=[2.0], help="alpha / rank values of the grid"
    )
    ap.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout of every config")
    ap.add_argument(
        "--data",
        choices=("copy", "gsm8k"),
        default="copy",
        help="copy/reverse rows of about --tokens, or GSM8K-like rows: lognormal lengths with "
        "median --tokens, cut at --max-seq-len",
    )
    ap.add_argument("--tokens", type=int, default=600, help="tokens per row (--data gsm8k: median)")
    ap.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="the sweep's max_seq_len (default --tokens + 40)",
    )
    ap.add_argument("--train-rows", type=int, default=2000)
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument(
        "--timeout-s", type=float, default=None, help="stop a system after this many seconds"
    )
    ap.add_argument("--rtol", type=float, default=0.05, help="eval-loss agreement across systems")
    ap.add_argument(
        "--min-drop-ratio",
        type=float,
        default=0.5,
        help="each system's eval-loss drop below the base model, at least this x another's",
    )
    ap.add_argument(
        "--fused-kernels",
        choices=("auto", "on", "off"),
        default="auto",
        help="plora's training.fused_kernels (Liger-Kernel on the base, as plora sweep runs it)",
    )
    ap.add_argument(
        "--plora-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="plora's training.cuda_graphs (the steady packed step replayed as CUDA graphs)",
    )
    ap.add_argument(
        "--fresh-profile",
        action="store_true",
        help="plan from an empty plora profile store (no measurements of earlier sweeps)",
    )
    known, _ = ap.parse_known_args(argv)
    if known.case is not None:
        ap.set_defaults(**CASES[known.case])
    if known.smoke:
        ap.set_defaults(**{**SMOKE, **SMOKE_CASE.get(known.case, {})})
    args = ap.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.max_seq_len is None:
        args.max_seq_len = args.tokens + 40
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown or not args.systems:
        ap.error(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if not 0 < args.gpu_fraction <= 1:
        ap.error(f"--gpu-fraction {args.gpu_fraction}: must be in (0, 1]")
    wide = {"tune-fsdp", "tune-devmap"} & set(args.systems)
    if wide and not 1 <= args.gpus_per_trial <= args.gpus:
        ap.error(f"--gpus-per-trial {args.gpus_per_trial}: {sorted(wide)} need 1..--gpus")
    if args.draw is not None and args.draw < 1:
        ap.error(f"--draw {args.draw}: draw at least 1 config")
    if args.draw is not None and args.configs is not None:
        ap.error("--configs keeps a sub-grid; with --draw K the K draws are the configs")
    if args.draw is not None and "tune-fsdp" in args.systems:
        ap.error("--draw: tune-fsdp splits a batch over its ranks, and batch size 1 is drawn")
    if "tune-fsdp" in args.systems and min(args.batch_sizes) < args.gpus_per_trial:
        ap.error(
            f"--batch-sizes {args.batch_sizes}: tune-fsdp splits a batch over "
            f"{args.gpus_per_trial} ranks; use batch sizes >= --gpus-per-trial"
        )
    if args.model in TINY and args.max_seq_len > 512:
        ap.error(
            f"--max-seq-len {args.max_seq_len}: {args.model} has 512 positions; use at most 512 "
            "(default: --tokens + 40)"
        )
    if args.max_seq_len < args.tokens:
        ap.error(f"--max-seq-len {args.max_seq_len}: below --tokens {args.tokens}")
    if args.draw is not None and args.alpha_ratios != [2.0]:
        ap.error("--draw draws alpha from Table 1's ranges; --alpha-ratios is for the grid")
    return args
