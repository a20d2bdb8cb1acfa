"""Held-out evaluation of one adapter: eval loss and the task metric.

For eval examples ``x`` with target positions ``T(x)`` (labels != -100 after the HF shift):

* **loss** -- token-weighted mean negative log-likelihood
  ``sum_x sum_{t in T(x)} -log p(x_t | x_<t) / sum_x |T(x)|`` (NaN when there is no target).
* **exact_match** -- greedy decoding from the prompt (batched, left-padded, KV cache), stopped
  at eos, at a newline or after ``max_new_tokens``; the decoded text up to the first newline,
  stripped of surrounding whitespace, must equal the stripped reference answer.
* **accuracy** -- for each label option ``o``, the score ``sum log p(tok(o) + eos | prompt)``
  (the same tokenization as training completions); the prediction is the arg-max option
  (ties: the first). Accuracy is the fraction of predictions equal to the example's label.

:func:`evaluate` takes any callable causal LM -- a plain HF model, a PEFT model, or a model with
plora's packed layers inside ``plora.engine.adapters.use_slot(model, slot)``. Many slots of a pack
are scored by :func:`plora.engine.evaluate_packed.evaluate_adapters` (packed forwards, or one
slot at a time through :func:`evaluate`, the reference the tests compare against). The model is put in eval mode (and restored afterwards) and run without gradients.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from plora.engine.data import IGNORE_INDEX, Example
from plora.engine.device import model_device


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalResult:
    """Evaluation of one adapter on the eval split.

    Attributes:
        loss: token-weighted mean eval NLL (nats); NaN when there are no target tokens.
        metric_name: ``"exact_match"``, ``"accuracy"`` or ``"none"``.
        metric_value: in [0, 1]; ``None`` when ``metric_name == "none"`` or no examples.
        num_examples: eval examples scored.
        seconds: wall seconds spent on this adapter; in a packed evaluation, the whole
            evaluation's wall time split by the adapter's share of the rows.
    """

    loss: float
    metric_name: str
    metric_value: float | None
    num_examples: int
    seconds: float = 0.0


def evaluate(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    metric: str,
    labels: Sequence[str] | None,
    batch_size: int = 32,
    max_new_tokens: int = 8,
) -> EvalResult:
    """Eval loss and task metric of ``model`` on ``examples``.

    Args:
        model: a causal LM called as ``model(input_ids=, attention_mask=, ...)`` returning
            logits ``[B, S, V]`` (or an object with ``.logits``).
        tokenizer: its tokenizer (pad/eos ids; decoding; label option encoding).
        examples: eval examples (see :class:`plora.engine.data.Example`).
        metric: ``"exact_match"``, ``"accuracy"`` or ``"none"``.
        labels: the label options (required for accuracy).
        batch_size: rows per forward.
        max_new_tokens: generation budget for exact match.
    """
    check_metric(metric, labels)
    examples = list(examples)
    start = time.perf_counter()
    with eval_mode(model):
        loss = eval_loss(model, examples, pad_id=_pad_id(tokenizer), batch_size=batch_size)
        value: float | None = None
        if examples and metric == "exact_match":
            value = exact_match(
                model, tokenizer, examples, batch_size=batch_size, max_new_tokens=max_new_tokens
            )
        elif examples and metric == "accuracy":
            value = label_accuracy(model, tokenizer, examples, labels or [], batch_size=batch_size)
    return EvalResult(
        loss=loss,
        metric_name=metric,
        metric_value=value,
        num_examples=len(examples),
        seconds=time.perf_counter() - start,
    )


def check_metric(metric: str, labels: Sequence[str] | None) -> None:
    """Raise ``ValueError`` for an unknown metric or accuracy without label options."""
    if metric not in ("exact_match", "accuracy", "none"):
        raise ValueError(f"unknown metric {metric!r}; use exact_match, accuracy or none")
    if metric == "accuracy" and not labels:
        raise ValueError("accuracy needs the label options (labels=[...])")


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """Eval mode (no dropout) and no gradients inside; the training flag is restored after."""
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if was_training and hasattr(model, "train"):
            model.train()


# ---------------------------------------------------------------------------- pieces


@torch.no_grad()
def eval_loss(
    model: Any, examples: Sequence[Example], *, pad_id: int, batch_size: int = 32
) -> float:
    """Token-weighted mean NLL over the examples' target tokens (NaN if none)."""
    total, count = 0.0, 0
    for chunk in _chunks(examples, batch_size):
        ids, mask = _right_pad([ex.input_ids for ex in chunk], pad_id, _device(model))
        labels, _ = _right_pad([ex.labels for ex in chunk], IGNORE_INDEX, ids.device)
        logits = _logits(model(input_ids=ids, attention_mask=mask))[:, :-1].float()
        target = labels[:, 1:]
        nll = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        total += float(nll)
        count += int((target != IGNORE_INDEX).sum())
    return total / count if count else math.nan


@torch.no_grad()
def generate_greedy(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    pad_id: int,
    stop_ids: Iterable[int],
    max_new_tokens: int,
) -> list[list[int]]:
    """Greedy continuations of left-padded ``prompts`` (one batch), each cut at its first stop id.

    Uses the model's KV cache when it returns ``past_key_values``; otherwise re-runs the whole
    sequence each step. Position ids follow the attention mask, so padding does not shift RoPE.
    """
    device = _device(model)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    ids, mask = ids.to(device), mask.to(device)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out = torch.empty((len(prompts), 0), dtype=torch.long, device=device)
    past, step_ids = None, ids
    for _ in range(max_new_tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        kwargs: dict[str, Any] = {
            "attention_mask": mask,
            "position_ids": pos if past is None else pos[:, -step_ids.shape[1] :],
        }
        if past is not None:
            kwargs["past_key_values"] = past
        res = model(input_ids=step_ids, use_cache=True, **kwargs)
        nxt = _logits(res)[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        out = torch.cat([out, nxt[:, None]], dim=1)
        done |= torch.isin(nxt, stops)
        if bool(done.all()):
            break
        past = getattr(res, "past_key_values", None)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], dim=1)
        step_ids = nxt[:, None] if past is not None else ids
    result = []
    stop_set = set(stops.tolist())
    for row in out.tolist():
        cut = next((i for i, t in enumerate(row) if t in stop_set), len(row))
        result.append(row[:cut])
    return result


def exact_match(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    batch_size: int = 32,
    max_new_tokens: int = 8,
) -> float:
    """Fraction of examples whose greedy answer equals ``example.answer`` (see module doc)."""
    stop_ids = set(_eos_ids(tokenizer)) | set(_newline_ids(tokenizer))
    hits = 0
    for chunk in _chunks(examples, batch_size):
        prompts = [ex.input_ids[: ex.context_len()] for ex in chunk]
        gens = generate_greedy(
            model,
            prompts,
            pad_id=_pad_id(tokenizer),
            stop_ids=stop_ids,
            max_new_tokens=max_new_tokens,
        )
        for ex, gen in zip(chunk, gens, strict=True):
            text = tokenizer.decode(gen, skip_special_tokens=True).split("\n")[0].strip()
            hits += text == (ex.answer or "").strip()
    return hits / len(examples)


@torch.no_grad()
def option_scores(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    options: Sequence[str],
    *,
    batch_size: int = 32,
) -> torch.Tensor:
    """``[N, K]`` log-likelihood of each option (its tokens + eos) after each example's prompt."""
    eos = _eos_ids(tokenizer)[:1]
    encoded = [list(tokenizer(o, add_special_tokens=False)["input_ids"]) + eos for o in options]
    seqs, spans = [], []
    for ex in examples:
        prompt = ex.input_ids[: ex.context_len()]
        for opt in encoded:
            seqs.append(prompt + opt)
            spans.append((len(prompt), len(prompt) + len(opt)))
    scores = []
    pad = _pad_id(tokenizer)
    for start in range(0, len(seqs), batch_size):
        chunk, chunk_spans = seqs[start : start + batch_size], spans[start : start + batch_size]
        ids, mask = _right_pad(chunk, pad, _device(model))
        logp = torch.log_softmax(_logits(model(input_ids=ids, attention_mask=mask)).float(), dim=-1)
        for r, (a, b) in enumerate(chunk_spans):
            pos = torch.arange(max(a, 1), b, device=ids.device)
            scores.append(float(logp[r, pos - 1, ids[r, pos]].sum()))
    return torch.tensor(scores).view(len(examples), len(options))


def label_accuracy(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    options: Sequence[str],
    *,
    batch_size: int = 32,
) -> float:
    """Fraction of examples whose best-scoring option is their label (see module doc)."""
    scores = option_scores(model, tokenizer, examples, options, batch_size=batch_size)
    pred: list[int] = scores.argmax(dim=1).tolist()
    hits = sum(
        options[p] == (ex.label if ex.label is not None else ex.answer)
        for p, ex in zip(pred, examples, strict=True)
    )
    return hits / len(examples)


def _chunks(items: Sequence[Example], size: int) -> Iterable[Sequence[Example]]:
    if size < 1:
        raise ValueError(f"batch_size={size} must be >= 1")
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _right_pad(
    seqs: Sequence[Sequence[int]], pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.tensor([list(s) + [pad] * (width - len(s)) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.long)
    return ids.to(device), mask.to(device)


def _logits(out: Any) -> torch.Tensor:
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out
    return logits


def _device(model: Any) -> torch.device:
    """:func:`~plora.engine.device.model_device` (a CPU-offloaded base: its GPU), CPU for
    something without parameters."""
    try:
        return model_device(model)
    except AttributeError:
        return torch.device("cpu")


def _pad_id(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def _eos_ids(tokenizer: Any) -> list[int]:
    return [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []


def _newline_ids(tokenizer: Any) -> list[int]:
    """Ids of tokens that are exactly a newline (one or more) -- stop tokens for generation."""
    ids = set()
    for text in ("\n", "\n\n"):
        enc = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(enc) == 1:
            ids.add(int(enc[0]))
    return sorted(ids)


__all__ = [
    "EvalResult",
    "check_metric",
    "eval_loss",
    "eval_mode",
    "evaluate",
    "exact_match",
    "generate_greedy",
    "label_accuracy",
    "option_scores",
]
