"""Triton kernels of the packed multi-LoRA linear (launched by :mod:`plora.kernels.ops`).

Three kernels cover the forward and the backward (``T`` = tokens, ``i`` = slot)::

    _shrink_kernel   O[t, r]  = c_i · Σ_k drop?(P)[t, k] · M[o_i + r, k]     S = s·drop(x)·Aᵀ, dS = s·dY·B
    _lora_gemm_kernel O[t, n] (+)= [Σ_k P[t, k]·Q[n, k]] + bias?[n]
                              + Σ_i mask?(Σ_r L[t, r]·R[n, o_i + r])         y, dX (fused or LoRA only)
    _wgrad_kernel    G[n, o_i + r] = c_i · Σ_{t∈i} drop?(P)[t, n] · Q[t, r]    dA = dSᵀ·drop(x), dB = dYᵀ·S (one launch)

``_wgrad_kernel`` lives in :mod:`plora.kernels.triton_wgrad` (it shares this module's helpers).
``_fused_tma_kernel`` is the fused ``_lora_gemm_kernel`` for Hopper-class GPUs (persistent, TMA
descriptors, optional warp specialization); both route the LoRA products through
``_lora_tile`` (operands by pointer loads or by TMA).

Routing. The shrink kernel runs over segment-aligned row tiles: tile ``pid`` finds its slot by a
prefix sum over the per-slot tile counts (no host table, no sync). The GEMM kernel runs over the
regular ``(BM, BN)`` output tiles of the base GEMM (LoRAFusion's tile-level routing): each tile
loops over the few slots whose segments intersect its rows and adds their rank-``r_i`` products,
masked to those rows, into the same accumulator. The weight-gradient kernel gives one program a
``(slot, BN columns)`` tile and reduces over that slot's tokens in order: no atomics, bitwise
repeatable results.

Dropout. Element ``(t, c)`` of slot ``i`` (``t`` counted from the segment start, ``c`` an input
feature) is kept iff ``uniform(word (col_base+c)%4 of Philox4x32-10(key_i, counter)) >= p_i`` with the
counter of ``plora.kernels.meta.DropoutKeys`` (``tl.philox``: one call per four elements, Philox
being the cost of dropout); each kernel regenerates the bits it needs (see
:func:`plora.kernels.reference.dropout_mask`).

The slot table is one int32 tensor ``(8, n_slots + 1)``: rows seg_starts, rank_offsets, ranks,
scales (float32 bits), dropout_p (float32 bits), the dropout key's low and high words and the
slot's first row; ``ts`` is its row stride.
"""

from __future__ import annotations

import triton
import triton.language as tl

_BIG = tl.constexpr(2147483647)

#: Integer arguments that change from call to call: the dropout counter's module word, the row
#: length (padded sequence length), the token count M and the slot count. Triton would otherwise compile one variant
#: per value class it sees (== 1, divisible by 16), so a module word or token count that first happens to
#: be divisible by 16 at step 23 stalls that step on a compile (seen on an H100: 3-8 s stalls at
#: random steps of a sweep). Runtime values only feed masks and loop bounds here.
_VARYING = ("word", "row_len", "M", "n_slots")


def _jit(fn):
    """``triton.jit`` without value specialization of the :data:`_VARYING` arguments it has."""
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return triton.jit(fn, do_not_specialize=[n for n in _VARYING if n in names])


@triton.jit
def _drop_key(table_ptr, ts, slot):
    """``(key, first row)`` of ``slot``'s dropout (table rows 5-7); load once, outside loops."""
    lo = _slot_entry(table_ptr, ts, 5, slot).to(tl.uint32, bitcast=True).to(tl.uint64)
    hi = _slot_entry(table_ptr, ts, 6, slot).to(tl.uint32, bitcast=True).to(tl.uint64)
    key = ((hi << 32) | lo).to(tl.int64, bitcast=True)
    return key, _slot_entry(table_ptr, ts, 7, slot)


@triton.jit
def _keep(key, first_row, t_local, col0, p, word, row_len, col_base, groups, BC: tl.constexpr):
    """Dropout keep mask ``(len(t_local), BC)`` for local columns ``col0 + [0, BC)``.

    One Philox4x32-10 call under the slot's ``key`` yields four words: column ``c`` uses word
    ``(col_base + c) % 4`` of counter ``(s·groups + (col_base + c)//4, first_row + t //
    row_len, word, 0)`` with ``s = t % row_len`` (see ``DropoutKeys``). ``col0``, ``col_base``
    and ``BC`` are multiples of 4. ``key`` and ``first_row`` come from :func:`_drop_key`,
    loaded before the loop that calls this (table loads inside the software-pipelined TMA
    shrink loop gave wrong masks in float32 on an H100).
    """
    n_row = tl.cast(row_len, tl.uint32)
    t = t_local.to(tl.uint32)
    g = ((col_base + col0) // 4 + tl.arange(0, BC // 4)).to(tl.uint32)
    c0 = ((t % n_row) * tl.cast(groups, tl.uint32))[:, None] + g[None, :]
    c1 = (first_row.to(tl.uint32) + t // n_row)[:, None] + g[None, :] * 0
    c2 = c0 * 0 + tl.cast(word, tl.uint32)
    c3 = c0 * 0
    w0, w1, w2, w3 = tl.philox(key, c0, c1, c2, c3)
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (t_local.shape[0], BC))
    # Triton's uint -> uniform [0, 1) conversion (tl.rand), on the interleaved words.
    x = words.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, ~x, x)
    return x.to(tl.float32) * 4.6566127342e-10 >= p


@triton.jit
def _slot_entry(table_ptr, ts, row: tl.constexpr, slot):
    return tl.load(table_ptr + row * ts + slot)


@triton.jit
def _slot_float(table_ptr, ts, row: tl.constexpr, slot):
    return tl.load(table_ptr + row * ts + slot).to(tl.float32, bitcast=True)


@triton.jit
def _grouped_tile(tile, grid_m, grid_n, GROUP_M: tl.constexpr):
    """(row, column) tile of linear index ``tile`` in grouped order (L2 reuse of the Q panel)."""
    width = GROUP_M * grid_n
    first_m = (tile // width) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@triton.jit
def _lora_tile(
    acc, m0, n0, M, N, l_ptr, r_ptr, l_desc, r_desc, table_ptr, word, row_len, col_base, groups, n_slots, ts,
    stride_lm, stride_rn, stride_rr,
    HAS_DROPOUT: tl.constexpr, BY_TMA: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, SLOTS_P2: tl.constexpr,
):  # fmt: skip
    """``acc + Σ_i mask?(L_i·R_iᵀ)`` over the slots whose segments meet rows ``[m0, m0 + BM)``.

    The routing step of every output tile (LoRAFusion's tile-level routing): usually one or two
    slots; each product is masked to the slot's rows and, with dropout, to its keep mask.
    Operands by pointer loads (``L[t, r]`` at ``l_ptr``, ``R[n, o_i + r]`` at ``r_ptr``), or with
    ``BY_TMA`` by the descriptors ``l_desc`` (``L`` row tiles, masked in registers) and
    ``r_desc`` (``R`` stored ``(R_tot, N)``); the unused pair is never read.
    """
    rows = m0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    idx = tl.arange(0, SLOTS_P2)
    valid = idx < n_slots
    seg_lo = tl.load(table_ptr + idx, mask=valid, other=_BIG)
    seg_hi = tl.load(table_ptr + idx + 1, mask=valid, other=_BIG)
    j_first = tl.sum((seg_hi <= m0).to(tl.int32), 0)
    j_stop = tl.sum((seg_lo < m0 + BM).to(tl.int32), 0)
    for j in range(j_first, j_stop):
        start = _slot_entry(table_ptr, ts, 0, j)
        end = _slot_entry(table_ptr, ts, 0, j + 1)
        off = tl.multiple_of(_slot_entry(table_ptr, ts, 1, j), 16)
        rank = _slot_entry(table_ptr, ts, 2, j)
        in_seg = row_ok & (rows >= start) & (rows < end)
        if HAS_DROPOUT:  # noqa: SIM108 (a constexpr branch, not a value)
            part = tl.zeros((BM, BN), dtype=tl.float32)
        else:
            part = acc
        for r0 in range(0, rank, BR):
            rr = r0 + tl.arange(0, BR)
            r_ok = rr < rank
            if BY_TMA:
                lt = tl.where(in_seg[:, None] & r_ok[None, :], l_desc.load([m0, r0]), 0.0)
                rt = r_desc.load([off + r0, n0])
            else:
                lt = tl.load(
                    l_ptr + rows64[:, None] * stride_lm + rr[None, :],
                    mask=in_seg[:, None] & r_ok[None, :],
                    other=0.0,
                )
                rt = tl.load(
                    r_ptr
                    + cols64[None, :] * stride_rn
                    + (off + rr).to(tl.int64)[:, None] * stride_rr,
                    mask=col_ok[None, :] & r_ok[:, None],
                    other=0.0,
                )
            part = tl.dot(lt, rt, part)
        if HAS_DROPOUT:
            p = _slot_float(table_ptr, ts, 4, j)
            if p > 0.0:
                key, first_row = _drop_key(table_ptr, ts, j)
                keep = _keep(
                    key, first_row, rows - start, n0, p, word, row_len, col_base, groups, BN
                )
                part = tl.where(keep, part / (1.0 - p), 0.0)
            acc += part
        else:
            acc = part
    return acc


@_jit
def _shrink_kernel(
    p_ptr, m_ptr, o_ptr, table_ptr, word, row_len, col_base, groups, p_desc, m_desc,
    K, n_slots, ts,
    stride_pt, stride_pk, stride_mr, stride_mk, stride_ot,
    HAS_DROPOUT: tl.constexpr, BY_TMA: tl.constexpr,
    BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SLOTS_P2: tl.constexpr,
):  # fmt: skip
    """Segment-aligned row tiles of ``O``; operand tiles by pointer loads or, with ``BY_TMA``, by
    the descriptors ``p_desc`` (``[BM, BK]`` boxes of P) and ``m_desc`` (``[BR, BK]`` boxes of
    M's rank rows): rows past the segment are stored nowhere, ranks past the slot's zeroed."""
    pid = tl.program_id(0)
    # --- which slot and which rows: prefix sum of per-slot tile counts
    idx = tl.arange(0, SLOTS_P2)
    valid = idx < n_slots
    starts = tl.load(table_ptr + idx, mask=valid, other=0)
    ends = tl.load(table_ptr + idx + 1, mask=valid, other=0)
    tiles = (ends - starts + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)
    slot = tl.sum((cum <= pid).to(tl.int32), 0)
    if slot < n_slots:
        first_tile = tl.sum(tl.where(idx == slot, cum - tiles, 0), 0)
        seg_start = tl.sum(tl.where(idx == slot, starts, 0), 0)
        seg_end = tl.sum(tl.where(idx == slot, ends, 0), 0)
        off = tl.multiple_of(_slot_entry(table_ptr, ts, 1, slot), 16)  # rank blocks are 16-aligned
        rank = _slot_entry(table_ptr, ts, 2, slot)
        scale = _slot_float(table_ptr, ts, 3, slot)
        p = _slot_float(table_ptr, ts, 4, slot)

        rows = seg_start + (pid - first_tile) * BM + tl.arange(0, BM)
        row_ok = rows < seg_end
        rr = tl.arange(0, BR)
        r_ok = rr < rank
        rows64 = rows.to(tl.int64)
        acc = tl.zeros((BM, BR), dtype=tl.float32)
        row0 = seg_start + (pid - first_tile) * BM
        key, first_row = _drop_key(table_ptr, ts, slot)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < K
            if BY_TMA:
                pt = p_desc.load([row0, k0])
            else:
                pt = tl.load(
                    p_ptr + rows64[:, None] * stride_pt + ks[None, :] * stride_pk,
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
            if HAS_DROPOUT:
                keep = _keep(
                    key, first_row, rows - seg_start, k0, p, word, row_len, col_base, groups, BK
                )  # fmt: skip
                pt = tl.where(keep, pt, 0.0)
            if BY_TMA:  # the box runs past the rank: those columns of acc are zeroed below
                mt = m_desc.load([off, k0]).T
            else:
                mt = tl.load(
                    m_ptr + (off + rr).to(tl.int64)[None, :] * stride_mr + ks[:, None] * stride_mk,
                    mask=r_ok[None, :] & k_ok[:, None],
                    other=0.0,
                )
            acc = tl.dot(pt, mt, acc)
        if HAS_DROPOUT:
            scale = scale / (1.0 - p)
        acc = tl.where(r_ok[None, :], acc * scale, 0.0)
        tl.store(
            o_ptr + rows64[:, None] * stride_ot + rr[None, :],
            acc.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (rr < stride_ot)[None, :],
        )


@_jit
def _lora_gemm_kernel(
    p_ptr, q_ptr, bias_ptr, l_ptr, r_ptr, o_ptr, table_ptr, word, row_len, col_base, groups,
    M, N, K, n_slots, ts,
    stride_pm, stride_pk, stride_qn, stride_qk, stride_lm, stride_rn, stride_rr,
    stride_om, stride_on,
    HAS_BASE: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    SLOTS_P2: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # --- grouped tile order (L2 reuse of the Q panel)
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    pid_m, pid_n = _grouped_tile(pid, grid_m, grid_n, GROUP_M)

    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)

    if HAS_BASE:
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < K
            pt = tl.load(
                p_ptr + rows64[:, None] * stride_pm + ks[None, :] * stride_pk,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            qt = tl.load(
                q_ptr + cols64[None, :] * stride_qn + ks[:, None] * stride_qk,
                mask=col_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            acc = tl.dot(pt, qt, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]

    acc = _lora_tile(
        acc, pid_m * BM, pid_n * BN, M, N, l_ptr, r_ptr, l_ptr, r_ptr, table_ptr, word, row_len,
        col_base, groups, n_slots,
        ts, stride_lm, stride_rn, stride_rr, HAS_DROPOUT, False, BM, BN, BR, SLOTS_P2,
    )  # fmt: skip

    o_ptrs = o_ptr + rows64[:, None] * stride_om + cols64[None, :] * stride_on
    o_mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=o_mask)


@_jit
def _fused_tma_kernel(
    p_desc, q_desc, o_desc, bias_ptr, l_ptr, r_ptr, l_desc, r_desc, table_ptr, word, row_len,
    col_base, groups,
    M, N, K, n_slots, ts,
    stride_lm, stride_rn, stride_rr,
    Q_NK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, LORA_TMA: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    SLOTS_P2: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    SUBTILE: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """The fused GEMM for Hopper-class GPUs: ``O = P·Qᵀ (+bias) + route(L·Rᵀ)``, persistent, TMA.

    One program per SM walks the output tiles in grouped order; operand tiles arrive by TMA
    (``Q_NK``: Q is stored (N, K), else (K, N)), the LoRA products are added by
    :func:`_lora_tile` into the same accumulator, and the tile leaves by TMA store (in two
    column halves with ``SUBTILE``). Out-of-range rows and columns are zero-filled on load and
    clipped on store by the descriptors.
    """
    start = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    n_tiles = grid_m * grid_n
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(start, n_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _grouped_tile(tile, grid_m, grid_n, GROUP_M)
        m0 = pid_m * BM
        n0 = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            k0 = kk * BK
            a = p_desc.load([m0, k0])
            if Q_NK:
                b = q_desc.load([n0, k0])
                acc = tl.dot(a, b.T, acc)
            else:
                b = q_desc.load([k0, n0])
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            cols = n0 + tl.arange(0, BN)
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        acc = _lora_tile(
            acc, m0, n0, M, N, l_ptr, r_ptr, l_desc, r_desc, table_ptr, word, row_len, col_base, groups, n_slots, ts,
            stride_lm, stride_rn, stride_rr, HAS_DROPOUT, LORA_TMA, BM, BN, BR, SLOTS_P2,
        )  # fmt: skip
        out = acc.to(o_desc.dtype)
        if SUBTILE:
            halves = tl.permute(tl.reshape(out, (BM, 2, BN // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            o_desc.store([m0, n0], left)
            o_desc.store([m0, n0 + BN // 2], right)
        else:
            o_desc.store([m0, n0], out)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (``triton.next_power_of_2`` in plain Python: launchers
    call this several times per launch, and Triton's is a wrapped constexpr function)."""
    return 1 << (max(int(n), 1) - 1).bit_length()
