"""Packed evaluation of many adapters (``evaluate_adapters``): against PEFT, each adapter
exported and reloaded, and against the per-slot reference; its forwards' row and token caps."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
import time

import pytest
import torch
from peft import PeftModel

from plora.config import DatasetSpec, LoRAConfig
from plora.engine.data import load_dataset
from plora.engine.evaluate import EvalResult, evaluate, generate_greedy, option_scores
from plora.engine.evaluate_packed import evaluate_adapters
from plora.models import load_model


@pytest.mark.parametrize("task", ["sentiment", "arithmetic"])  # scoring / KV-cached generation
def test_evaluate_adapters_on_packed_model_matches_peft(qwen, tmp_path, task):
    adapters = pytest.importorskip("plora.engine.adapters")
    checkpoint = pytest.importorskip("plora.engine.checkpoint")
    base, tok = qwen
    ds = load_dataset(DatasetSpec(builtin=task, num_examples=70, eval_fraction=0.3), tok)
    model = copy.deepcopy(base)
    adapters.inject(model)
    configs = [
        LoRAConfig(rank=4, alpha=8, lr=1e-3, batch_size=4, max_steps=1, target_modules="all"),
        LoRAConfig(
            rank=8, alpha=8, lr=1e-3, batch_size=4, max_steps=1, target_modules=("q_proj", "v_proj")
        ),
    ]
    torch.manual_seed(1)
    for slot, cfg in enumerate(configs):
        for p in adapters.add_adapter(model, slot, cfg):
            with torch.no_grad():
                p.normal_(0, 0.05)  # non-zero B: the adapters change the model
    got = evaluate_adapters(model, tok, ds, [0, 1, None], batch_size=8)
    base_res = evaluate(base, tok, ds.eval, metric=ds.metric, labels=ds.labels)
    assert got[None].loss == pytest.approx(base_res.loss, rel=1e-5)
    differs = []
    for slot, cfg in enumerate(configs):
        path = checkpoint.export_peft_adapter(
            tmp_path / f"a{slot}", config=cfg, weights=adapters.adapter_state_dict(model, slot)
        )
        peft = PeftModel.from_pretrained(copy.deepcopy(base), path)
        ref = evaluate(peft, tok, ds.eval, metric=ds.metric, labels=ds.labels)
        assert got[slot].loss == pytest.approx(ref.loss, rel=1e-4)
        assert got[slot].metric_value == ref.metric_value
        assert abs(got[slot].loss - base_res.loss) > 1e-3
        # Token-level: KV-cached greedy generation through the packed layers = PEFT's.
        prompts = [ex.input_ids[: ex.context_len()] for ex in ds.eval]
        gen = dict(pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id], max_new_tokens=6)
        with adapters.use_slot(model, slot):
            packed_gen = generate_greedy(model, prompts, **gen)
        assert packed_gen == generate_greedy(peft, prompts, **gen)
        differs.append(packed_gen != generate_greedy(base, prompts, **gen))
    assert any(differs)  # the comparison is not vacuous


# ------------------------------------------------------------------------ packed evaluation
#
# Packed evaluation (every slot's rows side by side in shared forwards) against the per-slot
# reference (``packed=False``: each slot alone under ``use_slot``, its own batches). The
# adapters have random non-zero A and B, so each changes the model; the eval sets' answers and
# labels are rewritten to one slot's own greedy answers / predicted options (computed with
# ``use_slot``, not with the packed code), so the metric differs between slots too: a row
# routed through the wrong slot changes the numbers.

ADAPTERS = {  # slot -> config: ranks 4/8/20 (16-row padding), different targets, dropout > 0
    3: LoRAConfig(rank=4, alpha=8, lr=1e-3, batch_size=4, max_steps=1, target_modules="all"),
    7: LoRAConfig(
        rank=8,
        alpha=8,
        lr=1e-3,
        batch_size=4,
        max_steps=1,
        target_modules=("q_proj", "v_proj"),
        dropout=0.3,
    ),
    12: LoRAConfig(rank=20, alpha=16, lr=1e-3, batch_size=4, max_steps=1, target_modules="mlp"),
}
OWNER = {"arithmetic": 7, "sentiment": 12, "reverse": 3}  # whose answers become the references


@functools.cache
def _packed_setup(name: str):
    """(model with ADAPTERS in train mode, tokenizer, {task: eval set}) -- built once per model."""
    from plora.engine import adapters

    base, tok = load_model(name)
    model = copy.deepcopy(base)
    adapters.inject(model)
    torch.manual_seed(1)
    for slot, cfg in ADAPTERS.items():
        for p in adapters.add_adapter(model, slot, cfg):
            with torch.no_grad():
                p.normal_(0, 0.05)
    model.eval()  # the owners' answers without dropout
    sets = {}
    for task, owner in OWNER.items():
        ds = load_dataset(DatasetSpec(builtin=task, num_examples=40, eval_fraction=0.3), tok)
        prompts = [ex.input_ids[: ex.context_len()] for ex in ds.eval]
        with adapters.use_slot(model, owner):
            if ds.metric == "accuracy":
                scores = option_scores(model, tok, ds.eval, ds.labels, batch_size=4)
                own = [ds.labels[int(k)] for k in scores.argmax(1)]
                evals = [dataclasses.replace(e, label=o) for e, o in zip(ds.eval, own, strict=True)]
            else:
                gens = generate_greedy(
                    model,
                    prompts,
                    pad_id=tok.pad_token_id,
                    stop_ids=[tok.eos_token_id],
                    max_new_tokens=8,
                )
                own = [tok.decode(g, skip_special_tokens=True).split("\n")[0] for g in gens]
                evals = [
                    dataclasses.replace(e, answer=o) for e, o in zip(ds.eval, own, strict=True)
                ]
        sets[task] = dataclasses.replace(ds, eval=evals)
    model.train()  # evaluation must switch dropout off by itself (and restore the mode)
    return model, tok, sets


def _same(got: EvalResult, ref: EvalResult) -> bool:
    """Packed equals reference: loss to fp32 summation order (NaN = NaN), the rest exactly."""
    loss_ok = (math.isnan(got.loss) and math.isnan(ref.loss)) or got.loss == pytest.approx(
        ref.loss, rel=1e-5
    )
    return loss_ok and (got.metric_name, got.metric_value, got.num_examples) == (
        ref.metric_name,
        ref.metric_value,
        ref.num_examples,
    )


def _spy_forwards(monkeypatch) -> list[list[list]]:
    """Record the rows of every packed forward, one list per pass (loss, metric)."""
    from plora.engine import eval_rows

    passes: list[list[list]] = []
    real = eval_rows.forward_chunks

    def spy(*args, **kw):
        passes.append([])
        for chunk in real(*args, **kw):
            passes[-1].append(chunk)
            yield chunk

    monkeypatch.setattr(eval_rows, "forward_chunks", spy)  # even_forwards cuts through it
    return passes


PACKED_CASES = [
    # model, task, metric override, slots, batch_size, max_tokens, max_examples
    ("tiny-qwen2", "arithmetic", None, [3, None, 12, 7], 5, None, None),  # slots straddle
    ("tiny-qwen2", "sentiment", None, [12, 3, None, 7], 7, None, None),  # 2 option rows/ex
    ("tiny-qwen2", "reverse", None, [7, 12, 7, 3], 1, None, None),  # 1 row/forward, dup slot
    ("tiny-qwen2", "reverse", None, [None], 4, None, None),  # the base model alone
    ("tiny-qwen2", "sentiment", None, [3, 7], 256, None, None),  # every row in one forward
    ("tiny-qwen2", "arithmetic", None, [12, None, 3], 64, 150, None),  # token budget
    ("tiny-qwen2", "arithmetic", "none", [None, 3, 7, 12], 5, None, None),  # loss only
    ("tiny-qwen2", "arithmetic", None, [3, None], 4, None, 0),  # empty eval split
    ("tiny-qwen2", "sentiment", None, [7, None], 4, None, 0),  # empty eval split
    ("tiny-llama", "arithmetic", None, [None, 7, 3, 12], 9, None, None),
    ("tiny-llama", "reverse", None, [7, None, 3], 5, None, None),
]


@pytest.mark.parametrize(
    ("name", "task", "metric", "slots", "batch_size", "max_tokens", "max_examples"), PACKED_CASES
)
def test_packed_evaluation_equals_per_slot_reference(
    one_thread, monkeypatch, name, task, metric, slots, batch_size, max_tokens, max_examples
):
    model, tok, sets = _packed_setup(name)
    ds = sets[task] if metric is None else dataclasses.replace(sets[task], metric=metric)
    if max_examples is None:
        assert len({len(ex.input_ids) for ex in ds.eval}) > 1  # ragged: padding matters
    kw = dict(max_examples=max_examples, max_new_tokens=8)
    ref = evaluate_adapters(model, tok, ds, slots, batch_size=8, packed=False, **kw)
    passes = _spy_forwards(monkeypatch)
    got = evaluate_adapters(
        model, tok, ds, slots, batch_size=batch_size, max_tokens=max_tokens, **kw
    )

    assert model.training  # train mode restored (and dropout was off inside)
    assert list(got) == list(dict.fromkeys(slots))
    for slot in got:
        assert _same(got[slot], ref[slot]), (slot, got[slot], ref[slot])
        assert got[slot].seconds >= 0.0
    if max_examples == 0:
        assert not passes
        assert all(r.num_examples == 0 and r.metric_value is None for r in got.values())
        return
    # Not vacuous: the slots' losses differ, and the owner of the references scores 1.0 where
    # the other slots do not.
    if len(got) > 1:
        losses = sorted(ref[s].loss for s in got)
        assert min(b - a for a, b in itertools.pairwise(losses)) > 1e-4
    if ds.metric != "none" and OWNER[task] in got and len(got) > 1:
        assert ref[OWNER[task]].metric_value == 1.0
        assert min(r.metric_value for r in ref.values()) < 1.0
    # The forwards: at most batch_size rows; every slot's rows (all of them) contiguous; slots
    # sharing forwards and a slot straddling two forwards when the batch is smaller than a
    # slot's rows.
    n = len(ds.eval)
    rows = [n] + ([n * len(ds.labels)] if ds.metric == "accuracy" else [n] * (ds.metric != "none"))
    assert len(passes) == len(rows)  # loss, then the metric
    for chunks, per_slot in zip(passes, rows, strict=True):
        assert max(len(c) for c in chunks) <= batch_size
        if max_tokens is not None:  # the budget binds before the row cap
            assert max(len(c) for c in chunks) < batch_size
            assert all(len(c) * max(len(r.ids) for r in c) <= max_tokens for c in chunks)
        groups = [r.group for c in chunks for r in c]
        runs = [(g, len(list(rs))) for g, rs in itertools.groupby(groups)]
        assert runs == [(g, per_slot) for g in range(len(got))]
        if len(got) > 1 and 1 < batch_size < per_slot and per_slot % batch_size:
            assert any(len({r.group for r in c}) > 1 for c in chunks)
            assert any(a[-1].group == b[0].group for a, b in itertools.pairwise(chunks))


def _swap_slots(segments):
    order = sorted(ADAPTERS)
    return [(order[(order.index(s) + 1) % len(order)], a, b) for s, a, b in segments]


def _drop_last_row(segments):
    return [(s, a, b - 1) for s, a, b in segments]


def _move_boundary(segments):
    """One row of the second of two adjacent segments goes to the first."""
    out = list(segments)
    for i, ((s, a, b), (t, c, d)) in enumerate(itertools.pairwise(out)):
        if b == c and d - c > 1:
            out[i : i + 2] = [(s, a, b + 1), (t, c + 1, d)]
            break
    return out


@pytest.mark.parametrize("task", ["arithmetic", "sentiment"])
@pytest.mark.parametrize("broken", [_swap_slots, _drop_last_row, _move_boundary])
def test_packed_comparison_catches_wrong_routing(one_thread, monkeypatch, task, broken):
    """Mutation check: with the segment table corrupted, packed != reference for some slot."""
    from plora.engine import evaluate_packed

    model, tok, sets = _packed_setup("tiny-qwen2")
    ds, slots = sets[task], [3, None, 12, 7]
    ref = evaluate_adapters(model, tok, ds, slots, batch_size=8, packed=False)
    real = evaluate_packed.packed_segments
    monkeypatch.setattr(
        evaluate_packed, "packed_segments", lambda m, segs, **kw: real(m, broken(segs), **kw)
    )
    got = evaluate_adapters(model, tok, ds, slots, batch_size=5)
    assert not all(_same(got[s], ref[s]) for s in slots)


def test_packed_evaluation_seconds_unknown_slot_and_bad_batch():
    model, tok, sets = _packed_setup("tiny-qwen2")
    ds = sets["arithmetic"]
    t0 = time.perf_counter()
    got = evaluate_adapters(model, tok, ds, [3, 7, None], max_examples=6)
    wall = time.perf_counter() - t0
    seconds = [r.seconds for r in got.values()]
    assert len(set(seconds)) == 1 and 0 < sum(seconds) <= wall  # equal shares of the wall time
    ref = evaluate_adapters(model, tok, ds, [3], max_examples=6, packed=False)
    assert ref[3].seconds > 0
    for packed in (True, False):
        with pytest.raises(ValueError, match=r"slots \[5\] hold no adapter"):
            evaluate_adapters(model, tok, ds, [3, 5], packed=packed)
    with pytest.raises(ValueError, match="batch_size"):
        evaluate_adapters(model, tok, ds, [3], batch_size=0)


@pytest.mark.parametrize(
    ("lengths", "batch_size", "max_tokens", "extra", "sizes"),
    [
        ([5, 5, 5, 5, 5], 2, None, 0, [2, 2, 1]),
        ([5, 5, 5, 5, 5], 8, None, 0, [5]),
        ([3, 4, 9, 2, 2], 8, 18, 0, [2, 2, 1]),  # 3 x 9 > 18; 2 x 9 fits; 3 x 9 > 18
        ([3, 4, 2, 2, 9], 8, 18, 0, [4, 1]),  # 4 x 4 fits; 5 x 9 > 18
        ([20, 2, 2], 8, 10, 0, [1, 2]),  # one row over budget still runs, alone
        ([2, 2, 2, 2], 8, 20, 3, [4]),  # 4 x (2 + 3) = 20
        ([2, 2, 2, 2], 8, 19, 3, [3, 1]),
    ],
)
def test_packed_forwards_respect_row_and_token_caps(lengths, batch_size, max_tokens, extra, sizes):
    from plora.engine.eval_rows import EvalRow, chunk_segments, forward_chunks

    rows = [EvalRow(group=0, slot=1, ids=[7] * n) for n in lengths]
    chunks = list(forward_chunks(rows, batch_size, max_tokens, extra=extra))
    assert [len(c) for c in chunks] == sizes
    assert [r for c in chunks for r in c] == rows
    mixed = [EvalRow(group=g, slot=s, ids=[1]) for g, s in [(0, 4), (0, 4), (1, None), (2, 9)]]
    assert chunk_segments(mixed) == [(4, 0, 2), (9, 3, 4)]


def test_packed_forwards_share_one_row_count():
    """Every forward but the last has the same rows (Liger's RoPE compiles per row count): as
    many as the token cap holds at the widest row, not as many as each forward's width allows."""
    from plora.engine.eval_rows import EvalRow, even_forwards, forward_chunks

    rows = [EvalRow(group=0, slot=1, ids=[7] * n) for n in (2, 3, 5, 9, 9, 5, 3, 2)]
    assert [len(c) for c in forward_chunks(rows, 8, 20)] == [3, 2, 3]  # per-forward widths
    for extra in (0, 1):  # 20 // (9 + extra) rows
        chunks = list(even_forwards(rows, 8, 20, extra=extra))
        assert [len(c) for c in chunks] == [2, 2, 2, 2]
        assert [r for c in chunks for r in c] == rows
    assert [len(c) for c in even_forwards(rows, 3, None)] == [3, 3, 2]
    assert [len(c) for c in even_forwards(rows, 8, 4)] == [1] * 8  # a row over the cap runs alone


@pytest.mark.gpu
def test_packed_evaluation_on_cuda():
    """fp32 on CUDA (torch path) equals the reference; bf16 autocast (fused kernels) is close."""
    model, tok, sets = _packed_setup("tiny-qwen2")
    model = copy.deepcopy(model).cuda()
    for task in ("arithmetic", "sentiment"):
        ds = sets[task]
        ref = evaluate_adapters(model, tok, ds, [3, None, 12, 7], packed=False)
        got = evaluate_adapters(model, tok, ds, [3, None, 12, 7], batch_size=5)
        assert all(_same(got[s], ref[s]) for s in got)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = evaluate_adapters(model, tok, ds, [3, None, 12, 7], packed=False)
            got = evaluate_adapters(model, tok, ds, [3, None, 12, 7], batch_size=5)
        for s in got:
            assert got[s].loss == pytest.approx(ref[s].loss, rel=2e-2)
            assert abs(got[s].metric_value - ref[s].metric_value) <= 0.25
