"""End-to-end `plora sweep` on one GPU with a Qwen2.5-0.5B-shaped random model, through Ray.

Builds a random-weight model of the Qwen2.5-0.5B architecture (the shipped config, no
download) with the tiny byte-level tokenizer (its ids are valid Qwen2.5 ids), writes a sweep
file pointing at it, runs ``plora sweep`` (embedded local Ray, the real GPU), and prints the
wall time, training tokens/s and a summary of ``jobs.parquet`` / ``results.parquet``.

    PYTHONPATH=$PWD python benchmarks/runtime_gpu.py --out $OUT/sweep
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml


def build_model(dest: Path, *, smoke: bool = False) -> None:
    """Random bf16 Qwen2.5-0.5B-shaped model + the tiny tokenizer, saved as a HF directory.

    With ``smoke`` (no GPU), the tiny-qwen2 shape instead, to check the script on CPU.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from plora.model_spec import shipped_config_path
    from plora.models import load_model, tiny_config

    if smoke:
        cfg = tiny_config("tiny-qwen2")
    else:
        cfg = AutoConfig.from_pretrained(str(shipped_config_path("Qwen/Qwen2.5-0.5B")))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    _, tok = load_model("tiny-qwen2")
    model.save_pretrained(dest)
    tok.save_pretrained(dest)


def direct_run(sweep_file: Path, out_dir: Path) -> None:
    """Train the sweep's configs as one pack with ``run_pack`` in this process, timing steps."""
    from plora.config import SweepConfig
    from plora.engine import Control, run_pack
    from plora.tune.space import expand

    sweep = SweepConfig.from_yaml(sweep_file)
    configs = expand(sweep)
    t0 = time.perf_counter()
    marks: list[tuple[int, float]] = []

    class Hooks:
        def on_metrics(self, metrics) -> None:
            step = max(m.step for m in metrics)
            if step % 10 == 0 and (not marks or marks[-1][0] != step):
                marks.append((step, time.perf_counter() - t0))
                print(f"direct: step {step} at {marks[-1][1]:.1f} s", flush=True)

        def poll(self) -> Control:
            return Control()

    res = run_pack(
        model=sweep.model, configs=configs, dataset=sweep.dataset, out_dir=out_dir, hooks=Hooks()
    )
    total = time.perf_counter() - t0
    tokens = sum(r.tokens for r in res.results.values())
    print(f"direct run_pack: {len(configs)} configs, {total:.1f} s total (load+train+eval), "
          f"{tokens} tokens, {tokens / total:.0f} tok/s; last step mark {marks[-1] if marks else None}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="sweep directory to create")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument(
        "--direct", action="store_true", help="also time run_pack in-process first (no Ray)"
    )
    args = ap.parse_args()
    work = args.out.parent
    model_dir = work / "qwen2.5-0.5b-random"
    smoke = not torch.cuda.is_available()
    build_model(model_dir, smoke=smoke)
    gpu = torch.cuda.get_device_name(0) if not smoke else "cpu"
    gpu_type = "cpu" if smoke else ("H200" if "H200" in gpu else "H100")
    sweep = {
        "name": "qwen2.5-0.5b-random-gpu",
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
        "dataset": {"builtin": "arithmetic", "num_examples": 4000, "max_seq_len": 64},
        "space": {
            "lr": [1.0e-4, 3.0e-4, 1.0e-3],
            "rank": [8, 32],
            "alpha_ratio": [1.0, 2.0],
            "batch_size": 8,
            "target_modules": "all",
            "max_steps": args.steps,
            "warmup_steps": 20,
            "schedule": "cosine",
        },
        "search": "grid",
        "metric": "eval_metric",
        "hardware": {"num_gpus": 1, "gpu_type": gpu_type},
    }
    sweep_file = work / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(sweep, sort_keys=False))
    if args.direct:
        direct_run(sweep_file, work / "direct")
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from plora.cli import app; app()",
            "sweep",
            str(sweep_file),
            "--out",
            str(args.out),
        ],
        check=True,
    )
    wall = time.perf_counter() - t0

    from plora.analysis import load

    res = load(args.out)
    results, jobs, metrics = res.results, res.jobs, res.metrics
    tokens = float(results["tokens"].sum())
    try:
        busy = float((jobs["end"] - jobs["start"]).sum())
    except TypeError:
        busy = float("nan")
    print(f"device {gpu}; {len(results)} configs; sweep wall {wall:.1f} s (incl. Ray start)")
    print(f"training tokens {tokens:.0f}; tokens/s over the sweep {tokens / wall:.0f}; "
          f"over job time {tokens / busy:.0f}")  # fmt: skip
    print("jobs.parquet:")
    print(jobs.to_string(max_colwidth=60))
    cols = [c for c in ("config_id", "lr", "rank", "alpha", "status", "steps", "final_train_loss",
                        "eval_loss", "eval_metric") if c in results.columns]  # fmt: skip
    print(results[cols].sort_values("eval_metric", ascending=False).to_string())
    print(f"metrics rows: {len(metrics)}")


if __name__ == "__main__":
    main()
