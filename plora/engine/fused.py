"""The one bridge from :class:`~plora.engine.lora.PackedLoRALinear` to ``plora.kernels``.

On CUDA in bf16/fp16 (autocast or half weights), when ``plora.kernels.packed_lora_linear``
(Triton) is importable, a packed layer's
whole output ``y = x·Wᵀ + b + Σ_i s_i·(drop_i(x_i)·A_iᵀ)·B_iᵀ`` is one fused call over the
rank-concatenated factors (ranks zero-padded to :data:`RANK_ALIGN`) and a token segment table.
Everything else -- CPU, float32 on CUDA (the exactness mode), or no Triton -- runs the one torch
formula of the kernels, :func:`plora.kernels.reference.lora_term`, per piece of rows with the same
keyed dropout masks (:func:`reference_forward`): one torch reference, one dropout mask per
adapter, on every path.

QLoRA. When the frozen weight is stored in NF4 (:mod:`plora.models.quantize`) the kernels get
it dequantized to the compute dtype, once per layer and call (``W = deq(W_q)``, then the fused
GEMM), and autograd keeps the 4-bit weight, not the dense one: the dense weight saved for
``dX = dY·W`` is dequantized again in backward (:func:`~plora.models.quantize.recompute_saved`),
so at most one layer's dense weight is alive at a time, as with torchao's ``linear_nf4``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from plora.kernels.meta import DropoutKeys
from plora.kernels.reference import lora_term

from plora.engine.rng import mix
from plora.models.quantize import dense_weight, is_nf4, recompute_saved

#: Ranks are zero-padded to a multiple of this in the concatenated (kernel) layout.
RANK_ALIGN = 16

#: ``"auto"``: fused kernels on CUDA when ``plora.kernels`` provides them; ``"torch"``: never.
KERNEL_BACKEND = {"mode": "auto"}
_CACHE: list[Callable[..., torch.Tensor] | None] = []


def set_kernel_backend(mode: str) -> None:
    """Choose ``"auto"`` (kernels on CUDA when available) or ``"torch"`` (reference only)."""
    if mode not in ("auto", "torch"):
        raise ValueError(f"kernel backend {mode!r}: use 'auto' or 'torch'")
    KERNEL_BACKEND["mode"] = mode


def kernel() -> Callable[..., torch.Tensor] | None:
    """``plora.kernels.packed_lora_linear`` if usable, else None (the torch path)."""
    if KERNEL_BACKEND["mode"] == "torch":
        return None
    if not _CACHE:
        try:
            from plora import kernels  # type: ignore[attr-defined]  # kernels/ installs as plora.kernels

            _CACHE.append(kernels.packed_lora_linear)
        except (ImportError, AttributeError):
            _CACHE.append(None)
    return _CACHE[0]


def fused_forward(
    fn: Callable[..., torch.Tensor],
    layer: Any,
    x: torch.Tensor,
    pieces: Sequence[tuple[int, int, int]],
    routing: Any,
) -> torch.Tensor:
    """One fused call ``y = base(x) + Σ_i delta_i`` over all rows.

    The kernels get the layer's packed parameters themselves whenever the rows allow it: the
    table lists every slot of the layer in row order, slots without rows in this forward as empty
    segments. Only rows *between* pieces (rows of slots without factors here) need a filler slot
    of rank 1 and scale 0 (one zero block of ``RANK_ALIGN`` rows) to keep the segment table
    gap-free; then the factors are gathered once (:meth:`PackedLoRALinear.packed`). Dropout runs
    inside the kernel from each slot's Philox key (adapter seed and step) at counters of
    (token, row in the adapter's batch, module): the same masks as the torch path's.
    """
    per_row = math.prod(x.shape[1:-1])
    key = ("kernel", tuple(pieces), layer.training, per_row)
    table = layer.memo.get(key)
    if table is None:
        if len(layer.memo) > 64:  # many distinct row tables (sequence lengths): start over
            layer.memo.clear()
        table = layer.memo[key] = _slot_table(layer, pieces, per_row)
    slots, _, _, _, drops, starts = table
    a_cat, b_cat, rank_offsets = layer.packed(slots)
    keyed = tuple(
        (layer.specs[s].seed, *routing.dropout_keys.get(s, (0, start))) if p > 0.0 else None
        for s, start, p in zip(slots, starts, drops, strict=True)
    )
    keys, rows = _keys_and_rows(keyed)
    cols = layer.in_slice  # row-wise TP: this rank's columns of the full-width mask
    drop = DropoutKeys(
        keys=keys, rows=rows, row_len=max(per_row, 1), word=layer.key,
        col_base=0 if cols is None else cols.start, in_total=layer.in_features,
    )  # fmt: skip
    autocast = torch.is_autocast_enabled(x.device.type)
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    base = layer.base_layer
    bias = base.bias
    weight = dense_weight(base, dtype)
    keep = (
        recompute_saved(weight, lambda: dense_weight(base, dtype))
        if is_nf4(base.weight)
        else contextlib.nullcontext()
    )
    with keep:
        return _call(fn, x.to(dtype), weight, None if bias is None else bias.to(dtype),
                     a_cat.to(dtype), b_cat.to(dtype), table, rank_offsets, drop)  # fmt: skip


def reference_deltas(
    layer: Any, x: torch.Tensor, pieces: Sequence[tuple[int, int, int]], routing: Any
) -> list[torch.Tensor]:
    """The LoRA term of each ``(slot, start, stop)`` piece, ``(stop - start, ..., out)``, by the
    kernels' one torch formula (:func:`plora.kernels.reference.lora_term`).

    Per piece: the slot's factors as views of the packed parameters (one split each, so the
    backward writes one gradient per packed parameter), its keyed dropout mask (adapter seed and
    step, row in the adapter's batch, token, module; the columns of a row-wise TP shard) -- the
    masks the kernels regenerate. Without autocast ``x`` is cast to float32 and each term back to
    ``x``'s dtype (exact per-adapter training); under autocast the matmuls run in its dtype.
    """
    autocast = torch.is_autocast_enabled(x.device.type)
    xl = x if autocast else x.to(torch.float32)
    parts = layer.split_factors()
    cols = layer.in_slice  # row-wise TP: this rank's columns of the full-width mask
    out = []
    for slot, start, stop in pieces:
        a, bt = parts[slot]
        spec = layer.specs[slot]
        xs = xl[start:stop]
        step, offset = routing.dropout_keys.get(slot, (0, start))
        per_row = math.prod(xs.shape[1:-1])
        delta = lora_term(
            xs.reshape(-1, xs.shape[-1]), a, bt.t(), spec.scale,
            spec.dropout if layer.training else 0.0, key=dropout_key(spec.seed, step),
            row0=offset, row_len=max(per_row, 1), word=layer.key,
            col_base=0 if cols is None else cols.start, in_total=layer.in_features,
        ).reshape(*xs.shape[:-1], -1)  # fmt: skip
        out.append(delta if autocast else delta.to(x.dtype))
    return out


def reference_forward(
    layer: Any, x: torch.Tensor, pieces: Sequence[tuple[int, int, int]], routing: Any
) -> torch.Tensor:
    """``base(x)`` plus each piece's :func:`reference_deltas` on its rows: the packed layer off
    the kernels (CPU, float32 on CUDA, no Triton)."""
    return add_rows(layer.base_layer(x), reference_deltas(layer, x, pieces, routing), pieces)


def add_rows(
    y: torch.Tensor, deltas: Sequence[torch.Tensor], pieces: Sequence[tuple[int, int, int]]
) -> torch.Tensor:
    """``y`` with ``deltas[k]`` added to rows ``pieces[k]``; other rows unchanged."""
    if len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][2] == y.shape[0]:
        return y + deltas[0]
    parts, cursor = [], 0
    for (_, start, stop), delta in zip(pieces, deltas, strict=True):
        if start > cursor:
            parts.append(y[cursor:start])
        parts.append(y[start:stop] + delta)
        cursor = stop
    if cursor < y.shape[0]:
        parts.append(y[cursor:])
    return torch.cat(parts)


def _call(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    table: tuple[Any, ...],
    rank_offsets: Any,
    drop: Any,
) -> torch.Tensor:
    _, seg_starts, ranks, scales, drops, _ = table
    return fn(
        x,
        weight,
        bias,
        a_cat,
        b_cat,  # a transposed view of a contiguous Bᵀ: the kernels' native layout
        seg_starts,
        rank_offsets,
        ranks,
        scales,
        drops,
        drop,
    )


@functools.lru_cache(maxsize=256)
def _keys_and_rows(
    keyed: tuple[tuple[int, int, int] | None, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per table entry ``(seed, step, first row)`` (None: no dropout) -> (keys, rows); shared by
    every layer of a forward with the same slots."""
    keys = tuple(0 if k is None else dropout_key(k[0], k[1]) for k in keyed)
    return keys, tuple(0 if k is None else k[2] for k in keyed)


def dropout_key(seed: int, step: int) -> int:
    """Philox key of one adapter's optimizer step: the same in every module, pack and device."""
    return mix(seed, step)


def _slot_table(
    layer: Any, pieces: Sequence[tuple[int, int, int]], per_row: int
) -> tuple[Any, ...]:
    """``(slots, seg_starts, ranks, scales, dropout_p, first rows)`` of the kernel call."""
    order = layer.slots
    where = {s: k for k, s in enumerate(order)}
    ordered = all(where[a[0]] < where[b[0]] for a, b in itertools.pairwise(pieces))
    entries: list[tuple[int | None, int, int]] = []
    cursor, k = pieces[0][1], 0
    for slot in order if ordered else [p[0] for p in pieces]:
        if k < len(pieces) and pieces[k][0] == slot:
            _, start, stop = pieces[k]
            if start > cursor:
                entries.append((None, cursor, start))
            entries.append((slot, start, stop))
            cursor, k = stop, k + 1
        else:  # a slot of this layer without rows in this forward: an empty segment
            entries.append((slot, cursor, cursor))
    specs = [layer.specs[s] if s is not None else None for s, _, _ in entries]
    return (
        tuple(s for s, _, _ in entries),
        tuple(r * per_row for r in [entries[0][1], *(stop for _, _, stop in entries)]),
        tuple(sp.rank if sp else 1 for sp in specs),
        tuple(sp.scale if sp else 0.0 for sp in specs),
        tuple(
            sp.dropout if sp and layer.training and stop > start else 0.0
            for sp, (_, start, stop) in zip(specs, entries, strict=True)
        ),
        tuple(start for _, start, _ in entries),
    )


__all__ = [
    "KERNEL_BACKEND",
    "RANK_ALIGN",
    "add_rows",
    "fused_forward",
    "kernel",
    "reference_deltas",
    "reference_forward",
    "set_kernel_backend",
]
