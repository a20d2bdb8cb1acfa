"""The packed loss: each adapter's own mean token cross-entropy, summed over adapters.

Logits are formed only at target positions (label != -100 after the causal shift), a chunk at
a time, with the gradient w.r.t. the hidden states computed in the same pass (a fused
linear-cross-entropy in plain torch), so ``R × S × V`` logits never exist and the head is not
recomputed in backward. :func:`token_nll` is the same head and cross-entropy, forward only, for
evaluation (:mod:`plora.engine.evaluate_packed`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plora.engine.device import to_device

_IGNORE = -100
#: Logits (tokens x vocab) per chunk of the fused head + cross-entropy.
_LOGIT_CHUNK = 1 << 26


def packed_loss(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    segments: Sequence[Any],
    denoms: dict[int, int],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """``Σ_i Σ_{t ∈ rows_i} CE_t / N_i`` over target tokens only.

    Args:
        head: the LM head (hidden -> vocab logits).
        hidden: ``(R, S, H)`` final hidden states.
        labels: ``(R, S)`` aligned labels (-100 = ignore); position ``t`` predicts ``t+1``.
            On the host (CPU) while ``hidden`` is on an accelerator, the target positions and
            weights are found on the host and copied over without a device sync; on
            ``hidden``'s device they are found there (a sync on CUDA).
        segments: ``(slot, start, stop)`` rows of each slot.
        denoms: ``N_i`` per slot (target tokens of the slot's whole step batch).

    Returns:
        The scalar loss (fp32) and each slot's detached CE sum in this micro-batch (a 0-d
        float64 tensor on ``hidden``'s device: read it once the step is done, no sync here).
    """
    where, t, w, owner, slots = loss_targets(labels, segments, denoms)
    if labels.device != hidden.device:
        where, t, w, owner = (to_device(x, hidden.device) for x in (where, t, w, owner))
    loss, per_slot = targets_loss(head, hidden, where, t, w, owner, len(slots))
    return loss, dict(zip(slots, per_slot.unbind(), strict=True))


def loss_targets(
    labels: torch.Tensor, segments: Sequence[Any], denoms: dict[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The target tokens of a packed micro-batch, found where ``labels`` lie.

    Returns ``(where, targets, weights, owner, slots)``: each target's position in the hidden
    states viewed as ``(R·S, H)``, its label, its weight ``1 / N_i`` and the index in ``slots``
    of the slot whose rows hold it; ``slots`` are the slots with rows, in segment order.
    """
    targets = labels[:, 1:]
    valid = targets != _IGNORE
    row_w = torch.zeros(labels.shape[0], dtype=torch.float32, device=labels.device)
    row_slot = torch.full((labels.shape[0],), -1, dtype=torch.long, device=labels.device)
    slots: list[int] = []
    for seg in segments:
        slot, start, stop = (seg.slot, seg.start, seg.stop) if hasattr(seg, "slot") else seg
        if stop <= start:
            continue
        k = len(slots)
        row_w[start:stop] = 1.0 / denoms[slot]
        row_slot[start:stop] = k
        slots.append(slot)
    rows, cols = valid.nonzero(as_tuple=True)
    # (row, col) of each target -> its hidden state's row in hidden viewed as (R·S, H)
    where = rows * labels.shape[1] + cols
    return where, targets[rows, cols], row_w[rows], row_slot[rows], slots


def targets_loss(
    head: nn.Module,
    hidden: torch.Tensor,
    where: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    owner: torch.Tensor,
    n_slots: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Σ_t w_t CE_t`` over the targets of :func:`loss_targets` (on ``hidden``'s device) and
    each slot's detached CE sum, float64 ``(n_slots,)``. An owner of ``n_slots`` or more (a
    padding target of weight 0, as a captured step's fixed-size buffers hold) counts nowhere."""
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, where)
    loss, ce = _weighted_ce(head, h, targets, weights)
    per_slot = torch.zeros(n_slots + 1, dtype=torch.float64, device=hidden.device)
    per_slot.index_add_(0, owner.clamp(max=n_slots), ce.detach().to(torch.float64))
    return loss, per_slot[:n_slots]


@torch.no_grad()
def token_nll(
    head: nn.Module, h: torch.Tensor, targets: torch.Tensor, *, max_logits: int | None = None
) -> torch.Tensor:
    """``CE_t = -log softmax(head(h_t))[y_t]`` per token, forward only (no gradients).

    Equals ``F.cross_entropy(head(h).float(), targets, reduction="none")``: per chunk of
    tokens, the chunk's logits from ``head`` (its dtype, or autocast's), ``log_softmax`` in
    float32 (on CUDA in the cross-entropy kernel's one pass), the target's entry; at most
    ``max_logits`` logits (tokens × vocab) exist at once.

    Args:
        head: the LM head (hidden -> vocab logits), called as ``head(h)``.
        h: ``(n, H)`` hidden states at the target positions.
        targets: ``(n,)`` token ids on ``h``'s device.
        max_logits: logits per chunk; None: ``_LOGIT_CHUNK`` (2^26).

    Returns:
        float32 ``(n,)`` on ``h``'s device.
    """
    weight = head.weight
    assert isinstance(weight, torch.Tensor)
    chunk = max(1, (max_logits or _LOGIT_CHUNK) // weight.shape[0])
    out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    for i in range(0, h.shape[0], chunk):
        out[i : i + chunk] = _chunk_ce(head(h[i : i + chunk]), targets[i : i + chunk])[0]
    return out


class _LinearCrossEntropy(torch.autograd.Function):
    """``Σ_t w_t · CE(h_t Wᵀ + b, y_t)`` with ``∂/∂h`` formed during the forward pass.

    Per chunk of tokens: logits in the compute dtype, then the per-token CE and
    ``w ⊙ (softmax - onehot)`` in float32 -- the same arithmetic autograd would do for HF's
    ``CE(logits.float())`` -- rounded to the compute dtype for ``∂L/∂h = G·W``. No logits
    survive the chunk and nothing is recomputed in backward. On CUDA one Triton pass per row
    writes G over the logits (:func:`plora.kernels.cross_entropy.cross_entropy_`); elsewhere
    torch's ``log_softmax``. The head is frozen (no ``∂/∂W``).
    """

    @staticmethod
    def forward(  # autograd.Function: the arguments of apply
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        w: torch.Tensor,
        chunk: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        with torch.autocast(h.device.type, enabled=False):
            wt = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for i in range(0, n, chunk):
                logits = F.linear(h[i : i + chunk].to(dtype), wt, b)
                ce[i : i + chunk], g = _chunk_ce(logits, targets[i : i + chunk], w[i : i + chunk])
                assert g is not None  # weighted: the gradient comes back
                grad_h[i : i + chunk] = (g @ wt).to(h.dtype)
            loss = (ce * w).sum()
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(ce)
        return loss, ce

    @staticmethod
    def backward(
        ctx: Any, grad_loss: torch.Tensor, _grad_ce: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), None, None, None, None, None, None


def _kernel_ce(logits: torch.Tensor) -> bool:
    """Whether the Triton cross-entropy takes this chunk: CUDA, a float dtype, rows of unit
    stride, and not turned off (``PLORA_KERNELS_CE=0``: torch's, as on the CPU)."""
    return (
        logits.is_cuda
        and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and logits.stride(-1) == 1
        and os.environ.get("PLORA_KERNELS_CE", "1") != "0"
    )


def _chunk_ce(
    logits: torch.Tensor, targets: torch.Tensor, w: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(CE, w ⊙ (softmax - onehot))`` of one chunk, the second in the logits' dtype (on CUDA
    written over ``logits``); without ``w``, ``(CE, None)`` and ``logits`` only read."""
    if _kernel_ce(logits):
        from plora.kernels.cross_entropy import cross_entropy_

        return cross_entropy_(logits, targets, w), None if w is None else logits
    from plora.kernels.reference import cross_entropy_reference

    out: tuple[torch.Tensor, torch.Tensor | None] = cross_entropy_reference(logits, targets, w)
    return out


def _weighted_ce(
    head: nn.Module, h: torch.Tensor, t: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ_t w_t CE_t, CE)`` of ``head(h)`` in chunks of ``_LOGIT_CHUNK`` logits."""
    weight = head.weight
    assert isinstance(weight, torch.Tensor)
    if weight.requires_grad:
        raise ValueError("packed_loss expects a frozen LM head (weight.requires_grad is True)")
    chunk = max(1, _LOGIT_CHUNK // weight.shape[0])
    if _kernel_ce(h):  # the kernel keeps no float32 copy of a chunk: twice the tokens fit
        chunk *= 2
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    out: tuple[torch.Tensor, torch.Tensor] = _LinearCrossEntropy.apply(
        h, weight, head.bias, t, w, chunk, dtype
    )
    return out


__all__ = ["loss_targets", "packed_loss", "targets_loss", "token_nll"]
