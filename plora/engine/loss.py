"""The packed loss: each adapter's own mean token cross-entropy, summed over adapters.

Logits are formed only at target positions (label != -100 after the causal shift), in chunks
whose head matmul + cross-entropy is recomputed in backward when large, so ``R × S × V``
logits never exist at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

_IGNORE = -100
#: Above this many logits (tokens x vocab) per chunk, the head + CE is recomputed in backward.
_LOGIT_CHUNK = 1 << 26


def packed_loss(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    segments: Sequence[Any],
    denoms: dict[int, int],
) -> tuple[torch.Tensor, dict[int, float]]:
    """``Σ_i Σ_{t ∈ rows_i} CE_t / N_i`` over target tokens only.

    Args:
        head: the LM head (hidden -> vocab logits).
        hidden: ``(R, S, H)`` final hidden states.
        labels: ``(R, S)`` aligned labels (-100 = ignore); position ``t`` predicts ``t+1``.
        segments: ``(slot, start, stop)`` rows of each slot.
        denoms: ``N_i`` per slot (target tokens of the slot's whole step batch).

    Returns:
        The scalar loss (fp32) and each slot's detached CE sum in this micro-batch.
    """
    targets = labels[:, 1:]
    valid = targets != _IGNORE
    row_w = torch.zeros(labels.shape[0], dtype=torch.float32, device=labels.device)
    row_slot = torch.full((labels.shape[0],), -1, dtype=torch.long, device=labels.device)
    slots = []
    for seg in segments:
        slot, start, stop = (seg.slot, seg.start, seg.stop) if hasattr(seg, "slot") else seg
        if stop <= start:
            continue
        k = len(slots)
        row_w[start:stop] = 1.0 / denoms[slot]
        row_slot[start:stop] = k
        slots.append(slot)
    rows = valid.nonzero()[:, 0]
    h = hidden[:, :-1][valid]
    t = targets[valid]
    ce = _chunked_ce(head, h, t)
    loss = (ce * row_w[rows]).sum()
    per_slot = torch.zeros(len(slots), dtype=torch.float64, device=labels.device)
    per_slot.index_add_(0, row_slot[rows], ce.detach().to(torch.float64))
    return loss, dict(zip(slots, per_slot.tolist(), strict=True))


def _ce(head: nn.Module, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), t, reduction="none")


def _chunked_ce(head: nn.Module, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per-token CE of ``head(h)`` without holding all logits (recomputed in backward)."""
    vocab = head.weight.shape[0]
    chunk = max(1, _LOGIT_CHUNK // vocab)
    if h.shape[0] <= chunk:
        return _ce(head, h, t)
    parts = [
        checkpoint(_ce, head, h[i : i + chunk], t[i : i + chunk], use_reentrant=False)
        for i in range(0, h.shape[0], chunk)
    ]
    return torch.cat(parts)


__all__ = ["packed_loss"]
