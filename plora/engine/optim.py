"""Per-adapter schedules and step counts; the AdamW constants.

Every adapter follows its own lr curve, built by transformers' ``get_*_schedule_with_warmup``
(warmup ``w``, total ``T``)::

    constant: f(t) = min(1, t / w)
    linear:   f(t) = t / w  (t < w),  max(0, (T - t) / (T - w))
    cosine:   f(t) = t / w  (t < w),  max(0, ½(1 + cos(π (t - w) / (T - w))))

and its update ``t`` (0-based) uses ``lr · f(t)``, exactly what a ``LambdaLR`` over its own
``torch.optim.AdamW`` would set, so an adapter trained in a pack follows the lr curve it would
follow alone. The AdamW step of all adapters together is
:class:`plora.engine.packed_optim.PackedAdamW` (betas (0.9, 0.999), eps 1e-8 as in
transformers' ``TrainingArguments``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

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
    epochs = float(config.epochs or 0.0)  # LoRAConfig: exactly one of max_steps, epochs
    return max(1, math.ceil(epochs * num_examples / config.batch_size))


def make_schedule(optimizer: torch.optim.Optimizer, config: LoRAConfig, steps: int) -> LambdaLR:
    """Warmup + constant/linear/cosine ``LambdaLR`` (transformers' semantics)."""
    warmup = config.warmup_steps
    if config.schedule is Schedule.CONSTANT:
        schedule: LambdaLR = get_constant_schedule_with_warmup(optimizer, warmup)
        return schedule
    if config.schedule is Schedule.LINEAR:
        linear: LambdaLR = get_linear_schedule_with_warmup(optimizer, warmup, steps)
        return linear
    cosine: LambdaLR = get_cosine_schedule_with_warmup(optimizer, warmup, steps)
    return cosine


def lr_lambda(config: LoRAConfig, steps: int) -> Callable[[int], float]:
    """``f``: the multiplier of ``config.lr`` at each optimizer step (transformers' own function).

    ``config.lr * f(t)`` is the lr a ``LambdaLR`` of :func:`make_schedule` sets for update ``t``.
    """
    holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
    return make_schedule(holder, config, steps).lr_lambdas[0]


__all__ = ["ADAM_BETAS", "ADAM_EPS", "lr_lambda", "make_schedule", "total_steps"]
