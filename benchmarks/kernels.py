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
import contextlib
import datetime
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from plora.kernels import ops, packed_lora_delta, packed_lora_linear
from plora.kernels.meta import make_meta, padded_rank

DRY = "--dry-run" in sys.argv


def bench(fn, grad_to_none=None) -> float:
    """Median milliseconds of ``fn``."""
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(
        fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"
    )


def cycler(items):
    """Zero-argument function returning the next item, round-robin."""
    it = itertools.cycle(items)
    return lambda: next(it)


def rotate_calls(fns):
    """Zero-argument function calling the next of ``fns``, round-robin (rotating inputs)."""
    nxt = cycler(fns)
    return lambda: nxt()()


class Pack:
    """Random packed-LoRA problem: tokens, frozen weight, K adapters, segment table."""

    def __init__(
        self, *, seg_lens, ranks, in_f, out_f, dtype, device, dropout=0.0, n_rot=3, seed=0
    ):
        g = torch.Generator().manual_seed(seed)
        self.n = sum(seg_lens)
        self.in_f, self.out_f = in_f, out_f
        self.seg = [0, *itertools.accumulate(seg_lens)]
        self.ranks = list(ranks)
        self.offs = [0, *itertools.accumulate(padded_rank(r) for r in ranks)]
        self.scales = [16.0 / r for r in ranks]
        self.dropout = [dropout] * len(ranks)

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

        self.xs = [rnd(self.n, in_f).requires_grad_() for _ in range(n_rot)]
        self.dys = [rnd(self.n, out_f) for _ in range(n_rot)]
        self.w = rnd(out_f, in_f, scale=in_f**-0.5)
        self.a = rnd(self.offs[-1], in_f, scale=in_f**-0.5).requires_grad_()
        self.b = rnd(out_f, self.offs[-1], scale=0.1).requires_grad_()
        # The same adapters as separate leaf tensors, for the per-adapter torch baselines.
        self.a_list = [
            self.a[o : o + r].detach().clone().requires_grad_()
            for o, r in zip(self.offs, ranks, strict=False)
        ]
        self.b_list = [
            self.b[:, o : o + r].detach().clone().requires_grad_()
            for o, r in zip(self.offs, ranks, strict=False)
        ]

    @property
    def table(self):
        return dict(
            seg_starts=self.seg,
            rank_offsets=self.offs,
            ranks=self.ranks,
            scales=self.scales,
            dropout_p=self.dropout,
        )

    def meta(self):
        return make_meta(
            n_tokens=self.n, r_total=self.offs[-1], in_features=self.in_f, **self.table
        )

    def packed(self, x, fused):
        return packed_lora_linear(
            x,
            self.w,
            None,
            self.a,
            self.b,
            **self.table,
            dropout_seed=1,
            fused=fused,
            backend="triton",
        )

    def delta(self, x):
        return packed_lora_delta(x, self.a, self.b, **self.table, dropout_seed=1, backend="triton")

    def seq_delta(self, x):
        """Sequential per-adapter torch LoRA (PEFT-style), one output per adapter."""
        return [
            ((x[s:e] @ a.t()) @ b.t()) * sc
            for s, e, a, b, sc in zip(
                self.seg, self.seg[1:], self.a_list, self.b_list, self.scales, strict=False
            )
        ]

    def naive(self, x):
        """mLoRA BatchLoRA style: the base GEMM once, then a torch loop over adapters."""
        return F.linear(x, self.w) + torch.cat(self.seq_delta(x))

    def leaves(self):
        return [*self.xs, self.a, self.b, *self.a_list, *self.b_list]


def ragged_lens(n: int, n_slots: int, seed: int = 1) -> list[int]:
    """``n_slots`` segment lengths summing to ``n``, each within 0.5-1.5x of the mean."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n_slots, generator=g) + 0.5
    lens = (w / w.sum() * n).floor().long().tolist()
    lens[-1] += n - sum(lens)
    return lens


def time_fwd_bwd(pk: Pack, fwd) -> tuple[float, float]:
    """(forward ms, backward ms) of ``fwd(x) -> tensor | list`` with rotating inputs."""
    t_f = bench(rotate_calls([lambda x=x: fwd(x) for x in pk.xs]), grad_to_none=pk.leaves())
    graphs = []
    for x, dy in zip(pk.xs, pk.dys, strict=True):
        y = fwd(x)
        if isinstance(y, list):
            graphs.append((y, list(dy.split([t.shape[0] for t in y]))))
        else:
            graphs.append(([y], [dy]))
    step = rotate_calls(
        [
            lambda ys=ys, gs=gs: torch.autograd.backward(ys, gs, retain_graph=True)
            for ys, gs in graphs
        ]
    )
    t_b = bench(step, grad_to_none=pk.leaves())
    return t_f, t_b


def frozen_times(pk: Pack) -> tuple[float, float]:
    x_it = cycler(pk.xs)
    dy_it = cycler(pk.dys)
    t_f = bench(lambda: F.linear(x_it(), pk.w))
    t_b = bench(lambda: dy_it() @ pk.w)
    return t_f, t_b


# ----------------------------------------------------------------------------------- tuning
#: The TMA kernel's candidates: TMA_KEYS per row (BK 64, GROUP_M 8, SUBTILE, 8 warps for all).
TMA_KEYS = ("BM", "BN", "BR", "FLATTEN", "WS", "LORA_TMA", "num_stages")
TMA_GRID = [
    (128, 256, 32, 1, 1, 0, 3), (128, 256, 32, 1, 1, 1, 3), (128, 256, 64, 1, 1, 1, 3),
    (128, 256, 32, 0, 1, 1, 3), (128, 256, 32, 1, 0, 1, 4), (128, 256, 64, 1, 0, 1, 3),
    (128, 256, 32, 0, 0, 1, 4), (128, 256, 16, 1, 1, 1, 3), (256, 128, 32, 0, 0, 1, 3),
]  # fmt: skip
CANDIDATES = {
    "shrink": [
        dict(BM=64, BK=64, num_warps=4, num_stages=3),
        dict(BM=64, BK=128, num_warps=4, num_stages=3),
        dict(BM=32, BK=128, num_warps=4, num_stages=4),
        dict(BM=64, BK=64, num_warps=4, num_stages=4),
        dict(BM=128, BK=64, num_warps=8, num_stages=3),
    ],
    # The persistent TMA fused GEMM (Hopper); timed as forward + backward-orientation calls.
    "tma": [
        dict(zip(TMA_KEYS, row, strict=True), BK=64, GROUP_M=8, SUBTILE=1, num_warps=8)
        for row in TMA_GRID
    ],
    "gemm": [
        dict(BM=128, BN=128, BK=64, BR=32, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BM=128, BN=128, BK=64, BR=64, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BM=128, BN=256, BK=64, BR=32, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BM=128, BN=128, BK=64, BR=32, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BM=256, BN=128, BK=64, BR=32, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BM=128, BN=128, BK=64, BR=64, GROUP_M=8, num_warps=8, num_stages=4),
    ],
    "lora": [
        dict(BM=64, BN=128, BK=32, BR=32, GROUP_M=8, num_warps=4, num_stages=2),
        dict(BM=128, BN=128, BK=32, BR=64, GROUP_M=8, num_warps=8, num_stages=2),
        dict(BM=64, BN=256, BK=32, BR=32, GROUP_M=8, num_warps=4, num_stages=2),
        dict(BM=128, BN=256, BK=32, BR=32, GROUP_M=8, num_warps=8, num_stages=2),
        dict(BM=128, BN=128, BK=32, BR=32, GROUP_M=8, num_warps=4, num_stages=3),
        dict(BM=64, BN=128, BK=32, BR=64, GROUP_M=8, num_warps=4, num_stages=3),
    ],
    "wgrad": [
        dict(BN=128, BT=64, BR=128, num_warps=4, num_stages=3),
        dict(BN=128, BT=64, BR=64, num_warps=4, num_stages=3),
        dict(BN=128, BT=64, BR=32, num_warps=4, num_stages=3),
        dict(BN=64, BT=64, BR=64, num_warps=4, num_stages=3),
        dict(BN=128, BT=32, BR=64, num_warps=4, num_stages=4),
        dict(BN=256, BT=32, BR=32, num_warps=8, num_stages=3),
        dict(BN=128, BT=128, BR=32, num_warps=4, num_stages=3),
        dict(BN=128, BT=64, BR=64, SPLIT_R=1, num_warps=4, num_stages=3),
        dict(BN=128, BT=64, BR=32, SPLIT_R=1, num_warps=4, num_stages=3),
        dict(BN=64, BT=64, BR=64, SPLIT_R=1, num_warps=4, num_stages=3),
        dict(BN=128, BT=128, BR=32, SPLIT_R=1, num_warps=4, num_stages=3),
    ],
}
if DRY:
    CANDIDATES = {k: [ops._INTERPRETER_CONFIGS[k]] for k in CANDIDATES}


def kernel_calls(pk: Pack) -> dict:
    """One zero-argument launch per kernel kind, on ``pk``'s first input (as autograd.py calls them)."""
    meta = pk.meta()
    x, dy = pk.xs[0].detach(), pk.dys[0]
    a = pk.a.detach()
    b_t = pk.b.detach().t().contiguous()
    table = meta.device_table(x.device)
    a_str, bt_str = (a.stride(0), a.stride(1)), (b_t.stride(1), b_t.stride(0))
    s_buf = ops.shrink(x, a, a_str, table, meta, 1, dropout=True)
    y = torch.empty(x.shape[0], pk.out_f, device=x.device, dtype=x.dtype)
    da, db = torch.empty_like(pk.a), torch.empty_like(pk.b)
    dx = torch.empty_like(x)
    w_t = (pk.w.stride(1), pk.w.stride(0))  # dX = dY·W: Q[n, k] = W[k, n]

    def gemm(tma: bool):
        ops.USE_TMA = tma
        try:
            ops.lora_gemm(y, s_buf, b_t, bt_str, table, meta, 1, base=(x, pk.w, pk.w.stride()))
            if tma:
                ops.lora_gemm(
                    dx, s_buf, a, (a.stride(1), a.stride(0)), table, meta, 1, base=(dy, pk.w, w_t)
                )
        finally:
            ops.USE_TMA = True

    return {
        "shrink": lambda: ops.shrink(x, a, a_str, table, meta, 1, dropout=True),
        "lora": lambda: ops.lora_gemm(y, s_buf, b_t, bt_str, table, meta, 1),
        "gemm": lambda: gemm(False),  # the pointer-based fused GEMM (forward)
        "tma": lambda: gemm(True),  # the TMA fused GEMM, forward + backward orientation
        "wgrad": lambda: (
            ops.wgrad(x, s_buf, da, (a.stride(1), a.stride(0)), table, meta, 1, dropout=True),
            ops.wgrad(dy, s_buf, db, (db.stride(0), db.stride(1)), table, meta, 1, dropout=False),
        ),
        "addmm": lambda: y.addmm_(x, pk.w.t()),
    }


def tune_configs(pk: Pack, log) -> dict:
    calls = kernel_calls(pk)
    best = {}
    for kind, cands in CANDIDATES.items():
        rows = []
        for cfg in cands:
            ops.CONFIG_OVERRIDES[kind] = cfg
            try:
                ms = bench(calls[kind])
            except Exception as err:  # a config that does not compile (shared memory) is skipped
                log(f"  {kind} {cfg}: failed ({type(err).__name__}: {str(err)[:80]})")
                continue
            rows.append((ms, cfg))
            log(f"  {kind} {cfg}: {ms:.4f} ms")
        if not rows:
            ops.CONFIG_OVERRIDES.pop(kind, None)
            log(f"  -> {kind}: no candidate compiled; keeping the defaults")
            continue
        ms, cfg = min(rows, key=lambda r: r[0])
        best[kind] = cfg
        ops.CONFIG_OVERRIDES[kind] = cfg
        log(f"  -> {kind}: {cfg} ({ms:.4f} ms)")
    return best


DISPATCH_SHAPES = [(t, i, o) for t in (2048, 8192) for i, o in
                   [(2048, 2048), (2048, 11008), (11008, 2048), (3584, 3584), (3584, 18944),
                    (18944, 3584), (4096, 4096)]]  # fmt: skip
if DRY:
    DISPATCH_SHAPES = [(64, 32, 48), (128, 48, 32)]


@contextlib.contextmanager
def forced_mode(mode: str | None):
    """Run packed_lora_linear in ``mode`` (an ops.Mode value), or as dispatched if None."""
    if mode is None:
        yield
        return
    original = ops.choose_mode
    ops.choose_mode = lambda *a, **k: ops.Mode(mode)
    try:
        yield
    finally:
        ops.choose_mode = original


def time_modes(pk: Pack, modes) -> dict:
    """(fwd ms, bwd ms) of the whole packed linear per mode (None = the dispatched choice)."""
    out = {}
    for mode in modes:
        with forced_mode(mode):
            out[mode] = time_fwd_bwd(pk, lambda x, pk=pk: pk.packed(x, None))
    return out


def tune_dispatch(dtype, device, log) -> list[dict]:
    rows = []
    for tokens, in_f, out_f in DISPATCH_SHAPES:
        n_slots = 16
        lens = [tokens // n_slots] * n_slots
        ranks = [(8, 16, 32, 64, 128, 24, 48, 96)[i % 8] for i in range(n_slots)]
        pk = Pack(
            seg_lens=lens, ranks=ranks, in_f=in_f, out_f=out_f, dtype=dtype, device=device, n_rot=2
        )
        times = time_modes(pk, [m.value for m in ops.Mode])
        pk.dropout = [0.1] * n_slots  # the backward again, with the dropout mask on dX
        dropped = time_modes(pk, [m.value for m in ops.Mode])
        for phase, k, measured in (
            ("fwd", 0, times),
            ("bwd", 1, times),
            ("bwd-dropout", 1, dropped),
        ):
            ms = {m: round(t[k], 4) for m, t in measured.items()}
            best = min(ms, key=ms.__getitem__)
            rows.append(
                dict(phase=phase, tokens=tokens, **{"in": in_f, "out": out_f}, mode=best, ms=ms)
            )
            log(f"  {phase} {tokens}x{in_f}->{out_f}: {ms} -> {best}")
        del pk
    return rows


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
            seq = time_fwd_bwd(pk, pk.seq_delta)
            packed = time_fwd_bwd(pk, pk.delta)
            # Bytes any kernel must move: fwd reads x and writes y, bwd reads dY and x and
            # writes dX (A, B and S are small). seq_ms / (bytes / bandwidth) bounds the speedup.
            act = k * tokens * d * torch.finfo(dtype).bits // 8
            floor_f, floor_b = 2 * act / bw * 1e3, 3 * act / bw * 1e3
            row = dict(d=d, adapters=k, seq_fwd_ms=seq[0], seq_bwd_ms=seq[1], packed_fwd_ms=packed[0],
                       packed_bwd_ms=packed[1], speedup_fwd=seq[0] / packed[0], speedup_bwd=seq[1] / packed[1],
                       bound_fwd=seq[0] / floor_f, bound_bwd=seq[1] / floor_b)  # fmt: skip
            rows.append(row)
            log(f"  d={d} K={k}: fwd {row['speedup_fwd']:.2f}x (bound {row['bound_fwd']:.1f}x) "
                f"bwd {row['speedup_bwd']:.2f}x (bound {row['bound_bwd']:.1f}x) "
                f"(packed {packed[0]:.3f}/{packed[1]:.3f} ms, seq {seq[0]:.3f}/{seq[1]:.3f} ms)")  # fmt: skip
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
            frozen.append(frozen_times(pk0))
            for mode, times in time_modes(pk, modes).items():
                samples[mode].append((*times, sum(times) / sum(frozen[-1])))
        f_f, f_b = (statistics.median(t[i] for t in frozen) for i in (0, 1))
        out.setdefault("frozen", {})[str(p)] = dict(fwd_ms=f_f, bwd_ms=f_b, rounds=frozen)
        out["frozen_fwd_ms"], out["frozen_bwd_ms"] = f_f, f_b
        log(f"  frozen linear: fwd {f_f:.4f} ms, bwd (dY·W) {f_b:.4f} ms, total {f_f + f_b:.4f} ms")
        for mode, rows in samples.items():
            t_f, t_b, ratio = (statistics.median(r[i] for r in rows) for i in (0, 1, 2))
            row = dict(
                dropout=p, mode=mode or "auto", fwd_ms=t_f, bwd_ms=t_b, ratio_vs_frozen=ratio,
                ratios=[r[2] for r in rows],
            )  # fmt: skip
            out["rows"].append(row)
            spread = f"{min(row['ratios']):.3f}-{max(row['ratios']):.3f}"
            log(f"  packed p={p} mode={row['mode']}: fwd {t_f:.4f} bwd {t_b:.4f} ms -> "
                f"{ratio:.3f}x frozen (rounds {spread})")  # fmt: skip
        if p == 0.0:
            calls = kernel_calls(pk)
            out["kernels_ms"] = {k: bench(c) for k, c in calls.items()}
            log(f"  per-kernel ms (p=0): {out['kernels_ms']}")
            n_f, n_b = time_fwd_bwd(pk, pk.naive)
            out["naive_fwd_ms"], out["naive_bwd_ms"] = n_f, n_b
            best = min(
                (r for r in out["rows"] if r["dropout"] == 0.0),
                key=lambda r: r["fwd_ms"] + r["bwd_ms"],
            )
            out["speedup_vs_naive"] = (n_f + n_b) / (best["fwd_ms"] + best["bwd_ms"])
            log(
                f"  naive loop: fwd {n_f:.4f} bwd {n_b:.4f} ms; packed best is {out['speedup_vs_naive']:.2f}x faster"
            )
        del pk
    return out


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
        log("== tune: tile configs on the (b) shape")
        n, d = (8192, 4096) if not DRY else (128, 48)
        ranks = [(8, 16, 24, 32, 48, 64, 96, 128)[i % 8] for i in range(32 if not DRY else 4)]
        pk = Pack(seg_lens=ragged_lens(n, len(ranks)), ranks=ranks, in_f=d, out_f=d, dtype=dtype,
                  device=device, n_rot=1)  # fmt: skip
        configs = tune_configs(pk, log)
        del pk
        log("== tune: modes (fused / epilogue / accumulate) per phase and shape")
        dispatch = tune_dispatch(dtype, device, log)
        entry = dict(
            configs=configs, dispatch=dispatch, measured=info["date"], triton=info["triton"]
        )
        tuned = json.loads(ops.TUNED_PATH.read_text()) if ops.TUNED_PATH.exists() else {}
        tuned[gpu] = entry
        (out_dir / "tuned.json").write_text(json.dumps(tuned, indent=1, sort_keys=True) + "\n")
        if not DRY:
            ops.TUNED_PATH.write_text(json.dumps(tuned, indent=1, sort_keys=True) + "\n")
        ops.CONFIG_OVERRIDES.clear()
        ops.reload_tuned()
        results["tuned"] = entry
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
    (out_dir / "kernels_results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "kernels_log.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
