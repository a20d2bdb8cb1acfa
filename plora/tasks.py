"""Synthetic tasks: small, deterministic, learnable datasets for tests and the quickstart.

Each task turns ``(num_examples, seed)`` into rows ``{"prompt", "completion"}`` (plus
``"label"`` for label tasks) with no files and no network, and names the metric it is scored
by. The rows feed the same tokenization path as a user's JSONL file
(:func:`plora.engine.data.load_dataset`), so a builtin sweep exercises the real data pipeline.

Tasks:

* ``arithmetic`` -- ``"7+9="`` -> ``"16"``, ``"8-3="`` -> ``"5"`` (operands 0..9 by default:
  a table of 155 questions). Scored by **exact match** of the greedy answer. Questions are drawn
  without replacement from the table while it lasts (then it is reshuffled and repeats), so
  up to 155 rows have no duplicate question across the train/eval split.
* ``sentiment`` -- a bag of review words (positive, negative and neutral fillers, with
  opposite-polarity noise) -> ``"pos"`` / ``"neg"``; the label is the majority polarity (never
  tied). Scored by **accuracy**: the model's log-likelihood of each label option.
* ``reverse`` -- ``"reverse: abcd ->"`` -> ``"dcba"``; exact match. Its first 200 rows at seed 0
  are shipped as ``plora/data/reverse_200.jsonl`` to exercise the JSONL path.
* ``copy`` -- ``"copy: <400-500 random letters> ->"`` -> the same letters: long rows (about
  1,000 tokens with a byte-level tokenizer) for sweeps whose memory and step time are those of
  real sequence lengths (the multi-GPU sweeps); exact match, though such sweeps usually score
  ``eval_loss`` alone (``dataset.metric: none``: no 500-token generation). Not part of the
  tiny models' pretraining corpus.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from plora.config import ConfigError

POSITIVE_WORDS: tuple[str, ...] = (
    "good",
    "great",
    "excellent",
    "happy",
    "love",
    "wonderful",
    "fine",
    "nice",
    "superb",
    "enjoyed",
    "fun",
    "best",
    "lovely",
    "bright",
    "amazing",
    "pleasant",
)
NEGATIVE_WORDS: tuple[str, ...] = (
    "bad",
    "awful",
    "terrible",
    "sad",
    "hate",
    "boring",
    "poor",
    "worst",
    "ugly",
    "dull",
    "broken",
    "rude",
    "slow",
    "noisy",
    "wasted",
    "bland",
)
NEUTRAL_WORDS: tuple[str, ...] = (
    "the",
    "movie",
    "food",
    "service",
    "room",
    "was",
    "and",
    "it",
    "very",
    "a",
    "staff",
    "plot",
    "day",
    "really",
    "quite",
    "place",
    "book",
    "music",
    "so",
    "all",
)

Row = dict[str, str]


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    """A builtin synthetic task.

    Attributes:
        name: the ``dataset.builtin`` value that selects it.
        metric: ``"exact_match"`` or ``"accuracy"`` -- what ``metric: auto`` resolves to.
        labels: the label options for accuracy tasks (``None`` for exact match).
        generate: ``(num_examples, seed) -> rows``; deterministic in both arguments.
    """

    name: str
    metric: str
    labels: tuple[str, ...] | None
    generate: Callable[[int, int], list[Row]]


def make_arithmetic(num_examples: int, seed: int = 0, *, max_operand: int = 9) -> list[Row]:
    """Addition and subtraction questions with non-negative answers.

    Args:
        num_examples: number of rows.
        seed: RNG seed; the rows are a pure function of ``(num_examples, seed, max_operand)``.
        max_operand: operands are drawn from ``0..max_operand``.

    Returns:
        Rows ``{"prompt": "a+b=", "completion": str(a + b)}`` (``-`` only when ``a >= b``).
        Questions are distinct while ``num_examples`` <= the table size, then repeat.
    """
    _check_size(num_examples, max_operand)
    table = [(a, "+", b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    table += [(a, "-", b) for a in range(max_operand + 1) for b in range(a + 1)]
    rng = random.Random(f"arithmetic:{seed}")
    picks: list[tuple[int, str, int]] = []
    while len(picks) < num_examples:
        order = table[:]
        rng.shuffle(order)
        picks.extend(order[: num_examples - len(picks)])
    return [
        {"prompt": f"{a}{op}{b}=", "completion": str(a + b if op == "+" else a - b)}
        for a, op, b in picks
    ]


def make_sentiment(
    num_examples: int, seed: int = 0, *, min_words: int = 4, max_words: int = 8
) -> list[Row]:
    """Review-like word bags labelled by their majority polarity.

    Each row has ``k`` polarity words (``k`` odd, so never tied) -- a majority of one polarity
    and a minority (noise) of the other -- shuffled among neutral filler words.

    Returns:
        Rows ``{"prompt": "review: <words>\\nsentiment: ", "completion": "pos"|"neg",
        "label": same}``; labels are balanced in expectation.
    """
    _check_size(num_examples, max_words)
    rng = random.Random(f"sentiment:{seed}")
    rows: list[Row] = []
    for _ in range(num_examples):
        label = rng.choice(("pos", "neg"))
        k = rng.choice((1, 3, 5))
        minority = rng.randint(0, k // 2)
        major, minor = (
            (POSITIVE_WORDS, NEGATIVE_WORDS) if label == "pos" else (NEGATIVE_WORDS, POSITIVE_WORDS)
        )
        words = [rng.choice(major) for _ in range(k - minority)]
        words += [rng.choice(minor) for _ in range(minority)]
        n_fill = max(0, rng.randint(min_words, max_words) - k)
        words += [rng.choice(NEUTRAL_WORDS) for _ in range(n_fill)]
        rng.shuffle(words)
        prompt = f"review: {' '.join(words)}\nsentiment: "
        rows.append({"prompt": prompt, "completion": label, "label": label})
    return rows


def make_reverse(
    num_examples: int, seed: int = 0, *, min_len: int = 3, max_len: int = 6
) -> list[Row]:
    """Reverse a short lowercase string: ``"reverse: abc ->"`` -> ``"cba"``."""
    _check_size(num_examples, max_len)
    rng = random.Random(f"reverse:{seed}")
    rows: list[Row] = []
    for _ in range(num_examples):
        word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(min_len, max_len)))
        rows.append({"prompt": f"reverse: {word} ->", "completion": word[::-1]})
    return rows


def make_copy(
    num_examples: int, seed: int = 0, *, min_len: int = 400, max_len: int = 500
) -> list[Row]:
    """Copy a long lowercase string: ``"copy: qzx... ->"`` -> ``" qzx..."``."""
    _check_size(num_examples, max_len)
    rng = random.Random(f"copy:{seed}")
    rows: list[Row] = []
    for _ in range(num_examples):
        text = "".join(
            rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(min_len, max_len))
        )
        rows.append({"prompt": f"copy: {text} ->", "completion": f" {text}"})
    return rows


def _check_size(num_examples: int, bound: int) -> None:
    if not isinstance(num_examples, int) or num_examples < 1:
        raise ConfigError(f"dataset.num_examples={num_examples!r} must be an integer >= 1")
    if bound < 1:
        raise ConfigError(f"task size parameter {bound!r} must be >= 1")


TASKS: dict[str, Task] = {
    "arithmetic": Task(
        name="arithmetic", metric="exact_match", labels=None, generate=make_arithmetic
    ),
    "sentiment": Task(
        name="sentiment", metric="accuracy", labels=("neg", "pos"), generate=make_sentiment
    ),
    "reverse": Task(name="reverse", metric="exact_match", labels=None, generate=make_reverse),
    "copy": Task(name="copy", metric="exact_match", labels=None, generate=make_copy),
}
#: The tasks whose text pretrains the tiny models (:func:`task_corpus`; fixed: the tiny models'
#: weights, and so every golden number of the tests, depend on it).
PRETRAIN_TASKS = ("arithmetic", "sentiment", "reverse")


def get_task(name: str) -> Task:
    """Look up a builtin task; unknown names raise a one-line :class:`ConfigError`."""
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(
            f"dataset.builtin={name!r} is not a builtin task; choose one of {', '.join(TASKS)}"
        ) from None


def shipped_data_path(name: str = "reverse_200.jsonl") -> Path:
    """Path of a data file shipped in the package (``plora/data/<name>``)."""
    path = Path(__file__).resolve().parent / "data" / name
    if not path.is_file():
        raise ConfigError(
            "no such shipped data file",
            key="dataset.path",
            value=name,
            fix="use reverse_200.jsonl or your own .jsonl path",
        )
    return path


def task_corpus(num_examples: int = 2000, seed: int = 0) -> list[str]:
    """Plain text from every builtin task (prompt + completion), shuffled; used to pretrain
    the tiny base models so that LoRA fine-tuning has structure to adapt."""
    rng = random.Random(f"corpus:{seed}")
    texts = [
        row["prompt"] + row["completion"]
        for name in PRETRAIN_TASKS
        for row in TASKS[name].generate(num_examples, seed)
    ]
    rng.shuffle(texts)
    return texts


__all__ = [
    "NEGATIVE_WORDS",
    "NEUTRAL_WORDS",
    "POSITIVE_WORDS",
    "TASKS",
    "Task",
    "get_task",
    "make_arithmetic",
    "make_reverse",
    "make_sentiment",
    "shipped_data_path",
    "task_corpus",
]
