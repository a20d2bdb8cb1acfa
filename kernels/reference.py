"""Pure-torch twin of the packed multi-LoRA kernels, and the dropout mask they share.

:func:`packed_lora_reference` is a plain loop over slots (autograd by torch); it is the CPU path
of :func:`plora.kernels.packed_lora_linear` and the oracle of the kernel tests (run it in float64).

:func:`dropout_mask` is an independent port of Triton's counter-based Philox4x32-10 and its
uint32 -> float conversion (``tl.rand``), written with int64 torch ops so that it runs on any
device. The kernels draw element ``(t, c)`` of slot ``i``'s segment from word ``c % 4`` of the
counter ``(t·⌈in/4⌉ + c//4, i, 0, 0)`` under key ``(seed mod 2³², seed >> 32)`` (``tl.randint4x``);
this function draws the same numbers, so a CPU run and a GPU run of one step drop the same
activations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .meta import PackedMeta, make_meta

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
    return signed_nonneg.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def dropout_mask(
    seed: int,
    slot: int,
    shape: tuple[int, int],
    p: float,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Keep mask of one slot's segment, identical to the one the Triton kernels regenerate.

    Args:
        seed: the call's ``dropout_seed``.
        slot: slot index ``i`` (the Philox counter's second word).
        shape: ``(tokens in the segment, in_features)``.
        p: dropout probability; element kept iff ``uniform >= float32(p)``.
        device: where to build the mask.

    Returns:
        Bool tensor of ``shape``; ``True`` = kept (scaled by ``1/(1-p)`` by the caller).
    """
    rows, cols = shape
    groups = (cols + 3) // 4
    t = torch.arange(rows, device=device, dtype=torch.int64).unsqueeze(1)
    g = torch.arange(groups, device=device, dtype=torch.int64).unsqueeze(0)
    seed &= 0x7FFFFFFFFFFFFFFF  # as the kernels: a Triton int64 argument holds 63 bits
    zero = torch.zeros((), dtype=torch.int64, device=device)
    slot_word = torch.tensor(slot, device=device, dtype=torch.int64)
    words = philox4x32((seed & _M32, (seed >> 32) & _M32), t * groups + g, slot_word, zero, zero)
    bits = torch.stack(words, dim=-1).reshape(rows, groups * 4)[:, :cols]  # column c: word c % 4
    return uniform_from_uint32(bits) >= torch.tensor(p, dtype=torch.float32, device=device)


def _as_meta(x2d: torch.Tensor, lora_a: torch.Tensor, *table) -> PackedMeta:
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
    )


def reference_delta(
    x2d: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    meta: PackedMeta,
    dropout_seed: int,
    masks: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """LoRA term for flattened tokens ``x2d (N, in)`` -> ``(N, out)``, looping over slots.

    ``masks[i]`` (bool, segment shape) overrides slot ``i``'s regenerated keep mask.
    """
    delta = x2d.new_zeros(x2d.shape[0], lora_b.shape[0])
    for i in range(meta.n_slots):
        start, stop = meta.seg_starts[i], meta.seg_starts[i + 1]
        if stop == start:
            continue
        off, rank, p = meta.rank_offsets[i], meta.ranks[i], meta.dropout_p[i]
        xi = x2d[start:stop]
        if p > 0.0:
            keep = masks[i] if masks is not None else None
            if keep is None:
                keep = dropout_mask(dropout_seed, i, tuple(xi.shape), p, xi.device)
            xi = xi * keep.to(xi.dtype) / (1.0 - p)
        a_i = lora_a[off : off + rank]
        b_i = lora_b[:, off : off + rank]
        delta[start:stop] = meta.scales[i] * ((xi @ a_i.t()) @ b_i.t())
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
    dropout_seed: int,
    *,
    masks: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """``y = x·Wᵀ + bias + Σ_i s_i·(drop_i(x_i)·A_iᵀ)·B_iᵀ`` by a loop over slots.

    Same arguments and layouts as :func:`plora.kernels.packed_lora_linear`; ``x (..., in)`` gives
    ``y (..., out)`` in ``x.dtype``. Autograd is torch's own.
    """
    x2d = x.reshape(-1, x.shape[-1])
    meta = _as_meta(x2d, lora_a, seg_starts, rank_offsets, ranks, scales, dropout_p)
    y = F.linear(x2d, weight, bias) + reference_delta(
        x2d, lora_a, lora_b, meta, dropout_seed, masks
    )
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
    dropout_seed: int,
) -> torch.Tensor:
    """The LoRA term alone, ``(..., out)``; see :func:`packed_lora_reference`."""
    x2d = x.reshape(-1, x.shape[-1])
    meta = _as_meta(x2d, lora_a, seg_starts, rank_offsets, ranks, scales, dropout_p)
    delta = reference_delta(x2d, lora_a, lora_b, meta, dropout_seed)
    return delta.reshape(*x.shape[:-1], lora_b.shape[0])
