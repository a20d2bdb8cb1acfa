"""Fine-tuning data: load and tokenize, split, stream per adapter, and pack a step's batch.

Pipeline::

    DatasetSpec ─► rows (JSONL file | save_to_disk dir | builtin task) ─► Example (token ids +
    aligned labels) ─► TokenizedDataset(train, eval, metric, labels)
    per adapter: AdapterStream(n, batch_size, seed).next_batch() ─► indices
    per step:    pack_batch([examples of slot 0, examples of slot 1, ...]) ─► PackedBatch

Reading raw rows lives in :mod:`plora.engine.rows`; :class:`Example` in
:mod:`plora.engine.example`; streams and packing in :mod:`plora.engine.batch` (all re-exported
here).

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
than ``max_seq_len`` are cut on the right; an example (train or eval) left with no target token
is left out (all training examples left out is an error). :class:`DataReport` counts both per
split (``TokenizedDataset.report``). A chat role other than those of :data:`CHAT_ROLES` is an
error naming the row (``human``/``gpt`` of ShareGPT files must be mapped first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plora.config import ConfigError
from plora.engine.batch import (
    AdapterStream,
    PackedBatch,
    Segment,
    micro_batches,
    pack_batch,
)
from plora.engine.data_report import DataReport, SplitReport
from plora.engine.example import IGNORE_INDEX, Example
from plora.engine.rows import Row, read_path, read_rows, split_rows
from plora.tasks import get_task

if TYPE_CHECKING:
    from plora.config import DatasetSpec

#: Chat roles a ``messages`` row may use (loss on ``assistant`` turns only).
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

#: ``metric: auto`` scores a prompt/completion set by accuracy when it has at most this many
#: distinct completions (and every eval completion is one of the training ones).
MAX_AUTO_LABELS = 10


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
    report: DataReport | None = None
    """Rows read, cut and left out per split (None: built without :func:`load_dataset`)."""


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
        rows = [
            Row(r, f"builtin:{task.name}", i + 1)
            for i, r in enumerate(task.generate(spec.num_examples + n_eval, spec.seed))
        ]
        if spec.eval_path is not None:
            train_rows, eval_rows = (
                rows[: spec.num_examples],
                read_rows(spec.eval_path, spec.format),
            )
        else:
            train_rows, eval_rows = split_rows(rows, n_eval, spec.seed)
        metric = task.metric if spec.metric == "auto" else spec.metric
        labels = list(task.labels) if task.labels else None
    else:
        assert spec.path is not None  # DatasetSpec holds exactly one of builtin and path
        train_rows, extra_eval = read_path(spec.path, spec.format)
        if spec.eval_path is not None:
            eval_rows = read_rows(spec.eval_path, spec.format)
        elif extra_eval is not None:
            eval_rows = extra_eval
        else:
            n_eval = round(len(train_rows) * spec.eval_fraction)
            if spec.eval_fraction > 0 and len(train_rows) >= 2:
                n_eval = min(max(n_eval, 1), len(train_rows) - 1)
            train_rows, eval_rows = split_rows(train_rows, n_eval, spec.seed)
        metric = spec.metric
    train_lens = [_encode(r, tokenizer, spec) for r in train_rows]
    eval_lens = [_encode(r, tokenizer, spec) for r in eval_rows]
    train, evals = [ex for ex, _ in train_lens], [ex for ex, _ in eval_lens]
    metric, labels = _resolve_metric(metric, labels, train, evals, spec)
    if metric == "accuracy":
        train = [_with_label(ex) for ex in train]
        evals = [_with_label(ex) for ex in evals]
    kept = [ex for ex in train if _has_target(ex)]
    if not kept:
        raise ConfigError(
            "no training example keeps a target token after truncation",
            key="dataset.max_seq_len",
            value=spec.max_seq_len,
            fix="raise max_seq_len above the prompt length",
        )
    report = DataReport(
        max_seq_len=spec.max_seq_len,
        train=_split_report(train, [n for _, n in train_lens], spec.max_seq_len),
        eval=_split_report(evals, [n for _, n in eval_lens], spec.max_seq_len),
    )
    scored = [ex for ex in evals if _has_target(ex)]
    return TokenizedDataset(train=kept, eval=scored, metric=metric, labels=labels, report=report)


def _has_target(ex: Example) -> bool:
    """Whether a label is left to predict (the model shifts labels: position 0 predicts none)."""
    return any(y != IGNORE_INDEX for y in ex.labels[1:])


def _split_report(examples: list[Example], lengths: list[int], max_seq_len: int) -> SplitReport:
    return SplitReport(
        rows=len(examples),
        truncated=sum(n > max_seq_len for n in lengths),
        dropped=sum(not _has_target(ex) for ex in examples),
        longest=max(lengths, default=0),
    )


# ---------------------------------------------------------------------------- encoding


def _layout(row: Row, fmt: str) -> str:
    data = row.data
    found = {
        "chat": "messages" in data,
        "prompt_completion": "prompt" in data and "completion" in data,
        "text": "text" in data,
    }
    if fmt in found:
        if found[fmt]:
            return fmt
        need = {
            "chat": "'messages'",
            "prompt_completion": "'prompt' and 'completion'",
            "text": "'text'",
        }[fmt]
        raise ConfigError(
            f"row has no {need} (format: {fmt}); keys: {', '.join(map(str, data)) or 'none'}",
            file=row.file,
            line=row.line,
            fix=f"give every row {need} or set format: auto",
        )
    for layout, ok in found.items():
        if ok:
            return layout
    raise ConfigError(
        f"row has no usable fields (keys: {', '.join(map(str, data)) or 'none'})",
        file=row.file,
        line=row.line,
        fix="give each row 'text', or 'prompt' and 'completion', or chat 'messages'",
    )


def _field(row: Row, key: str) -> str:
    value = row.data[key]
    if not isinstance(value, str):
        raise ConfigError(
            f"must be a string, not {type(value).__name__}",
            key=key,
            value=value,
            file=row.file,
            line=row.line,
            fix="quote the value as a JSON string",
        )
    return value


def _encode(row: Row, tok: Any, spec: DatasetSpec) -> tuple[Example, int]:
    """The row's example, cut to ``max_seq_len``, and its length in tokens before the cut."""
    layout = _layout(row, spec.format)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if layout == "text":
        ids = _ids(tok, _field(row, "text"), special=True) + eos
        ex = Example(input_ids=ids, labels=list(ids), prompt="", answer=None, prompt_len=0)
    elif layout == "prompt_completion":
        prompt, completion = _field(row, "prompt"), _field(row, "completion")
        p = _ids(tok, prompt, special=True)
        c = _ids(tok, completion, special=False) + eos
        ex = Example(
            input_ids=p + c,
            labels=[IGNORE_INDEX] * len(p) + c,
            prompt=prompt,
            answer=completion,
            label=row.data.get("label"),
            prompt_len=len(p),
        )
    else:
        ex = _encode_chat(row, tok, eos)
    if not spec.completion_only:
        ex = _replace(ex, labels=list(ex.input_ids))
    n, full = spec.max_seq_len, len(ex.input_ids)
    if full > n:
        ex = _replace(
            ex,
            input_ids=ex.input_ids[:n],
            labels=ex.labels[:n],
            prompt_len=min(ex.prompt_len or 0, n),
        )
    return ex, full


def _encode_chat(row: Row, tok: Any, eos: list[int]) -> Example:
    msgs = row.data["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ConfigError(
            "must be a non-empty list of {role, content} objects",
            key="messages",
            file=row.file,
            line=row.line,
            fix='e.g. [{"role": "user", "content": "hi"}, ...]',
        )
    for i, m in enumerate(msgs):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise ConfigError(
                "needs string 'role' and 'content'",
                key=f"messages[{i}]",
                value=m,
                file=row.file,
                line=row.line,
                fix='write {"role": "user", "content": "..."}',
            )
        if m["role"] not in CHAT_ROLES:
            raise ConfigError(
                f"unknown chat role (roles: {', '.join(CHAT_ROLES)})",
                key=f"messages[{i}].role",
                value=m["role"],
                file=row.file,
                line=row.line,
                fix="rename it (e.g. human -> user, gpt -> assistant) or drop the message",
            )
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not turns:
        raise ConfigError(
            "has no assistant turn to train on",
            key="messages",
            file=row.file,
            line=row.line,
            fix='add a {"role": "assistant", "content": "..."} message',
        )
    pieces: list[tuple[list[int], bool]] = []  # (ids, trained)
    if getattr(tok, "chat_template", None):
        done = ""
        for i in turns:
            head = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            full = tok.apply_chat_template(msgs[: i + 1], tokenize=False)
            if not (head.startswith(done) and full.startswith(head)):
                raise ConfigError(
                    "the tokenizer's chat template does not render turns as prefixes",
                    key="messages",
                    file=row.file,
                    line=row.line,
                    fix="use prompt/completion rows for this tokenizer",
                )
            pieces += [
                (_ids(tok, head[len(done) :], special=False), False),
                (_ids(tok, full[len(head) :], special=False), True),
            ]
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
    return Example(
        input_ids=ids, labels=labels, prompt=prompt_text, answer=last, prompt_len=prompt_len
    )


def _ids(tok: Any, text: str, *, special: bool) -> list[int]:
    # verbose=False: no "longer than the model's maximum length" warning per long row; rows are
    # cut to dataset.max_seq_len here, never fed whole to the model
    return list(tok(text, add_special_tokens=special, verbose=False)["input_ids"])


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
        raise ConfigError(
            "needs prompt/completion or chat rows, but some rows are plain text",
            key="dataset.metric",
            value=metric,
            fix="use metric: none for text data",
        )
    if metric == "accuracy" and labels is None:
        labels = sorted({a for a in answers if a is not None})
        if len(labels) < 2:
            raise ConfigError(
                "accuracy needs at least two distinct completions (the label options)",
                key="dataset.metric",
                value=metric,
                fix="use exact_match or none",
            )
    return metric, labels if metric == "accuracy" else None


__all__ = [
    "CHAT_ROLES",
    "IGNORE_INDEX",
    "AdapterStream",
    "DataReport",
    "Example",
    "PackedBatch",
    "Segment",
    "TokenizedDataset",
    "load_dataset",
    "micro_batches",
    "pack_batch",
]
