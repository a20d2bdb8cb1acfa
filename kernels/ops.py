"""Launchers of the packed LoRA kernels (configs and the mode choice: :mod:`.configs`).

The fused mode takes the persistent TMA kernel on Hopper-class GPUs when every stride is
16-byte aligned (``PLORA_KERNELS_TMA=0`` turns it off), the pointer-based GEMM kernel
otherwise; the shrink and weight-gradient kernels take TMA operand tiles where their tuned
config says so. Each launcher writes every element of its output (no pre-zeroing), uses no
atomics, and reduces in a fixed order.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import torch
from triton.runtime.errors import OutOfResources

from . import triton_kernels as tk
from . import triton_wgrad
from .configs import (  # noqa: F401 (re-exported: ops is the kernels' one entry point)
    _INTERPRETER_CONFIGS,
    CONFIG_OVERRIDES,
    DEFAULT_CONFIGS,
    TUNED_PATH,
    Mode,
    _interpreting,
    choose_mode,
    kernel_config,
    reload_tuned,
)
from .meta import PackedMeta

#: ``(word, row_len, col_base, groups)``: a call's dropout scalars (``DropoutKeys.scalars()``).
DropScalars = tuple[int, int, int, int]


def _pop_launch(cfg: dict[str, int]) -> dict[str, int]:
    return {k: cfg.pop(k) for k in ("num_warps", "num_stages") if k in cfg}


def _slots_p2(meta: PackedMeta) -> int:
    return max(16, tk.next_pow2(meta.n_slots + 1))


#: num_stages that fit shared memory, per (kernel, constexprs, device), learnt from OutOfResources.
_STAGES_THAT_FIT: dict[tuple, int] = {}


def _launch(kernel, grid, args: tuple, consts: dict, launch: dict) -> None:
    """Launch; on a shared-memory OutOfResources retry with one pipeline stage less (remembered)."""
    stages = launch.get("num_stages", 3)
    key = None
    if _STAGES_THAT_FIT:  # some config ran out of shared memory before: its stages that fit
        key = _fit_key(kernel, args, consts, launch)
        stages = _STAGES_THAT_FIT.get(key, stages)
    while True:
        try:
            kernel[grid](*args, **consts, **{**launch, "num_stages": stages})
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            key = key or _fit_key(kernel, args, consts, launch)
            _STAGES_THAT_FIT[key] = stages
            continue
        return


def _fit_key(kernel, args: tuple, consts: dict, launch: dict) -> tuple:
    """What a launch's shared-memory need depends on: kernel, constexprs, launch config, device."""
    return (
        kernel.fn.__name__,
        tuple(sorted(consts.items())),
        tuple(sorted(launch.items())),
        next(a for a in args if isinstance(a, torch.Tensor)).device.index,
    )


def shrink(
    inp: torch.Tensor,
    mat: torch.Tensor,
    mat_strides: tuple[int, int],
    table: torch.Tensor,
    meta: PackedMeta,
    drop: DropScalars,
    *,
    dropout: bool,
) -> torch.Tensor:
    """``O[t, r] = c_i·Σ_k drop?(inp)[t, k]·M[o_i + r, k]`` for tokens of slot ``i``.

    ``mat_strides`` = (stride along the rank, stride along k) of ``M`` inside ``mat``.
    Returns ``(T, max_rank_pad)`` in ``inp.dtype``; rows outside every segment are left unset.
    """
    width = meta.max_rank_pad
    out = torch.empty(inp.shape[0], width, device=inp.device, dtype=inp.dtype)
    cfg = kernel_config("shrink", inp.device, inp.element_size())
    launch = _pop_launch(cfg)
    bm, bk, k = cfg["BM"], cfg["BK"], inp.shape[1]
    n_tiles = _row_tiles(meta, bm)
    if n_tiles == 0:
        return out
    br = tk.next_pow2(width)
    # float32 with dropout loads by pointers: with TMA operand tiles the compiled float32 kernel
    # dropped the wrong elements on an H100 (Triton 3.6; bf16/fp16 and the interpreter were
    # right; tests/gpu/test_kernels_gpu.py::test_other_dtypes). float32 is the exactness
    # mode, not the training path.
    fp32_dropout = dropout and meta.has_dropout and inp.element_size() == 4
    by_tma = _side_tma(cfg, (inp, mat)) and mat_strides == mat.stride() and not fp32_dropout
    if by_tma:
        TensorDescriptor = _descriptor_class(inp.device)
        p_desc = TensorDescriptor(inp, list(inp.shape), [inp.stride(0), 1], [bm, bk])
        m_desc = TensorDescriptor(mat, list(mat.shape), [mat.stride(0), 1], [br, bk])
    else:
        p_desc = m_desc = out
    args = (
        inp, mat, out, table, *drop, p_desc, m_desc,
        k, meta.n_slots, table.stride(0),
        inp.stride(0), inp.stride(1), mat_strides[0], mat_strides[1], out.stride(0),
    )  # fmt: skip
    consts = dict(
        HAS_DROPOUT=dropout and meta.has_dropout, BY_TMA=by_tma,
        BM=bm, BR=br, BK=bk, SLOTS_P2=_slots_p2(meta),
    )  # fmt: skip
    _launch(tk._shrink_kernel, (n_tiles,), args, consts, launch)
    return out


@lru_cache(maxsize=1024)
def _row_tiles(meta: PackedMeta, bm: int) -> int:
    """Row tiles of ``bm`` tokens over the slots' segments (each segment starts a tile)."""
    return sum(-(-(meta.seg_starts[i + 1] - meta.seg_starts[i]) // bm) for i in range(meta.n_slots))


def lora_gemm(
    out: torch.Tensor,
    lora_in: torch.Tensor,
    r_mat: torch.Tensor,
    r_strides: tuple[int, int],
    table: torch.Tensor,
    meta: PackedMeta,
    drop: DropScalars,
    *,
    base: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None,
    bias: torch.Tensor | None = None,
    accumulate: bool = False,
    dropout: bool = False,
) -> torch.Tensor:
    """``out (+)= [P·Qᵀ] + bias + Σ_i mask?(L_i·R_iᵀ)`` over regular output tiles (all written).

    Args:
        out: ``(M, N)`` output, overwritten (read first and added to if ``accumulate``).
        lora_in: ``L (M, max_rank_pad)``: S (forward) or dS (backward).
        r_mat: holds ``R[n, o_i + r]`` at ``n·r_strides[0] + (o_i + r)·r_strides[1]``.
        base: ``(P (M, K), q_mat, (stride_n, stride_k))`` to fuse the base GEMM, or None for the
            LoRA term alone (rows outside every segment get ``bias`` or 0).
        bias: ``(N,)``.
        dropout: mask the LoRA part with each slot's keep mask over ``(t, n)`` (the dX pass).
    """
    m, n = out.shape
    if base is not None and _tma_ready(out, base):
        return _fused_tma(out, lora_in, r_mat, r_strides, table, meta, drop, base, bias, dropout)
    kind = "gemm" if base is not None else "lora"
    cfg = kernel_config(kind, out.device, out.element_size())
    launch = _pop_launch(cfg)
    use_dropout = dropout and meta.has_dropout
    _fit_dropout_tile(cfg, launch, use_dropout)
    if base is not None:
        p, q_mat, (sqn, sqk) = base
        k, spm, spk = p.shape[1], p.stride(0), p.stride(1)
    else:
        p, q_mat, sqn, sqk, k, spm, spk = out, out, 0, 0, 0, 0, 0
    grid = (triton_cdiv(m, cfg["BM"]) * triton_cdiv(n, cfg["BN"]),)
    args = (
        p, q_mat, bias if bias is not None else out, lora_in, r_mat, out, table, *drop,
        m, n, k, meta.n_slots, table.stride(0),
        spm, spk, sqn, sqk, lora_in.stride(0), r_strides[0], r_strides[1],
        out.stride(0), out.stride(1),
    )  # fmt: skip
    consts = dict(
        HAS_BASE=base is not None, HAS_BIAS=bias is not None, ACCUMULATE=accumulate,
        HAS_DROPOUT=use_dropout,
        BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], BR=min(cfg["BR"], tk.next_pow2(meta.max_rank_pad)),
        SLOTS_P2=_slots_p2(meta), GROUP_M=cfg["GROUP_M"],
    )  # fmt: skip
    _launch(tk._lora_gemm_kernel, grid, args, consts, launch)
    return out


def _fit_dropout_tile(cfg: dict, launch: dict, use_dropout: bool) -> None:
    """Halve BN until a tile's dropout mask fits in registers (<= 64 elements per thread).

    A 64x256 tile on 4 warps ran 2x slower in the backward than 64x128 on the H200.
    """
    while (
        use_dropout
        and cfg["BM"] * cfg["BN"] > 64 * 32 * launch.get("num_warps", 4)
        and cfg["BN"] > 32
    ):
        cfg["BN"] //= 2


#: Set to False to keep the fused mode on the pointer-based GEMM kernel everywhere.
USE_TMA = os.environ.get("PLORA_KERNELS_TMA", "1") != "0"


def _tma_ready(out: torch.Tensor, base) -> bool:
    """Can the persistent TMA kernel run this fused GEMM (Hopper or newer, 16-byte strides)?"""
    if not USE_TMA or not _tma_capable(out.device):
        return False
    p, q_mat, (sqn, sqk) = base
    return (
        _tma_operand(out, out.stride(1), out.stride(0))
        and _tma_operand(p, p.stride(1), p.stride(0))
        and _tma_operand(q_mat, min(sqn, sqk), max(sqn, sqk))
        and p.dtype == out.dtype == q_mat.dtype
    )


_THREAD = threading.local()


def _descriptor_class(device: torch.device):
    """Triton's host TensorDescriptor, with a CUDA context bound to this thread first.

    Autograd runs the backward on its own thread, which may have no current driver context
    yet, and Triton 3.6 encodes the descriptors (a driver call) before its launcher binds one
    ("invalid device context"). Any runtime call binds the device's primary context; once
    per thread and device.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    if device.type == "cuda":
        bound = _THREAD.__dict__.setdefault("devices", set())
        if device.index not in bound:
            torch.cuda.mem_get_info(device)
            bound.add(device.index)
    return TensorDescriptor


def _side_tma(cfg: dict, operands) -> bool:
    """Do a shrink / weight-gradient launch's operand tiles come by TMA? The tuned ``TMA`` (popped
    from ``cfg``), Hopper or newer, and every operand row-major with 16-byte rows."""
    return (
        bool(cfg.pop("TMA", 0))
        and USE_TMA
        and _tma_capable(operands[0].device)
        and all(_tma_operand(t, t.stride(1), t.stride(0)) for t in operands)
    )


def _tma_capable(device: torch.device) -> bool:
    """Hopper-class or newer GPU, or the interpreter (which emulates the descriptors)."""
    if device.type == "cuda":
        return not _interpreting() and _capability(device.index or 0)[0] >= 9
    return _interpreting()


def _tma_operand(t: torch.Tensor, inner_stride: int, row_stride: int) -> bool:
    """A 2-d TMA descriptor's needs: unit inner stride, 16-byte row stride and base address."""
    return (
        inner_stride == 1 and (row_stride * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
    )


@lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _fused_tma(out, lora_in, r_mat, r_strides, table, meta, drop, base, bias, dropout):
    """``out = P·Qᵀ + bias + route(L·Rᵀ)`` by the persistent TMA kernel (see lora_gemm)."""
    TensorDescriptor = _descriptor_class(out.device)
    m, n = out.shape
    p, q_mat, (sqn, sqk) = base
    k = p.shape[1]
    cfg = kernel_config("tma", out.device, out.element_size())
    launch = _pop_launch(cfg)
    use_dropout = dropout and meta.has_dropout
    _fit_dropout_tile(cfg, launch, use_dropout)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    subtile = bool(cfg["SUBTILE"]) and bn >= 32
    p_desc = TensorDescriptor(p, [m, k], [p.stride(0), 1], [bm, bk])
    q_nk = sqk == 1
    if q_nk:  # Q[n, k] at n·sqn + k: stored (N, K)
        q_desc = TensorDescriptor(q_mat, [n, k], [sqn, 1], [bn, bk])
    else:  # stored (K, N)
        q_desc = TensorDescriptor(q_mat, [k, n], [sqk, 1], [bk, bn])
    o_desc = TensorDescriptor(out, [m, n], [out.stride(0), 1], [bm, bn // 2 if subtile else bn])
    br = min(cfg["BR"], tk.next_pow2(meta.max_rank_pad))
    # LoRA operands by TMA too when R is stored (R_tot, N) (Bᵀ forward, A backward).
    lora_tma = (
        bool(cfg.get("LORA_TMA", 1))
        and _tma_operand(r_mat, r_strides[0], r_strides[1])
        and _tma_operand(lora_in, lora_in.stride(1), lora_in.stride(0))
        and r_mat.dtype == lora_in.dtype
    )
    if lora_tma:
        l_desc = TensorDescriptor(lora_in, list(lora_in.shape), [lora_in.stride(0), 1], [bm, br])
        r_desc = TensorDescriptor(r_mat, [r_mat.shape[0], n], [r_strides[1], 1], [br, bn])
    else:
        l_desc = r_desc = out
    n_sms = _num_sms(out.device.index or 0) if out.device.type == "cuda" else 4
    grid = (min(n_sms, triton_cdiv(m, bm) * triton_cdiv(n, bn)),)
    args = (
        p_desc, q_desc, o_desc, bias if bias is not None else out, lora_in, r_mat, l_desc, r_desc,
        table, *drop, m, n, k, meta.n_slots, table.stride(0),
        lora_in.stride(0), r_strides[0], r_strides[1],
    )  # fmt: skip
    consts = dict(
        Q_NK=q_nk, HAS_BIAS=bias is not None, HAS_DROPOUT=use_dropout, LORA_TMA=lora_tma,
        BM=bm, BN=bn, BK=bk, BR=br,
        SLOTS_P2=_slots_p2(meta), GROUP_M=cfg["GROUP_M"], NUM_SMS=n_sms,
        SUBTILE=subtile, FLATTEN=bool(cfg["FLATTEN"]), WARP_SPECIALIZE=bool(cfg.get("WS", 0)),
    )  # fmt: skip
    _launch(tk._fused_tma_kernel, grid, args, consts, launch)
    return out


class WgradJob(NamedTuple):
    """One weight gradient ``G[n, o_i + r] = Σ_{t∈i} P[t, n]·Q[t, r]`` (see :func:`wgrad`)."""

    p: torch.Tensor  #: (T, N): x for dA, dY for dB
    q: torch.Tensor  #: (T, max_rank_pad): dS for dA, S for dB
    grad: torch.Tensor  #: written at n·strides[0] + (o_i + r)·strides[1]
    strides: tuple[int, int]


def wgrad(
    jobs: Sequence[WgradJob],
    table: torch.Tensor,
    meta: PackedMeta,
    drop: DropScalars,
    *,
    dropout: bool,
) -> None:
    """Every slot's block of each job's ``grad`` (pad rows zero), in one launch.

    One program per (slot, BN columns of one job[, rank chunk]) reduces over the slot's tokens
    in order: no atomics. ``dropout`` masks the first job's P with the slots' keep masks
    (``dA = dSᵀ·drop(x)``); the second job is never masked (``dB = dYᵀ·S``, S already dropped).
    """
    first, second = jobs[0], jobs[-1]
    p0 = first.p
    cfg = kernel_config("wgrad", p0.device, p0.element_size())
    launch = _pop_launch(cfg)
    use_dropout = dropout and meta.has_dropout
    # Rank chunk: the tuned BR without dropout; with dropout, one chunk (no Philox recompute).
    full = tk.next_pow2(meta.max_rank_pad)
    br = full if use_dropout else min(cfg.pop("BR", full), full)
    # SPLIT_R: one program per rank chunk (high-rank slots spread over more programs) instead
    # of one program walking all of its slot's chunks.
    span = br if cfg.pop("SPLIT_R", 0) else full
    n0 = p0.shape[1]
    n1 = second.p.shape[1] if len(jobs) == 2 else 0
    nb0 = triton_cdiv(n0, cfg["BN"])
    grid = (meta.n_slots, nb0 + triton_cdiv(n1, cfg["BN"]), triton_cdiv(meta.max_rank_pad, span))
    by_tma = _side_tma(cfg, [t for job in jobs for t in (job.p, job.q)])
    if by_tma:
        TensorDescriptor = _descriptor_class(p0.device)
        descs = [
            TensorDescriptor(t, list(t.shape), [t.stride(0), 1], box)
            for job in (first, second)
            for t, box in ((job.p, [cfg["BT"], cfg["BN"]]), (job.q, [cfg["BT"], br]))
        ]
    else:
        descs = [p0] * 4
    args = (
        first.p, first.q, first.grad, second.p, second.q, second.grad, table, *drop, *descs,
        n0, n1, nb0, table.stride(0),
        *(s for job in (first, second) for s in (
            job.p.stride(0), job.p.stride(1), job.q.stride(0), *job.strides)),
    )  # fmt: skip
    consts = dict(
        HAS_DROPOUT=use_dropout, BY_TMA=by_tma, BN=cfg["BN"], BR=br, BT=cfg["BT"], R_SPAN=span
    )
    _launch(triton_wgrad._wgrad_kernel, grid, args, consts, launch)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
