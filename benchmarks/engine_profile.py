"""Where one packed training step spends its time: GPU kernels by kind, and the host's share.

Builds the same random-weight model and packed trainer as ``engine_throughput.py`` (Liger on the
frozen base when importable, the Triton kernels on) and measures each variant of the step on a
fresh trainer over the same base: ``--graphs both`` (default) the eager step (``packed-K``),
then the steady step replayed as CUDA graphs (``packed-K+graphs``, ``cuda_graphs=True``: what
``training.cuda_graphs`` runs); ``off`` / ``on`` one of them. Each variant warms up (a graphed
one at least 3 steps: a shape's first step runs eagerly and the next captures), times
``--steps`` steps, then records two more with ``torch.profiler``, and reports per step:

* ``wall_ms``: the wall time of a step (timed without the profiler, synchronised);
* ``host_ms``: step start until the host had queued its last kernel (``StepProfile.host_s``);
* ``gpu_kernel_ms``: GPU kernel time (the profiler's), grouped by kind (packed-LoRA kernels,
  cuBLAS GEMMs, attention, Liger, optimizer, ...), and the top kernels;
* ``gpu_idle``: ``1 - gpu_kernel_ms / wall_ms``, the share of the wall the GPU waits for the
  host;

and the top host-side operators. ``--loss-kernel both`` measures each variant with the packed
loss's cross-entropy in torch (``PLORA_KERNELS_CE=0``), then by the Triton kernel; ``--rounds N``
repeats the whole sequence (alternating, for clock drift). ``--out DIR`` writes
``DIR/engine_profile.json``, one entry per variant. On the CPU (``--smoke``: a tiny shape)
there is no GPU kernel time (``gpu_kernel_ms`` and ``gpu_idle`` are null) and ``+graphs`` runs
the graph's static-buffer step eagerly.

GPU:   python benchmarks/engine_profile.py --model Qwen/Qwen2.5-3B --adapters 16 --rank 16 --out $OUT
CPU:   python benchmarks/engine_profile.py --smoke --out DIR
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import engine_throughput as et

from plora.engine import lora
from plora.engine.liger import apply_fused_kernels
from plora.utils import atomic_write_json

#: Steps recorded by the profiler per variant.
PROFILED_STEPS = 2
#: Kernel-name fragment -> kind, first match wins.
KINDS = [
    ("_fused_tma", "lora: fused TMA GEMM"), ("_lora_gemm", "lora: gemm / expand"),
    ("_shrink", "lora: shrink"), ("_wgrad", "lora: weight gradients"),
    ("flash", "attention"), ("fmha", "attention"), ("sdpa", "attention"),
    ("_rms", "liger"), ("swiglu", "liger"), ("rope", "liger"), ("liger", "liger"),
    ("nvjet", "cuBLAS GEMM"), ("gemm", "cuBLAS GEMM"), ("cutlass", "cuBLAS GEMM"),
    ("adam", "optimizer"), ("foreach", "optimizer"), ("norm", "optimizer"),
    ("softmax", "loss"), ("cross_entropy", "loss"), ("_ce_kernel", "loss"), ("nll", "loss"),
    ("copy", "copies / casts"), ("cat", "copies / casts"), ("elementwise", "element-wise"),
]  # fmt: skip


def kind(name: str) -> str:
    low = name.lower()
    return next((k for frag, k in KINDS if frag in low), "other")


def profile_variant(
    base, tok, data, args, device, dtype, *, graphs: bool, loss_kernel: bool = True
) -> dict[str, Any]:
    """One variant on a fresh trainer over ``base`` (given back plain): wall, host and GPU
    kernel time per step, the GPU's idle share, kernels by kind, top kernels and host ops.
    ``loss_kernel=False``: the packed loss's cross-entropy in torch (``PLORA_KERNELS_CE=0``)."""
    os.environ["PLORA_KERNELS_CE"] = "1" if loss_kernel else "0"
    warmup = et.graph_warmup(args.warmup, graphs)
    trainer = et.packed_trainer(base, tok, data, args.adapters, args.rank, device, dtype,
                                graphs=graphs, profile_steps=warmup + args.steps)  # fmt: skip
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    try:
        wall_ms = 1e3 * et.time_steps(trainer.step, device, warmup, args.steps)
        host_ms = et.host_ms(trainer, warmup)
        with profile(activities=activities) as prof:
            for _ in range(PROFILED_STEPS):
                trainer.step()
            et.sync(device)
    finally:
        et.drop_trainer(trainer, base)
    gpu: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            gpu[ev.name] += ev.device_time_total
            calls[ev.name] += 1
    kernel_ms = sum(gpu.values()) / PROFILED_STEPS / 1e3 if gpu else None
    by_kind: collections.Counter[str] = collections.Counter()
    for name, us in gpu.items():
        by_kind[kind(name)] += us / PROFILED_STEPS / 1e3
    host_ops = [
        {"name": ev.key, "self_ms": ev.self_cpu_time_total / PROFILED_STEPS / 1e3,
         "calls": ev.count // PROFILED_STEPS}
        for ev in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
    ]  # fmt: skip
    return {
        "label": et.graph_label(f"packed-{args.adapters}", graphs)
        + ("" if loss_kernel else " (torch CE)"),
        "graphs": graphs,
        "loss_kernel": loss_kernel,
        "warmup": warmup,
        "steps": args.steps,
        "wall_ms": wall_ms,
        "host_ms": host_ms,
        "gpu_kernel_ms": kernel_ms,
        "gpu_idle": None if kernel_ms is None else 1 - kernel_ms / wall_ms,
        "graph_stats": et.graph_stats(trainer),
        # few kernels per step under graphs would mean the profiler missed the replayed ones
        "kernels_per_step": sum(calls.values()) / PROFILED_STEPS,
        "by_kind_ms": dict(by_kind.most_common()),
        "top_kernels": [
            {"name": name, "ms": us / PROFILED_STEPS / 1e3, "calls": calls[name] // PROFILED_STEPS}
            for name, us in gpu.most_common(20)
        ],
        "top_host_ops": host_ops,
    }


def _ms(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def show(v: dict[str, Any], args: argparse.Namespace) -> None:
    """Print one variant as the earlier, single-variant profile did."""
    kernel, idle = v["gpu_kernel_ms"], v["gpu_idle"]
    print(f"{args.model} x{args.adapters} rank {args.rank}, seq {args.seq}, {v['label']}: wall "
          f"{v['wall_ms']:.1f} ms per step, host {_ms(v['host_ms'])} ms, GPU kernels "
          f"{_ms(kernel)} ms ({_ms(idle, '.0%')} of the wall the GPU waits)")  # fmt: skip
    for k, ms in v["by_kind_ms"].items():
        print(f"  {k:26s} {ms:8.1f} ms  {ms / kernel:6.1%}")
    if v["top_kernels"]:
        print("top kernels (ms per step, calls per step):")
    for row in v["top_kernels"]:
        print(f"  {row['ms']:8.2f}  x{row['calls']:5d}  {row['name'][:100]}")
    print("top host operators by self time (ms per step, calls per step):")
    for row in v["top_host_ops"]:
        print(f"  {row['self_ms']:8.2f}  x{row['calls']:6d}  {row['name'][:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-3B")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--liger", choices=["auto", "on", "off"], default="auto",
                    help="training.fused_kernels of the profiled step")  # fmt: skip
    ap.add_argument("--graphs", choices=sorted(et.GRAPH_MODES), default="both",
                    help="the eager step (off), CUDA graphs (on: training.cuda_graphs), or "
                    "both on fresh trainers, eager first")  # fmt: skip
    ap.add_argument("--loss-kernel", choices=["on", "off", "both"], default="on",
                    help="the packed loss's cross-entropy by the Triton kernel (on), by torch "
                    "(off: PLORA_KERNELS_CE=0), or both, torch first")  # fmt: skip
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the variants this many times, alternating (clock drift)",
    )
    ap.add_argument("--warmup", type=int, default=3, help="graphed: at least 3")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (seconds)")
    ap.add_argument("--out", type=Path, default=None, help="directory for engine_profile.json")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.seq, args.adapters, args.rank, args.liger = "smoke", 32, 4, 8, "off"
        args.warmup, args.steps = 1, 2
        torch.set_num_threads(1)  # toy matmuls: threads only add overhead
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = et.model_config(args.model)
    base = et.build_base(cfg, device, dtype)
    # the engine's switch, as a sweep resolves training.fused_kernels
    liger = apply_fused_kernels(base, args.liger, device=device)
    if not liger:
        print("fused kernels off (or liger_kernel not installed): stock HF base", flush=True)
    lora.set_kernel_backend("auto")
    data = et.synthetic_data(cfg.vocab_size, args.seq, n=2 * args.adapters)
    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 0})()
    loss_kernels = {"on": [True], "off": [False], "both": [False, True]}[args.loss_kernel]
    variants = []
    for _ in range(args.rounds):
        for graphs in et.GRAPH_MODES[args.graphs]:
            for lk in loss_kernels:
                variants.append(profile_variant(
                    base, tok, data, args, device, dtype, graphs=graphs, loss_kernel=lk
                ))  # fmt: skip
                show(variants[-1], args)
                if cuda:
                    torch.cuda.empty_cache()
    if len(variants) == 2:
        before, after = variants
        print(f"{before['label']} -> {after['label']}: wall {before['wall_ms']:.1f} -> "
              f"{after['wall_ms']:.1f} ms ({before['wall_ms'] / after['wall_ms']:.2f}x), host "
              f"{_ms(before['host_ms'])} -> {_ms(after['host_ms'])} ms, GPU idle "
              f"{_ms(before['gpu_idle'], '.1%')} -> {_ms(after['gpu_idle'], '.1%')}")  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out / "engine_profile.json", {
            "benchmark": "engine_profile",
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": "python benchmarks/engine_profile.py " + shlex.join(sys.argv[1:]),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "model": args.model, "adapters": args.adapters, "rank": args.rank, "seq": args.seq,
            "liger": liger, "graphs": args.graphs, "loss_kernel": args.loss_kernel,
            "rounds": args.rounds, "profiled_steps": PROFILED_STEPS,
            "variants": variants,
        })  # fmt: skip


if __name__ == "__main__":
    main()
