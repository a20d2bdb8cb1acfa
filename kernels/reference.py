"""Pure-torch twin of the packed multi-LoRA kernels, and the dropout mask they share.

:func:`lora_term` is one slot's LoRA term ``s·(drop(x)·Aᵀ)·Bᵀ``, the one torch formula of the
packed LoRA: :func:`packed_lora_reference` loops it over a call's slots (autograd by torch) -- the
CPU path of :func:`plora.kernels.packed_lora_linear` and the oracle of the kernel tests (run it
in float64) -- and the engine's torch path (``plora.engine``) calls it per slot.

:func:`dropout_mask` is an independent port of Triton's counter-based Philox4x32-10 and its
uint32 -> float conversion (``tl.rand``), written with int64 torch ops so that it runs on any
device. The kernels draw element ``(t, c)`` of slot ``i``'s segment from word ``c % 4`` of
Philox under the slot's key at the counter :class:`~plora.kernels.meta.DropoutKeys` describes
(``tl.philox``); this function draws the same numbers, so a CPU run and a GPU run of one step
drop the same activations.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .errors import PackedLoRAError
from .meta import DropoutKeys, PackedMeta, make_meta

_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
#: Triton's scale from a non-negative int32 to [0, 1): the largest float with (2^31 - 1)·s < 1.
_UNIFORM_SCALE = 4.6566127342e-10
_N_ROUNDS = 10


def _mul_parts(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a·b`` for ``a, b < 2³²`` without int64 overflow."""
    lo = (a & 0xFFFF) * b  # < 2^48
    hi = (a >> 16) * b  # < 2^48; a·b = hi·2^16 + lo
    mulhi = (hi + (lo >> 16)) >> 16
    mullo = (((hi & 0xFFFF) << 16) + lo) & _M32
    return mulhi, mullo


def philox4x32(
    key: tuple[int, int], c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 (Salmon et al. 2011) on int64 tensors holding 32-bit words.

    Args:
        key: ``(k0, k1)``, each < 2³².
        c0, c1, c2, c3: broadcastable int64 tensors of counter words (< 2³²).

    Returns:
        The four output words, int64 in [0, 2³²).
    """
    k0, k1 = key
    c0, c1, c2, c3 = torch.broadcast_tensors(*(c.to(torch.int64) for c in (c0, c1, c2, c3)))
    for _ in range(_N_ROUNDS):
        hi_b, lo_b = _mul_parts(_ROUND_B, c2)
        hi_a, lo_a = _mul_parts(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _M32
        k1 = (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def uniform_from_uint32(bits: torch.Tensor) -> torch.Tensor:
    """Triton's ``uint_to_uniform_float`` for 32-bit words: float32 in [0, 1)."""
    signed_nonneg = torch.where(bits >= 2**31, _M32 - bits, bits)  # ~x for negative int32
    scale = torch.full((), _UNIFORM_SCALE, dtype=torch.float32, device=bits.device)
    return signed_nonneg.to(torch.float32) * scale


def dropout_mask(
    key: int,
    shape: tuple[int, int],
    p: float,
    device: torch.device | str = "cpu",
    *,
    row0: int = 0,
    row_len: int | None = None,
    word: int = 0,
    col_base: int = 0,
    in_total: int | None = None,
) -> torch.Tensor:
    """Keep mask of one slot's segment, identical to the one the Triton kernels regenerate.

    Args:
        key: the slot's 63-bit Philox key (:class:`~plora.kernels.meta.DropoutKeys`).
        shape: ``(tokens in the segment, columns)``.
        p: dropout probability; element kept iff ``uniform >= float32(p)``.
        device: where to build the mask.
        row0, row_len, word, col_base, in_total: as in :class:`~plora.kernels.meta.DropoutKeys`
            (``row_len`` defaults to the segment: one row).

    Returns:
        Bool tensor of ``shape``; ``True`` = kept (scaled by ``1/(1-p)`` by the caller).
    """
    tokens, cols = shape
    length = max(tokens, 1) if row_len is None else row_len
    groups = ((col_base + cols if in_total is None else in_total) + 3) // 4
    first, last = col_base // 4, (col_base + cols + 3) // 4
    lead = col_base - 4 * first  # columns of the first group before col_base
    t = torch.arange(tokens, device=device, dtype=torch.int64).unsqueeze(1)
    g = torch.arange(first, last, device=device, dtype=torch.int64).unsqueeze(0)
    key &= 0x7FFFFFFFFFFFFFFF  # as the kernels: a Triton int64 argument holds 63 bits
    words = philox4x32(
        (key & _M32, (key >> 32) & _M32),
        (t % length) * groups + g,
        row0 + t // length,
        torch.full((), word, dtype=torch.int64, device=device),
        torch.zeros((), dtype=torch.int64, device=device),
    )
    bits = torch.stack(words, dim=-1).reshape(tokens, (last - first) * 4)[:, lead : lead + cols]
    # torch.full, not torch.tensor: no host-to-device copy, which a CUDA graph's capture refuses
    return uniform_from_uint32(bits) >= torch.full((), p, dtype=torch.float32, device=device)


def _as_meta(x2d: torch.Tensor, lora_a: torch.Tensor, *table, dropout=None) -> PackedMeta:
    seg_starts, rank_offsets, ranks, scales, dropout_p = table
    return make_meta(
        n_tokens=x2d.shape[0],
        r_total=lora_a.shape[0],
        in_features=x2d.shape[1],
        seg_starts=seg_starts,
        rank_offsets=rank_offsets,
        ranks=ranks,
        scales=scales,
        dropout_p=dropout_p,
        dropout=dropout,
    )


def resolve_dropout(dropout_seed: int | DropoutKeys, x: torch.Tensor, n_slots: int) -> DropoutKeys:
    """The call's :class:`DropoutKeys` (from one seed: :meth:`DropoutKeys.from_seed`), resolved
    against ``x (..., in)``."""
    drop = (
        dropout_seed
        if isinstance(dropout_seed, DropoutKeys)
        else DropoutKeys.from_seed(int(dropout_seed), n_slots)
    )
    if len(drop.keys) != n_slots:
        raise PackedLoRAError(
            f"packed_lora: {len(drop.keys)} dropout keys for {n_slots} slots; give one per slot"
        )
    return _resolved(drop, math.prod(x.shape[:-1]), x.shape[-1])


@functools.lru_cache(maxsize=256)
def _resolved(drop: DropoutKeys, n_tokens: int, in_features: int) -> DropoutKeys:
    return drop.resolved(n_tokens, in_features)


def lora_term(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    p: float,
    *,
    key: int = 0,
    row0: int = 0,
    row_len: int | None = None,
    word: int = 0,
    col_base: int = 0,
    in_total: int | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """One slot's LoRA term ``s · (drop(x)·Aᵀ)·Bᵀ``: the unit of every torch path.

    PEFT's order and arithmetic (``lora_B(lora_A(dropout(x))) * scaling``, dropout as torch's
    ``x · (m / (1 - p))``); autograd by torch; matmuls in the autocast dtype under autocast.

    Args:
        x: ``(T, in)``: the slot's tokens.
        lora_a: ``(r, in)``.
        lora_b: ``(out, r)``.
        scale: ``s``.
        p: dropout probability (0: none).
        key, row0, row_len, word, col_base, in_total: the keep mask's Philox key and counter
            (:func:`dropout_mask`); ``keep`` (bool ``(T, in)``) overrides it.

    Returns:
        ``(T, out)``.
    """
    if p > 0.0:
        if keep is None:
            keep = dropout_mask(
                key, (x.shape[0], x.shape[1]), p, x.device, row0=row0, row_len=row_len,
                word=word, col_base=col_base, in_total=in_total,
            )  # fmt: skip
        x = x * (keep.to(x.dtype) * (1.0 / (1.0 - p)))
    return (x @ lora_a.t()) @ lora_b.t() * scale


def reference_delta(
    x2d: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    meta: PackedMeta,
    drop: DropoutKeys,
    masks: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """LoRA term for flattened tokens ``x2d (N, in)`` -> ``(N, out)``, looping over slots.

    ``masks[i]`` (bool, segment shape) overrides slot ``i``'s regenerated keep mask.
    """
    n_tokens, out_f = x2d.shape[0], lora_b.shape[0]
    if meta.n_slots == 0:
        return x2d.new_zeros(n_tokens, out_f)
    # One differentiable split per factor (each slot's rank rows, then its pad rows) and one
    # concatenation of the rows: the backward writes one gradient per factor and slices dY,
    # instead of a full-size gradient (or a full-size copy of dY) per slot.
    sizes: list[int] = []
    for i in range(meta.n_slots):
        block = meta.rank_offsets[i + 1] - meta.rank_offsets[i]
        sizes += [meta.ranks[i], block - meta.ranks[i]]
    a_parts, b_parts = lora_a.split(sizes, 0), lora_b.split(sizes, 1)
    rows: list[torch.Tensor] = []
    if meta.seg_starts[0] > 0:  # tokens before the first segment: no LoRA term
        rows.append(x2d.new_zeros(meta.seg_starts[0], out_f))
    for i in range(meta.n_slots):
        start, stop = meta.seg_starts[i], meta.seg_starts[i + 1]
        if stop == start:
            continue
        rows.append(
            lora_term(
                x2d[start:stop], a_parts[2 * i], b_parts[2 * i], meta.scales[i],
                meta.dropout_p[i], key=meta.dropout_keys[i] if meta.dropout_keys else 0,
                row0=meta.dropout_rows[i] if meta.dropout_rows else 0,
                row_len=drop.row_len, word=drop.word, col_base=drop.col_base,
                in_total=drop.in_total, keep=None if masks is None else masks[i],
            )
        )  # fmt: skip
    if meta.seg_starts[-1] < n_tokens:  # tokens after the last segment
        rows.append(x2d.new_zeros(n_tokens - meta.seg_starts[-1], out_f))
    if not rows:
        return x2d.new_zeros(n_tokens, out_f)
    delta = torch.cat(rows) if len(rows) > 1 else rows[0]
    return delta.to(x2d.dtype)
    # One differentiable split per factor (each slot's rank rows, then its pad rows): the backward
    # is one concatenation, one gradient per factor, not one full-size gradient per slot.
    sizes: list[int] = []
    for i in range(meta.n_slots):
        block = meta.rank_offsets[i + 1] - meta.rank_offsets[i]
        sizes += [meta.ranks[i], block - meta.ranks[i]]
    a_parts, b_parts = lora_a.split(sizes, 0), lora_b.split(sizes, 1)
    for i in range(meta.n_slots):
        start, stop = meta.seg_starts[i], meta.seg_starts[i + 1]
        if stop == start:
            continue
        p = meta.dropout_p[i]
        xi = x2d[start:stop]
        if p > 0.0:
            keep = masks[i] if masks is not None else None
            if keep is None:
                keep = dropout_mask(
                    meta.dropout_keys[i], tuple(xi.shape), p, xi.device, row0=meta.dropout_rows[i],
                    row_len=drop.row_len, word=drop.word, col_base=drop.col_base,
                    in_total=drop.in_total,
                )  # fmt: skip
            xi = xi * (keep.to(xi.dtype) * (1.0 / (1.0 - p)))  # as torch's dropout: x · (m/(1-p))
        a_i, b_i = a_parts[2 * i], b_parts[2 * i]
        # PEFT's order: lora_B(lora_A(drop(x))) · s
        delta[start:stop] = (xi @ a_i.t()) @ b_i.t() * meta.scales[i]
    return delta


def packed_lora_reference(
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
    masks: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """``y = x·Wᵀ + bias + Σ_i s_i·(drop_i(x_i)·A_iᵀ)·B_iᵀ`` by a loop over slots.

    Same arguments and layouts as :func:`plora.kernels.packed_lora_linear`; ``x (..., in)`` gives
    ``y (..., out)`` in ``x.dtype``. Autograd is torch's own.
    """
    x2d = x.reshape(-1, x.shape[-1])
    drop = resolve_dropout(dropout_seed, x, len(_raw_ranks(ranks)))
    meta = _as_meta(x2d, lora_a, seg_starts, rank_offsets, ranks, scales, dropout_p, dropout=drop)
    y = F.linear(x2d, weight, bias) + reference_delta(x2d, lora_a, lora_b, meta, drop, masks)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def packed_lora_delta_reference(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: Sequence[int] | torch.Tensor,
    rank_offsets: Sequence[int] | torch.Tensor,
    ranks: Sequence[int] | torch.Tensor,
    scales: Sequence[float] | torch.Tensor,
    dropout_p: Sequence[float] | torch.Tensor | float,
    dropout_seed: int | DropoutKeys,
) -> torch.Tensor:
    """The LoRA term alone, ``(..., out)``; see :func:`packed_lora_reference`."""
    x2d = x.reshape(-1, x.shape[-1])
    drop = resolve_dropout(dropout_seed, x, len(_raw_ranks(ranks)))
    meta = _as_meta(x2d, lora_a, seg_starts, rank_offsets, ranks, scales, dropout_p, dropout=drop)
    delta = reference_delta(x2d, lora_a, lora_b, meta, drop)
    return delta.reshape(*x.shape[:-1], lora_b.shape[0])


def cross_entropy_reference(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What :func:`plora.kernels.cross_entropy.cross_entropy_` computes, in torch:
    ``(ce, grad or None)`` (``logits`` untouched)."""
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    ce = -logp.gather(1, targets[:, None].long()).squeeze(1)
    if weights is None:
        return ce, None
    g = logp.exp_()
    g[torch.arange(targets.shape[0], device=g.device), targets.long()] -= 1.0
    return ce, g.mul_(weights[:, None].float()).to(logits.dtype)


def _raw_ranks(ranks: Sequence[int] | torch.Tensor) -> Sequence[int]:
    return ranks.tolist() if isinstance(ranks, torch.Tensor) else ranks
