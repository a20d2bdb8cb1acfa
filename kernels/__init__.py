"""Packed multi-LoRA linear: Triton kernels (forward and backward) and their pure-torch twin.

Installed as ``plora.kernels`` (never import it as a top-level ``kernels``).

Math
----
Tokens are flattened to ``x: (N, in)``. Slot ``i`` owns the contiguous token segment
``[seg_starts[i], seg_starts[i+1])``; tokens outside ``[seg_starts[0], seg_starts[-1])`` get the
frozen linear only. With ``r_i`` the true rank, ``o_i = rank_offsets[i]``,
``A_i = lora_a[o_i : o_i + r_i]`` (r_i, in) and ``B_i = lora_b[:, o_i : o_i + r_i]`` (out, r_i)::

    y   = x·Wᵀ + bias + Σ_i  s_i · (drop_i(x_i)·A_iᵀ)·B_iᵀ            (rows of segment i)
    dX  = dY·W + Σ_i  m_i/(1-p_i) ⊙ (s_i · dY_i·B_i·A_i)
    dA_i = s_i · (dY_i·B_i)ᵀ · drop_i(x_i)          dB_i = s_i · dY_iᵀ · (drop_i(x_i)·A_iᵀ)

``drop_i(x_i) = x_i ⊙ m_i / (1 - p_i)`` with the keep mask ``m_i`` regenerated from counter-based
Philox4x32-10 (Triton's ``tl.philox``, four words per call): element ``(t, c)`` of segment ``i``
(``t`` counted from the segment start) is kept iff ``u >= p_i``, where ``u`` is word
``(col_base + c) % 4`` of Philox(key = key_i, counter = (s·G + (col_base + c)//4, row0_i + t //
row_len, word, 0)), ``s = t % row_len``, ``G = ⌈in_total/4⌉``, mapped to [0, 1) as ``tl.rand``
does (:class:`DropoutKeys` holds the keys and the counter's parts). So a mask belongs to an
adapter's rows -- the same whatever pack, padded length or row-wise TP split it runs in.
No mask is stored; the backward regenerates it. :func:`dropout_mask` reproduces it in pure torch
on any device (an independent Philox port, checked against Random123's known answers and the
kernels).

Public API
----------
``packed_lora_linear(x, weight, bias, lora_a, lora_b, seg_starts, rank_offsets, ranks, scales,
dropout_p, dropout_seed, *, fused=None, backend="auto") -> y``
    Autograd-aware. Gradients flow to ``x``, ``lora_a``, ``lora_b`` (and to ``weight``/``bias``
    only if they require grad; a frozen base never computes ``dW``).

``packed_lora_delta(x, lora_a, lora_b, seg_starts, rank_offsets, ranks, scales, dropout_p,
dropout_seed, *, backend="auto") -> delta``
    The LoRA term alone, ``delta = y - (x·Wᵀ + bias)``, zero on rows outside every segment, for
    callers that run the base GEMM themselves.

``dropout_mask(key, shape, p, device, *, row0, row_len, word, col_base, in_total) ->
BoolTensor[shape]`` — the keep mask of one slot
    (``shape = (tokens of the segment, in)``).

``packed_lora_reference(...)`` — same arguments as ``packed_lora_linear`` (no ``fused``), a
    loop over slots in plain torch (autograd by torch); the CPU path and the tests' oracle.

Arguments and layouts
---------------------
x:            ``(..., in)`` float16 / bfloat16 / float32; leading dims are flattened to ``N``
              tokens in row-major order (a packed batch ``(R, S, in)`` gives token ``r·S + s``).
weight:       ``(out, in)``, same dtype as ``x``, frozen (the nn.Linear layout).
bias:         ``(out,)`` or ``None``.
lora_a:       ``(R_tot, in)``: every slot's A stacked along rank; slot ``i`` occupies rows
              ``[rank_offsets[i], rank_offsets[i+1])``, a block of ``rp_i = ceil16(r_i)`` rows
              (ranks padded to a multiple of 16; only the first ``r_i`` rows are used, the pad
              rows get zero gradient).
lora_b:       ``(out, R_tot)``: the same slots along columns.
seg_starts:   ``n_slots + 1`` non-decreasing token offsets (int), ``seg_starts[-1] <= N``.
              Empty segments (0 tokens) are fine.
rank_offsets: ``n_slots + 1`` ints, ``rank_offsets[0] == 0``, ``rank_offsets[-1] == R_tot``,
              each step a multiple of 16 and ``>= ranks[i]``.
ranks:        ``n_slots`` true ranks (1..256, e.g. 8, 24, 64, 128).
scales:       ``n_slots`` floats ``s_i`` (alpha/r, or alpha/sqrt(r) for rsLoRA).
dropout_p:    ``n_slots`` floats in ``[0, 1)`` (or one float for every slot).
dropout_seed: a :class:`DropoutKeys` (one key per slot and the counter's parts; what the engine
              passes), or one int from which every slot gets its key (:func:`slot_key`): give
              every layer and step its own (equal seeds, equal masks).
fused:        how the base GEMM and the LoRA term meet (``ops.Mode``, measured per GPU and shape
              in ``kernels/tuned.json``): ``None`` takes the fastest mode of the nearest tuned
              shape (packs with dropout use the backward rows measured with dropout);
              ``True`` forces FUSED (the LoRA products accumulate inside a Triton base GEMM tile,
              and dX inside the ``dY·W`` GEMM; on Hopper-class GPUs a persistent TMA kernel when
              every stride is 16-byte aligned, ``PLORA_KERNELS_TMA=0`` to opt out); ``False``
              takes the faster unfused mode: EPILOGUE (LoRA kernel writes its term, cuBLAS ``addmm`` adds the base) or
              ACCUMULATE (cuBLAS first, the LoRA kernel adds in place).
backend:      ``"auto"`` (Triton on CUDA tensors, torch reference elsewhere), ``"triton"``
              (also on CPU under ``TRITON_INTERPRET=1``, for tests) or ``"torch"``.

The metadata arguments (``seg_starts`` .. ``dropout_p``) are host values: Python sequences or
CPU tensors. They are packed into one small device tensor per distinct value (cached), so
passing the same table to every layer of a step costs one copy. CUDA tensors are accepted but
read back to the host (a device sync).

Dtype rules: the Triton path takes float16 / bfloat16 / float32 ``x`` and computes in
``x.dtype`` (weights and factors are cast to it; autograd casts their gradients back), with
float32 accumulation (float32 dots use TF32 on the GPU); ``y``/``dX`` in ``x.dtype``; the intermediate
``S = s·drop(x)·Aᵀ`` (saved for the backward, ``N × max rp`` elements) in ``x.dtype``;
``dA``/``dB`` in the parameters' dtype and layout (a ``lora_b`` stored as a contiguous ``Bᵀ``
gets its gradient stored that way). Weight gradients use no atomics: one program owns one
slot's tile and reduces over that slot's tokens in a fixed order, so results are bitwise
repeatable.

Beside the packed linear: :func:`plora.kernels.cross_entropy.cross_entropy_`, the packed loss's
cross-entropy in one pass per row with the gradient written over the logits (CUDA;
``PLORA_KERNELS_CE=0`` keeps torch's, its twin
:func:`~plora.kernels.reference.cross_entropy_reference`).
"""

from __future__ import annotations

from .errors import PackedLoRAError
from .meta import DropoutKeys, slot_key

__all__ = [
    "DropoutKeys",
    "PackedLoRAError",
    "dropout_mask",
    "packed_lora_delta",
    "packed_lora_linear",
    "packed_lora_reference",
    "slot_key",
]


def __getattr__(name: str):  # lazy: importing plora.kernels must not import triton
    if name in ("dropout_mask", "packed_lora_reference"):
        from . import reference

        return getattr(reference, name)
    if name in ("packed_lora_linear", "packed_lora_delta"):
        from . import autograd

        return getattr(autograd, name)
    raise AttributeError(f"module 'plora.kernels' has no attribute {name!r}")
