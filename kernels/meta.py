"""The segment/rank table of a packed LoRA call, validated once and shipped to the device once.

A :class:`PackedMeta` holds the host copy of the table (tuples, so it hashes) and hands out one
small device tensor per (table, device); every layer of a step passes the same table, so only the
first layer pays the host-to-device copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from .errors import PackedLoRAError

#: Ranks are padded to a multiple of this inside the rank-concatenated A and B.
RANK_ALIGN = 16
#: Largest supported true rank.
MAX_RANK = 256

# Rows of the packed int32 device table (see PackedMeta.device_table).
ROW_SEG, ROW_OFF, ROW_RANK, ROW_SCALE, ROW_P = range(5)


def padded_rank(rank: int) -> int:
    """``rank`` rounded up to a multiple of :data:`RANK_ALIGN` (24 -> 32)."""
    return -(-rank // RANK_ALIGN) * RANK_ALIGN


def _raw(value, name: str) -> tuple | float:
    """Hashable host copy of a table argument (validated later, in :func:`_validated`)."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1:
            raise PackedLoRAError(
                f"packed_lora: {name} must be 1-d, got shape {tuple(value.shape)}"
            )
        value = value.tolist()
    if isinstance(value, int | float):
        return float(value)
    return tuple(value)


@dataclass(frozen=True, slots=True, eq=False)
class PackedMeta:
    """Validated host copy of the slot table (hashed by identity: one object per distinct table).

    Attributes:
        seg_starts: ``n_slots + 1`` token offsets.
        rank_offsets: ``n_slots + 1`` row offsets into the rank-concatenated A.
        ranks: ``n_slots`` true ranks.
        scales: ``n_slots`` LoRA scales.
        dropout_p: ``n_slots`` dropout probabilities.
        n_slots: number of slots.
        max_rank_pad: largest padded rank block (0 without slots).
        has_dropout: any ``p > 0``.
    """

    seg_starts: tuple[int, ...]
    rank_offsets: tuple[int, ...]
    ranks: tuple[int, ...]
    scales: tuple[float, ...]
    dropout_p: tuple[float, ...]
    n_slots: int
    max_rank_pad: int
    has_dropout: bool

    def device_table(self, device: torch.device) -> torch.Tensor:
        """``(5, n_slots + 1)`` int32 table on ``device``: seg, off, rank, scale, p (as bits)."""
        return _device_table(self, torch.device(device))


@lru_cache(maxsize=64)
def _device_table(meta: PackedMeta, device: torch.device) -> torch.Tensor:
    n = meta.n_slots
    host = torch.zeros(5, n + 1, dtype=torch.int32)
    host[ROW_SEG] = torch.tensor(meta.seg_starts, dtype=torch.int32)
    host[ROW_OFF] = torch.tensor(meta.rank_offsets, dtype=torch.int32)
    host[ROW_RANK, :n] = torch.tensor(meta.ranks, dtype=torch.int32)
    host[ROW_SCALE, :n] = torch.tensor(meta.scales, dtype=torch.float32).view(torch.int32)
    host[ROW_P, :n] = torch.tensor(meta.dropout_p, dtype=torch.float32).view(torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def make_meta(
    *,
    n_tokens: int,
    r_total: int,
    in_features: int,
    seg_starts: Sequence[int] | torch.Tensor,
    rank_offsets: Sequence[int] | torch.Tensor,
    ranks: Sequence[int] | torch.Tensor,
    scales: Sequence[float] | torch.Tensor,
    dropout_p: Sequence[float] | torch.Tensor | float,
) -> PackedMeta:
    """Validate the slot table against the tensor shapes; raise PackedLoRAError naming the bad value.

    Cached on the table's values: every layer of a step that passes the same table gets the same
    :class:`PackedMeta` (and so the same device copy) for a few microseconds.
    """
    return _validated(
        int(n_tokens),
        int(r_total),
        int(in_features),
        _raw(seg_starts, "seg_starts"),
        _raw(rank_offsets, "rank_offsets"),
        _raw(ranks, "ranks"),
        _raw(scales, "scales"),
        _raw(dropout_p, "dropout_p"),
    )


@lru_cache(maxsize=256)
def _validated(n_tokens, r_total, in_features, seg_starts, rank_offsets, ranks, scales, dropout_p):
    if not all(isinstance(v, tuple) for v in (seg_starts, rank_offsets, ranks)):
        raise PackedLoRAError(
            "packed_lora: seg_starts, rank_offsets and ranks must be sequences of ints"
        )
    segs = tuple(int(v) for v in seg_starts)
    offs = tuple(int(v) for v in rank_offsets)
    rks = tuple(int(v) for v in ranks)
    n = len(rks)
    if len(segs) != n + 1:
        raise PackedLoRAError(
            f"packed_lora: seg_starts has {len(segs)} entries for {n} slots; give n_slots + 1"
        )
    if len(offs) != n + 1:
        raise PackedLoRAError(
            f"packed_lora: rank_offsets has {len(offs)} entries for {n} slots; give n_slots + 1"
        )
    if segs and (segs[0] < 0 or segs[-1] > n_tokens):
        raise PackedLoRAError(
            f"packed_lora: seg_starts spans [{segs[0]}, {segs[-1]}) but x has {n_tokens} tokens; "
            "keep segments inside the flattened tokens"
        )
    for i in range(n):
        if segs[i + 1] < segs[i]:
            raise PackedLoRAError(
                f"packed_lora: seg_starts[{i + 1}]={segs[i + 1]} < seg_starts[{i}]={segs[i]}; "
                "segments must be contiguous and in slot order"
            )
        if (segs[i + 1] - segs[i]) * in_features >= 2**32:
            raise PackedLoRAError(
                f"packed_lora: slot {i} has {segs[i + 1] - segs[i]} tokens x {in_features} "
                "features >= 2**32 dropout counters; split the batch"
            )
        if not 1 <= rks[i] <= MAX_RANK:
            raise PackedLoRAError(f"packed_lora: ranks[{i}]={rks[i]}; use 1..{MAX_RANK}")
        block = offs[i + 1] - offs[i]
        if block < rks[i] or block % RANK_ALIGN:
            raise PackedLoRAError(
                f"packed_lora: slot {i} has a rank block of {block} rows for rank {rks[i]}; "
                f"use a multiple of {RANK_ALIGN} >= the rank (e.g. {padded_rank(rks[i])})"
            )
    if offs and (offs[0] != 0 or offs[-1] != r_total):
        raise PackedLoRAError(
            f"packed_lora: rank_offsets runs {offs[0]}..{offs[-1]} but lora_a has {r_total} rows; "
            "start at 0 and end at lora_a.shape[0]"
        )
    scl = _floats(scales, "scales", n)
    drop = _floats(dropout_p, "dropout_p", n)
    for i in range(n):
        if not 0.0 <= drop[i] < 1.0:
            raise PackedLoRAError(f"packed_lora: dropout_p[{i}]={drop[i]}; use a value in [0, 1)")
        if not math.isfinite(scl[i]):
            raise PackedLoRAError(f"packed_lora: scales[{i}]={scl[i]}; use a finite scale")
    return PackedMeta(
        seg_starts=segs,
        rank_offsets=offs,
        ranks=rks,
        scales=scl,
        dropout_p=drop,
        n_slots=n,
        max_rank_pad=max((offs[i + 1] - offs[i] for i in range(n)), default=0),
        has_dropout=any(p > 0.0 for p in drop),
    )


def _floats(value: tuple | float, name: str, n: int) -> tuple[float, ...]:
    if isinstance(value, float):
        return (value,) * n
    if len(value) != n:
        raise PackedLoRAError(
            f"packed_lora: {name} has {len(value)} entries; give one per slot ({n})"
        )
    return tuple(float(v) for v in value)
