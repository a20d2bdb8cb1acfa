"""How far single-process packed training moves when only its reduction order changes: the
measured basis of the dist tier's weight tolerance.

A parallel run sums the same products in another order than one process does: tensor
parallelism adds the ``k``-slices of a row-wise projection across ranks (an all-reduce), FSDP
adds each rank's share of the rows into an adapter's gradient (a reduce-scatter). In fp32 that
moves a step's loss by ~1e-7; Adam turns such noise into ~1e-5 on an element whose gradient
is near ``eps`` (:func:`_engine_testlib.assert_same_adapter`), so the final weights of a correct
parallel run differ from the single process's by that optimizer-amplified noise, which grows
with the number of partial sums. The reference run's own spread measures it:
the same single-process training with every linear layer's ``x · Wᵀ`` computed as the sum of
``parts`` slices of ``k`` (:func:`split_k`, the reduction a ``parts``-way row-wise split makes),
compared with the plain run. A parallel run must then agree with the single process within
:func:`weight_tolerance` of that spread: both differ from exact arithmetic by noise of that
size, so by the triangle inequality by at most twice of it from each other; never looser.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from _engine_testlib import adapter_rel_err

#: The packing contract's tolerance (DESIGN: packed == alone, fp32 CPU, <= 1e-5 relative): a
#: parallel run is never held to a looser one than its spread justifies, nor a tighter one.
CONTRACT = 1e-5


@contextlib.contextmanager
def split_k(parts: int) -> Iterator[None]:
    """Every ``F.linear`` (the base projections, hence ``nn.Linear``) sums ``parts`` slices of
    its input dimension, as ``parts`` ranks of a row-wise split do, instead of one GEMM."""
    plain = F.linear

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        k = w.shape[-1]
        if k % parts:
            return plain(x, w, b)
        step = k // parts
        y = sum(plain(x[..., i : i + step], w[:, i : i + step]) for i in range(0, k, step))
        return y if b is None else y + b

    torch.nn.functional.linear = linear  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.nn.functional.linear = plain


def reference_spread(
    run: Callable[[], dict[str, dict[str, torch.Tensor]]],
    plain: dict[str, dict[str, torch.Tensor]],
    parts: int,
) -> float:
    """The largest whole-adapter relative error between ``plain`` (the single process's final
    weights by config id) and ``run()`` (the same training) under :func:`split_k` (``parts``)."""
    with split_k(parts):
        split = run()
    return max(adapter_rel_err(split[cid], plain[cid]) for cid in plain)


def weight_tolerance(spread: float) -> float:
    """The contract's 1e-5, or twice the measured ``spread`` when that is larger."""
    return max(CONTRACT, 2.0 * spread)
