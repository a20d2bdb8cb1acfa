"""Packed evaluation: the eval loss and task metric of many adapters in shared forwards.

:func:`evaluate_adapters` scores slots of a pack, by default with :func:`evaluate_packed`.

The per-adapter math is that of :mod:`plora.engine.evaluate` (loss, exact match, accuracy);
only the batching changes. The rows of a forward are ``(slot, example)`` pairs --
``(slot, example, option)`` for accuracy -- ordered by slot, so each slot's rows are
contiguous, at most ``batch_size`` rows (and ``max_tokens`` padded tokens) per forward, and
routed with :func:`plora.engine.adapters.packed_segments`. In every packed layer, a row ``x_r`` of
slot ``i`` computes ::

    y_r = x_r·Wᵀ + b + s_i·(x_r·A_iᵀ)·B_iᵀ          (slot None, the base model: y_r = x_r·Wᵀ + b)

in eval mode (no dropout) and without gradients. A row attends only to its own tokens (causal
attention, padding masked; left padding and mask-derived position ids for generation), so a
slot's numbers equal the slot evaluated alone (``evaluate_adapters(..., packed=False)``) up to
floating-point summation order; greedy decoding keeps every row in place across decode steps,
so the per-row routing holds with the KV cache.

Order. Within a slot, examples run in length order -- ascending for slots at even positions,
descending at odd ones -- so a forward straddling two slots joins rows of similar length.
Per-slot sums do not depend on the order. The rows and their cut into forwards are
:mod:`plora.engine.eval_rows`.

Scored rows (the loss, label accuracy). Where the model's logits are ``head(h)`` and nothing
more (:func:`plora.engine.causal_lm.plain_head_parts`: the families plora trains), a forward runs
the decoder body alone, as the training step does, takes the hidden states that predict the
scored tokens and applies the head to those only, a bounded chunk at a time, with the NLL in
float32 (:func:`plora.engine.loss.token_nll`): the rows × width × vocab logits never exist.
Rows are right-padded and attention is causal, so no scored position attends to padding: under
HF's SDPA attention the forward passes no mask (:func:`plora.engine.attention.causal_only`, as
the graphed training step: flash attention on CUDA), unless a sliding window shorter than the
padded width needs the mask. Any other model (a pipeline stage, post-processed logits) runs
whole, with the mask, and its logits are picked at the scored positions: the reference path
(``packed_loss(..., full_logits=True)``), which the tests compare with.

Host work. A forward's tensors (ids, mask, and for every scored token the flat index of the
hidden state (logit) that predicts it, the token and the sum it goes to) are built on the host
in one go and copied once; log-probabilities are summed on the device (``index_add_``) and read
back once.
Greedy decoding syncs once per decode step (its all-done test), as
:func:`~plora.engine.evaluate.generate_greedy` does.

Time. ``EvalResult.seconds`` is the wall time of the whole packed evaluation split by each
slot's share of the rows; every slot scores the same examples, so the shares are equal.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plora.engine.adapters import packed_layers, packed_segments, use_slot
from plora.engine.attention import causal_only
from plora.engine.causal_lm import plain_head_parts
from plora.engine.data import IGNORE_INDEX, Example, TokenizedDataset
from plora.engine.device import to_device
from plora.engine.eval_rows import (
    EVAL_BATCH_ROWS,
    EVAL_MAX_TOKENS,
    EvalRow,
    Slot,
    chunk_segments,
    even_forwards,
    length_order,
    recut_after_oom,
)
from plora.engine.evaluate import (
    EvalResult,
    _device,
    _eos_ids,
    _logits,
    _newline_ids,
    _pad_id,
    check_metric,
    eval_mode,
    evaluate,
    generate_greedy,
)
from plora.engine.loss import token_nll

log = logging.getLogger(__name__)


def evaluate_packed(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    slots: Iterable[Slot],
    *,
    metric: str,
    labels: Sequence[str] | None,
    batch_size: int = EVAL_BATCH_ROWS,
    max_new_tokens: int = 8,
    max_tokens: int | None = EVAL_MAX_TOKENS,
) -> dict[Slot, EvalResult]:
    """Eval loss and task metric of every slot in ``slots``, all slots in the same forwards.

    Args:
        model: a model with plora packed LoRA layers (``plora.engine.adapters.inject``).
        tokenizer: its tokenizer (pad/eos ids; decoding; label option encoding).
        examples: eval examples, the same for every slot.
        slots: slots to evaluate (duplicates are scored once); ``None`` is the base model.
        metric: ``"exact_match"``, ``"accuracy"`` or ``"none"``.
        labels: the label options (required for accuracy).
        batch_size: rows per forward (rows of several slots share a forward).
        max_new_tokens: generation budget for exact match.
        max_tokens: also cap the padded tokens of a forward (rows x width, the generation
            budget included); ``None``: rows only.

    Returns:
        ``{slot: EvalResult}`` in the order of ``slots``.
    """
    check_metric(metric, labels)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    wanted = list(dict.fromkeys(slots))
    examples = list(examples)
    start = time.perf_counter()
    losses = [math.nan] * len(wanted)
    values: Sequence[float | None] = [None] * len(wanted)
    with eval_mode(model):
        if examples and wanted:
            losses = packed_loss(model, examples, wanted, pad_id=_pad_id(tokenizer),
                                 batch_size=batch_size, max_tokens=max_tokens)  # fmt: skip
            if metric == "exact_match":
                values = packed_exact_match(
                    model, tokenizer, examples, wanted, max_new_tokens=max_new_tokens,
                    batch_size=batch_size, max_tokens=max_tokens,
                )  # fmt: skip
            elif metric == "accuracy":
                values = packed_accuracy(model, tokenizer, examples, wanted, labels or [],
                                         batch_size=batch_size, max_tokens=max_tokens)  # fmt: skip
    share = (time.perf_counter() - start) / max(len(wanted), 1)
    return {
        slot: EvalResult(
            loss=losses[g],
            metric_name=metric,
            metric_value=values[g],
            num_examples=len(examples),
            seconds=share,
        )
        for g, slot in enumerate(wanted)
    }


def packed_loss(
    model: Any,
    examples: Sequence[Example],
    slots: Sequence[Slot],
    *,
    pad_id: int,
    batch_size: int = EVAL_BATCH_ROWS,
    max_tokens: int | None = EVAL_MAX_TOKENS,
    full_logits: bool = False,
) -> list[float]:
    """Per slot, the token-weighted mean NLL over the examples' target tokens (NaN if none).

    ``full_logits=True`` scores from the whole model's logits (with the padding mask) even where
    the head could run at the scored positions alone: the reference path (see the module).
    """
    scored = [
        [
            p
            for p in range(1, min(len(ex.input_ids), len(ex.labels)))
            if ex.labels[p] != IGNORE_INDEX
        ]
        for ex in examples
    ]
    count = sum(map(len, scored))
    if not count:
        return [math.nan] * len(slots)
    order = length_order([len(ex.input_ids) for ex in examples])
    rows = [
        EvalRow(group=g, slot=slot, ids=examples[i].input_ids, scored=scored[i], dest=g)
        for g, slot in enumerate(slots)
        for i in order[g % 2]
        if scored[i]
    ]
    sums = _score_rows(model, rows, size=len(slots), pad_id=pad_id, batch_size=batch_size,
                       max_tokens=max_tokens, full_logits=full_logits)  # fmt: skip
    return [-s / count for s in sums.tolist()]


def packed_accuracy(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    slots: Sequence[Slot],
    options: Sequence[str],
    *,
    batch_size: int = EVAL_BATCH_ROWS,
    max_tokens: int | None = EVAL_MAX_TOKENS,
) -> list[float]:
    """Per slot, the fraction of examples whose best-scoring option is their label.

    An option's score is ``sum log p(tok(option) + eos | prompt)``, the arg-max the prediction
    (ties: the first option), as :func:`plora.engine.evaluate.label_accuracy`.
    """
    eos = _eos_ids(tokenizer)[:1]
    encoded = [list(tokenizer(o, add_special_tokens=False)["input_ids"]) + eos for o in options]
    prompts = [ex.input_ids[: ex.context_len()] for ex in examples]
    seqs = [[p + o for o in encoded] for p in prompts]
    n, k = len(examples), len(options)
    order = length_order([len(p) for p in prompts])
    rows = [
        EvalRow(
            group=g,
            slot=slot,
            ids=seqs[i][j],
            scored=range(max(len(prompts[i]), 1), len(seqs[i][j])),
            dest=(g * n + i) * k + j,
        )
        for g, slot in enumerate(slots)
        for i in order[g % 2]
        for j in range(k)
    ]
    rows = [r for r in rows if r.scored]  # a row with nothing to score adds 0
    scores = _score_rows(
        model,
        rows,
        size=len(slots) * n * k,
        pad_id=_pad_id(tokenizer),
        batch_size=batch_size,
        max_tokens=max_tokens,
    )
    pred = scores.view(len(slots), n, k).argmax(dim=-1).tolist()
    truth = [ex.label if ex.label is not None else ex.answer for ex in examples]
    return [sum(options[p] == t for p, t in zip(pg, truth, strict=True)) / n for pg in pred]


def packed_exact_match(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    slots: Sequence[Slot],
    *,
    batch_size: int = EVAL_BATCH_ROWS,
    max_new_tokens: int = 8,
    max_tokens: int | None = EVAL_MAX_TOKENS,
) -> list[float]:
    """Per slot, the fraction of examples whose greedy answer equals ``example.answer``.

    Greedy decoding of all slots' rows together (left padding, KV cache, each row through its
    own adapter); stop and comparison rules of :func:`plora.engine.evaluate.exact_match`.
    """
    stop_ids = set(_eos_ids(tokenizer)) | set(_newline_ids(tokenizer))
    prompts = [ex.input_ids[: ex.context_len()] for ex in examples]
    answers = [(ex.answer or "").strip() for ex in examples]
    order = length_order([len(p) for p in prompts])
    rows = [
        EvalRow(group=g, slot=slot, ids=prompts[i], dest=i)
        for g, slot in enumerate(slots)
        for i in order[g % 2]
    ]
    hits = [0] * len(slots)
    texts: dict[tuple[int, ...], str] = {}  # adapters often agree: decode each answer once
    for chunk in even_forwards(rows, batch_size, max_tokens, extra=max_new_tokens):
        with packed_segments(model, chunk_segments(chunk)):
            gens = generate_greedy(
                model,
                [r.ids for r in chunk],
                pad_id=_pad_id(tokenizer),
                stop_ids=stop_ids,
                max_new_tokens=max_new_tokens,
            )
        for row, gen in zip(chunk, gens, strict=True):
            key = tuple(gen)
            if key not in texts:
                texts[key] = tokenizer.decode(gen, skip_special_tokens=True).split("\n")[0].strip()
            hits[row.group] += texts[key] == answers[row.dest]
    return [h / len(examples) for h in hits]


# ---------------------------------------------------------------------------- pieces


def _score_rows(
    model: Any,
    rows: Sequence[EvalRow],
    *,
    size: int,
    pad_id: int,
    batch_size: int,
    max_tokens: int | None,
    full_logits: bool = False,
) -> torch.Tensor:
    """``sums[d] = Σ log p(ids[p] | ids[:p])`` over the scored tokens of the rows with ``dest == d``.

    Per forward: the decoder and the head at the scored positions (:func:`_head_nll`), or with
    ``full_logits`` or a model without a plain head, the whole model (:func:`_logits_nll`).
    A forward of several rows that runs out of GPU memory adds nothing: its rows and the rest
    are cut again at half its size (:func:`~plora.engine.eval_rows.recut_after_oom`), the
    GPU's cached blocks handed back first.

    Returns:
        float64 ``[size]`` on the model's device.
    """
    device = _device(model)
    parts = None if full_logits else plain_head_parts(model)
    sums = torch.zeros(size, dtype=torch.float64, device=device)
    pending = list(even_forwards(rows, batch_size, max_tokens))[::-1]  # popped from the end
    while pending:
        chunk = pending.pop()
        width = max(len(r.ids) for r in chunk)
        ids = [list(r.ids) + [pad_id] * (width - len(r.ids)) for r in chunk]
        mask = [[1] * len(r.ids) + [0] * (width - len(r.ids)) for r in chunk]
        inputs = to_device(torch.tensor([ids, mask], dtype=torch.long), device)
        index = torch.tensor(
            [
                [j * width + p - 1 for j, r in enumerate(chunk) for p in r.scored],
                [r.ids[p] for r in chunk for p in r.scored],
                [r.dest for r in chunk for _ in r.scored],
            ],
            dtype=torch.long,
        )
        index = to_device(index, device)
        nll = None
        try:
            with packed_segments(model, chunk_segments(chunk)):
                if parts is None:
                    nll = _logits_nll(model, inputs, index)
                else:
                    nll = _head_nll(model, *parts, inputs, index)
        except torch.OutOfMemoryError:
            if len(chunk) == 1:
                raise
        if nll is None:  # out of memory; handled here, where its traceback's tensors are freed
            pending, caps = recut_after_oom(chunk, pending, max_tokens)
            max_tokens = caps[1]
            log.warning(
                "packed evaluation: a forward of %d rows ran out of GPU memory; going on with at "
                "most %d rows and %d tokens a forward", len(chunk), *caps,
            )  # fmt: skip
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        sums.index_add_(0, index[2], nll.double(), alpha=-1)
    return sums


def _logits_nll(model: Any, inputs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The reference: the whole model's ``(R, S, V)`` logits (padding masked), picked at the
    flat positions ``index[0]``, cross-entropy against ``index[1]`` in float32."""
    logits = _logits(model(input_ids=inputs[0], attention_mask=inputs[1]))
    picked = logits.reshape(-1, logits.shape[-1]).index_select(0, index[0]).float()
    return F.cross_entropy(picked, index[1], reduction="none")


def _head_nll(
    model: Any, decoder: nn.Module, head: nn.Module, inputs: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """:func:`_logits_nll` from the decoder's hidden states at ``index[0]`` and ``head`` applied
    to those only (:func:`~plora.engine.loss.token_nll`); no padding mask where causal attention
    alone is exact (:func:`~plora.engine.attention.causal_suffices`)."""
    with causal_only(model, width=inputs.shape[-1]) as maskless:
        mask = None if maskless else inputs[1]
        out = decoder(input_ids=inputs[0], attention_mask=mask, use_cache=False)
    hidden = out[0]  # last_hidden_state (a ModelOutput's first field, or a tuple's)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index[0])
    return token_nll(head, h, index[1])


def evaluate_adapters(
    model: Any,
    tokenizer: Any,
    dataset: TokenizedDataset,
    slots: Iterable[int | None],
    *,
    batch_size: int = EVAL_BATCH_ROWS,
    max_new_tokens: int = 8,
    max_examples: int | None = None,
    packed: bool = True,
    max_tokens: int | None = EVAL_MAX_TOKENS,
) -> dict[int | None, EvalResult]:
    """Evaluate slots of a packed model on ``dataset.eval``, each as if it ran alone.

    Args:
        model: a model with plora packed LoRA layers (``plora.engine.adapters.inject``).
        tokenizer: its tokenizer.
        dataset: the eval split, its metric and label options.
        slots: slots to evaluate (duplicates are scored once); ``None`` is the frozen base model.
        batch_size: rows per forward.
        max_new_tokens: generation budget for exact match.
        max_examples: score only the first ``max_examples`` eval examples.
        packed: score all slots together in packed forwards
            (:func:`evaluate_packed`); ``False`` scores one slot
            after the other with :func:`evaluate` under ``use_slot`` (the reference).
        max_tokens: packed path only: also cap the padded tokens of a forward (rows x width,
            generation budget included); ``None``: rows only.

    Returns:
        ``{slot: EvalResult}`` in the order of ``slots``.

    Raises:
        ValueError: a slot holds no adapter in ``model``, an unknown metric, or accuracy
            without label options.
    """
    wanted = list(dict.fromkeys(slots))
    present = set().union(*(layer.specs for layer in packed_layers(model).values()))
    missing = [s for s in wanted if s is not None and s not in present]
    if missing:
        raise ValueError(
            f"evaluate_adapters: slots {missing} hold no adapter in this model "
            f"(present: {sorted(present)}); add them first or leave them out of slots"
        )
    examples = dataset.eval[:max_examples] if max_examples is not None else dataset.eval
    if packed:
        return evaluate_packed(
            model,
            tokenizer,
            examples,
            wanted,
            metric=dataset.metric,
            labels=dataset.labels,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            max_tokens=max_tokens,
        )
    out: dict[int | None, EvalResult] = {}
    for slot in wanted:
        with use_slot(model, slot):
            out[slot] = evaluate(
                model,
                tokenizer,
                examples,
                metric=dataset.metric,
                labels=dataset.labels,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
            )
    return out


__all__ = [
    "evaluate_adapters",
    "evaluate_packed",
    "packed_accuracy",
    "packed_exact_match",
    "packed_loss",
]
