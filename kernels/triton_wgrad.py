"""The weight-gradient Triton kernel of the packed multi-LoRA linear (launched by
:func:`plora.kernels.ops.wgrad`)::

    _wgrad_kernel    G[n, o_i + r] = c_i · Σ_{t∈i} drop?(P)[t, n] · Q[t, r]    dA = dSᵀ·drop(x), dB = dYᵀ·S

One program per ``(slot, BN columns[, rank chunk])`` reduces over that slot's tokens in order:
no atomics, bitwise repeatable results. The slot table, the dropout bits and the helpers are
:mod:`plora.kernels.triton_kernels`'.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import _drop_key, _jit, _keep, _slot_entry, _slot_float


@_jit
def _wgrad_kernel(
    p0_ptr, q0_ptr, g0_ptr, p1_ptr, q1_ptr, g1_ptr, table_ptr, word, row_len, col_base, groups,
    p0_desc, q0_desc, p1_desc, q1_desc,
    N0, N1, NB0, ts,
    stride0_pt, stride0_pn, stride0_qt, stride0_gn, stride0_gr,
    stride1_pt, stride1_pn, stride1_qt, stride1_gn, stride1_gr,
    HAS_DROPOUT: tl.constexpr, BY_TMA: tl.constexpr,
    BN: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr, R_SPAN: tl.constexpr,
):  # fmt: skip
    """Two weight gradients in one launch: column blocks ``[0, NB0)`` are job 0's, the rest job 1's.

    Job ``j``: ``G_j[n, o_i + r] = c_i · Σ_{t∈i} drop?(P_j)[t, n] · Q_j[t, r]``; only job 0 is
    masked (``dA = dSᵀ·drop(x)``; ``dB = dYᵀ·S`` takes S already dropped). Operand tiles by
    pointer loads or, with ``BY_TMA``, by the descriptors (``[BT, BN]`` boxes of P, ``[BT, BR]``
    of Q; rows of the next segment are loaded and zeroed).
    """
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    r_lo = tl.program_id(2) * R_SPAN  # this program's share of the rank block
    if pid_n < NB0:
        _wgrad_block(
            p0_ptr, q0_ptr, g0_ptr, p0_desc, q0_desc, table_ptr, word, row_len, col_base, groups,
            slot, pid_n, r_lo, N0, ts,
            stride0_pt, stride0_pn, stride0_qt, stride0_gn, stride0_gr,
            HAS_DROPOUT, BY_TMA, BN, BR, BT, R_SPAN,
        )  # fmt: skip
    else:
        _wgrad_block(
            p1_ptr, q1_ptr, g1_ptr, p1_desc, q1_desc, table_ptr, word, row_len, col_base, groups,
            slot, pid_n - NB0, r_lo,
            N1, ts, stride1_pt, stride1_pn, stride1_qt, stride1_gn, stride1_gr,
            False, BY_TMA, BN, BR, BT, R_SPAN,
        )  # fmt: skip


@triton.jit
def _wgrad_block(
    p_ptr, q_ptr, g_ptr, p_desc, q_desc, table_ptr, word, row_len, col_base, groups, slot,
    pid_n, r_lo, N, ts,
    stride_pt, stride_pn, stride_qt, stride_gn, stride_gr,
    HAS_DROPOUT: tl.constexpr, BY_TMA: tl.constexpr,
    BN: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr, R_SPAN: tl.constexpr,
):  # fmt: skip
    """One program's ``(slot, BN columns[, rank chunk])`` block of one weight gradient."""
    start = _slot_entry(table_ptr, ts, 0, slot)
    end = _slot_entry(table_ptr, ts, 0, slot + 1)
    off = tl.multiple_of(_slot_entry(table_ptr, ts, 1, slot), 16)
    block = _slot_entry(table_ptr, ts, 1, slot + 1) - off
    rank = _slot_entry(table_ptr, ts, 2, slot)
    n0 = pid_n * BN
    cols = n0 + tl.arange(0, BN)
    col_ok = cols < N
    if HAS_DROPOUT:
        p = _slot_float(table_ptr, ts, 4, slot)
        key, first_row = _drop_key(table_ptr, ts, slot)
    # Rank chunks of BR (outer) x token tiles of BT (inner): a rank-8 slot does one 16..BR chunk
    # instead of a max-rank-wide tile; the slot's P columns are re-read per chunk from L2.
    for r0 in range(r_lo, min(block, r_lo + R_SPAN), BR):
        rr = r0 + tl.arange(0, BR)
        r_ok = rr < rank
        acc = tl.zeros((BN, BR), dtype=tl.float32)
        for t0 in range(start, end, BT):
            tt = t0 + tl.arange(0, BT)
            t_ok = tt < end
            tt64 = tt.to(tl.int64)
            if BY_TMA:
                pt = tl.where(t_ok[:, None], p_desc.load([t0, n0]), 0.0)
                qt = tl.where(t_ok[:, None] & r_ok[None, :], q_desc.load([t0, r0]), 0.0)
            else:
                pt = tl.load(
                    p_ptr + tt64[:, None] * stride_pt + cols[None, :] * stride_pn,
                    mask=t_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
                qt = tl.load(
                    q_ptr + tt64[:, None] * stride_qt + rr[None, :],
                    mask=t_ok[:, None] & r_ok[None, :],
                    other=0.0,
                )
            if HAS_DROPOUT:  # noqa: SIM102 (a constexpr branch around a runtime one)
                if p > 0.0:
                    keep = _keep(
                        key, first_row, tt - start, n0, p, word, row_len, col_base, groups, BN,
                    )  # fmt: skip
                    pt = tl.where(keep, pt, 0.0)
            acc = tl.dot(tl.trans(pt), qt, acc)
        if HAS_DROPOUT:
            acc = acc * (1.0 / (1.0 - p))
        tl.store(
            g_ptr
            + cols.to(tl.int64)[:, None] * stride_gn
            + (off + rr).to(tl.int64)[None, :] * stride_gr,
            acc.to(g_ptr.dtype.element_ty),
            mask=col_ok[:, None] & (rr < block)[None, :],
        )
