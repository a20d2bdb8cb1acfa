"""The rows of packed evaluation and how they are cut into forwards.

A row is one ``(slot, example)`` pair -- ``(slot, example, option)`` for accuracy -- of
:mod:`plora.engine.evaluate_packed`. Rows are laid out slot by slot (:func:`length_order` gives
each slot's example order), cut into consecutive forwards under a row and a padded-token cap
(:func:`forward_chunks`; one row count per evaluation: :func:`even_forwards`; cut again after a
forward ran out of memory: :func:`recut_after_oom`), and each forward's rows are routed by its
segment table (:func:`chunk_segments`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from plora.cost.overheads import EVAL_BATCH_ROWS, EVAL_MAX_TOKENS, rows_per_forward

Slot = int | None


@dataclass(frozen=True, slots=True)
class EvalRow:
    """One row of a packed forward.

    Attributes:
        group: position of the row's slot in the evaluated slots.
        slot: the slot whose adapter the row goes through (``None``: base model only).
        ids: the row's tokens (unpadded).
        scored: positions ``p`` whose token ``ids[p]`` is scored (by the logits at ``p - 1``).
        dest: index of the sum the row's log-probabilities are added to.
    """

    group: int
    slot: Slot
    ids: Sequence[int]
    scored: Sequence[int] = ()
    dest: int = 0


def forward_chunks(
    rows: Sequence[EvalRow], batch_size: int, max_tokens: int | None, *, extra: int = 0
) -> Iterator[list[EvalRow]]:
    """Consecutive runs of rows, one per forward: at most ``batch_size`` rows and, when set,
    ``rows x (longest row + extra) <= max_tokens`` (at least one row)."""
    chunk: list[EvalRow] = []
    width = 0
    for row in rows:
        grown = max(width, len(row.ids) + extra)
        full = len(chunk) >= batch_size
        if chunk and (full or (max_tokens is not None and grown * (len(chunk) + 1) > max_tokens)):
            yield chunk
            chunk, grown = [], len(row.ids) + extra
        chunk.append(row)
        width = grown
    if chunk:
        yield chunk


def even_forwards(
    rows: Sequence[EvalRow], batch_size: int, max_tokens: int | None, *, extra: int = 0
) -> Iterator[list[EvalRow]]:
    """``rows`` cut into forwards of one row count (the last one shorter): ``batch_size``, or
    fewer where ``max_tokens`` holds fewer rows at the widest row's length (``+ extra``).

    One count, not as many rows as each forward's own width allows: kernels specialized on the
    row count (Liger-Kernel's RoPE takes it as a compile-time constant) compile once."""
    if max_tokens is not None and rows:
        widest = max(len(r.ids) for r in rows) + extra
        batch_size = max(1, min(batch_size, max_tokens // widest))
    return forward_chunks(rows, batch_size, max_tokens, extra=extra)


def recut_after_oom(
    chunk: list[EvalRow], pending: list[list[EvalRow]], max_tokens: int | None
) -> tuple[list[list[EvalRow]], tuple[int, int]]:
    """After the forward of ``chunk`` ran out of memory: its rows and those of ``pending``
    (forwards in popped-from-the-end order, so returned) cut again at half ``chunk``'s rows and
    padded tokens (``max_tokens`` if lower); and those two caps."""
    rows = max(1, len(chunk) // 2)
    tokens = max(1, len(chunk) * max(len(r.ids) for r in chunk) // 2)
    if max_tokens is not None:
        tokens = min(tokens, max_tokens)
    rest = chunk + [row for later in reversed(pending) for row in later]
    return list(even_forwards(rest, rows, tokens))[::-1], (rows, tokens)


def chunk_segments(chunk: Sequence[EvalRow]) -> list[tuple[int, int, int]]:
    """``(slot, start, stop)`` of each run of adapter rows in ``chunk`` (base rows: none)."""
    segments, start = [], 0
    for (_, slot), run in itertools.groupby(chunk, key=lambda r: (r.group, r.slot)):
        stop = start + sum(1 for _ in run)
        if slot is not None:
            segments.append((slot, start, stop))
        start = stop
    return segments


def length_order(lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Example indices by ascending and by descending length (stable)."""
    ascending = sorted(range(len(lengths)), key=lengths.__getitem__)
    return ascending, ascending[::-1]


__all__ = [
    "EVAL_BATCH_ROWS",
    "EVAL_MAX_TOKENS",
    "EvalRow",
    "Slot",
    "chunk_segments",
    "even_forwards",
    "forward_chunks",
    "length_order",
    "recut_after_oom",
    "rows_per_forward",
]
