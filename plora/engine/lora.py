"""Packed multi-LoRA linear layers: many adapters on one frozen base linear.

A :class:`PackedLoRALinear` wraps a frozen ``nn.Linear`` ``W`` (out x in) and holds the LoRA
factors of every *slot* that targets it. For a packed input ``x`` of shape ``(R, S, in)`` whose
rows ``[start_i, stop_i)`` belong to slot ``i`` (a segment table, rows of a slot contiguous)::

    y[rows_i] = x[rows_i] @ Wᵀ + b  +  s_i · (dropout_i(x[rows_i]) @ A_iᵀ) @ B_iᵀ

with ``A_i`` (r_i x in), ``B_i`` (out x r_i), ``s_i = alpha_i / r_i`` (``alpha_i / sqrt(r_i)``
for rsLoRA). Rows of slots that do not target this module get the base output only. This is
PEFT's ``result + lora_B(lora_A(dropout(x))) * scaling`` evaluated per segment.

Storage. Per layer, two fp32 parameters hold every slot: ``A`` (Σ r_pad x in) and ``Bt``
(Σ r_pad x out, i.e. ``B`` stored transposed), slots stacked in ascending slot order, each rank
zero-padded to a multiple of :data:`RANK_ALIGN` -- the kernels' rank-concatenated layout, so the
fused path passes the parameters themselves and its weight gradients land in them without a
copy. Pad rows of ``A`` and pad columns of ``B`` start at zero and get zero gradient (slot ``i``
only reads its first ``r_i`` rows), so AdamW keeps them at zero. Adding or removing a slot
(between steps) reallocates both and bumps :attr:`PackedLoRALinear.version`;
:class:`plora.engine.packed_optim.PackedAdamW` then moves its state rows along.
:meth:`PackedLoRALinear.factors` gives one slot's ``(A_i, B_i)`` as views (export, state dicts).

Routing. The segment table is set per step with :func:`plora.engine.adapters.packed_segments`;
:func:`~plora.engine.adapters.use_slot` applies one slot to all rows (evaluation, export checks)
and :func:`~plora.engine.adapters.base_only` none. Putting layers into a model and adapters into
slots is :mod:`plora.engine.adapters`. Routing is
stored on the modules (not a context variable) so activation-checkpoint recomputation during
backward sees it: run backward inside the context.

Dropout. Masks are keyed, not drawn from the global RNG: token ``s`` of row ``j`` of an adapter's
optimizer step ``t`` at module ``m`` is drawn from Philox under the key ``mix(seed, t)`` at counter
``(s, j, m)`` (:func:`dropout_mask`; the one mask of :mod:`plora.kernels`, which the fused kernels
regenerate on the GPU and the kernels' torch reference draws elsewhere). Masks therefore do not depend on
the pack, on micro-batching, on the padded length, on a row-wise TP split or on
activation-checkpoint recomputation; a CPU and a GPU run drop the same activations; and a PEFT
model given the same masks trains identically.

Init. ``A_i`` is kaiming-uniform(a=√5) (what PEFT and ``nn.Linear`` use: U(-1/√in, 1/√in)) from a
CPU generator seeded by ``(config seed, module key)``; ``B_i`` is zero. Values are thus the same
on every device and in every pack; they follow PEFT's distribution but not PEFT's global-RNG
draw order, so equivalence tests copy the initial packed weights into the PEFT reference.

Dtypes. Factors are fp32 master weights. Under autocast the matmuls run in the autocast dtype;
without autocast ``x`` is cast to fp32 for the LoRA path and the delta cast back to ``y``'s dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from plora.kernels.reference import dropout_mask as philox_mask
from torch import nn

from plora.config import PROJECTIONS
from plora.engine.fused import (
    RANK_ALIGN,
    dropout_key,
    fused_forward,
    kernel,
    reference_forward,
    set_kernel_backend,
)
from plora.engine.rng import mix


def module_key(layer: int, projection: str) -> int:
    """Stable integer id of projection ``projection`` of decoder layer ``layer``."""
    return layer * len(PROJECTIONS) + PROJECTIONS.index(projection)


def dropout_mask(
    *,
    seed: int,
    step: int,
    row: int,
    key: int,
    shape: Sequence[int],
    p: float,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The dropout multiplier of one row: ``1{u >= p} / (1 - p)`` with ``u`` uniform in [0, 1).

    Args:
        seed: the config's seed.
        step: the adapter's own optimizer step (0-based).
        row: the row's index within the adapter's batch of that step.
        key: :func:`module_key` of the module.
        shape: ``(..., in)`` of the row (``(S, in)`` for a sequence of ``S`` tokens).
        p: drop probability in [0, 1).

    Token ``s`` of the row draws from counter ``(s, row, key)``, so a shorter padded length
    gives a prefix of the same mask.
    """
    tokens = math.prod(shape[:-1])
    keep = philox_mask(
        dropout_key(seed, step), (tokens, shape[-1]), p, device, row0=row, row_len=max(tokens, 1),
        word=key,
    )  # fmt: skip
    mask: torch.Tensor = (keep.to(dtype) * (1.0 / (1.0 - p))).reshape(tuple(shape))
    return mask


@dataclass(frozen=True, slots=True)
class SlotSpec:
    """Static description of one slot in one layer."""

    rank: int
    scale: float
    dropout: float
    seed: int


@dataclass(frozen=True, slots=True)
class Routing:
    """Which rows go through which slot in the next forward(s).

    ``segments``: ``(slot, start, stop)`` row ranges (``None`` with ``single`` set means one
    slot for all rows; both unset means base model only). ``dropout_keys[slot] = (step,
    row_offset)``: the adapter's optimizer step and the index, within that step's batch, of the
    segment's first row.
    """

    segments: tuple[tuple[int, int, int], ...] | None = None
    single: int | None = None
    dropout_keys: Mapping[int, tuple[int, int]] = field(default_factory=dict)


#: Routing with no slot: the base model alone.
BASE_ONLY = Routing()


def _padded(rank: int) -> int:
    """``rank`` rounded up to a multiple of :data:`RANK_ALIGN`."""
    return -(-rank // RANK_ALIGN) * RANK_ALIGN


class PackedLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus the LoRA factors of every slot that targets it.

    Args:
        base_layer: the frozen linear (weight ``(out, in)``, optional bias); kept as is.
        key: :func:`module_key` of this module (seeds init and dropout).

    Attributes:
        A: fp32 parameter ``(Σ r_pad, in)``: the slots' ``A_i`` stacked in ascending slot order,
            slot ``i`` in rows ``[o_i, o_i + r_i)`` of its block ``[o_i, o_i + r_pad_i)``.
        Bt: fp32 parameter ``(Σ r_pad, out)``: the ``B_iᵀ`` in the same rows.
        specs: ``{slot: SlotSpec}``.
        offsets: ``{slot: o_i}``.
        version: bumped whenever ``A``/``Bt`` are replaced (slots added or removed, the module
            moved); optimizers over these parameters re-sync on a new version.
        memo: per-version memo of host-side tables (gather indices, kernel slot tables);
            cleared with every new version.
        in_slice: under row-wise tensor parallelism (:mod:`plora.parallel.tp`), the columns of
            the full input this rank holds (``A`` then has those columns only; init and dropout
            masks are drawn at full width and sliced); ``None`` otherwise.

    Shapes: input ``(R, ..., in)`` (rows first), output ``(R, ..., out)``.
    """

    def __init__(self, base_layer: nn.Linear, *, key: int) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.key = key
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        device = base_layer.weight.device
        self.A = nn.Parameter(torch.zeros(0, self.in_features, device=device), False)
        self.Bt = nn.Parameter(torch.zeros(0, self.out_features, device=device), False)
        self.specs: dict[int, SlotSpec] = {}
        self.offsets: dict[int, int] = {}
        self.version = 0
        self.routing: Routing | None = None
        self._order: tuple[int, ...] = ()
        self._splits: list[int] = []
        self.memo: dict[Any, Any] = {}
        self.in_slice: slice | None = None
        # set by plora.parallel.tp.apply_tp: the base's split (colwise/rowwise) and its group
        self.tp_style: Any = None
        self.tp_group: Any = None
        base_layer.requires_grad_(False)

    # ------------------------------------------------------------------ slots
    @property
    def slots(self) -> list[int]:
        """Slots that have factors in this layer, ascending (their row order)."""
        return list(self._order)

    @property
    def rows(self) -> int:
        """``Σ r_pad``: rows of ``A`` and ``Bt``."""
        return self.A.shape[0]

    def add_slot(
        self,
        slot: int,
        *,
        rank: int,
        scale: float,
        dropout: float = 0.0,
        seed: int = 0,
    ) -> None:
        """Create slot ``slot``'s factors: A kaiming-uniform from ``(seed, key)``, B zeros.

        Reallocates ``A`` and ``Bt`` (new parameters, old rows copied): call between steps.
        """
        self.add_slots({slot: SlotSpec(rank=rank, scale=float(scale), dropout=dropout, seed=seed)})

    def add_slots(self, new: Mapping[int, SlotSpec]) -> None:
        """:meth:`add_slot` for several slots at once: one reallocation of ``A`` and ``Bt`` and
        one host-to-device copy of the new ``A`` rows for all of them (a pack's start adds a
        dozen adapters to every layer: one at a time that was a synchronizing copy and two
        reallocations per adapter and layer)."""
        for slot in new:
            if slot in self.specs:
                raise ValueError(f"slot {slot} already present in layer {self.key}")
        if not new:
            return
        old_a, old_bt, old_offsets = self.A.detach(), self.Bt.detach(), dict(self.offsets)
        # the new slots' A blocks (pad rows zero), one after another, on the host
        host = torch.zeros(sum(_padded(spec.rank) for spec in new.values()), old_a.shape[1])
        at: dict[int, int] = {}
        row = 0
        for slot, spec in new.items():
            at[slot] = row
            host[row : row + spec.rank] = self._init_a(spec)
            row += _padded(spec.rank)
        self.specs.update(new)
        order = sorted(self.specs)
        rows = sum(_padded(self.specs[s].rank) for s in order)
        with torch.no_grad():
            fresh = host.to(old_a.device)
            a, bt = old_a.new_zeros(rows, old_a.shape[1]), old_bt.new_zeros(rows, old_bt.shape[1])
            row = 0
            for slot in order:
                pad = _padded(self.specs[slot].rank)
                if slot in new:
                    a[row : row + pad] = fresh[at[slot] : at[slot] + pad]
                else:
                    src = slice(old_offsets[slot], old_offsets[slot] + pad)
                    a[row : row + pad], bt[row : row + pad] = old_a[src], old_bt[src]
                row += pad
            self._replace(a, bt)

    def _init_a(self, spec: SlotSpec) -> torch.Tensor:
        """A fresh slot's ``A (rank, in)``: kaiming-uniform from its seed and this module's key,
        drawn at full width (this rank's columns under row-wise TP)."""
        gen = torch.Generator().manual_seed(mix(spec.seed, self.key, 0x10A))
        a = torch.empty(spec.rank, self.in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        return a if self.in_slice is None else a[:, self.in_slice]

    def remove_slot(self, slot: int) -> None:
        """Drop slot ``slot``'s factors (no-op when absent); reallocates ``A`` and ``Bt``."""
        if slot not in self.specs:
            return
        start, stop = self.offsets[slot], self.offsets[slot] + _padded(self.specs.pop(slot).rank)
        with torch.no_grad():
            a, bt = self.A.detach(), self.Bt.detach()
            self._replace(torch.cat([a[:start], a[stop:]]), torch.cat([bt[:start], bt[stop:]]))

    def _replace(self, a: torch.Tensor, bt: torch.Tensor) -> None:
        trainable = bool(self.specs)
        self.A = nn.Parameter(a, requires_grad=trainable)
        self.Bt = nn.Parameter(bt, requires_grad=trainable)
        self._order = tuple(sorted(self.specs))
        self.offsets, self._splits, row = {}, [], 0
        for s in self._order:
            rank = self.specs[s].rank
            self.offsets[s] = row
            self._splits += [rank, _padded(rank) - rank]
            row += _padded(rank)
        self._changed()

    def _changed(self) -> None:
        self.version += 1
        self.memo.clear()

    def _apply(
        self, fn: Callable[..., Any], recurse: bool = True
    ) -> PackedLoRALinear:  # .to() / .cuda() / .float() replace the parameters
        self._changed()
        applied: PackedLoRALinear = super()._apply(fn, recurse)
        return applied

    def block(self, slot: int) -> slice:
        """Rows ``[o_i, o_i + r_i)`` of ``slot`` in ``A`` / ``Bt`` (and their gradients)."""
        start = self.offsets[slot]
        return slice(start, start + self.specs[slot].rank)

    def factors(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A_i, B_i)`` of ``slot``: views ``(r, in)`` and ``(out, r)`` of the packed parameters.

        For export, state dicts and tests; training goes through ``A`` and ``Bt``.
        """
        rows = self.block(slot)
        return self.A[rows], self.Bt[rows].t()

    def split_factors(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``{slot: (A_i (r, in), B_iᵀ (r, out))}``: one differentiable split per parameter.

        The backward of a split is one concatenation, so a forward that uses several slots
        produces one gradient per packed parameter (pad rows zero), not one per slot.
        """
        a_parts = self.A.split(self._splits)
        bt_parts = self.Bt.split(self._splits)
        return {s: (a_parts[2 * k], bt_parts[2 * k]) for k, s in enumerate(self._order)}

    def packed(self, slots: Sequence[int | None]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Rank-concatenated, zero-padded factors of ``slots`` (differentiable).

        When ``slots`` are this layer's slots in row order (:attr:`slots`), these are the
        parameters themselves (``A`` and ``Btᵀ``, no copy). Otherwise one gather: a ``None``
        entry is a filler (a zero block of ``RANK_ALIGN`` rows), the others their padded blocks.

        Returns:
            ``A`` (Σ r_pad, in), ``B`` (out, Σ r_pad) and the padded offsets (len + 1), where
            ``r_pad = ceil(r / RANK_ALIGN) · RANK_ALIGN``; padding rows/cols are zeros. ``B`` is
            the transpose of a contiguous ``Bᵀ`` (strides ``(1, out)``).
        """
        slots = tuple(slots)
        key = ("gather", slots, self.A.device)
        plan = self.memo.get(key)
        if plan is None:
            plan = self.memo[key] = self._gather_plan(slots)
        offsets, index = plan
        if index is None:
            return self.A, self.Bt.t(), list(offsets)
        src, dst = index
        out = []
        for p in (self.A, self.Bt):
            rows = p.index_select(0, src)
            if dst is not None:
                rows = p.new_zeros(offsets[-1], p.shape[1]).index_copy(0, dst, rows)
            out.append(rows)
        return out[0], out[1].t(), list(offsets)

    def _gather_plan(
        self, slots: tuple[int | None, ...]
    ) -> tuple[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None] | None]:
        """Offsets and (source rows, destination rows or None) of :meth:`packed`'s gather."""
        offsets, src, dst = [0], list[int](), list[int]()
        for slot in slots:
            size = RANK_ALIGN if slot is None else _padded(self.specs[slot].rank)
            if slot is not None:
                src.extend(range(self.offsets[slot], self.offsets[slot] + size))
                dst.extend(range(offsets[-1], offsets[-1] + size))
            offsets.append(offsets[-1] + size)
        if slots == self._order:
            return tuple(offsets), None
        device = self.A.device
        src_t = torch.tensor(src, dtype=torch.long, device=device)
        dst_t = None if None not in slots else torch.tensor(dst, dtype=torch.long, device=device)
        return tuple(offsets), (src_t, dst_t)

    # ---------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.routing
        if routing is None:
            raise RuntimeError(
                "PackedLoRALinear called without routing; wrap the forward in "
                "packed_segments(...), use_slot(...) or base_only(...)"
            )
        pieces = self._pieces(routing, x.shape[0])
        if not pieces:
            y: torch.Tensor = self.base_layer(x)
            return y
        fn = fused_op(x)
        if fn is not None:
            return fused_forward(fn, self, x, pieces, routing)
        return reference_forward(self, x, pieces, routing)

    def _pieces(self, routing: Routing, rows: int) -> list[tuple[int, int, int]]:
        """``(slot, start, stop)`` row ranges of the slots present in this layer."""
        if routing.segments is None:
            if routing.single is None or routing.single not in self.specs:
                return []
            return [(routing.single, 0, rows)]
        return [seg for seg in routing.segments if seg[0] in self.specs]

    def extra_repr(self) -> str:
        ranks = {s: spec.rank for s, spec in sorted(self.specs.items())}
        return f"in={self.in_features}, out={self.out_features}, key={self.key}, slots={ranks}"


#: Compute dtypes that take the fused kernels; float32 on CUDA runs the exact torch path.
_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def fused_op(x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The fused kernel for ``x`` (CUDA, bf16/fp16 compute), or None: the torch path."""
    return kernel() if x.is_cuda and _compute_dtype(x) in _FUSED_DTYPES else None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


__all__ = [
    "BASE_ONLY",
    "RANK_ALIGN",
    "PackedLoRALinear",
    "Routing",
    "SlotSpec",
    "dropout_key",
    "dropout_mask",
    "module_key",
    "set_kernel_backend",
]
