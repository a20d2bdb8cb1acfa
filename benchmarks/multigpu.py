"""Packed jobs on d GPUs under each strategy (tp, fsdp, pp) vs PEFT one adapter per GPU.

For each base shape (random bf16 weights of ``plora/models/configs``; Qwen2.5-14B by default) and
each strategy, one process per GPU (NCCL) builds the base, parallelises it
(:func:`plora.parallel.parallelize`) and trains packs of K batch-1 adapters at sequence length
``--seq`` with :class:`~plora.parallel.trainer.ParallelPackedTrainer`; then every GPU trains one
PEFT adapter on its own whole copy of the base at the same time (Min GPU: the d GPUs' tokens/s
added). All in one run, on one machine. Reported per case: tokens/s of the whole job, the fraction
of the FLOP ceiling ``d · peak / (4·P_mm + 6·s·h·L)`` (useful FLOPs only: recomputation under
activation checkpointing is not counted), the peak memory of the busiest GPU beside the cost
model's prediction (:mod:`plora.cost.memory` with the job's d and strategy), and the step time the
cost model predicts (:class:`~plora.cost.throughput.StepTimeModel` with its default coefficients,
not refit) beside the measured one.

GPU:  PYTHONPATH=... python benchmarks/multigpu.py --gpus 2 --models Qwen/Qwen2.5-14B --out DIR
CPU:  python benchmarks/multigpu.py --smoke      (tiny shape, 2 gloo processes, < 1 minute)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import gzip
import json
import os
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_throughput import (
    SMOKE_CONFIG,
    adapter_configs,
    build_base,
    measure_peak_flops,
    run_peft,
    synthetic_data,
    time_steps,
)

from plora.config import GPU_TYPES
from plora.cost import Strategy
from plora.cost import memory as mem
from plora.cost.priors import DEFAULT_COEFFICIENTS, LIGER_COEFFICIENTS
from plora.cost.throughput import AdapterLoad, StepTimeModel
from plora.engine.liger import apply_fused_kernels
from plora.model_spec import ModelSpec, shipped_config_path
from plora.utils import atomic_write_json

STRATEGIES = ("tp", "fsdp", "pp")


def hf_config(name: str):
    from transformers import AutoConfig, Qwen2Config

    if name == "smoke":
        return Qwen2Config(**{k: v for k, v in SMOKE_CONFIG.items() if k != "model_type"})
    return AutoConfig.from_pretrained(str(shipped_config_path(name)))


def predicted(
    spec: ModelSpec, cfgs, seq: int, d: int, strategy: str, *, liger: bool, ckpt: bool,
    micro: int | None = None,
):  # fmt: skip
    """Cost-model peak bytes per GPU (allocator's share) and step seconds of the pack (``micro``:
    the pipeline's micro-batches under pp)."""
    opts = mem.MemoryOptions(loss=mem.Loss.FUSED, fused_kernels=liger, checkpointing=ckpt)
    strat = Strategy(strategy) if d > 1 else None
    total = mem.base_memory(spec, d=d, strategy=strat, options=opts).total - opts.reserved_bytes
    for c in cfgs:
        total += mem.adapter_memory(
            spec, rank=c.rank, targets=c.target_modules, batch_size=c.batch_size, seq_len=seq,
            dropout=c.dropout, d=d, strategy=strat, options=opts, pipeline_micro_batches=micro,
        ).total  # fmt: skip
    gpu = GPU_TYPES["H200"]
    model = StepTimeModel(
        spec, gpu, LIGER_COEFFICIENTS if liger else DEFAULT_COEFFICIENTS, recompute=ckpt
    )
    step = model.step_time([AdapterLoad.of(c) for c in cfgs], seq, d, strat)
    return total, step


def _micro_counts(args: argparse.Namespace, strategy: str, k: int, d: int) -> list[int | None]:
    """The pipeline micro-batch counts to run a pack of ``k`` batch-1 adapters with:
    ``--pp-micro``'s (those 1F1B can run: at least ``d``, at most one row each), else what a
    job's trainer runs (:func:`plora.parallel.trainer.pipeline_micro_batches`); ``[None]`` (the
    trainer's own) for tp and fsdp."""
    from plora.parallel.trainer import pipeline_micro_batches

    if strategy != "pp":
        return [None]
    default = pipeline_micro_batches(k, pp=d)
    if args.pp_micro:
        return [m for m in args.pp_micro if d <= m <= max(k, d)] or [default]
    return [default]


def _profile_step(step, device: torch.device, out: Path | None, label: str) -> None:
    """One more step under ``torch.profiler`` on every rank: its wall, the GPU's busy time (the
    union of kernel intervals, so NCCL overlapping compute counts once), kernel time by kind
    (``engine_profile.kind``, NCCL apart) and the top host operators, in
    ``OUT/profile-LABEL-rankR.json``, and the rank's trace as ``...-rankR.trace.json.gz``."""
    from engine_profile import kind
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_s = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind: collections.Counter[str] = collections.Counter()
    for e in kernels:
        by_kind["NCCL" if "nccl" in e.name.lower() else kind(e.name)] += e.device_time_total / 1e3
    busy_us, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        busy_us += max(0.0, stop - max(start, end))
        end = max(end, stop)
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    rank = dist.get_rank()
    report = {
        "label": label, "rank": rank, "wall_ms": wall_s * 1e3, "gpu_busy_ms": busy_us / 1e3,
        "kernels": len(kernels), "by_kind_ms": dict(by_kind.most_common()),
        "top_host_ops": [{"name": e.key, "self_ms": e.self_cpu_time_total / 1e3,
                          "calls": e.count} for e in host],
    }  # fmt: skip
    print(f"profile {label} rank {rank}: wall {report['wall_ms']:.0f} ms, GPU busy "
          f"{report['gpu_busy_ms']:.0f} ms, by kind {json.dumps(report['by_kind_ms'])}",
          flush=True)  # fmt: skip
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / f"profile-{label}-rank{rank}.json", report)
        trace = out / f"profile-{label}-rank{rank}.trace.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        trace.unlink()


def _peak(device: torch.device) -> int:
    """The largest peak allocation over the job's GPUs."""
    if device.type != "cuda":
        return 0
    t = torch.tensor([torch.cuda.max_memory_allocated(device)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def run_strategy(rank, args, name, cfg, spec, strategy, device, dtype, peak, rows) -> None:
    from plora.parallel import ParallelDims, parallelize
    from plora.parallel.trainer import ParallelPackedTrainer

    d = args.gpus
    dims = ParallelDims.for_job(d, strategy)
    mesh = dims.build_mesh(device.type)
    torch.manual_seed(0)
    base = build_base(cfg, device, dtype)
    if args.liger:  # the engine's switch (training.fused_kernels: on)
        apply_fused_kernels(base, "on", device=device)
    stage = parallelize(base, dims=dims, mesh=mesh)
    data = synthetic_data(spec.vocab_size, args.seq, n=max(args.packs) * 2)
    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 0})()
    ceiling = d * spec.flop_ceiling_tokens_per_s(peak, args.seq)
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    cases = [(k, m) for k in args.packs for m in _micro_counts(args, strategy, k, d)]
    for k, micro in cases:
        cfgs = adapter_configs(k, args.rank)
        pred_b, _ = predicted(spec, cfgs, args.seq, d, strategy, liger=args.liger, ckpt=False,
                              micro=micro)  # fmt: skip
        ckpt = args.checkpointing == "on" or (
            args.checkpointing == "auto" and capacity and pred_b > 0.9 * capacity
        )
        pred_b, pred_s = predicted(spec, cfgs, args.seq, d, strategy, liger=args.liger, ckpt=ckpt,
                                   micro=micro)  # fmt: skip
        label = f"{strategy}{d}-packed-{k}" + (f"-m{micro}" if args.pp_micro and micro else "")
        row = {"model": name, "case": label, "strategy": strategy, "d": d, "adapters": k,
               "checkpointing": bool(ckpt), "liger": args.liger, "micro_batches": micro}  # fmt: skip
        trainer, added = None, []
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            trainer = ParallelPackedTrainer(
                base, tok, data, device=device, dtype=dtype if device.type == "cuda" else None,
                dims=dims, mesh=mesh, stage=stage, microbatches=micro, gradient_checkpointing=ckpt,
            )  # fmt: skip
            for c in cfgs:
                trainer.add(c)
                added.append(c.config_id)
            step_s = time_steps(trainer.step, device, args.warmup, args.steps)
            peak_b = _peak(device)
            tps = k * args.seq / step_s
            row.update(
                tokens_per_s=tps, ceiling_fraction=tps / ceiling, step_s=step_s,
                predicted_step_s=pred_s, peak_gib=peak_b / 2**30, predicted_gib=pred_b / 2**30,
            )  # fmt: skip
            if args.profile:
                _profile_step(trainer.step, device, args.out, f"{name.split('/')[-1]}-{label}")
        except Exception as e:
            # the other ranks may wait in a collective this one left: record, save, and end
            # this process (mp.spawn then ends the others) rather than hang until the timeout
            row["error"] = _error_text(e)
            rows.append(row)
            traceback.print_exc()
            _print(row)
            _save(args, rows)
            sys.stdout.flush()
            os._exit(1)
        finally:
            if trainer is not None:
                for cid in added:
                    trainer.remove(cid)
                    trainer.release(cid)
            if ckpt:
                base.gradient_checkpointing_disable()
            del trainer
        rows.append(row)
        if rank == 0:
            _print(row)
            _save(args, rows)
    del base, stage
    gc.collect()


def run_min_gpu(rank, args, name, cfg, spec, device, dtype, peak, rows) -> None:
    """Every GPU trains one PEFT adapter on its own base at the same time."""
    torch.manual_seed(0)
    base = build_base(cfg, device, dtype)
    data = synthetic_data(spec.vocab_size, args.seq, n=4)
    row = {"model": name, "case": f"peft-min-gpu-x{args.gpus}", "strategy": "min-gpu",
           "d": args.gpus, "adapters": args.gpus}  # fmt: skip
    try:
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        res = run_peft(base, data, args.seq, args.rank, device, dtype, args.warmup, args.steps)
        t = torch.tensor([res["step_s"]], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest GPU's step
        tps = args.gpus * args.seq / float(t.item())
        ceiling = args.gpus * spec.flop_ceiling_tokens_per_s(peak, args.seq)
        row.update(tokens_per_s=tps, ceiling_fraction=tps / ceiling, step_s=float(t.item()),
                   peak_gib=_peak(device) / 2**30)  # fmt: skip
    except Exception as e:
        row["error"] = _error_text(e)
    rows.append(row)
    if rank == 0:
        _print(row)
        _save(args, rows)
    del base
    gc.collect()


def _error_text(e: BaseException) -> str:
    """The error and the causes it was raised from, one line (torch's pipelining wraps the
    stage's real error in a generic one)."""
    parts = []
    while e is not None and len(parts) < 4:
        parts.append(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def _last_line(e: BaseException) -> str:
    """A spawned rank's error, without its traceback."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else repr(e)


def _save(args: argparse.Namespace, rows: list[dict]) -> None:
    """Write the rows so far (rank 0; also after a failed case)."""
    if args.out and dist.get_rank() == 0:
        _write(args, rows)


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    """``--out``'s JSON: the rows, the run's settings and what a case group's ranks measured
    (device, peak; kept from the file when this process did not measure them: the parent
    recording a failed group)."""
    path = args.out / "multigpu.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    meta = {k: v for k, v in old.items() if k != "rows"}
    meta.update(gpus=args.gpus, seq=args.seq, rank=args.rank, **vars(args).get("meta", {}))
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {**meta, "rows": rows})


def _print(row: dict) -> None:
    if "error" in row:
        print(f"{row['model']:>18} {row['case']:>20} ERROR {row['error']}", flush=True)
        return
    extra = ""
    if "predicted_step_s" in row:
        extra = (f"  step {row['step_s']:.3f} s (predicted {row['predicted_step_s']:.3f})  "
                 f"peak {row['peak_gib']:.1f} GiB (predicted {row['predicted_gib']:.1f})")  # fmt: skip
    print(
        f"{row['model']:>18} {row['case']:>20} {row['tokens_per_s']:>10.0f} tok/s  "
        f"{row['ceiling_fraction']:6.3f} of ceiling{extra}",
        flush=True,
    )


def _worker(rank: int, args: argparse.Namespace, port: int, name: str, strategy: str) -> None:
    """One case group (a strategy, or ``min-gpu``) of one model in its own process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = not args.smoke
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    dist.init_process_group(
        "nccl" if cuda else "gloo", rank=rank, world_size=args.gpus,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )  # fmt: skip
    try:
        if not cuda:
            torch.set_num_threads(1)
        peak = measure_peak_flops(device, dtype)
        t = torch.tensor([peak], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        peak = float(t.item())
        gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
        args.meta = {"device": gpu, "peak_flops": peak}
        if rank == 0:
            print(f"{args.gpus} x {gpu}: measured peak {peak / 1e12:.1f} TFLOP/s each", flush=True)
        cfg = hf_config(name)
        cfg.use_cache = False
        spec = ModelSpec.from_hf_config(cfg)
        rows: list[dict] = _load_rows(args)
        if strategy == "min-gpu":
            run_min_gpu(rank, args, name, cfg, spec, device, dtype, peak, rows)
        else:
            run_strategy(rank, args, name, cfg, spec, strategy, device, dtype, peak, rows)
        _save(args, rows)
    finally:
        dist.destroy_process_group()


def _load_rows(args: argparse.Namespace) -> list[dict]:
    """The rows earlier case groups of this run wrote (each group is its own set of processes)."""
    if args.out is None or not (args.out / "multigpu.json").is_file():
        return list(args.rows)
    return json.loads((args.out / "multigpu.json").read_text())["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--models", nargs="*", default=["Qwen/Qwen2.5-14B"])
    ap.add_argument("--strategies", nargs="*", choices=STRATEGIES, default=list(STRATEGIES))
    ap.add_argument("--packs", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--liger", action="store_true", help="Liger-Kernel's fused ops on the base")
    ap.add_argument("--checkpointing", choices=["auto", "on", "off"], default="auto")
    ap.add_argument(
        "--pp-micro",
        type=int,
        nargs="*",
        default=[],
        help="pipeline micro-batch counts to run each pp pack with (default: the trainer's)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="profile one more step of each case on every rank (JSON and trace to --out)",
    )
    ap.add_argument("--no-min-gpu", dest="min_gpu", action="store_false")
    ap.add_argument("--timeout-s", type=int, default=300, help="collective timeout")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, gloo on CPU")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.smoke:
        args.models, args.seq, args.packs, args.warmup, args.steps = ["smoke"], 32, [2, 4], 1, 2
    elif torch.cuda.device_count() < args.gpus:
        sys.exit(f"error: --gpus {args.gpus} but this machine has {torch.cuda.device_count()}")
    args.rows = []
    failed = 0
    groups = [(n, s) for n in args.models for s in [*args.strategies, *["min-gpu"] * args.min_gpu]]
    for name, strategy in groups:
        # each strategy in its own processes: a case that fails (its ranks end at once rather
        # than wait in a collective) costs only the rest of its own group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            mp.spawn(_worker, args=(args, port, name, strategy), nprocs=args.gpus, join=True)
        except ProcessException as e:
            failed += 1
            print(f"{name:>18} {strategy:>20} FAILED ({e}); going on with the next", flush=True)
            rows = _load_rows(args)
            if not any(r["model"] == name and r["strategy"] == strategy and "error" in r
                       for r in rows):  # fmt: skip
                rows.append({"model": name, "case": f"{strategy}{args.gpus}", "strategy": strategy,
                             "d": args.gpus, "error": _last_line(e)})  # fmt: skip
            args.rows = rows
            if args.out is not None:
                _write(args, rows)
    if failed:
        sys.exit(f"{failed} of {len(groups)} case groups failed (their rows say why)")


if __name__ == "__main__":
    main()
