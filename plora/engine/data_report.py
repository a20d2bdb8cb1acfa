"""What loading a dataset did to its rows: :class:`DataReport` (per split: rows read, rows cut to
``max_seq_len``, rows left out because no target token survived the cut).

Nothing is changed silently: ``plora sweep`` prints the report when a row was cut or left out,
and writes it to the sweep directory (``data.json``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitReport:
    """One split (train or eval) after tokenizing."""

    rows: int
    """Rows read."""
    truncated: int = 0
    """Rows longer than ``max_seq_len`` tokens, cut on the right (kept when a target is left)."""
    dropped: int = 0
    """Rows left out: no target token left after the cut (train: nothing to learn; eval: nothing
    to score, so ``eval_loss`` and ``eval_metric`` are over the other rows)."""
    longest: int = 0
    """Tokens of the longest row before the cut."""

    @property
    def kept(self) -> int:
        return self.rows - self.dropped


@dataclass(frozen=True, kw_only=True, slots=True)
class DataReport:
    """Both splits of a tokenized dataset and the cut they were measured against."""

    max_seq_len: int
    train: SplitReport
    eval: SplitReport

    @property
    def changed(self) -> bool:
        """Whether any row was cut or left out."""
        return any(s.truncated or s.dropped for s in (self.train, self.eval))

    def lines(self) -> list[str]:
        """One human line per split that lost something (empty when nothing did)."""
        out = []
        for name, s in (("train", self.train), ("eval", self.eval)):
            if not (s.truncated or s.dropped):
                continue
            out.append(
                f"data: {name} {s.truncated} of {s.rows} rows cut to dataset.max_seq_len="
                f"{self.max_seq_len} (longest {s.longest} tokens), {s.dropped} left out with no "
                f"target token left; raise dataset.max_seq_len to keep them"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_seq_len": self.max_seq_len,
            "train": {**asdict(self.train), "kept": self.train.kept},
            "eval": {**asdict(self.eval), "kept": self.eval.kept},
        }


__all__ = ["DataReport", "SplitReport"]
