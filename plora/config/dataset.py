"""The fine-tuning data of a sweep: :class:`DatasetSpec`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from plora.config.errors import ConfigError
from plora.config.validate import as_bool, as_choice, as_float, as_int, as_str

#: Built-in synthetic datasets (``plora.tasks``).
BUILTIN_DATASETS: tuple[str, ...] = ("arithmetic", "sentiment", "reverse", "copy")
#: Dataset file layouts: ``auto`` detects from the rows (``text`` / ``prompt``+``completion`` /
#: chat ``messages``) or a ``datasets.save_to_disk`` directory (``disk``).
DATASET_FORMATS: tuple[str, ...] = ("auto", "text", "prompt_completion", "chat", "disk")
#: Most training rows a built-in task generates (every row is held in memory, tokenized).
BUILTIN_MAX_EXAMPLES = 1_000_000
#: Task metrics of a dataset; ``auto`` picks the builtin task's metric (none for text rows).
DATASET_METRICS: tuple[str, ...] = ("auto", "exact_match", "accuracy", "none")


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetSpec:
    """The fine-tuning data. Exactly one of ``path`` and ``builtin``.

    Files are only required to exist for training (:meth:`check_files`): planning needs just
    ``num_examples`` and ``max_seq_len``.
    """

    path: str | None = None
    """A ``.jsonl`` file (rows with ``text``, or ``prompt``+``completion``, or chat ``messages``)
    or a directory written by ``datasets.save_to_disk``."""
    builtin: str | None = None
    """A built-in synthetic task: arithmetic (exact match) | sentiment (accuracy) | reverse |
    copy (long rows: ~1,000 tokens)."""
    format: str = "auto"
    """Row layout: auto | text | prompt_completion | chat | disk."""
    num_examples: int = 2000
    """Training examples: for a builtin, the training rows generated (held-out rows come on
    top); for a file, a planning hint (the real count replaces it once the file is read)."""
    eval_path: str | None = None
    """Separate evaluation file; when absent ``eval_fraction`` of the data is held out."""
    eval_fraction: float = 0.1
    """Fraction held out for evaluation when there is no ``eval_path``, in [0, 1)."""
    max_seq_len: int = 256
    """Maximum tokens per example (longer ones are truncated); the planner's sequence length."""
    completion_only: bool = True
    """Train only on completion/answer tokens (prompt tokens masked from the loss)."""
    metric: str = "auto"
    """Task metric: auto | exact_match | accuracy | none."""
    seed: int = 0
    """Seed of the train/eval split and of builtin data generation."""

    def __post_init__(self) -> None:
        if (self.path is None) == (self.builtin is None):
            raise ConfigError(
                "set exactly one of path and builtin", key="path/builtin",
                value=f"{self.path!r}/{self.builtin!r}",
                fix=f"e.g. path: data/train.jsonl, or builtin: {BUILTIN_DATASETS[0]}",
            )  # fmt: skip
        if self.builtin is not None:
            as_choice(
                self.builtin, "builtin", BUILTIN_DATASETS, fix="or give a .jsonl path instead"
            )
        if self.path is not None:
            as_str(self.path, "path")
            p = Path(self.path).expanduser()
            if p.is_file() and p.suffix not in (".jsonl", ".json"):
                raise ConfigError("dataset file must be .jsonl", key="path", value=self.path,
                                  fix="convert it to JSON lines or pass a save_to_disk directory")  # fmt: skip
        if self.eval_path is not None:
            as_str(self.eval_path, "eval_path")
        as_choice(self.format, "format", DATASET_FORMATS)
        as_int(self.num_examples, "num_examples", ge=1)
        if self.builtin is not None and self.num_examples > BUILTIN_MAX_EXAMPLES:
            raise ConfigError(
                f"a built-in task generates at most {BUILTIN_MAX_EXAMPLES:,} rows",
                key="num_examples", value=self.num_examples,
                fix="lower it, or give your data as a .jsonl file (dataset.path)",
            )  # fmt: skip
        object.__setattr__(
            self, "eval_fraction", as_float(self.eval_fraction, "eval_fraction", ge=0.0, lt=1.0)
        )
        as_int(
            self.max_seq_len,
            "max_seq_len",
            ge=8,
            fix="use the longest example's token count, e.g. 1024",
        )
        as_bool(self.completion_only, "completion_only")
        as_choice(self.metric, "metric", DATASET_METRICS)
        as_int(self.seed, "seed", ge=0)

    def check_files(self) -> None:
        """Raise :class:`ConfigError` unless the files training needs exist."""
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value is not None and not Path(value).expanduser().exists():
                raise ConfigError("dataset file not found", key=key, value=value,
                                  fix="create it or fix the path (relative paths are relative to the sweep file)")  # fmt: skip


__all__ = [
    "BUILTIN_DATASETS",
    "BUILTIN_MAX_EXAMPLES",
    "DATASET_FORMATS",
    "DATASET_METRICS",
    "DatasetSpec",
]
