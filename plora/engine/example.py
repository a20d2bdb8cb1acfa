"""One tokenized training or eval example: token ids with aligned labels."""

from __future__ import annotations

from dataclasses import dataclass

#: Label of a position the loss ignores (HF convention).
IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True, slots=True)
class Example:
    """One tokenized example.

    Attributes:
        input_ids: token ids, ``[L]``.
        labels: ``[L]``, aligned with ``input_ids``; ``-100`` on masked (prompt) positions.
        prompt: the text the answer is generated from (empty for text rows).
        answer: the reference completion for exact match (``None`` for text rows).
        label: the correct label option for accuracy tasks, else ``None``.
        prompt_len: leading ``input_ids`` that form the prompt (generation context); ``None``
            means "up to the first unmasked label".
    """

    input_ids: list[int]
    labels: list[int]
    prompt: str = ""
    answer: str | None = None
    label: str | None = None
    prompt_len: int | None = None

    def context_len(self) -> int:
        """Tokens of ``input_ids`` before the answer (clipped to the example's length)."""
        if self.prompt_len is not None:
            return min(self.prompt_len, len(self.input_ids))
        return next((i for i, y in enumerate(self.labels) if y != IGNORE_INDEX), len(self.labels))


__all__ = ["IGNORE_INDEX", "Example"]
