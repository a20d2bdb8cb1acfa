"""Autograd wiring of the packed LoRA kernels: :func:`packed_lora_linear`, :func:`packed_lora_delta`.

Forward (``S = s·drop(x)·Aᵀ`` is saved, the dropout mask is not)::

    S  = shrink(x, A)                              (N, rp_max)
    y  = x·Wᵀ + bias + route(S·B_iᵀ)               by one of three measured modes (ops.Mode):
         FUSED      one Triton GEMM, LoRA products routed into the base tile's accumulator
                    (the persistent TMA kernel on Hopper, the pointer-based one elsewhere)
         EPILOGUE   LoRA kernel writes route(S·B_iᵀ) + bias, cuBLAS adds x·Wᵀ (addmm, beta = 1)
         ACCUMULATE cuBLAS writes x·Wᵀ + bias, the LoRA kernel adds its term in place

Backward::

    dS = shrink(dY, Bᵀ)                            s·dY_i·B_i
    dX = dY·W + mask ⊙ route(dS·A_i)               the same three modes (measured separately
                                                   for packs with dropout: 'bwd-dropout')
    dA = wgrad(drop(x), dS)      dB = wgrad(dY, S)  per-slot reductions, no atomics

See the package docstring for the argument layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from .errors import PackedLoRAError
from .meta import DropoutKeys, PackedMeta, make_meta
from .reference import (
    _raw_ranks,
    packed_lora_delta_reference,
    packed_lora_reference,
    resolve_dropout,
)

Backend = Literal["auto", "triton", "torch"]


class _PackedLoRA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, lora_a, lora_b, meta, drop, mode_fwd, mode_bwd):
        from . import ops

        table = meta.device_table(x2d.device)
        s_buf = ops.shrink(
            x2d, lora_a, (lora_a.stride(0), lora_a.stride(1)), table, meta, drop, dropout=True
        )
        # Bᵀ (R_tot, out), contiguous along out: the LoRA tiles of y and of dS = dY·B then load
        # 16-byte vectors along out instead of 2-byte gathers along the rank (a copy of R_tot·out).
        b_t = lora_b.t().contiguous()
        b_strides = (b_t.stride(1), b_t.stride(0))  # R[n, o + r] = Bᵀ[o + r, n]
        lora = (s_buf, b_t, b_strides, table, meta, drop)
        if weight is None:  # the LoRA term alone
            y = x2d.new_empty(x2d.shape[0], b_t.shape[1])
            ops.lora_gemm(y, *lora)
        elif mode_fwd == ops.Mode.ACCUMULATE:  # cuBLAS base, then the LoRA term added in place
            y = F.linear(x2d, weight, bias)
            ops.lora_gemm(y, *lora, accumulate=True)
        elif mode_fwd == ops.Mode.EPILOGUE:  # LoRA term (+ bias), then cuBLAS adds x·Wᵀ (beta=1)
            y = x2d.new_empty(x2d.shape[0], b_t.shape[1])
            ops.lora_gemm(y, *lora, bias=bias)
            y.addmm_(x2d, weight.t())
        else:  # FUSED: one Triton GEMM, base tile + routed LoRA products
            y = x2d.new_empty(x2d.shape[0], b_t.shape[1])
            base = (x2d, weight, (weight.stride(0), weight.stride(1)))
            ops.lora_gemm(y, *lora, base=base, bias=bias)
        ctx.save_for_backward(x2d, weight, lora_a, b_t, s_buf)
        ctx.meta, ctx.drop, ctx.mode_bwd = meta, drop, mode_bwd
        ctx.b_transposed = lora_b.stride(0) == 1 and lora_b.shape[1] > 1  # Bᵀ-contiguous storage
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        from . import ops

        x2d, weight, lora_a, b_t, s_buf = ctx.saved_tensors
        meta, drop = ctx.meta, ctx.drop
        dy = dy.contiguous()
        table = meta.device_table(dy.device)
        need_x, need_w, need_b, need_a, need_lb = ctx.needs_input_grad[:5]
        ds = ops.shrink(dy, b_t, (b_t.stride(0), b_t.stride(1)), table, meta, drop, dropout=False)
        a_strides = (lora_a.stride(1), lora_a.stride(0))  # R[n, o + r] = A[o + r, n]
        dx = dw = dbias = da = dlb = None
        jobs = []  # weight gradients, one launch: dA = dSᵀ·drop(x), dB = dYᵀ·S
        if need_a:
            da = torch.empty_like(lora_a)
            jobs.append(ops.WgradJob(x2d, ds, da, a_strides))
        if need_lb:
            # (out, R_tot) in lora_b's own layout: the engine stores every B transposed, and a
            # gradient in the parameter's layout needs no strided copy per adapter downstream.
            if ctx.b_transposed:
                dlb = b_t.new_empty(b_t.shape).t()
            else:
                dlb = b_t.new_empty(b_t.shape[1], b_t.shape[0])
            jobs.append(ops.WgradJob(dy, s_buf, dlb, (dlb.stride(0), dlb.stride(1))))

        if need_x:
            lora = (ds, lora_a, a_strides, table, meta, drop)
            if weight is None:
                dx = torch.empty_like(x2d)
                ops.lora_gemm(dx, *lora, dropout=True)
            elif ctx.mode_bwd == ops.Mode.ACCUMULATE:
                dx = dy @ weight
                ops.lora_gemm(dx, *lora, accumulate=True, dropout=True)
            elif ctx.mode_bwd == ops.Mode.EPILOGUE:
                dx = torch.empty_like(x2d)
                ops.lora_gemm(dx, *lora, dropout=True)
                dx.addmm_(dy, weight)
            else:
                dx = torch.empty_like(x2d)
                base = (dy, weight, (weight.stride(1), weight.stride(0)))
                ops.lora_gemm(dx, *lora, base=base, dropout=True)
        if jobs:
            ops.wgrad(jobs, table, meta, drop, dropout=need_a)
        if need_w and weight is not None:
            dw = dy.t() @ x2d
        if need_b and ctx.has_bias:
            dbias = dy.sum(0)
        return dx, dw, dbias, da, dlb, None, None, None, None


def _check_tensors(x, weight, bias, lora_a, lora_b) -> None:
    in_f = x.shape[-1]
    if lora_a.dim() != 2 or lora_a.shape[1] != in_f:
        raise PackedLoRAError(
            f"packed_lora: lora_a has shape {tuple(lora_a.shape)}; expected (R_tot, {in_f}) for x (..., {in_f})"
        )
    out_f = weight.shape[0] if weight is not None else lora_b.shape[0]
    if weight is not None and tuple(weight.shape) != (out_f, in_f):
        raise PackedLoRAError(
            f"packed_lora: weight has shape {tuple(weight.shape)}; expected (out, {in_f})"
        )
    if lora_b.dim() != 2 or tuple(lora_b.shape) != (out_f, lora_a.shape[0]):
        raise PackedLoRAError(
            f"packed_lora: lora_b has shape {tuple(lora_b.shape)}; expected ({out_f}, {lora_a.shape[0]})"
        )
    if bias is not None and tuple(bias.shape) != (out_f,):
        raise PackedLoRAError(
            f"packed_lora: bias has shape {tuple(bias.shape)}; expected ({out_f},)"
        )
    named = {"weight": weight, "bias": bias, "lora_a": lora_a, "lora_b": lora_b}
    for name, t in named.items():
        if t is not None and t.dtype != x.dtype:
            raise PackedLoRAError(
                f"packed_lora: {name} is {t.dtype} but x is {x.dtype}; cast all operands to one "
                "dtype (the engine casts to the autocast dtype)"
            )


def _use_triton(x: torch.Tensor, backend: Backend) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise PackedLoRAError(f"packed_lora: backend={backend!r}; use 'auto', 'triton' or 'torch'")
    return backend == "triton" or (backend == "auto" and x.is_cuda)


def _run(x, weight, bias, lora_a, lora_b, table_args, dropout_seed, fused) -> torch.Tensor:
    from . import ops

    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise PackedLoRAError(
            f"packed_lora: x has dtype {x.dtype}; the Triton kernels take float16, bfloat16 or "
            "float32 (use backend='torch' for others)"
        )
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    drop = resolve_dropout(dropout_seed, x, len(_raw_ranks(table_args["ranks"])))
    meta: PackedMeta = make_meta(
        n_tokens=x2d.shape[0], r_total=lora_a.shape[0], in_features=x2d.shape[1], **table_args,
        dropout=drop,
    )  # fmt: skip
    dt = x2d.dtype
    lora_a, lora_b = lora_a.to(dt), lora_b.to(dt)  # compute dtype = x's; autograd casts grads back
    if weight is not None:
        weight = weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    out_f = lora_b.shape[0]
    if meta.n_slots == 0 or x2d.shape[0] == 0:
        if weight is None:
            y = x2d.new_zeros(x2d.shape[0], out_f) + 0.0 * (lora_a.sum() + lora_b.sum())
        else:
            y = F.linear(x2d, weight, bias)
        return y.reshape(*x.shape[:-1], out_f)
    shape = (x2d.shape[0], x2d.shape[1], out_f, x2d.device)
    mode_fwd = ops.choose_mode("fwd", *shape, fused=fused)
    mode_bwd = ops.choose_mode("bwd-dropout" if meta.has_dropout else "bwd", *shape, fused=fused)
    y = _PackedLoRA.apply(
        x2d, weight, bias, lora_a, lora_b, meta, drop.scalars(), mode_fwd, mode_bwd
    )
    return y.reshape(*x.shape[:-1], out_f)


def packed_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: Sequence[int] | torch.Tensor,
    rank_offsets: Sequence[int] | torch.Tensor,
    ranks: Sequence[int] | torch.Tensor,
    scales: Sequence[float] | torch.Tensor,
    dropout_p: Sequence[float] | torch.Tensor | float,
    dropout_seed: int | DropoutKeys,
    *,
    fused: bool | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``y = x·Wᵀ + bias + Σ_i s_i·(drop_i(x_i)·A_iᵀ)·B_iᵀ`` for packed slots, autograd-aware.

    Args and layouts: see :mod:`plora.kernels`. ``x (..., in)`` -> ``y (..., out)`` in x.dtype.
    """
    _check_tensors(x, weight, bias, lora_a, lora_b)
    table_args = dict(
        seg_starts=seg_starts,
        rank_offsets=rank_offsets,
        ranks=ranks,
        scales=scales,
        dropout_p=dropout_p,
    )
    if not _use_triton(x, backend):
        return packed_lora_reference(
            x, weight, bias, lora_a, lora_b, **table_args, dropout_seed=dropout_seed
        )
    return _run(x, weight, bias, lora_a, lora_b, table_args, dropout_seed, fused)


def packed_lora_delta(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: Sequence[int] | torch.Tensor,
    rank_offsets: Sequence[int] | torch.Tensor,
    ranks: Sequence[int] | torch.Tensor,
    scales: Sequence[float] | torch.Tensor,
    dropout_p: Sequence[float] | torch.Tensor | float,
    dropout_seed: int | DropoutKeys,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """The LoRA term ``Σ_i s_i·(drop_i(x_i)·A_iᵀ)·B_iᵀ`` alone, ``(..., out)``, zero off-segment."""
    _check_tensors(x, None, None, lora_a, lora_b)
    table_args = dict(
        seg_starts=seg_starts,
        rank_offsets=rank_offsets,
        ranks=ranks,
        scales=scales,
        dropout_p=dropout_p,
    )
    if not _use_triton(x, backend):
        return packed_lora_delta_reference(
            x, lora_a, lora_b, **table_args, dropout_seed=dropout_seed
        )
    return _run(x, None, None, lora_a, lora_b, table_args, dropout_seed, False)
