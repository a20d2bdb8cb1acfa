"""Benchmarks of the packed multi-LoRA kernels (plora.kernels) on one GPU.

Sections:
  a) PLoRA Table 7: LoRA term only, r = 64, 1,024 tokens per adapter, d in {2048, 11008, 3584,
     18944} (in = out = d), K in {2, 8, 32} adapters: packed kernels vs sequential per-adapter
     torch LoRA, forward and backward separately. Target: speedup >= 0.9·K.
  b) The whole packed LoRA linear (fwd + bwd: y, dX, dA, dB) vs the frozen linear alone (x·Wᵀ
     forward + dY·W backward): 8,192 tokens, d = 4,096, 32 slots of ranks 8-128, ragged
     segments; each mode (fused / epilogue / accumulate) and auto, dropout 0 and 0.1. Target: <= 1.10x.
  c) The same shape vs the naive per-adapter torch loop (mLoRA BatchLoRA style).
  --tune first sweeps tile configs per kernel on the (b) shape, then times the three modes
  per phase on a grid of shapes, and writes the tuned.json entry for this GPU.

Timing: triton.testing.do_bench, median, after its warm-up; inputs rotate over several buffers
(each larger than L2 at the big shapes); random data. Usage on the GPU:
    PYTHONPATH=$PWD python benchmarks/kernels.py --tune --out $OUT
``--dry-run`` runs every code path at toy sizes on the CPU under the Triton interpreter.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch
import triton
from kernels_common import (
    DRY,
    Pack,
    Timing,
    bench,
    frozen_times,
    kernel_calls,
    ragged_lens,
    time_fwd_bwd,
    time_modes,
)
from kernels_tune import run_tune
from plora.kernels import ops

from plora.utils import atomic_write_text


# --------------------------------------------------------------------------------- sections
def section_a(dtype, device, log) -> list[dict]:
    dims, ks, tokens, rank = (2048, 11008, 3584, 18944), (2, 8, 32), 1024, 64
    if DRY:
        dims, ks, tokens, rank = (32, 48), (2, 3), 16, 16
    rows = []
    bw = copy_bandwidth(device, dtype)
    log(f"  copy bandwidth (read + write of a 1 GiB buffer): {bw / 1e12:.2f} TB/s")
    for d in dims:
        for k in ks:
            pk = Pack(
                seg_lens=[tokens] * k,
                ranks=[rank] * k,
                in_f=d,
                out_f=d,
                dtype=dtype,
                device=device,
                n_rot=2,
            )
            seq = time_fwd_bwd(pk, pk.seq_delta, pk.adapters(), graph=True, inputs=pk.parts)
            packed = time_fwd_bwd(pk, pk.delta, [pk.a, pk.b], graph=True)
            # Bytes any kernel must move: fwd reads x and writes y, bwd reads dY and x and
            # writes dX (A, B and S are small). seq_ms / (bytes / bandwidth) bounds the speedup.
            act = k * tokens * d * torch.finfo(dtype).bits // 8
            floor_f, floor_b = 2 * act / bw * 1e3, 3 * act / bw * 1e3
            row = dict(d=d, adapters=k, seq=seq._asdict(), packed=packed._asdict(),
                       speedup_fwd=seq.fwd / packed.fwd, speedup_bwd=seq.bwd / packed.bwd,
                       graph_speedup_fwd=seq.fwd_graph / packed.fwd_graph,
                       graph_speedup_bwd=seq.bwd_graph / packed.bwd_graph,
                       bound_fwd=seq.fwd / floor_f, bound_bwd=seq.bwd / floor_b,
                       graph_bound_fwd=seq.fwd_graph / floor_f,
                       graph_bound_bwd=seq.bwd_graph / floor_b)  # fmt: skip
            rows.append(row)
            log(f"  d={d} K={k}: eager fwd {row['speedup_fwd']:.2f}x (bound {row['bound_fwd']:.1f}x) "
                f"bwd {row['speedup_bwd']:.2f}x (bound {row['bound_bwd']:.1f}x) | graph fwd "
                f"{row['graph_speedup_fwd']:.2f}x (bound {row['graph_bound_fwd']:.1f}x) bwd "
                f"{row['graph_speedup_bwd']:.2f}x (bound {row['graph_bound_bwd']:.1f}x) "
                f"(ms eager packed {packed.fwd:.3f}/{packed.bwd:.3f} seq {seq.fwd:.3f}/{seq.bwd:.3f}; "
                f"graph packed {packed.fwd_graph:.3f}/{packed.bwd_graph:.3f} "
                f"seq {seq.fwd_graph:.3f}/{seq.bwd_graph:.3f})")  # fmt: skip
            del pk
    return rows


def copy_bandwidth(device, dtype) -> float:
    """Bytes per second of ``dst.copy_(src)`` (read + write) on a 1 GiB buffer."""
    n = (2**30 if not DRY else 2**12) // (torch.finfo(dtype).bits // 8)
    src = torch.randn(n, device=device).to(dtype)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def section_bc(dtype, device, log) -> dict:
    n, d, n_slots = 8192, 4096, 32
    if DRY:
        n, d, n_slots = 256, 64, 6
    lens = ragged_lens(n, n_slots)
    ranks = [(8, 16, 24, 32, 48, 64, 96, 128)[i % 8] for i in range(n_slots)]
    out: dict = {
        "tokens": n,
        "d": d,
        "slots": n_slots,
        "ranks": ranks,
        "seg_lens": lens,
        "rows": [],
    }
    # The GPU's clock drifts over a run (a few % as it warms): frozen and packed are timed in
    # alternating rounds; each ratio is packed over the frozen time of its own round; medians.
    rounds = 1 if DRY else 3
    pk0 = Pack(seg_lens=lens, ranks=ranks, in_f=d, out_f=d, dtype=dtype, device=device)
    for p in (0.0, 0.1):
        pk = Pack(
            seg_lens=lens, ranks=ranks, in_f=d, out_f=d, dtype=dtype, device=device, dropout=p
        )
        modes = [m.value for m in ops.Mode] + [None]
        samples: dict = {mode: [] for mode in modes}
        frozen = []
        for _ in range(rounds):
            frozen.append(frozen_times(pk0, graph=True))
            for mode, t in time_modes(pk, modes, graph=True).items():
                samples[mode].append((t, ratios(t, frozen[-1])))
        f = Timing.median(frozen)
        out.setdefault("frozen", {})[str(p)] = dict(**f._asdict(), rounds=frozen)
        log(f"  frozen linear: fwd {f.fwd:.4f} ms, bwd (dY·W) {f.bwd:.4f} ms, total "
            f"{f.fwd + f.bwd:.4f} ms; graph {f.fwd_graph:.4f} + {f.bwd_graph:.4f} ms")  # fmt: skip
        for mode, rows in samples.items():
            t = Timing.median(r[0] for r in rows)
            eager, graph = (statistics.median(r[1][i] for r in rows) for i in (0, 1))
            row = dict(
                dropout=p, mode=mode or "auto", **t._asdict(), ratio_vs_frozen=eager,
                graph_ratio_vs_frozen=graph, ratios=[r[1] for r in rows],
            )  # fmt: skip
            out["rows"].append(row)
            spread = "-".join(f"{fn(r[1][0] for r in rows):.3f}" for fn in (min, max))
            log(f"  packed p={p} mode={row['mode']}: fwd {t.fwd:.4f} bwd {t.bwd:.4f} ms -> "
                f"{eager:.3f}x frozen (rounds {spread}); graph {t.fwd_graph:.4f} + "
                f"{t.bwd_graph:.4f} ms -> {graph:.3f}x")  # fmt: skip
        if p == 0.0:
            calls = kernel_calls(pk)
            out["kernels_ms"] = {k: bench(c) for k, c in calls.items()}
            log(f"  per-kernel ms (p=0): {out['kernels_ms']}")
            n_f, n_b = time_fwd_bwd(pk, pk.naive, pk.adapters())[:2]
            out["naive_fwd_ms"], out["naive_bwd_ms"] = n_f, n_b
            best = min(
                (r for r in out["rows"] if r["dropout"] == 0.0),
                key=lambda r: r["fwd"] + r["bwd"],
            )
            out["speedup_vs_naive"] = (n_f + n_b) / (best["fwd"] + best["bwd"])
            log(
                f"  naive loop: fwd {n_f:.4f} bwd {n_b:.4f} ms; packed best is {out['speedup_vs_naive']:.2f}x faster"
            )
        del pk
    return out


def ratios(packed: Timing, frozen: Timing) -> tuple[float, float]:
    """Packed fwd + bwd over frozen fwd + bwd: eager, and as CUDA graphs."""
    return (
        (packed.fwd + packed.bwd) / (frozen.fwd + frozen.bwd),
        (packed.fwd_graph + packed.bwd_graph) / (frozen.fwd_graph + frozen.bwd_graph),
    )


def section_probes(dtype, device, log) -> dict:
    """Where the memory-bound LoRA kernels stand against plain copies of the same bytes."""
    n, d = (8192, 4096) if not DRY else (256, 64)
    out = {}
    y = torch.empty(n, d, device=device, dtype=dtype)
    x = torch.randn(n, d, device=device, dtype=dtype)
    out["write_y_ms"] = bench(lambda: y.fill_(1.0))
    out["copy_x_to_y_ms"] = bench(lambda: y.copy_(x))
    for ranks in (
        [16] * 32,
        [128] * 32,
        [(8, 16, 24, 32, 48, 64, 96, 128)[i % 8] for i in range(32)],
    ):
        pk = Pack(
            seg_lens=ragged_lens(n, 32),
            ranks=ranks,
            in_f=d,
            out_f=d,
            dtype=dtype,
            device=device,
            n_rot=1,
        )
        calls = kernel_calls(pk)
        key = f"ranks {sorted(set(ranks))}"
        out[key] = {k: bench(calls[k]) for k in ("shrink", "lora", "wgrad")}
        del pk
    for k, v in out.items():
        log(f"  {k}: {v}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--tune", action="store_true", help="tune configs and dispatch first; write tuned.json"
    )
    ap.add_argument(
        "--sections", default="a,b", help="comma list of a, b (b includes c), p (probes)"
    )
    ap.add_argument(
        "--out", default="runs/kernels", help="directory for results JSON and tuned.json"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="toy sizes on CPU under the Triton interpreter"
    )
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = "cpu" if DRY else "cuda"
    dtype = torch.float32 if DRY else torch.bfloat16
    gpu = "cpu (interpreter)" if DRY else torch.cuda.get_device_name()
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    info = dict(gpu=gpu, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                torch=torch.__version__, triton=triton.__version__, command=" ".join(sys.argv), dtype=str(dtype))  # fmt: skip
    log(json.dumps(info))
    results: dict = {"info": info}
    if args.tune:
        results["tuned"] = run_tune(dtype, device, gpu, info, out_dir, log)
    sections = set(args.sections.split(","))
    if "a" in sections:
        log(
            "== a) Table 7 shapes: packed vs sequential per-adapter LoRA (speedup; target >= 0.9*K)"
        )
        results["table7"] = section_a(dtype, device, log)
    if "b" in sections:
        log("== b/c) packed LoRA linear vs frozen linear (target <= 1.10x) and vs naive loop")
        results["linear"] = section_bc(dtype, device, log)
    if "p" in sections:
        log("== p) probes: bandwidth floors vs the LoRA kernels at the (b) shape")
        results["probes"] = section_probes(dtype, device, log)
    atomic_write_text(out_dir / "kernels_results.json", json.dumps(results, indent=1) + "\n")
    atomic_write_text(out_dir / "kernels_log.txt", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
