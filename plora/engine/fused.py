"""The one bridge from :class:`~plora.engine.lora.PackedLoRALinear` to ``plora.kernels``.

On CUDA in bf16/fp16 (autocast or half weights), when ``plora.kernels.packed_lora_linear``
(Triton) is importable, a packed layer's
whole output ``y = x·Wᵀ + b + Σ_i s_i·(drop_i(x_i)·A_iᵀ)·B_iᵀ`` is one fused call over the
rank-concatenated factors (ranks zero-padded to :data:`RANK_ALIGN`) and a token segment table.
Everything else -- CPU, float32 on CUDA (the exactness mode), or no Triton -- runs the torch
reference in :mod:`plora.engine.lora`.
"""

from __future__ import annotations

import math

import torch

#: Ranks are zero-padded to a multiple of this in the concatenated (kernel) layout.
RANK_ALIGN = 16

#: ``"auto"``: fused kernels on CUDA when ``plora.kernels`` provides them; ``"torch"``: never.
KERNEL_BACKEND = {"mode": "auto"}
_CACHE: list = []


def set_kernel_backend(mode: str) -> None:
    """Choose ``"auto"`` (kernels on CUDA when available) or ``"torch"`` (reference only)."""
    if mode not in ("auto", "torch"):
        raise ValueError(f"kernel backend {mode!r}: use 'auto' or 'torch'")
    KERNEL_BACKEND["mode"] = mode


def kernel():
    """``plora.kernels.packed_lora_linear`` if usable, else None (the torch path)."""
    if KERNEL_BACKEND["mode"] == "torch":
        return None
    if not _CACHE:
        try:
            from plora import kernels

            _CACHE.append(kernels.packed_lora_linear)
        except (ImportError, AttributeError):
            _CACHE.append(None)
    return _CACHE[0]


def fused_forward(fn, layer, x, pieces, *, seed: int) -> torch.Tensor:
    """One fused call ``y = base(x) + Σ_i delta_i`` over all rows.

    Rows between pieces (slots without factors here) become a filler slot of rank 1 and scale
    0 (one zero block of ``RANK_ALIGN`` rows), so the segment table is gap-free. Dropout runs
    inside the kernel from a Philox seed keyed by (step nonce, module key): deterministic under
    recomputation, statistically the same as the CPU path's keyed masks.
    """
    slots: list[int | None] = []
    seg_rows = [pieces[0][1]]
    for slot, start, stop in pieces:
        if start > seg_rows[-1]:
            slots.append(None)
            seg_rows.append(start)
        slots.append(slot)
        seg_rows.append(stop)
    a_cat, b_cat, rank_offsets = layer.packed(slots)
    specs = [layer.specs[s] if s is not None else None for s in slots]
    ranks = [sp.rank if sp else 1 for sp in specs]
    scales = [sp.scale if sp else 0.0 for sp in specs]
    drops = [sp.dropout if sp and layer.training else 0.0 for sp in specs]
    per_row = math.prod(x.shape[1:-1])
    autocast = torch.is_autocast_enabled(x.device.type)
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    bias = layer.base_layer.bias
    return fn(
        x.to(dtype),
        layer.base_layer.weight.to(dtype),
        None if bias is None else bias.to(dtype),
        a_cat.to(dtype),
        b_cat.to(dtype),  # a transposed view of a contiguous Bᵀ: the kernels' native layout
        [r * per_row for r in seg_rows],
        rank_offsets,
        ranks,
        scales,
        drops,
        seed,
    )


__all__ = ["KERNEL_BACKEND", "RANK_ALIGN", "fused_forward", "kernel", "set_kernel_backend"]
