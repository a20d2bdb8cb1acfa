"""The rows of packed evaluation and how they are cut into forwards.

A row is one ``(slot, example)`` pair -- ``(slot, example, option)`` for accuracy -- of
:mod:`plora.engine.evaluate_packed`. Rows are laid out slot by slot (:func:`length_order` gives
each slot's example order), cut into consecutive forwards under a row and a padded-token cap
(:func:`forward_chunks`), and each forward's rows are routed by its segment table
(:func:`chunk_segments`).
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
    "forward_chunks",
    "length_order",
    "rows_per_forward",
]
