"""Token-balanced micro-batches: the rows of every adapter split into bins of near-equal tokens.

The packed batch of a step is the rows of all adapters in slot order, ``n`` rows with token
counts ``w_0 … w_{n-1}`` (real tokens, padding excluded). A data-parallel rank or a pipeline
micro-batch costs about its tokens, so the step's time is set by the heaviest bin (LoRAFusion
§4.3, LobRA). We cut the row sequence into ``k`` *contiguous* bins minimising the heaviest::

    min over 0 = b_0 ≤ b_1 ≤ … ≤ b_k = n  of  max_j Σ_{b_j ≤ t < b_{j+1}} w_t

(the linear-partition problem; exact: binary search on the cap with a greedy feasibility test,
``O(n log Σw)``), every bin non-empty when ``n ≥ k``. The optimum ``W*`` satisfies
``W* ≤ Σw / k + max w``: near-equal bins whenever single rows are short against a bin.

Why contiguous. Each bin then holds, per adapter, a run of consecutive rows of that adapter's
batch, i.e. a segment with a row offset -- exactly the engine's micro-batch unit
(``{slot: (row offset, rows)}``), so keyed dropout (seeded by the row's index in its adapter's
batch), the segment table and the loss weights ``1 / N_i`` (``N_i`` = target tokens of the
adapter's *whole* step batch) are unchanged and per-adapter training stays exact: every row is
in exactly one bin, and ``Σ_bins Σ_{t ∈ bin ∩ rows_i} CE_t / N_i`` is adapter ``i``'s mean loss.
Adapters are in slot order, so one bin mixes the tail of one adapter with the head of the next:
a pipeline's micro-batches each carry several adapters' work (mLoRA's bubble filling).

Pure Python, no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence


def linear_partition(weights: Sequence[int], k: int) -> list[int]:
    """Bounds ``[b_0 = 0, …, b_k = n]`` of the ``k`` contiguous bins with the least heaviest bin.

    Args:
        weights: ``n`` non-negative integer weights (tokens per row).
        k: number of bins, ``k ≥ 1``.

    Returns:
        ``k + 1`` non-decreasing bounds; bin ``j`` is ``weights[b_j : b_{j+1}]``. Every bin is
        non-empty when ``n ≥ k``; otherwise the first ``n`` bins hold one row each and the rest
        are empty.
    """
    if k < 1:
        raise ValueError(f"linear_partition: k={k} must be >= 1")
    w = [int(x) for x in weights]
    if any(x < 0 for x in w):
        raise ValueError("linear_partition: weights must be >= 0")
    n = len(w)
    if n == 0:
        return [0] * (k + 1)
    lo, hi = max(w), sum(w)
    while lo < hi:  # least cap for which the greedy fill needs at most k bins
        mid = (lo + hi) // 2
        if _bins_needed(w, mid) <= k:
            hi = mid
        else:
            lo = mid + 1
    return _fill(w, k, lo)


def _bins_needed(w: Sequence[int], cap: int) -> int:
    bins, load = 1, 0
    for x in w:
        if load + x > cap:
            bins, load = bins + 1, 0
        load += x
    return bins


def _fill(w: Sequence[int], k: int, cap: int) -> list[int]:
    """Greedy fill up to ``cap``, closing a bin early when just enough rows remain for the rest."""
    n, i, bounds = len(w), 0, [0]
    for b in range(k):
        rest = k - b - 1  # bins after this one
        if i < n:  # a bin's first row always fits: cap >= max(w)
            load, i = w[i], i + 1
            while i < n and load + w[i] <= cap and n - i > rest:
                load += w[i]
                i += 1
        bounds.append(i)
    if i != n:  # cannot happen for a feasible cap
        raise AssertionError(f"linear_partition: {n - i} rows left over at cap {cap}")
    return bounds


def balanced_micro_batches(
    rows: Mapping[int, Sequence[int]], k: int
) -> list[dict[int, tuple[int, int]]]:
    """Split the step's rows (all adapters, slot order) into ``k`` token-balanced bins.

    Args:
        rows: ``{slot: tokens of each of its rows}`` (the adapter's batch, in order).
        k: number of bins (e.g. ``fsdp · micro-batches per rank`` or PP micro-batches).

    Returns:
        ``k`` bins, each ``{slot: (row offset in the slot's batch, number of rows)}`` with the
        slots ascending (an empty dict for an empty bin). Every row of every slot is in exactly
        one bin, and within a bin a slot's rows are consecutive.
    """
    flat = [(slot, j, t) for slot in sorted(rows) for j, t in enumerate(rows[slot])]
    bounds = linear_partition([t for _, _, t in flat], k)
    bins: list[dict[int, tuple[int, int]]] = []
    for lo, hi in itertools.pairwise(bounds):
        part: dict[int, tuple[int, int]] = {}
        for slot, j, _ in flat[lo:hi]:
            offset, count = part.get(slot, (j, 0))
            part[slot] = (offset, count + 1)
        bins.append(part)
    return bins


def bin_tokens(rows: Mapping[int, Sequence[int]], part: Mapping[int, tuple[int, int]]) -> int:
    """Tokens of one bin of :func:`balanced_micro_batches`."""
    return sum(sum(rows[s][o : o + c]) for s, (o, c) in part.items())


__all__ = ["balanced_micro_batches", "bin_tokens", "linear_partition"]
