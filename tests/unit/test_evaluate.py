"""Evaluation of one model: loss, greedy exact match and label accuracy against independent
references (HF's loss and ``generate``, PEFT). Packed evaluation of many adapters is
``test_evaluate_packed.py``."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model

from plora.config import DatasetSpec
from plora.engine.data import AdapterStream, load_dataset, pack_batch
from plora.engine.evaluate import (
    EvalResult,
    eval_loss,
    evaluate,
    exact_match,
    generate_greedy,
    option_scores,
)
from plora.models import load_model


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-llama"])
def tiny(request):
    return load_model(request.param)


def _hf_generate(model, prompt, n, eos):
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0
    )[0, len(prompt) :].tolist()
    return out[: out.index(eos)] if eos in out else out


def test_eval_loss_matches_hf_loss_per_example(tiny):
    model, tok = tiny
    ds = load_dataset(DatasetSpec(builtin="reverse", num_examples=40, eval_fraction=0.25), tok)
    total = count = 0
    with torch.no_grad():
        for ex in ds.eval:  # one at a time, HF's own shifted mean loss
            n = sum(1 for y in ex.labels[1:] if y != -100)
            loss = model(
                input_ids=torch.tensor([ex.input_ids]), labels=torch.tensor([ex.labels])
            ).loss
            total, count = total + float(loss) * n, count + n
    got = eval_loss(model, ds.eval, pad_id=tok.pad_token_id, batch_size=3)
    assert got == pytest.approx(total / count, rel=1e-5)
    assert math.isnan(eval_loss(model, [], pad_id=0))


def test_greedy_generation_matches_hf_generate(tiny):
    model, tok = tiny
    ds = load_dataset(DatasetSpec(builtin="sentiment", num_examples=40, eval_fraction=0.25), tok)
    prompts = [ex.input_ids[: ex.context_len()] for ex in ds.eval]  # ragged: left padding matters
    assert len({len(p) for p in prompts}) > 3
    got = generate_greedy(
        model, prompts, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id], max_new_tokens=6
    )
    want = [_hf_generate(model, p, 6, tok.eos_token_id) for p in prompts]
    assert got == want


def test_exact_match_counts_the_models_own_answers(qwen):
    model, tok = qwen
    ds = load_dataset(DatasetSpec(builtin="arithmetic", num_examples=60, eval_fraction=0.2), tok)
    nl = tok("\n", add_special_tokens=False)["input_ids"][0]
    answers = []
    for ex in ds.eval:
        gen = _hf_generate(model, ex.input_ids[: ex.context_len()], 5, tok.eos_token_id)
        gen = gen[: gen.index(nl)] if nl in gen else gen
        answers.append(tok.decode(gen, skip_special_tokens=True).strip())
    own = [dataclasses.replace(ex, answer=a) for ex, a in zip(ds.eval, answers, strict=True)]
    assert exact_match(model, tok, own, batch_size=5, max_new_tokens=5) == 1.0
    half = [
        dataclasses.replace(ex, answer=ex.answer + "x") if i % 2 else ex for i, ex in enumerate(own)
    ]
    assert exact_match(model, tok, half, max_new_tokens=5) == pytest.approx(
        sum(1 for i in range(len(own)) if not i % 2) / len(own)
    )


def test_option_scores_and_accuracy(tiny):
    model, tok = tiny
    ds = load_dataset(DatasetSpec(builtin="sentiment", num_examples=40, eval_fraction=0.2), tok)
    options = ["neg", "pos"]
    scores = option_scores(model, tok, ds.eval, options, batch_size=3)
    with torch.no_grad():
        for i, ex in enumerate(ds.eval[:4]):
            prompt = ex.input_ids[: ex.context_len()]
            for k, opt in enumerate(options):
                target = tok(opt, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                ids = torch.tensor([prompt + target])
                labels = torch.tensor([[-100] * len(prompt) + target])
                ref = -float(model(input_ids=ids, labels=labels).loss) * len(target)
                assert scores[i, k].item() == pytest.approx(ref, rel=1e-5, abs=1e-5)
    pred = [options[int(k)] for k in scores.argmax(1)]
    res = evaluate(model, tok, ds.eval, metric="accuracy", labels=options)
    assert res.metric_value == pytest.approx(
        sum(p == ex.label for p, ex in zip(pred, ds.eval, strict=True)) / len(ds.eval)
    )
    # Relabel every example with the model's own choice: accuracy 1.
    own = [dataclasses.replace(ex, label=p) for ex, p in zip(ds.eval, pred, strict=True)]
    assert evaluate(model, tok, own, metric="accuracy", labels=options).metric_value == 1.0


def test_evaluate_result_and_mode_restored(qwen):
    model, tok = qwen
    ds = load_dataset(DatasetSpec(builtin="arithmetic", num_examples=50), tok)
    model.train()
    try:
        res = evaluate(model, tok, ds.eval, metric="exact_match", labels=None, max_new_tokens=4)
        assert model.training
    finally:
        model.eval()
    assert (
        isinstance(res, EvalResult) and res.num_examples == 5 and res.metric_name == "exact_match"
    )
    assert 0.0 <= res.metric_value <= 1.0 and res.loss > 0
    none = evaluate(model, tok, ds.eval, metric="none", labels=None)
    assert none.metric_value is None and none.loss == pytest.approx(res.loss)
    with pytest.raises(ValueError, match="label options"):
        evaluate(model, tok, ds.eval, metric="accuracy", labels=None)


def test_peft_training_improves_eval(qwen, tmp_path):
    """A short PEFT LoRA run lowers eval loss; evaluate works on PEFT models and reloads."""
    base, tok = qwen
    ds = load_dataset(DatasetSpec(builtin="arithmetic", num_examples=400), tok)
    before = evaluate(base, tok, ds.eval, metric=ds.metric, labels=ds.labels)
    torch.manual_seed(0)
    peft = get_peft_model(
        copy.deepcopy(base), PeftLoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    )
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=2e-3)
    stream = AdapterStream(len(ds.train), 16, seed=0)
    peft.train()
    for _ in range(30):
        pb = pack_batch([[ds.train[i] for i in stream.next_batch()]], tok.pad_token_id)
        peft(
            input_ids=pb.input_ids, attention_mask=pb.attention_mask, labels=pb.labels
        ).loss.backward()
        opt.step()
        opt.zero_grad()
    after = evaluate(peft, tok, ds.eval, metric=ds.metric, labels=ds.labels)
    assert after.loss < before.loss - 0.05
    peft.save_pretrained(tmp_path / "a")
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "a")
    again = evaluate(reloaded, tok, ds.eval, metric=ds.metric, labels=ds.labels)
    assert again.loss == pytest.approx(after.loss, rel=1e-6)
    assert again.metric_value == after.metric_value
