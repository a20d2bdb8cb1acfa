"""Where one packed training step spends its time: GPU kernels by kind, and the host's share.

Builds the same random-weight model and packed trainer as ``engine_throughput.py`` (Liger on the
frozen base when importable, the Triton kernels on), warms up, then records two steps with
``torch.profiler`` and prints, per step: the wall time, the GPU kernel time grouped by kind
(packed-LoRA kernels, cuBLAS GEMMs, attention, Liger, optimizer, ...), the top kernels and the
top host-side operators. The gap between wall and GPU time is the time the GPU waits for the host.

GPU:   python benchmarks/engine_profile.py --model Qwen/Qwen2.5-3B --adapters 16 --rank 16
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).parent))
import engine_throughput as et

from plora.engine import lora
from plora.engine.liger import apply_fused_kernels
from plora.engine.trainer import PackedTrainer
from plora.model_spec import shipped_config_path

#: Kernel-name fragment -> kind, first match wins.
KINDS = [
    ("_fused_tma", "lora: fused TMA GEMM"), ("_lora_gemm", "lora: gemm / expand"),
    ("_shrink", "lora: shrink"), ("_wgrad", "lora: weight gradients"),
    ("flash", "attention"), ("fmha", "attention"), ("sdpa", "attention"),
    ("_rms", "liger"), ("swiglu", "liger"), ("rope", "liger"), ("liger", "liger"),
    ("nvjet", "cuBLAS GEMM"), ("gemm", "cuBLAS GEMM"), ("cutlass", "cuBLAS GEMM"),
    ("adam", "optimizer"), ("foreach", "optimizer"), ("norm", "optimizer"),
    ("softmax", "loss"), ("cross_entropy", "loss"), ("nll", "loss"),
    ("copy", "copies / casts"), ("cat", "copies / casts"), ("elementwise", "element-wise"),
]  # fmt: skip


def kind(name: str) -> str:
    low = name.lower()
    return next((k for frag, k in KINDS if frag in low), "other")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-3B")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--liger", choices=["auto", "on", "off"], default="auto",
                    help="training.fused_kernels of the profiled step")  # fmt: skip
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = AutoConfig.from_pretrained(str(shipped_config_path(args.model)))
    base = et.build_base(cfg, device, dtype)
    # the engine's switch, as a sweep resolves training.fused_kernels
    if not apply_fused_kernels(base, args.liger, device=device):
        print("fused kernels off (or liger_kernel not installed): stock HF base", flush=True)
    lora.set_kernel_backend("auto")
    data = et.synthetic_data(cfg.vocab_size, args.seq, n=2 * args.adapters)
    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 0})()
    trainer = PackedTrainer(base, tok, data, device=device, dtype=dtype)
    for c in et.adapter_configs(args.adapters, args.rank):
        trainer.add(c)
    for _ in range(3):
        trainer.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        trainer.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 3

    steps = 2
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.step()
        torch.cuda.synchronize()
    gpu, calls = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            gpu[ev.name] += ev.device_time_total
            calls[ev.name] += 1
    total = sum(gpu.values()) / steps / 1e3
    print(f"{args.model} x{args.adapters} rank {args.rank}, seq {args.seq}: wall {wall * 1e3:.1f} ms "
          f"per step, GPU kernels {total:.1f} ms ({1 - total / (wall * 1e3):.0%} of the wall the GPU "
          "waits)")  # fmt: skip
    by_kind = collections.Counter()
    for name, us in gpu.items():
        by_kind[kind(name)] += us / steps / 1e3
    for k, ms in by_kind.most_common():
        print(f"  {k:26s} {ms:8.1f} ms  {ms / total:6.1%}")
    print("top kernels (ms per step, calls per step):")
    for name, us in gpu.most_common(20):
        print(f"  {us / steps / 1e3:8.2f}  x{calls[name] // steps:5d}  {name[:100]}")
    print("top host operators by self time (ms per step, calls per step):")
    cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for ev in cpu[:20]:
        print(
            f"  {ev.self_cpu_time_total / steps / 1e3:8.2f}  x{ev.count // steps:6d}  {ev.key[:90]}"
        )


if __name__ == "__main__":
    main()
