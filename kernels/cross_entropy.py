"""Cross-entropy of a chunk of logits in one pass per row, the gradient written over the logits.

The packed loss (:mod:`plora.engine.loss`) forms logits only at target positions, a chunk of
tokens at a time, and takes ``∂L/∂h`` in the same pass. In plain torch each chunk costs a float32
``log_softmax``, an ``exp``, a broadcast multiply and a cast: about eight full passes over a
``tokens × vocab`` buffer, most of them in float32 (on a 3B model with a 152k vocabulary, ~35 ms
of a 550 ms H100 step). :func:`cross_entropy_` reads each row twice and writes it once, in the
logits' own dtype::

    ce[t]        = logsumexp(z[t]) - z[t, y_t]
    z[t, :]     <- w_t · (softmax(z[t]) - onehot(y_t))        (grad=True)

with the max, the exponent sums and the softmax in float32 -- the arithmetic of
``-log_softmax(z.float())[y]`` and its gradient, rounded once to the logits' dtype at the end,
as the torch path rounds it before the head's backward GEMM. A weight of 0 (a padding target of
a captured step) writes a zero row. :func:`plora.kernels.reference.cross_entropy_reference` is
its torch twin (the CPU path and the tests' oracle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Vocabulary columns one program iteration reads (a power of two).
BLOCK_V = 4096


@triton.jit
def _ce_kernel(
    z_ptr, stride_z, t_ptr, w_ptr, ce_ptr, V,
    GRAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per row: an online max / sum over ``V`` columns, then (``GRAD``) the row's
    gradient over the row itself."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        offs = start + cols
        z = tl.load(z_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(t_ptr + row)
    z_t = tl.load(z_row + target).to(tl.float32)
    tl.store(ce_ptr + row, lse - z_t)
    if GRAD:
        w = tl.load(w_ptr + row).to(tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + cols
            z = tl.load(z_row + offs, mask=offs < V, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) - tl.where(offs == target, 1.0, 0.0)
            tl.store(z_row + offs, (w * g).to(z_ptr.dtype.element_ty), mask=offs < V)


def cross_entropy_(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row cross-entropy of ``logits`` ``(n, V)`` at ``targets`` ``(n,)``, float32 ``(n,)``.

    With ``weights`` ``(n,)``, ``logits`` is overwritten with ``weights[t] · (softmax - onehot)``,
    the gradient of ``Σ_t weights[t] · ce[t]``; without, ``logits`` is only read. Targets must lie
    in ``[0, V)`` (the caller drops ignored positions first).
    """
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(
            f"cross_entropy_: logits need unit stride along the vocabulary, got {logits.stride()}"
        )
    ce = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return ce
    grad = weights is not None
    w = weights if grad else ce  # unread without GRAD
    _ce_kernel[(n,)](
        logits, logits.stride(0), targets, w, ce, vocab,
        GRAD=grad, BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)), num_warps=8,
    )  # fmt: skip
    return ce


__all__ = ["BLOCK_V", "cross_entropy_"]
