"""Per-adapter data order and the packed batch of one training step.

* :class:`AdapterStream` -- one adapter's epoch-wise shuffled index stream. Its order depends
  only on ``(num_examples, seed)``, so an adapter sees the same batches alone and in a pack.
* :func:`pack_batch` -- the examples every slot draws this step, stacked into one right-padded
  batch with a segment table (rows of a slot contiguous, slots ascending): what
  ``PackedLoRALinear`` routes by. No row ever mixes adapters.

Both are re-exported by :mod:`plora.engine.data`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from plora.config import ConfigError
from plora.engine.example import IGNORE_INDEX, Example

_T = TypeVar("_T")


class AdapterStream:
    """One adapter's infinite, epoch-wise shuffled stream of example indices.

    Epoch ``e`` visits ``permutation(num_examples, seed, e)`` in order, ``batch_size`` indices
    at a time; the last batch of an epoch is shorter (or skipped with ``drop_last``). The order
    depends only on ``(num_examples, seed)``, so an adapter trained alone and the same adapter
    in a pack see the same batches.
    """

    def __init__(
        self, num_examples: int, batch_size: int, seed: int, *, drop_last: bool = False
    ) -> None:
        if num_examples < 1:
            raise ConfigError(
                "the training split is empty",
                key="dataset",
                value=num_examples,
                fix="give it at least one example",
            )
        if batch_size < 1:
            raise ConfigError("must be >= 1", key="batch_size", value=batch_size)
        if drop_last and batch_size > num_examples:
            raise ConfigError(
                f"is larger than the {num_examples} training examples with drop_last",
                key="batch_size",
                value=batch_size,
                fix="lower batch_size or add data",
            )
        self.num_examples, self.batch_size, self.seed, self.drop_last = (
            num_examples,
            batch_size,
            seed,
            drop_last,
        )
        self.epoch = 0  # completed passes = the epoch the next batch comes from
        self.position = 0  # offset of the next batch in the epoch's permutation
        self.steps = 0  # batches drawn so far
        self.examples_seen = 0
        self._order = self.permutation(num_examples, seed, 0)

    @staticmethod
    def permutation(num_examples: int, seed: int, epoch: int) -> list[int]:
        """The visiting order of ``epoch`` (NumPy PCG64 seeded by ``(seed, epoch)``)."""
        order: list[int] = np.random.default_rng([seed, epoch]).permutation(num_examples).tolist()
        return order

    @property
    def steps_per_epoch(self) -> int:
        """Batches per pass over the data."""
        full, rest = divmod(self.num_examples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def epochs_done(self) -> float:
        """Passes over the data so far, fractional (``examples_seen / num_examples``)."""
        return self.examples_seen / self.num_examples

    def next_batch(self) -> list[int]:
        """Indices of the next batch (``batch_size`` of them, fewer at an epoch's end)."""
        batch = self._order[self.position : self.position + self.batch_size]
        self.position += len(batch)
        self.steps += 1
        self.examples_seen += len(batch)
        remaining = self.num_examples - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.position = 0
            self._order = self.permutation(self.num_examples, self.seed, self.epoch)
        return batch

    def get_state(self) -> dict[str, Any]:
        """JSON-able state; :meth:`set_state` on a fresh stream resumes exactly."""
        keys = (
            "num_examples",
            "batch_size",
            "seed",
            "drop_last",
            "epoch",
            "position",
            "steps",
            "examples_seen",
        )
        return {k: getattr(self, k) for k in keys}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`get_state` output; the stream's identity must match."""
        for key in ("num_examples", "batch_size", "seed", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"stream state has {key}={state[key]!r}, this stream {getattr(self, key)!r}"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.steps, self.examples_seen = int(state["steps"]), int(state["examples_seen"])
        self._order = self.permutation(self.num_examples, self.seed, self.epoch)


# ---------------------------------------------------------------------------- packing


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows ``[start, stop)`` of a packed batch belong to ``slot`` (empty when start == stop)."""

    slot: int
    start: int
    stop: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedBatch:
    """One step's rows of every slot, right-padded to a common length.

    Attributes:
        input_ids: ``LongTensor[R, S]``, padding = ``pad_id``.
        attention_mask: ``LongTensor[R, S]``, 1 on real tokens.
        labels: ``LongTensor[R, S]``, aligned with ``input_ids``, ``-100`` on padding/masked.
        segments: one per slot, in slot order (``segments[i].slot == i``); rows of a slot are
            contiguous and slots ascend down the rows.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    segments: tuple[Segment, ...]

    def to(self, device: str | torch.device) -> PackedBatch:
        """The same batch with its tensors on ``device``."""
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            labels=self.labels.to(device),
            segments=self.segments,
        )

    def target_tokens(self) -> dict[int, int]:
        """``{slot: number of predicted tokens}`` (labels after the HF shift that are not -100)."""
        valid = (self.labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
        return {s.slot: int(valid[s.start : s.stop].sum()) for s in self.segments}


def pack_batch(
    rows: Sequence[Sequence[Example]], pad_id: int, *, pad_to_multiple_of: int | None = None
) -> PackedBatch:
    """Stack the examples of every slot into one right-padded batch with a segment table.

    Args:
        rows: ``rows[i]`` = the examples of slot ``i`` this step (may be empty).
        pad_id: token id used for padding (its label is -100, its attention mask 0).
        pad_to_multiple_of: round the sequence length S up to a multiple of this.

    Returns:
        A :class:`PackedBatch` with ``R = sum(len(r) for r in rows)`` rows.
    """
    flat = [ex for slot_rows in rows for ex in slot_rows]
    if not flat:
        raise ValueError("pack_batch: no examples in any slot")
    width = max(len(ex.input_ids) for ex in flat)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(flat), width), pad_id, dtype=torch.long)
    labels = torch.full((len(flat), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(flat), width), dtype=torch.long)
    for r, ex in enumerate(flat):
        if len(ex.labels) != len(ex.input_ids):
            raise ValueError(
                f"example has {len(ex.input_ids)} input_ids but {len(ex.labels)} labels"
            )
        n = len(ex.input_ids)
        ids[r, :n] = torch.tensor(ex.input_ids, dtype=torch.long)
        labels[r, :n] = torch.tensor(ex.labels, dtype=torch.long)
        mask[r, :n] = 1
    segments, start = [], 0
    for slot, slot_rows in enumerate(rows):
        segments.append(Segment(slot, start, start + len(slot_rows)))
        start += len(slot_rows)
    return PackedBatch(input_ids=ids, attention_mask=mask, labels=labels, segments=tuple(segments))


def micro_batches(rows: Sequence[_T], max_rows: int) -> list[list[_T]]:
    """Consecutive chunks of at most ``max_rows`` items (for gradient accumulation)."""
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows} must be >= 1")
    return [list(rows[i : i + max_rows]) for i in range(0, len(rows), max_rows)]


def plan_micro_batches(
    batches: dict[int, list[Any]], max_rows: int | None
) -> list[dict[int, tuple[int, list[Any]]]]:
    """Split the step's rows (slot order) into micro-batches of at most ``max_rows`` rows.

    Returns a list of ``{slot: (row offset in the slot's batch, examples)}``.
    """
    flat = [(slot, j, ex) for slot in sorted(batches) for j, ex in enumerate(batches[slot])]
    size = max_rows or max(1, len(flat))
    micros = []
    for i in range(0, len(flat), size):
        micro: dict[int, tuple[int, list[Any]]] = {}
        for slot, j, ex in flat[i : i + size]:
            micro.setdefault(slot, (j, []))[1].append(ex)
        micros.append(micro)
    return micros


def pack_micro_batch(
    micro: dict[int, tuple[int, list[Any]]], pad_id: int, *, pad_to_multiple_of: int | None = None
) -> PackedBatch:
    """:func:`pack_batch` of one micro-batch of :func:`plan_micro_batches` (slot ``i``'s
    examples in the rows of segment ``i``; slots below the largest without rows get empty
    segments)."""
    rows = [micro[s][1] if s in micro else [] for s in range(max(micro) + 1)]
    return pack_batch(rows, pad_id, pad_to_multiple_of=pad_to_multiple_of)


def target_count(ex: Any) -> int:
    return sum(1 for y in ex.labels[1:] if y != IGNORE_INDEX)


def truncate(ex: Any, n: int) -> Any:
    if len(ex.input_ids) <= n:
        return ex
    return dataclasses.replace(ex, input_ids=list(ex.input_ids[:n]), labels=list(ex.labels[:n]))


__all__ = [
    "AdapterStream",
    "PackedBatch",
    "Segment",
    "micro_batches",
    "pack_batch",
    "pack_micro_batch",
    "plan_micro_batches",
    "target_count",
    "truncate",
]
