"""PackedAdamW across ranks: gradients summed where they are partial, norms over all shards.

Each rank's :class:`~plora.engine.packed_optim.PackedAdamW` holds the packed factors of its
own layers (pipeline stage) and its own shards (tensor parallelism); the adapters are not
sharded over data-parallel ranks (they are a few per cent of the base: see
:mod:`plora.parallel.fsdp`). Before the AdamW step:

- data parallel (``dp_group``): every gradient buffer is all-reduced (sum). The loss each rank
  backpropagates is its rows' share ``Σ_{t ∈ rank} CE_t / N_i`` with ``N_i`` the adapter's
  whole-batch target count, so the sum is the full batch's gradient (not a mean over ranks).
- tensor parallel (``tp_group``): the partial factor gradients (``∂A`` of column-wise layers,
  ``∂Bt`` of row-wise ones, :mod:`plora.parallel.tp`) are all-reduced (sum).

Then each slot's gradient norm (for clipping and metrics) is the norm over all of its
shards and stages::

    ‖g‖_i² = Σ_{pp ranks} Σ_{tp ranks} Σ_rows w_row · ‖g_row‖²,
    w_row = 1 for a TP-sharded factor, 1 / T for a TP-replicated one (counted once over T ranks)

(``T`` a power of two: the weights are exact in binary). The per-slot sums are float64 and
all-reduced over TP then PP; all ranks then take identical steps on identical replicas.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from plora.engine.lora import PackedLoRALinear
from plora.engine.packed_optim import PackedAdamW
from plora.parallel.tp import TPStyle


def _partial_attr(layer: PackedLoRALinear) -> str | None:
    """The factor of ``layer`` whose gradient is a partial sum over TP ranks."""
    style = layer.tp_style
    if style is None:
        return None
    return "A" if style is TPStyle.COLWISE else "Bt"


def _replicated_attr(layer: PackedLoRALinear) -> str | None:
    """The factor of ``layer`` that every TP rank holds whole (the same one as partial)."""
    return _partial_attr(layer)


class ParallelPackedAdamW(PackedAdamW):
    """:class:`PackedAdamW` whose step first sums gradients over ``dp_group`` and the partial
    TP gradients over ``tp_group``, and whose per-slot norms cover every shard and stage.

    Args:
        layers: this rank's ``{name: PackedLoRALinear}``.
        dp_group: data-parallel group (FSDP ranks with the same TP/PP coordinates) or None.
        tp_group: tensor-parallel group or None.
        pp_group: pipeline group (one rank per stage) or None.
    """

    def __init__(
        self,
        layers: Mapping[str, PackedLoRALinear],
        *,
        dp_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
        **kwargs,
    ) -> None:
        super().__init__(layers, **kwargs)
        self.dp_group, self.tp_group, self.pp_group = dp_group, tp_group, pp_group

    def step(self, lrs: Mapping[int, float]) -> torch.Tensor:
        self.sync()
        self._bind_grads()
        if self.dp_group is not None:
            for g in self._groups:
                dist.all_reduce(g.grad, group=self.dp_group)
        if self.tp_group is not None:  # one bucket: the partial gradients of every layer
            parts = [m.grad for g in self._groups for m in g.members
                     if m.attr == _partial_attr(m.layer)]  # fmt: skip
            if parts:
                flat = torch.cat([p.reshape(-1) for p in parts])
                dist.all_reduce(flat, group=self.tp_group)
                for p, v in zip(parts, flat.split([p.numel() for p in parts]), strict=True):
                    p.copy_(v.view_as(p))
        return super().step(lrs)

    def _slot_norm_sq(self) -> torch.Tensor:
        tp = 1 if self.tp_group is None else dist.get_world_size(self.tp_group)
        parts = []
        for g in self._groups:
            sq = torch.linalg.vector_norm(g.grad, dim=1).double().square()
            for m in g.members:
                if tp > 1 and m.attr == _replicated_attr(m.layer):
                    rows = slice(m.start, m.start + m.param.shape[0])
                    sq[rows] = sq[rows] / tp
            parts.append(sq)
        assert self._by_slot is not None  # built with the groups
        order, offsets = self._by_slot
        sq = torch.segment_reduce(
            torch.cat(parts).index_select(0, order), "sum", offsets=offsets, unsafe=True
        )
        n = sq.shape[0]
        for group in (self.tp_group, self.pp_group):
            if group is None:
                continue
            width = torch.tensor([n], dtype=torch.long, device=sq.device)
            dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
            full = sq.new_zeros(int(width))
            full[:n] = sq
            dist.all_reduce(full, group=group)
            sq = full[:n]
        return sq


__all__ = ["ParallelPackedAdamW"]
