"""``benchmarks/kernels.py --tune``: tile configs per kernel, then the mode table per shape.

Sweeps the candidate tile configs of every kernel on the (b) shape, times the three modes per
phase ('fwd', 'bwd', 'bwd-dropout') on a grid of shapes, and writes the tuned.json entry for
this GPU (into the run's output directory and, on a GPU, into ``kernels/tuned.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from kernels_common import (
    DRY,
    KernelLaunches,
    Pack,
    bench,
    ragged_lens,
    time_modes,
)
from plora.kernels import ops

from plora.utils import atomic_write_text

#: The TMA kernel's candidates: TMA_KEYS per row (GROUP_M 8, SUBTILE, 8 warps for all).
TMA_KEYS = ("BM", "BN", "BK", "BR", "FLATTEN", "WS", "LORA_TMA", "num_stages")
TMA_GRID = [
    (128, 256, 64, 32, 1, 1, 0, 3), (128, 256, 64, 32, 1, 1, 1, 3),
    (128, 256, 64, 32, 0, 1, 1, 3), (128, 256, 64, 32, 1, 0, 1, 4),
    (128, 256, 64, 32, 0, 0, 1, 4), (128, 256, 64, 16, 1, 1, 1, 3), (256, 128, 64, 32, 0, 0, 1, 3),
    (128, 256, 64, 32, 1, 1, 0, 4), (128, 256, 128, 32, 1, 1, 0, 2), (256, 128, 64, 32, 1, 1, 0, 3),
    (256, 128, 64, 32, 1, 1, 0, 4), (128, 128, 64, 32, 1, 1, 0, 4), (128, 128, 128, 32, 1, 1, 0, 3),
]  # fmt: skip
#: A candidate config's largest relative error against the float32 torch reference (bf16
#: rounding of the outputs is ~4e-3; a wrong tile shows up at 1e-2 and above).
MAX_ERROR = 1e-2
CANDIDATES = {
    "shrink": [
        dict(BM=64, BK=64, num_warps=4, num_stages=3),
        dict(BM=64, BK=128, num_warps=4, num_stages=3),
        dict(BM=32, BK=128, num_warps=4, num_stages=4),
        dict(BM=64, BK=64, num_warps=4, num_stages=4),
        dict(BM=128, BK=64, num_warps=8, num_stages=3),
        dict(BM=128, BK=128, num_warps=8, num_stages=3),
        dict(BM=64, BK=128, num_warps=4, num_stages=4),
        dict(BM=32, BK=256, num_warps=4, num_stages=3),
        dict(BM=128, BK=64, num_warps=4, num_stages=4),
        # operand tiles by TMA descriptors (Hopper)
        dict(BM=64, BK=128, TMA=1, num_warps=4, num_stages=4),
        dict(BM=64, BK=64, TMA=1, num_warps=4, num_stages=4),
        dict(BM=128, BK=128, TMA=1, num_warps=8, num_stages=3),
        dict(BM=128, BK=64, TMA=1, num_warps=8, num_stages=4),
    ],
    # The persistent TMA fused GEMM (Hopper); timed as forward + backward-orientation calls.
    "tma": [
        dict(zip(TMA_KEYS, row, strict=True), GROUP_M=8, SUBTILE=1, num_warps=8) for row in TMA_GRID
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
        # operand tiles by TMA descriptors (Hopper)
        dict(BN=128, BT=64, BR=64, SPLIT_R=1, TMA=1, num_warps=4, num_stages=3),
        dict(BN=128, BT=64, BR=64, TMA=1, num_warps=4, num_stages=3),
        dict(BN=128, BT=32, BR=64, SPLIT_R=1, TMA=1, num_warps=4, num_stages=4),
        dict(BN=256, BT=32, BR=32, TMA=1, num_warps=8, num_stages=3),
        dict(BN=64, BT=64, BR=64, SPLIT_R=1, TMA=1, num_warps=4, num_stages=4),
    ],
}
if DRY:
    CANDIDATES = {k: [ops._INTERPRETER_CONFIGS[k]] for k in CANDIDATES}


def tune_configs(pk: Pack, log) -> dict:
    launches = KernelLaunches(pk)
    calls = launches.calls()
    best = {}
    for kind, cands in CANDIDATES.items():
        rows = []
        for cfg in cands:
            ops.CONFIG_OVERRIDES[kind] = cfg
            try:
                ms = bench(calls[kind])
                error = launches.error(kind)
            except Exception as err:  # a config that does not compile (shared memory) is skipped
                log(f"  {kind} {cfg}: failed ({type(err).__name__}: {str(err)[:80]})")
                continue
            if not error < MAX_ERROR:  # fast and wrong: never picked
                log(f"  {kind} {cfg}: {ms:.4f} ms, REJECTED: relative error {error:.2e}")
                continue
            rows.append((ms, cfg))
            log(f"  {kind} {cfg}: {ms:.4f} ms (error {error:.1e})")
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


def run_tune(dtype, device, gpu: str, info: dict, out_dir: Path, log) -> dict:
    """Tune configs and modes for this GPU; write tuned.json; return the new entry."""
    log("== tune: tile configs on the (b) shape")
    n, d = (8192, 4096) if not DRY else (128, 48)
    ranks = [(8, 16, 24, 32, 48, 64, 96, 128)[i % 8] for i in range(32 if not DRY else 4)]
    pk = Pack(seg_lens=ragged_lens(n, len(ranks)), ranks=ranks, in_f=d, out_f=d, dtype=dtype,
              device=device, n_rot=1)  # fmt: skip
    configs = tune_configs(pk, log)
    del pk
    log("== tune: modes (fused / epilogue / accumulate) per phase and shape")
    dispatch = tune_dispatch(dtype, device, log)
    entry = dict(configs=configs, dispatch=dispatch, measured=info["date"], triton=info["triton"])
    tuned = json.loads(ops.TUNED_PATH.read_text()) if ops.TUNED_PATH.exists() else {}
    tuned[gpu] = entry
    text = json.dumps(tuned, indent=1, sort_keys=True) + "\n"
    atomic_write_text(out_dir / "tuned.json", text)
    if not DRY:
        atomic_write_text(ops.TUNED_PATH, text)
    ops.CONFIG_OVERRIDES.clear()
    ops.reload_tuned()
    return entry
