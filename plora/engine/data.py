"""Fine-tuning data: load and tokenize, split, stream per adapter, and pack a step's batch.

Pipeline::

    DatasetSpec ─► rows (JSONL file | save_to_disk dir | builtin task) ─► Example (token ids +
    aligned labels) ─► TokenizedDataset(train, eval, metric, labels)
    per adapter: AdapterStream(n, batch_size, seed).next_batch() ─► indices
    per step:    pack_batch([examples of slot 0, examples of slot 1, ...]) ─► PackedBatch

Row layouts (``format: auto`` detects each row; the first that applies wins):

* chat -- ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``,
  rendered with the tokenizer's chat template when it has one, otherwise with the plain
  template ``"<role>: <content>\\n"`` per turn where an assistant turn is
  ``"assistant: " + content + eos + "\\n"``. Loss on the assistant turns (content and
  end-of-turn) only.
* prompt/completion -- ``{"prompt": str, "completion": str}``: ``ids = tok(prompt) +
  tok(completion, add_special_tokens=False) + [eos]``; loss on the completion and eos.
* text -- ``{"text": str}``: ``ids = tok(text) + [eos]``; loss on every token.

With ``completion_only: false`` every non-padding token is trained. Labels are aligned with
``input_ids`` (HF convention: the model shifts them), ``-100`` where masked. Examples longer
than ``max_seq_len`` are cut on the right; a training example left with no target token is
dropped (all dropped is an error).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from plora.config import ConfigError
from plora.engine.tasks import get_task

if TYPE_CHECKING:
    from plora.config import DatasetSpec

IGNORE_INDEX = -100
#: ``metric: auto`` scores a prompt/completion set by accuracy when it has at most this many
#: distinct completions (and every eval completion is one of the training ones).
MAX_AUTO_LABELS = 10
_T = TypeVar("_T")


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


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizedDataset:
    """Train and eval examples plus how the eval split is scored.

    Attributes:
        metric: ``"exact_match"``, ``"accuracy"`` or ``"none"``.
        labels: the label options when ``metric == "accuracy"``.
    """

    train: list[Example]
    eval: list[Example]
    metric: str
    labels: list[str] | None = None


@dataclass(frozen=True, slots=True)
class _Row:
    data: dict[str, Any]
    file: str
    line: int  # 1-based JSONL line, or 1-based row index of a save_to_disk dataset


# ---------------------------------------------------------------------------- loading


def load_dataset(spec: DatasetSpec, tokenizer: Any) -> TokenizedDataset:
    """Read, tokenize and split the dataset ``spec`` describes.

    Builtin tasks generate ``num_examples`` training rows plus ``ceil(num_examples *
    eval_fraction)`` eval rows from ``seed``. Files are split by ``eval_path`` when given, else a
    ``validation``/``test`` split of a saved ``DatasetDict``, else a seeded random
    ``eval_fraction`` of the rows (deterministic in ``seed``).

    Raises:
        ConfigError: missing file, empty dataset, a row without usable fields (file, line
            and key in the message), an impossible metric, or ``max_seq_len`` too small.
    """
    labels: list[str] | None = None
    if spec.builtin is not None:
        task = get_task(spec.builtin)
        n_eval = math.ceil(spec.num_examples * spec.eval_fraction)
        rows = [_Row(r, f"builtin:{task.name}", i + 1) for i, r in enumerate(task.generate(spec.num_examples + n_eval, spec.seed))]  # fmt: skip
        if spec.eval_path is not None:
            train_rows, eval_rows = (
                rows[: spec.num_examples],
                _read_rows(spec.eval_path, spec.format),
            )
        else:
            train_rows, eval_rows = _split(rows, n_eval, spec.seed)
        metric = task.metric if spec.metric == "auto" else spec.metric
        labels = list(task.labels) if task.labels else None
    else:
        train_rows, extra_eval = _read_path(spec.path, spec.format)
        if spec.eval_path is not None:
            eval_rows = _read_rows(spec.eval_path, spec.format)
        elif extra_eval is not None:
            eval_rows = extra_eval
        else:
            n_eval = round(len(train_rows) * spec.eval_fraction)
            if spec.eval_fraction > 0 and len(train_rows) >= 2:
                n_eval = min(max(n_eval, 1), len(train_rows) - 1)
            train_rows, eval_rows = _split(train_rows, n_eval, spec.seed)
        metric = spec.metric
    train = [_encode(r, tokenizer, spec) for r in train_rows]
    evals = [_encode(r, tokenizer, spec) for r in eval_rows]
    metric, labels = _resolve_metric(metric, labels, train, evals, spec)
    if metric == "accuracy":
        train = [_with_label(ex) for ex in train]
        evals = [_with_label(ex) for ex in evals]
    kept = [ex for ex in train if any(y != IGNORE_INDEX for y in ex.labels[1:])]
    if not kept:
        raise ConfigError(
            "no training example keeps a target token after truncation",
            key="dataset.max_seq_len", value=spec.max_seq_len,
            fix="raise max_seq_len above the prompt length",
        )  # fmt: skip
    return TokenizedDataset(train=kept, eval=evals, metric=metric, labels=labels)


def _split(rows: list[_Row], n_eval: int, seed: int) -> tuple[list[_Row], list[_Row]]:
    """Seeded split: a permutation's first ``n_eval`` rows are eval; both keep file order."""
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(rows))
    held = set(order[:n_eval].tolist())
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]  # fmt: skip


def _read_path(path: str, fmt: str) -> tuple[list[_Row], list[_Row] | None]:
    p = Path(path).expanduser()
    if p.is_dir():
        return _read_disk(p)
    if fmt == "disk":
        raise ConfigError("format disk needs a directory written by datasets.save_to_disk",
                          key="dataset.path", value=path, fix="point path to that directory or use format: auto")  # fmt: skip
    return _read_rows(path, fmt), None


def _read_rows(path: str, fmt: str) -> list[_Row]:
    """Rows of a JSONL file (or a save_to_disk dir's train split)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return _read_disk(p)[0]
    if not p.is_file():
        raise ConfigError("dataset file not found", key="dataset.path", value=path,
                          fix="create it or fix the path (relative paths are relative to the sweep file)")  # fmt: skip
    rows: list[_Row] = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"invalid JSON ({err.msg} at column {err.colno})", file=path,
                                  line=n, fix="write one JSON object per line") from None  # fmt: skip
            if not isinstance(data, dict):
                raise ConfigError(f"row is a {type(data).__name__}, not a JSON object", file=path,
                                  line=n, fix='write rows like {"prompt": "...", "completion": "..."}')  # fmt: skip
            rows.append(_Row(data, str(path), n))
    if not rows:
        raise ConfigError("dataset is empty", key="dataset.path", value=path,
                          fix="add JSON lines with text, prompt+completion or messages")  # fmt: skip
    return rows


def _read_disk(p: Path) -> tuple[list[_Row], list[_Row] | None]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"not a datasets.save_to_disk directory ({err})", key="dataset.path",
                          value=str(p), fix="save it with Dataset.save_to_disk or give a .jsonl file") from None  # fmt: skip
    evals = None
    if isinstance(ds, datasets.DatasetDict):
        train_name = "train" if "train" in ds else next(iter(ds))
        eval_name = next((s for s in ("validation", "test", "eval") if s in ds), None)
        if eval_name is not None:
            evals = [_Row(dict(r), f"{p}[{eval_name}]", i + 1) for i, r in enumerate(ds[eval_name])]
        ds = ds[train_name]
    rows = [_Row(dict(r), str(p), i + 1) for i, r in enumerate(ds)]
    if not rows:
        raise ConfigError("dataset is empty", key="dataset.path", value=str(p),
                          fix="save a dataset with at least one row")  # fmt: skip
    return rows, evals


# ---------------------------------------------------------------------------- encoding


def _layout(row: _Row, fmt: str) -> str:
    data = row.data
    found = {
        "chat": "messages" in data,
        "prompt_completion": "prompt" in data and "completion" in data,
        "text": "text" in data,
    }
    if fmt in found:
        if found[fmt]:
            return fmt
        need = {"chat": "'messages'", "prompt_completion": "'prompt' and 'completion'", "text": "'text'"}[fmt]  # fmt: skip
        raise ConfigError(f"row has no {need} (format: {fmt}); keys: {', '.join(map(str, data)) or 'none'}",
                          file=row.file, line=row.line, fix=f"give every row {need} or set format: auto")  # fmt: skip
    for layout, ok in found.items():
        if ok:
            return layout
    raise ConfigError(f"row has no usable fields (keys: {', '.join(map(str, data)) or 'none'})",
                      file=row.file, line=row.line,
                      fix="give each row 'text', or 'prompt' and 'completion', or chat 'messages'")  # fmt: skip


def _field(row: _Row, key: str) -> str:
    value = row.data[key]
    if not isinstance(value, str):
        raise ConfigError(f"must be a string, not {type(value).__name__}", key=key, value=value,
                          file=row.file, line=row.line, fix="quote the value as a JSON string")  # fmt: skip
    return value


def _encode(row: _Row, tok: Any, spec: DatasetSpec) -> Example:
    layout = _layout(row, spec.format)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if layout == "text":
        ids = _ids(tok, _field(row, "text"), special=True) + eos
        ex = Example(input_ids=ids, labels=list(ids), prompt="", answer=None, prompt_len=0)
    elif layout == "prompt_completion":
        prompt, completion = _field(row, "prompt"), _field(row, "completion")
        p = _ids(tok, prompt, special=True)
        c = _ids(tok, completion, special=False) + eos
        ex = Example(input_ids=p + c, labels=[IGNORE_INDEX] * len(p) + c, prompt=prompt,
                     answer=completion, label=row.data.get("label"), prompt_len=len(p))  # fmt: skip
    else:
        ex = _encode_chat(row, tok, eos)
    if not spec.completion_only:
        ex = _replace(ex, labels=list(ex.input_ids))
    n = spec.max_seq_len
    if len(ex.input_ids) > n:
        ex = _replace(ex, input_ids=ex.input_ids[:n], labels=ex.labels[:n], prompt_len=min(ex.prompt_len or 0, n))  # fmt: skip
    return ex


def _encode_chat(row: _Row, tok: Any, eos: list[int]) -> Example:
    msgs = row.data["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ConfigError("must be a non-empty list of {role, content} objects", key="messages",
                          file=row.file, line=row.line, fix='e.g. [{"role": "user", "content": "hi"}, ...]')  # fmt: skip
    for i, m in enumerate(msgs):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise ConfigError("needs string 'role' and 'content'", key=f"messages[{i}]", value=m,
                              file=row.file, line=row.line, fix='write {"role": "user", "content": "..."}')  # fmt: skip
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not turns:
        raise ConfigError("has no assistant turn to train on", key="messages", file=row.file,
                          line=row.line, fix='add a {"role": "assistant", "content": "..."} message')  # fmt: skip
    pieces: list[tuple[list[int], bool]] = []  # (ids, trained)
    if getattr(tok, "chat_template", None):
        done = ""
        for i in turns:
            head = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            full = tok.apply_chat_template(msgs[: i + 1], tokenize=False)
            if not (head.startswith(done) and full.startswith(head)):
                raise ConfigError("the tokenizer's chat template does not render turns as prefixes",
                                  key="messages", file=row.file, line=row.line,
                                  fix="use prompt/completion rows for this tokenizer")  # fmt: skip
            pieces += [(_ids(tok, head[len(done) :], special=False), False),
                       (_ids(tok, full[len(head) :], special=False), True)]  # fmt: skip
            done = full
        prompt_text = head
    else:
        text, first = "", True
        for m in msgs[: turns[-1] + 1]:
            head = "assistant: " if m["role"] == "assistant" else f"{m['role']}: {m['content']}\n"
            pieces.append((_ids(tok, head, special=first), False))
            text, first = text + head, False
            if m["role"] == "assistant":
                pieces.append((_ids(tok, m["content"], special=False) + eos, True))
                prompt_text = text
                text += m["content"] + "\n"
                pieces.append((_ids(tok, "\n", special=False), False))
        pieces.pop()  # the newline after the last assistant turn
    ids, labels = [], []
    for piece, trained in pieces:
        ids += piece
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    last = msgs[turns[-1]]["content"]
    prompt_len = len(ids) - len(pieces[-1][0])
    return Example(input_ids=ids, labels=labels, prompt=prompt_text, answer=last, prompt_len=prompt_len)  # fmt: skip


def _ids(tok: Any, text: str, *, special: bool) -> list[int]:
    return list(tok(text, add_special_tokens=special)["input_ids"])


def _replace(ex: Example, **changes: Any) -> Example:
    import dataclasses

    return dataclasses.replace(ex, **changes)


def _with_label(ex: Example) -> Example:
    return ex if ex.label is not None else _replace(ex, label=ex.answer)


def _resolve_metric(
    metric: str, labels: list[str] | None, train: list[Example], evals: list[Example], spec: Any
) -> tuple[str, list[str] | None]:
    answers = [ex.answer for ex in train + evals]
    has_answers = all(a is not None for a in answers)
    if metric == "auto":
        if not has_answers:
            return "none", None
        distinct = sorted({a for a in answers if a is not None})
        in_train = {ex.answer for ex in train}
        if 2 <= len(distinct) <= MAX_AUTO_LABELS and all(ex.answer in in_train for ex in evals):
            return "accuracy", distinct
        return "exact_match", None
    if metric in ("exact_match", "accuracy") and not has_answers:
        raise ConfigError("needs prompt/completion or chat rows, but some rows are plain text",
                          key="dataset.metric", value=metric, fix="use metric: none for text data")  # fmt: skip
    if metric == "accuracy" and labels is None:
        labels = sorted({a for a in answers if a is not None})
        if len(labels) < 2:
            raise ConfigError("accuracy needs at least two distinct completions (the label options)",
                              key="dataset.metric", value=metric, fix="use exact_match or none")  # fmt: skip
    return metric, labels if metric == "accuracy" else None


# ---------------------------------------------------------------------------- streaming


class AdapterStream:
    """One adapter's infinite, epoch-wise shuffled stream of example indices.

    Epoch ``e`` visits ``permutation(num_examples, seed, e)`` in order, ``batch_size`` indices
    at a time; the last batch of an epoch is shorter (or skipped with ``drop_last``). The order
    depends only on ``(num_examples, seed)``, so an adapter trained alone and the same adapter
    in a pack see the same batches.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int, *, drop_last: bool = False) -> None:  # fmt: skip
        if num_examples < 1:
            raise ConfigError("the training split is empty", key="dataset", value=num_examples, fix="give it at least one example")  # fmt: skip
        if batch_size < 1:
            raise ConfigError("must be >= 1", key="batch_size", value=batch_size)
        if drop_last and batch_size > num_examples:
            raise ConfigError(f"is larger than the {num_examples} training examples with drop_last",
                              key="batch_size", value=batch_size, fix="lower batch_size or add data")  # fmt: skip
        self.num_examples, self.batch_size, self.seed, self.drop_last = num_examples, batch_size, seed, drop_last  # fmt: skip
        self.epoch = 0  # completed passes = the epoch the next batch comes from
        self.position = 0  # offset of the next batch in the epoch's permutation
        self.steps = 0  # batches drawn so far
        self.examples_seen = 0
        self._order = self.permutation(num_examples, seed, 0)

    @staticmethod
    def permutation(num_examples: int, seed: int, epoch: int) -> list[int]:
        """The visiting order of ``epoch`` (NumPy PCG64 seeded by ``(seed, epoch)``)."""
        return np.random.default_rng([seed, epoch]).permutation(num_examples).tolist()

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
        keys = ("num_examples", "batch_size", "seed", "drop_last", "epoch", "position", "steps", "examples_seen")  # fmt: skip
        return {k: getattr(self, k) for k in keys}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`get_state` output; the stream's identity must match."""
        for key in ("num_examples", "batch_size", "seed", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(f"stream state has {key}={state[key]!r}, this stream {getattr(self, key)!r}")  # fmt: skip
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
        return PackedBatch(input_ids=self.input_ids.to(device), attention_mask=self.attention_mask.to(device),
                           labels=self.labels.to(device), segments=self.segments)  # fmt: skip

    def target_tokens(self) -> dict[int, int]:
        """``{slot: number of predicted tokens}`` (labels after the HF shift that are not -100)."""
        valid = (self.labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
        return {s.slot: int(valid[s.start : s.stop].sum()) for s in self.segments}


def pack_batch(rows: Sequence[Sequence[Example]], pad_id: int, *, pad_to_multiple_of: int | None = None) -> PackedBatch:  # fmt: skip
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


__all__ = [
    "IGNORE_INDEX",
    "AdapterStream",
    "Example",
    "PackedBatch",
    "Segment",
    "TokenizedDataset",
    "load_dataset",
    "micro_batches",
    "pack_batch",
]
