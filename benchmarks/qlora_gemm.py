"""QLoRA's frozen GEMM, per projection: dequantize-then-GEMM vs a 4-bit GEMM vs the dense GEMM.

For each decoder projection shape of a model (``plora/models/configs``) and ``T`` tokens, times

* ``dense``      ``x·Wᵀ`` with a dense weight (bf16 on CUDA, fp32 on CPU) -- the floor;
* ``dequant``    torchao NF4 → dense, alone (what every QLoRA forward and backward pays);
* ``nf4``        ``F.linear(x, W_nf4)``: torchao's ``linear_nf4`` = dequantize + dense GEMM
                 (plora's torch path; the fused kernels take the same dequantized weight);
* ``int4``       torch's 4-bit weight-only GEMM (``_weight_int4pack_mm``, tinygemm on CUDA,
                 ``_for_cpu`` on CPU): an affine int4 format with groups of 64, *not* NF4, but the
                 one 4-bit GEMM torch ships -- the speed a 4-bit kernel would give (bf16
                 activations; on CPU compare with ``dense_int4dtype``, the dense bf16 GEMM);
* ``bnb``        bitsandbytes ``matmul_4bit`` on its NF4 weight (CUDA, when installed).

and the backward's ``dX = dY·W`` (dense, and NF4 dequantize + GEMM): a 4-bit GEMM of ``x·Wᵀ``
does not serve it (it needs ``W`` in the other orientation), so training pays a dequantization
per pass whatever the forward does. Every fast path is checked against its dense twin
(relative error printed; a mismatch above 2 % fails the run).

GPU:  PYTHONPATH=$PWD python benchmarks/qlora_gemm.py --out $OUT            (7B and 14B shapes)
CPU:  python benchmarks/qlora_gemm.py --smoke                 (0.5B shapes, T=256, one thread)
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from plora.model_spec import ModelSpec
from plora.utils import atomic_write_json

GROUP = 64


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after two warm-ups."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def int4_weight(w: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """torch's int4 weight-only GEMM for ``w`` (out, in): ``(x -> x·Ŵᵀ, Ŵ)`` with Ŵ its
    dequantized (affine, groups of 64) twin."""
    n, k = w.shape
    wg = w.float().view(n, k // GROUP, GROUP)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / 15
    q = ((wg - lo) / scale).round().clamp(0, 15).to(torch.int32)
    zero = lo + 8 * scale  # tinygemm: w = (q - 8)·scale + zero
    deq = ((q.float() - 8) * scale + zero).view(n, k).to(w.dtype)
    sz = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], -1).transpose(0, 1).contiguous()
    sz = sz.to(w.dtype)
    q = q.view(n, k)
    if w.is_cuda:
        packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
        return (lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz)), deq
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)), deq


def bnb_weight(w: torch.Tensor):
    """bitsandbytes NF4 (double quantization) of ``w``: ``(x -> x·Ŵᵀ, Ŵ)`` or None."""
    if not w.is_cuda or importlib.util.find_spec("bitsandbytes") is None:
        return None
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    w4, state = bf.quantize_4bit(w, quant_type="nf4", compress_statistics=True, blocksize=64)
    deq = bf.dequantize_4bit(w4, state)
    return (lambda x: bnb.matmul_4bit(x, w4.t(), quant_state=state)), deq


def bench_shape(name: str, out_f: int, in_f: int, tokens: int, device, dtype, reps: int) -> dict:
    from plora.models.quantize import to_nf4

    g = torch.Generator(device=device).manual_seed(0)
    w = (torch.randn(out_f, in_f, device=device, generator=g) * in_f**-0.5).to(dtype)
    x = torch.randn(tokens, in_f, device=device, generator=g).to(dtype)
    dy = torch.randn(tokens, out_f, device=device, generator=g).to(dtype)
    nf4 = to_nf4(w)
    deq = nf4.get_original_weight().to(dtype)
    row: dict = {"projection": name, "out": out_f, "in": in_f, "tokens": tokens}
    row["dense_ms"] = 1e3 * timed(lambda: F.linear(x, w), device, reps)
    row["dequant_ms"] = 1e3 * timed(lambda: nf4.get_original_weight().to(dtype), device, reps)
    row["nf4_ms"] = 1e3 * timed(lambda: F.linear(x, nf4), device, reps)
    row["dense_dx_ms"] = 1e3 * timed(lambda: dy @ w, device, reps)
    row["nf4_dx_ms"] = 1e3 * timed(lambda: dy @ nf4.get_original_weight().to(dtype), device, reps)
    row["nf4_err"] = rel(F.linear(x, nf4), F.linear(x, deq))
    # torch's CPU int4 kernel is built for bf16 activations (fp32 measured ~100x slower than
    # the dense fp32 GEMM): time it in bf16 there, beside a dense bf16 GEMM of the same shape
    w4, x4 = (w, x) if device.type == "cuda" else (w.bfloat16(), x.bfloat16())
    row["int4_dtype"] = str(x4.dtype).removeprefix("torch.")
    row["dense_int4dtype_ms"] = 1e3 * timed(lambda: F.linear(x4, w4), device, reps)
    try:
        mm, twin = int4_weight(w4)
        row["int4_ms"] = 1e3 * timed(lambda: mm(x4), device, reps)
        row["int4_err"] = rel(mm(x4), F.linear(x4, twin))
    except (RuntimeError, NotImplementedError) as err:
        row["int4_ms"], row["int4_note"] = None, " ".join(str(err).split())[:120]
    bnb = bnb_weight(w)
    if bnb is not None:
        mm, twin = bnb
        row["bnb_ms"] = 1e3 * timed(lambda: mm(x), device, reps)
        row["bnb_err"] = rel(mm(x), F.linear(x, twin))
    for key in ("nf4_err", "int4_err", "bnb_err"):
        if row.get(key) is not None and row[key] > 0.02:
            raise SystemExit(f"{name}: {key}={row[key]:.3g}: the fast path disagrees with its twin")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-14B"])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1024, 8192])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU, Qwen2.5-0.5B shapes, 256 tokens")
    ap.add_argument("--out", type=Path, default=None, help="directory for qlora_gemm.json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke or device.type == "cpu":
        args.models, args.tokens, args.reps = ["Qwen/Qwen2.5-0.5B"], [256], min(args.reps, 3)
        torch.set_num_threads(1)  # one core: steadier timings on a shared machine
    from plora.models.quantize import require_torchao

    require_torchao()
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {what}, {dtype}, torch {torch.__version__}", flush=True)
    head = f"{'model':>18} {'proj':>9} {'out x in':>12} {'T':>5}"
    cols = ("dense", "dequant", "nf4", "dense_int4dtype", "int4", "bnb", "dense_dx", "nf4_dx")
    names = {"dense_int4dtype": "dense16"}
    print(head + "".join(f"{names.get(c, c) + ' ms':>12}" for c in cols) + f"{'nf4/dense':>11}",
          flush=True)  # fmt: skip
    rows = []
    for model in args.models:
        spec = ModelSpec.from_hf_config(model)
        for tokens in args.tokens:
            for proj, (in_f, out_f) in spec.projection_shapes.items():
                row = {"model": model, **bench_shape(proj, out_f, in_f, tokens, device, dtype,
                                                      args.reps)}  # fmt: skip
                rows.append(row)
                cells = "".join(
                    f"{row[c + '_ms']:>12.3f}" if row.get(c + "_ms") is not None else f"{'-':>12}"
                    for c in cols
                )
                print(f"{model:>18} {proj:>9} {f'{out_f}x{in_f}':>12} {tokens:>5}{cells}"
                      f"{row['nf4_ms'] / row['dense_ms']:>11.2f}", flush=True)  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        out = {"device": what, "dtype": str(dtype), "torch": torch.__version__, "rows": rows}
        atomic_write_json(args.out / "qlora_gemm.json", out)


if __name__ == "__main__":
    main()
