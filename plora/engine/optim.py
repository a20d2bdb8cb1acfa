"""Per-adapter optimizer, schedule, step count and clipping.

Every adapter gets its own ``torch.optim.AdamW`` (its lr, weight decay; betas (0.9, 0.999),
eps 1e-8 as in transformers' ``TrainingArguments``) and its own ``LambdaLR`` built by
transformers' ``get_*_schedule_with_warmup`` (warmup ``w``, total ``T``)::

    constant: f(t) = min(1, t / w)
    linear:   f(t) = t / w  (t < w),  max(0, (T - t) / (T - w))
    cosine:   f(t) = t / w  (t < w),  max(0, ½(1 + cos(π (t - w) / (T - w))))

so an adapter trained in a pack follows exactly the lr curve it would follow alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from plora.config import LoRAConfig, Schedule

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def total_steps(config: LoRAConfig, num_examples: int) -> int:
    """Optimizer steps of ``config``: ``max_steps``, or ``ceil(epochs · n / batch_size)``."""
    if config.max_steps is not None:
        return config.max_steps
    return max(1, math.ceil(config.epochs * num_examples / config.batch_size))


def make_optimizer(params: Sequence[torch.nn.Parameter], config: LoRAConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over one adapter's parameters with its lr and weight decay.

    On CUDA the fused implementation (one kernel for all of the adapter's tensors; the same
    update rule) -- measured on an H200 at 16 adapters of Qwen2.5-3B shape, the multi-tensor
    default spent ~4 ms per adapter per step in launches.
    """
    params = list(params)
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=ADAM_BETAS,
        eps=ADAM_EPS,
        weight_decay=config.weight_decay,
        fused=fused or None,
    )


def make_schedule(optimizer: torch.optim.Optimizer, config: LoRAConfig, steps: int) -> LambdaLR:
    """Warmup + constant/linear/cosine ``LambdaLR`` (transformers' semantics)."""
    warmup = config.warmup_steps
    if config.schedule is Schedule.CONSTANT:
        return get_constant_schedule_with_warmup(optimizer, warmup)
    if config.schedule is Schedule.LINEAR:
        return get_linear_schedule_with_warmup(optimizer, warmup, steps)
    return get_cosine_schedule_with_warmup(optimizer, warmup, steps)


def clip_and_norm(
    params: Sequence[torch.nn.Parameter], max_norm: float | None
) -> torch.Tensor | float:
    """L2 norm of the adapter's gradients (before clipping); clip to ``max_norm`` if set.

    Returns the norm as a 0-d tensor on the gradients' device (no host sync), or 0.0 when no
    parameter has a gradient.
    """
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm is not None:
        return torch.nn.utils.clip_grad_norm_(grads, max_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in grads])


__all__ = [
    "ADAM_BETAS",
    "ADAM_EPS",
    "clip_and_norm",
    "make_optimizer",
    "make_schedule",
    "total_steps",
]
