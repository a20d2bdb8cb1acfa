"""PackedAdamW: one AdamW step over every slot of every packed layer, in a handful of launches.

Math. For each slot ``i`` (an adapter) with learning rate ``η_i`` (from its own schedule),
weight decay ``λ_i``, its own step count ``t_i`` and betas ``(β1, β2)``, eps ``ε``, every row of
the slot's parameters follows ``torch.optim.AdamW`` (decoupled weight decay), evaluated in the
same order and float32 roundings as torch's single-tensor implementation::

    clip:  g ← g · min(1, c_i / (‖g‖_i + 1e-6))         when the slot has max_grad_norm c_i
    p ← p · (1 - η_i λ_i)
    m ← lerp(m, g, 1 - β1)
    v ← v · β2 + ((1 - β2) · g) · g
    p ← p + (-η_i / (1 - β1^t_i)) · m / (sqrt(v) / sqrt(1 - β2^t_i) + ε)

``‖g‖_i`` is the L2 norm of all of slot ``i``'s gradients (every layer, A and B), before
clipping, and is returned per slot: row norms squared and summed in float64 per slot (one
deterministic segmented reduction, no atomics), equal to ``clip_grad_norm_``'s up to the last
float32 bit; the clip factor is then computed in ``clip_grad_norm_``'s float32 operations. Rows of
slots that take no step (finished, stopped, not registered) are frozen: clip factor 0, and
factors that leave ``p``, ``m`` and ``v`` bitwise unchanged. Pad rows (ranks padded to
``RANK_ALIGN``) have zero parameters and zero gradients, and stay zero.

Layout. The optimizer adopts the layers' packed parameters (``A`` and ``Bt`` of each
:class:`~plora.engine.lora.PackedLoRALinear`) into a few 2-D buffers, one per row width (a
*group*: e.g. hidden, intermediate and KV widths of a Qwen2 model). Each layer's parameter and
its ``.grad`` become row-range views of their group's buffers, so autograd accumulates straight
into them, and the moments live in matching buffers. Every row belongs to one slot
(``row_slot``). A step builds one per-slot table on the host (O(slots) floats, one small
host-to-device copy), gathers it per row, and runs ~12 tensor ops per group, whatever the
number of layers and slots; its one temporary is the size of the largest group.

When layers gain or lose slots (their ``version`` changes) the next :meth:`PackedAdamW.sync`
re-adopts them and carries each live slot's moment rows over; a slot added to the optimizer
starts from zero moments and step 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plora.engine.adapters import peft_key
from plora.engine.lora import RANK_ALIGN, PackedLoRALinear
from plora.engine.optim import ADAM_BETAS, ADAM_EPS

# Columns of the per-slot host table; on the device, column _COEF (the clip factor) replaces
# the last three.
_DECAY, _W1, _B2, _BC2, _NEG_STEP, _MAX_NORM, _CLIP, _ACTIVE = range(8)
_COEF = _MAX_NORM
#: A frozen slot's row of the table: no decay, no moment update, no parameter step.
_FROZEN = (1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0)
#: ``clip_grad_norm_``'s guard against division by zero.
_CLIP_EPS = 1e-6


@dataclass(slots=True)
class _Slot:
    weight_decay: float
    max_grad_norm: float | None
    generation: int
    step: int = 0


@dataclass(slots=True)
class _Member:
    """One packed parameter inside a group: rows ``[start, start + rows)``."""

    name: str
    layer: PackedLoRALinear
    attr: str
    param: torch.nn.Parameter
    grad: torch.Tensor
    start: int
    blocks: tuple[tuple[int, int | None, int, int], ...]
    """``(slot, generation or None, row offset in the parameter, padded rows)``."""


@dataclass(slots=True)
class _Group:
    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    row_slot: torch.Tensor
    members: list[_Member]


class PackedAdamW:
    """AdamW with per-slot lr, weight decay, step count and gradient clipping over packed layers.

    Args:
        layers: ``{module name: PackedLoRALinear}`` (``plora.engine.adapters.packed_layers``).
        betas: ``(β1, β2)``, shared by every slot (transformers' defaults).
        eps: ``ε``.

    Use: :meth:`add_slot` when an adapter joins, :meth:`sync` before the forward (after slots
    changed), backward, then :meth:`step` with each stepping slot's lr; :meth:`remove_slot`
    when it stops training (its rows freeze).
    """

    def __init__(
        self,
        layers: Mapping[str, PackedLoRALinear],
        *,
        betas: tuple[float, float] = ADAM_BETAS,
        eps: float = ADAM_EPS,
    ) -> None:
        self.layers = dict(layers)
        self.betas = betas
        self.eps = eps
        self._slots: dict[int, _Slot] = {}
        self._generations = itertools.count()
        self._groups: list[_Group] = []
        self._versions: tuple[int, ...] | None = None
        self._n_ids = 0
        self._by_slot: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ slots
    @property
    def slots(self) -> list[int]:
        """Slots that take optimizer steps, ascending."""
        return sorted(self._slots)

    def add_slot(self, slot: int, *, weight_decay: float, max_grad_norm: float | None) -> None:
        """Register ``slot`` (its rows must exist in the layers by the next :meth:`sync`)."""
        if slot in self._slots:
            raise ValueError(f"slot {slot} is already in the optimizer")
        self._slots[slot] = _Slot(weight_decay, max_grad_norm, next(self._generations))
        self._versions = None  # its moment rows start from zero

    def remove_slot(self, slot: int) -> None:
        """Stop updating ``slot`` and forget its state (no-op when absent); its rows freeze."""
        self._slots.pop(slot, None)

    def step_count(self, slot: int) -> int:
        """Optimizer steps ``slot`` took."""
        return self._slots[slot].step

    # ----------------------------------------------------------------- layout
    def sync(self) -> None:
        """Adopt the layers' parameters if they changed since the last call (cheap otherwise)."""
        versions = tuple(layer.version for layer in self.layers.values())
        if versions != self._versions:
            self._rebuild()
            self._versions = versions

    def _rebuild(self) -> None:
        old_rows = {
            (m.name, m.attr, slot, gen): (gi, m.start + off)
            for gi, g in enumerate(self._groups)
            for m in g.members
            for slot, gen, off, _ in m.blocks
            if gen is not None
        }
        old_groups, self._groups = self._groups, []
        by_width: dict[int, list[tuple[str, PackedLoRALinear, str]]] = {}
        devices = set()
        for name, layer in self.layers.items():
            for attr in ("A", "Bt"):
                p = getattr(layer, attr)
                if p.shape[0]:
                    by_width.setdefault(p.shape[1], []).append((name, layer, attr))
                    devices.add(p.device)
        if len(devices) > 1:
            names = sorted(map(str, devices))
            raise ValueError(f"PackedAdamW: packed layers on several devices {names}; use one")
        n_ids = max(self._slots, default=-1) + 1
        for items in by_width.values():
            group, n = self._adopt(items, old_rows, old_groups)
            self._groups.append(group)
            n_ids = max(n_ids, n)
        self._n_ids = n_ids
        # All groups' rows sorted by slot (stable) and each slot's range in that order: the
        # per-slot sums of squares are one deterministic segmented reduction (no atomics).
        if self._groups:
            row_slot = torch.cat([g.row_slot for g in self._groups])
            counts = torch.bincount(row_slot, minlength=n_ids)
            offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
            self._by_slot = (torch.sort(row_slot, stable=True).indices, offsets)

    def _adopt(self, items: Sequence[Any], old_rows: Any, old_groups: Any) -> tuple[_Group, int]:
        """One group: a buffer for the parameters of ``items``, moments carried over by row."""
        params = [getattr(layer, attr) for _, layer, attr in items]
        buf = torch.cat([p.detach() for p in params])
        grad = torch.zeros_like(buf)
        members, row_slot, start = [], [], 0
        src: dict[int, list[int]] = {}
        dst: dict[int, list[int]] = {}
        for (name, layer, attr), p in zip(items, params, strict=True):
            blocks = []
            for slot in layer.slots:
                off = layer.offsets[slot]
                size = -(-layer.specs[slot].rank // RANK_ALIGN) * RANK_ALIGN
                st = self._slots.get(slot)
                gen = None if st is None else st.generation
                blocks.append((slot, gen, off, size))
                row_slot += [slot] * size
                found = old_rows.get((name, attr, slot, gen))
                if found is not None:
                    src.setdefault(found[0], []).extend(range(found[1], found[1] + size))
                    dst.setdefault(found[0], []).extend(range(start + off, start + off + size))
            rows = p.shape[0]
            if p.grad is not None:
                grad[start : start + rows].copy_(p.grad)
            members.append(
                _Member(name, layer, attr, p, grad[start : start + rows], start, tuple(blocks))
            )
            start += rows
        moments = [torch.zeros_like(buf), torch.zeros_like(buf)]
        for gi, rows in src.items():
            s = torch.tensor(rows, dtype=torch.long, device=buf.device)
            d = torch.tensor(dst[gi], dtype=torch.long, device=buf.device)
            old = old_groups[gi]
            moments[0].index_copy_(0, d, old.exp_avg.index_select(0, s))
            moments[1].index_copy_(0, d, old.exp_avg_sq.index_select(0, s))
        for m in members:
            m.param.data = buf[m.start : m.start + m.param.shape[0]]
            m.param.grad = m.grad
        row_slot_t = torch.tensor(row_slot, dtype=torch.long, device=buf.device)
        group = _Group(buf, grad, moments[0], moments[1], row_slot_t, members)
        return group, max(row_slot, default=-1) + 1

    def _bind_grads(self) -> None:
        """Point every parameter's ``.grad`` at its buffer view (someone may have reset it)."""
        for g in self._groups:
            for m in g.members:
                current = m.param.grad
                if current is not m.grad:
                    if current is None:
                        m.grad.zero_()
                    else:
                        m.grad.copy_(current)
                    m.param.grad = m.grad

    def zero_grad(self) -> None:
        """Zero every gradient (the buffers stay bound to the parameters)."""
        self.sync()
        for g in self._groups:
            g.grad.zero_()
        self._bind_grads()

    # ------------------------------------------------------------------- step
    def step(self, lrs: Mapping[int, float]) -> torch.Tensor:
        """One AdamW step of the slots in ``lrs`` (``{slot: lr}``); every other row is frozen.

        Consumes the gradients: they are zero afterwards.

        Returns:
            float32 ``(n,)`` on the parameters' device: entry ``slot`` is the slot's gradient
            L2 norm before clipping (no host sync; read it after the step's synchronize).
        """
        self.sync()
        if not self._groups:
            return torch.zeros(max(lrs, default=-1) + 1)
        host = self.slot_table(lrs)
        device = self._groups[0].param.device
        if device.type == "cuda":
            host = host.pin_memory()
        norms = self.apply(host.to(device, non_blocking=True))
        self.count_step(lrs)
        return norms

    def count_step(self, lrs: Mapping[int, float]) -> None:
        """Count one step of each slot in ``lrs`` (after :meth:`apply` of its table)."""
        for slot in lrs:
            self._slots[slot].step += 1

    def slot_table(self, lrs: Mapping[int, float]) -> torch.Tensor:
        """The host half of :meth:`step`: the per-slot factors of the next step of the slots in
        ``lrs``, float32 ``(n, 8)`` on the host, for :meth:`apply` (then :meth:`count_step`). A
        captured step copies them into its own buffer and replays :meth:`apply`
        (:mod:`plora.engine.graphed`)."""
        self.sync()
        unknown = sorted(set(lrs) - set(self._slots))
        if unknown:
            raise KeyError(f"slots {unknown} are not in the optimizer; add_slot them first")
        table = [_FROZEN] * self._n_ids
        b1, b2 = self.betas
        for slot, lr in lrs.items():
            st = self._slots[slot]
            t = st.step + 1
            bc1, bc2 = 1 - b1**t, 1 - b2**t
            max_norm = st.max_grad_norm
            table[slot] = (
                1 - lr * st.weight_decay, 1 - b1, b2, bc2**0.5, -(lr / bc1),
                0.0 if max_norm is None else max_norm, float(max_norm is not None), 1.0,
            )  # fmt: skip
        return torch.tensor(table, dtype=torch.float64).to(torch.float32).reshape(-1, 8)

    def apply(self, tab: torch.Tensor) -> torch.Tensor:
        """The device half of :meth:`step` with :meth:`slot_table`'s factors on the device:
        clip, update, zero the gradients; returns the slots' gradient norms. No host work but
        launches, so a CUDA graph may capture it."""
        self._bind_grads()
        norm = self._slot_norm_sq().sqrt().float()
        clip = ((norm + _CLIP_EPS).reciprocal() * tab[:, _MAX_NORM]).clamp(max=1.0)
        coef = torch.where(tab[:, _CLIP] > 0, clip, tab[:, _ACTIVE])
        per_slot = torch.cat([tab[:, :_COEF], coef[:, None]], dim=1)
        for g in self._groups:
            self._update(g, per_slot.index_select(0, g.row_slot))
        return norm

    def _slot_norm_sq(self) -> torch.Tensor:
        """float64 ``(n,)``: each slot's sum of squared gradients over this process's rows.

        Sharded optimizers (:mod:`plora.parallel.optim`) override this to add the other
        ranks' shares; keep the row-then-slot order (deterministic, no atomics).
        """
        row_norms = torch.cat([torch.linalg.vector_norm(g.grad, dim=1) for g in self._groups])
        assert self._by_slot is not None, "sync() builds the slot order"
        order, offsets = self._by_slot
        return torch.segment_reduce(
            row_norms.double().square().index_select(0, order), "sum", offsets=offsets, unsafe=True
        )

    def _update(self, g: _Group, f: torch.Tensor) -> None:
        """The AdamW update of one group with per-row factors ``f`` (rows, 6)."""
        p, grad, m, v = g.param, g.grad, g.exp_avg, g.exp_avg_sq
        grad.mul_(f[:, _COEF : _COEF + 1])  # clip factor (0 on frozen rows)
        p.mul_(f[:, _DECAY : _DECAY + 1])
        m.lerp_(grad, f[:, _W1 : _W1 + 1])
        v.mul_(f[:, _B2 : _B2 + 1]).addcmul_(grad, grad, value=1 - self.betas[1])  # g = 0: frozen
        tmp = torch.sqrt(v)  # the step's one temporary, the size of the group
        tmp.div_(f[:, _BC2 : _BC2 + 1]).add_(self.eps)
        torch.mul(m, f[:, _NEG_STEP : _NEG_STEP + 1], out=grad)
        grad.div_(tmp)
        p.add_(grad)
        grad.zero_()

    # ------------------------------------------------------------------ state
    def slot_state(self, slot: int) -> dict[str, Any]:
        """``{"step", "exp_avg", "exp_avg_sq"}`` of ``slot``; moments PEFT-keyed like the
        weights (``...lora_A.weight`` (r, in), ``...lora_B.weight`` (out, r)), as views."""
        self.sync()
        moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
        for key, rows, group, transpose in self._rows_of(slot):
            for name in ("exp_avg", "exp_avg_sq"):
                t = getattr(group, name)[rows]
                moments[name][key] = t.t() if transpose else t
        return {"step": self._slots[slot].step, **moments}

    def load_slot_state(self, slot: int, state: Mapping[str, Any]) -> None:
        """Restore :meth:`slot_state` output into ``slot`` (registered, same layers)."""
        self.sync()
        found = list(self._rows_of(slot))
        expected = {key for key, *_ in found}
        for name in ("exp_avg", "exp_avg_sq"):
            if set(state[name]) != expected:
                diff = sorted(set(state[name]) ^ expected)[:3]
                raise ValueError(f"optimizer state does not match slot {slot}: {diff}")
        with torch.no_grad():
            for key, rows, group, transpose in found:
                for name in ("exp_avg", "exp_avg_sq"):
                    src = state[name][key]
                    getattr(group, name)[rows].copy_(src.t() if transpose else src)
        self._slots[slot].step = int(state["step"])

    def _rows_of(self, slot: int) -> Iterator[tuple[str, slice, _Group, bool]]:
        """``(PEFT key, group rows, group, is B)`` of each of ``slot``'s factors."""
        for g in self._groups:
            for m in g.members:
                if slot in m.layer.specs:
                    block = m.layer.block(slot)
                    rows = slice(m.start + block.start, m.start + block.stop)
                    factor = "A" if m.attr == "A" else "B"
                    yield peft_key(m.name, factor), rows, g, factor == "B"


__all__ = ["PackedAdamW"]
