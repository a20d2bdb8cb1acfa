"""Packed evaluation's scored rows from the decoder's hidden states: the LM head at the scored
positions only, no padding mask where causal attention alone is exact, and the whole model's
full logits where the head is not the whole story (post-processed logits, no plain head). The
reference is ``packed_loss(..., full_logits=True)``; the packed-vs-per-slot checks and the
shared setup (:func:`test_evaluate_packed._packed_setup`) are ``test_evaluate_packed.py``'s.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from test_evaluate_packed import _packed_setup

from plora.models import load_model


def test_token_nll_equals_cross_entropy_of_the_full_logits():
    from plora.engine.loss import token_nll

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 37)
    h, t = torch.randn(23, 16), torch.randint(0, 37, (23,))
    ref = F.cross_entropy(head(h).float(), t, reduction="none")
    for max_logits in (None, 37 * 5, 1):  # one chunk; 5 tokens a chunk (the last short); 1
        got = token_nll(head, h, t, max_logits=max_logits)
        assert got.dtype == torch.float32 and not got.requires_grad
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert token_nll(head, h[:0], t[:0]).shape == (0,)


@pytest.mark.parametrize(
    ("name", "task", "slots", "batch_size"),
    [
        ("tiny-qwen2", "arithmetic", [3, None, 12, 7], 5),  # slots straddle forwards
        ("tiny-llama", "reverse", [7, 12, None, 3], 3),
    ],
)
def test_scored_rows_from_hidden_states_equal_the_full_logits(
    one_thread, monkeypatch, name, task, slots, batch_size
):
    from plora.engine import evaluate_packed, loss
    from plora.engine.attention import CAUSAL_SDPA
    from plora.engine.evaluate import _pad_id, eval_mode

    model, tok, sets = _packed_setup(name)
    examples = sets[task].eval
    assert len({len(ex.input_ids) for ex in examples}) > 1  # ragged: rows are padded
    kw = dict(pad_id=_pad_id(tok), batch_size=batch_size)
    with eval_mode(model):
        ref = evaluate_packed.packed_loss(model, examples, slots, full_logits=True, **kw)
    head, decoder = model.get_output_embeddings(), model.get_decoder()
    monkeypatch.setattr(loss, "_LOGIT_CHUNK", 3 * head.weight.shape[0])  # 3 tokens a chunk
    heads: list[int] = []
    calls: list[tuple] = []

    def whole_model(*_):
        raise AssertionError("the whole model ran (full logits)")

    hooks = [
        head.register_forward_hook(lambda m, args, out: heads.append(args[0].shape[0])),
        decoder.register_forward_pre_hook(
            lambda m, args, kw: calls.append(
                (kw.get("attention_mask"), m.config._attn_implementation)
            ),
            with_kwargs=True,
        ),
        model.register_forward_pre_hook(whole_model),
    ]
    try:
        with eval_mode(model):
            got = evaluate_packed.packed_loss(model, examples, slots, **kw)
    finally:
        for hook in hooks:
            hook.remove()

    assert got == pytest.approx(ref, rel=1e-5)
    assert min(b - a for a, b in itertools.pairwise(sorted(ref))) > 1e-4  # slots differ
    assert calls and all(c == (None, CAUSAL_SDPA) for c in calls)  # no mask, causal SDPA
    assert model.config._attn_implementation == "sdpa"  # restored
    assert max(heads) == 3 and len(heads) > len(calls)  # head chunks: several a forward
    scored = sum(sum(y != -100 for y in ex.labels[1:]) for ex in examples)
    assert sum(heads) == scored * len(slots)  # the head ran on the scored positions only


def _gemma2():
    """A tiny Gemma2: logits soft-capped, ``c·tanh(head(h) / c)``."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=2.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)  # logits of a few units: the cap of 2 bites
    return model


def _qwen2_with(**extra):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    for key, value in extra.items():
        setattr(cfg, key, value)
    return Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize(
    ("build", "plain"),
    [
        (lambda: load_model("tiny-qwen2")[0], True),
        (lambda: load_model("tiny-llama")[0], True),
        (_gemma2, False),  # soft-capped logits
        (lambda: _qwen2_with(final_logit_softcapping=30.0), False),
        (lambda: _qwen2_with(logit_scale=0.25), False),
        (lambda: _qwen2_with().model, False),  # the decoder alone: no head
        (lambda: torch.nn.Linear(4, 4), False),  # a stand-in (a pipeline stage): no config
    ],
)
def test_plain_head_parts(build, plain):
    from plora.engine.causal_lm import plain_head_parts

    model = build()
    parts = plain_head_parts(model)
    assert (parts is not None) == plain
    if parts is not None:
        assert parts == (model.model, model.lm_head)


def test_post_processed_logits_are_scored_from_the_full_logits(monkeypatch):
    from plora.engine import evaluate_packed
    from plora.engine.causal_lm import decoder_and_head
    from plora.engine.data import Example

    model = _gemma2()
    gen = torch.Generator().manual_seed(0)
    examples = []
    for n in (9, 5, 12, 3):
        ids = torch.randint(3, 64, (n,), generator=gen).tolist()
        examples.append(Example(input_ids=ids, labels=[-100] * 2 + ids[2:]))
    kw = dict(pad_id=0, batch_size=3)
    with torch.no_grad():
        ref = evaluate_packed.packed_loss(model, examples, [None], full_logits=True, **kw)
        got = evaluate_packed.packed_loss(model, examples, [None], **kw)
        assert got == ref
        # not vacuous: the head alone (no soft-capping) would give other numbers
        monkeypatch.setattr(evaluate_packed, "plain_head_parts", decoder_and_head)
        wrong = evaluate_packed.packed_loss(model, examples, [None], **kw)
    assert abs(wrong[0] - ref[0]) > 1e-2


@pytest.mark.parametrize(
    ("attn", "window", "width", "causal"),
    [
        ("sdpa", None, 4096, True),
        ("sdpa", 64, 64, True),
        ("sdpa", 64, 65, False),  # only the mask applies the sliding window
        ("eager", None, 16, False),  # causal_only replaces SDPA only
        (None, None, 16, False),  # no config (a pipeline stage)
    ],
)
def test_scored_rows_drop_the_mask_only_where_causal_attention_is_exact(
    attn, window, width, causal
):
    from types import SimpleNamespace

    from plora.engine.attention import causal_suffices

    config = (
        None if attn is None else SimpleNamespace(_attn_implementation=attn, sliding_window=window)
    )
    assert causal_suffices(SimpleNamespace(config=config), width=width) is causal


@pytest.mark.parametrize("full_logits", [False, True])
def test_a_forward_out_of_memory_is_split_and_nothing_is_counted_twice(
    one_thread, full_logits, caplog
):
    """A scoring forward that runs out of GPU memory is cut in halves and retried, and every
    later forward keeps to the smaller size; the sums equal a run that never ran out."""
    from plora.engine import evaluate_packed
    from plora.engine.evaluate import _pad_id, eval_mode

    model, tok, sets = _packed_setup("tiny-qwen2")
    examples, slots = sets["reverse"].eval, [3, None, 12, 7]
    kw = dict(pad_id=_pad_id(tok), batch_size=6, full_logits=full_logits)
    with eval_mode(model):
        ref = evaluate_packed.packed_loss(model, examples, slots, **kw)
    module = model if full_logits else model.get_decoder()
    sizes: list[int] = []

    def runs_out_over_four_rows(m, args, kwargs):
        rows = kwargs["input_ids"].shape[0]
        sizes.append(rows)
        if rows > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (a test)")

    hook = module.register_forward_pre_hook(runs_out_over_four_rows, with_kwargs=True)
    try:
        with eval_mode(model), caplog.at_level("WARNING"):
            got = evaluate_packed.packed_loss(model, examples, slots, **kw)
    finally:
        hook.remove()
    assert got == pytest.approx(ref, rel=1e-6)
    assert sizes[0] == 6 and max(sizes[1:]) <= 3  # one failure, then half-size forwards
    assert sum(sizes[1:]) == len(examples) * len(slots)  # every row scored once
    assert "ran out of GPU memory" in caplog.text

    def always_out(m, args, kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (a test)")

    hook = module.register_forward_pre_hook(always_out, with_kwargs=True)
    try:
        with eval_mode(model), pytest.raises(torch.OutOfMemoryError):  # one row: nothing left
            evaluate_packed.packed_loss(model, examples, slots, **kw)
    finally:
        hook.remove()
