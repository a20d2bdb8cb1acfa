"""Data pipeline: row layouts, masks, splits, errors, builtin tasks, streams and packing."""

from __future__ import annotations

import json
import re

import pytest
import torch

from plora import tasks
from plora.config import ConfigError, DatasetSpec
from plora.engine.data import (
    IGNORE_INDEX,
    AdapterStream,
    Example,
    load_dataset,
    micro_batches,
    pack_batch,
)
from plora.models import load_model


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-llama"])
def tok(request):
    return load_model(request.param)[1]


@pytest.fixture(scope="module")
def qtok():
    return load_model("tiny-qwen2")[1]


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _trained_text(tok, ex):
    return tok.decode(
        [t for t, y in zip(ex.input_ids, ex.labels, strict=True) if y != IGNORE_INDEX]
    )


def test_prompt_completion_encoding(tok, tmp_path):
    rows = [{"prompt": f"q{i}: {i}*2=", "completion": str(2 * i)} for i in range(10)]
    ds = load_dataset(DatasetSpec(path=_jsonl(tmp_path / "d.jsonl", rows), eval_fraction=0.0), tok)
    assert len(ds.train) == 10 and ds.eval == []
    for row, ex in zip(rows, ds.train, strict=True):
        p = tok(row["prompt"])["input_ids"]
        c = tok(row["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ex.input_ids == p + c
        assert ex.labels == [IGNORE_INDEX] * len(p) + c
        assert ex.context_len() == len(p) and ex.prompt == row["prompt"]
        assert _trained_text(tok, ex) == row["completion"] + tok.eos_token


def test_completion_only_false_and_text_rows(qtok, tmp_path):
    path = _jsonl(
        tmp_path / "d.jsonl", [{"prompt": "a=", "completion": "1"}, {"text": "free text"}]
    )
    ds = load_dataset(
        DatasetSpec(path=path, eval_fraction=0.0, completion_only=False, metric="none"), qtok
    )
    assert all(ex.labels == ex.input_ids for ex in ds.train)
    text = ds.train[1]
    assert text.input_ids == qtok("free text")["input_ids"] + [qtok.eos_token_id]
    assert text.answer is None


def test_chat_rows_plain_template(tok, tmp_path):
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    ds = load_dataset(
        DatasetSpec(path=_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}]), eval_fraction=0.0), tok
    )
    ex = ds.train[0]
    eos = tok.eos_token
    assert _trained_text(tok, ex) == f"4{eos}6{eos}"
    full = (
        "system: be brief\nuser: 2+2?\nassistant: 4" + eos + "\nuser: and 3+3?\nassistant: 6" + eos
    )
    assert (
        tok.decode(ex.input_ids, skip_special_tokens=False).removeprefix(tok.bos_token or "")
        == full
    )
    assert ex.prompt.endswith("and 3+3?\nassistant: ") and ex.answer == "6"
    assert tok.decode(ex.input_ids[: ex.context_len()]).endswith("assistant: ")


def test_chat_rows_with_a_chat_template(tmp_path):
    _, tok = load_model("tiny-llama")
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ds = load_dataset(
        DatasetSpec(path=_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}]), eval_fraction=0.0), tok
    )
    ex = ds.train[0]
    assert tok.decode(ex.input_ids) == "<|user|>hi<|end|>\n<|assistant|>hello<|end|>\n"
    assert _trained_text(tok, ex) == "hello<|end|>\n"
    assert ex.prompt == "<|user|>hi<|end|>\n<|assistant|>"


def test_chat_template_that_rewrites_history_is_refused(tmp_path):
    _, tok = load_model("tiny-llama")
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}>{% endif %}{{ m['content'] }}{% endfor %}"
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": msgs}])
    with pytest.raises(ConfigError, match=r"c\.jsonl:1: messages: .*not render turns as prefixes"):
        load_dataset(DatasetSpec(path=path, eval_fraction=0.0), tok)


def test_shipped_jsonl_matches_its_generator_and_loads(qtok):
    path = tasks.shipped_data_path("reverse_200.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == tasks.make_reverse(200, 0)
    ds = load_dataset(DatasetSpec(path=str(path)), qtok)
    assert (len(ds.train), len(ds.eval), ds.metric, ds.labels) == (180, 20, "exact_match", None)


def test_save_to_disk_dir_equals_jsonl(qtok, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = tasks.make_arithmetic(50, 3)
    jsonl = load_dataset(DatasetSpec(path=_jsonl(tmp_path / "a.jsonl", rows)), qtok)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    disk = load_dataset(DatasetSpec(path=str(tmp_path / "disk")), qtok)
    assert disk == jsonl
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows[:40]), test=datasets.Dataset.from_list(rows[40:])
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    split = load_dataset(DatasetSpec(path=str(tmp_path / "dd")), qtok)
    assert [ex.prompt for ex in split.eval] == [r["prompt"] for r in rows[40:]]
    assert len(split.train) == 40


def test_eval_split_is_seeded_and_disjoint(qtok, tmp_path):
    rows = [{"prompt": f"n{i}=", "completion": f"v{i}"} for i in range(100)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    a = load_dataset(DatasetSpec(path=path, eval_fraction=0.2, seed=1), qtok)
    b = load_dataset(DatasetSpec(path=path, eval_fraction=0.2, seed=1), qtok)
    c = load_dataset(DatasetSpec(path=path, eval_fraction=0.2, seed=2), qtok)
    assert a == b and a.eval != c.eval
    train, held = {ex.prompt for ex in a.train}, {ex.prompt for ex in a.eval}
    assert len(held) == 20 and not train & held and train | held == {r["prompt"] for r in rows}
    evalp = _jsonl(tmp_path / "e.jsonl", [{"prompt": "x=", "completion": "y"}])
    d = load_dataset(DatasetSpec(path=path, eval_path=evalp), qtok)
    assert len(d.train) == 100 and [ex.answer for ex in d.eval] == ["y"]


def test_truncation(qtok, tmp_path):
    rows = [{"prompt": "p" * 5, "completion": "c" * 30}, {"prompt": "p" * 40, "completion": "c"}]
    ds = load_dataset(
        DatasetSpec(path=_jsonl(tmp_path / "d.jsonl", rows), eval_fraction=0.0, max_seq_len=16),
        qtok,
    )
    assert len(ds.train) == 1  # the second has no target left and is dropped
    assert len(ds.train[0].input_ids) == 16 and ds.train[0].labels[5:] == ds.train[0].input_ids[5:]
    with pytest.raises(ConfigError, match="max_seq_len=8: no training example keeps a target"):
        load_dataset(
            DatasetSpec(
                path=_jsonl(tmp_path / "e.jsonl", rows[1:]), eval_fraction=0.0, max_seq_len=8
            ),
            qtok,
        )


def test_metric_auto_and_explicit(qtok, tmp_path):
    rows = [{"prompt": f"r{i}:", "completion": ["yes", "no"][i % 2]} for i in range(40)]
    ds = load_dataset(DatasetSpec(path=_jsonl(tmp_path / "l.jsonl", rows)), qtok)
    assert ds.metric == "accuracy" and ds.labels == ["no", "yes"]
    assert all(ex.label == ex.answer for ex in ds.train + ds.eval)
    text = _jsonl(tmp_path / "t.jsonl", [{"text": f"line {i}"} for i in range(5)])
    assert load_dataset(DatasetSpec(path=text), qtok).metric == "none"
    with pytest.raises(ConfigError, match=r"metric='accuracy'.*plain text"):
        load_dataset(DatasetSpec(path=text, metric="accuracy"), qtok)
    assert load_dataset(DatasetSpec(builtin="sentiment", num_examples=20), qtok).labels == [
        "neg",
        "pos",
    ]


@pytest.mark.parametrize(
    ("lines", "pattern"),
    [
        (
            ['{"prompt": "a", "completion": "b"}', '{"prompt": "a"}'],
            r"d\.jsonl:2: row has no usable fields \(keys: prompt\); give each row",
        ),
        (['{"prompt": "a", "completion": "b"}', "", "{oops"], r"d\.jsonl:3: invalid JSON"),
        (["[1, 2]"], r"d\.jsonl:1: row is a list, not a JSON object"),
        (['{"prompt": "a", "completion": 7}'], r"d\.jsonl:1: completion=7: must be a string"),
        (
            ['{"messages": [{"role": "user", "content": "x"}]}'],
            r"d\.jsonl:1: messages: has no assistant turn",
        ),
        (
            ['{"messages": [{"role": "user"}]}'],
            r"d\.jsonl:1: messages\[0\]=.*needs string 'role' and 'content'",
        ),
    ],
)
def test_bad_rows_name_file_line_and_key(qtok, tmp_path, lines, pattern):
    path = _jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(ConfigError, match=pattern) as err:
        load_dataset(DatasetSpec(path=path), qtok)
    assert "\n" not in str(err.value)


def test_missing_empty_and_format_mismatch(qtok, tmp_path):
    with pytest.raises(ConfigError, match=r"dataset.path='.*nope.jsonl': dataset file not found"):
        load_dataset(DatasetSpec(path=str(tmp_path / "nope.jsonl")), qtok)
    empty = _jsonl(tmp_path / "e.jsonl", ["", "  "])
    with pytest.raises(ConfigError, match="dataset is empty"):
        load_dataset(DatasetSpec(path=empty), qtok)
    text = _jsonl(tmp_path / "t.jsonl", [{"text": "x"}])
    with pytest.raises(
        ConfigError,
        match=r"t\.jsonl:1: row has no 'prompt' and 'completion' \(format: prompt_completion\)",
    ):
        load_dataset(DatasetSpec(path=text, format="prompt_completion"), qtok)


# ---------------------------------------------------------------------------- builtin tasks


def test_arithmetic_answers_are_correct_and_distinct():
    rows = tasks.make_arithmetic(155, seed=4)
    for r in rows:
        m = re.fullmatch(r"(\d+)([+-])(\d+)=", r["prompt"])
        a, op, b = int(m[1]), m[2], int(m[3])
        assert int(r["completion"]) == (a + b if op == "+" else a - b) >= 0
    assert len({r["prompt"] for r in rows}) == 155  # the whole table, no repeats
    assert tasks.make_arithmetic(30, seed=4) == rows[:30]
    assert tasks.make_arithmetic(30, seed=5) != rows[:30]


def test_sentiment_label_is_the_majority_polarity():
    rows = tasks.make_sentiment(300, seed=0)
    for r in rows:
        words = r["prompt"].split("\n")[0].removeprefix("review: ").split()
        pos = sum(w in tasks.POSITIVE_WORDS for w in words)
        neg = sum(w in tasks.NEGATIVE_WORDS for w in words)
        assert pos != neg and r["label"] == r["completion"] == ("pos" if pos > neg else "neg")
    share = sum(r["label"] == "pos" for r in rows) / len(rows)
    assert 0.4 < share < 0.6


def test_builtin_dataset_sizes_and_unknown_name(qtok):
    ds = load_dataset(DatasetSpec(builtin="arithmetic", num_examples=100, eval_fraction=0.1), qtok)
    assert (len(ds.train), len(ds.eval), ds.metric) == (100, 10, "exact_match")
    assert not {ex.prompt for ex in ds.train} & {ex.prompt for ex in ds.eval}
    with pytest.raises(ConfigError, match="choose one of arithmetic, sentiment, reverse"):
        tasks.get_task("poetry")


# ---------------------------------------------------------------------------- streams


@pytest.mark.parametrize(
    ("n", "bs", "drop_last"), [(10, 3, False), (10, 3, True), (7, 7, False), (5, 8, False)]
)
def test_stream_epochs_are_permutations(n, bs, drop_last):
    s = AdapterStream(n, bs, seed=11, drop_last=drop_last)
    for epoch in range(3):
        seen = []
        for _ in range(s.steps_per_epoch):
            assert s.epoch == epoch
            seen += s.next_batch()
        assert len(seen) == (n // bs * bs if drop_last else n)
        assert seen == AdapterStream.permutation(n, 11, epoch)[: len(seen)]
        assert len(set(seen)) == len(seen)
    assert s.steps == 3 * s.steps_per_epoch and s.epoch == 3 and s.position == 0


def test_stream_order_depends_only_on_n_and_seed():
    a, b = AdapterStream(12, 4, seed=3), AdapterStream(12, 5, seed=3)
    flat_a = [i for _ in range(3) for i in a.next_batch()]
    flat_b = [i for _ in range(3) for i in b.next_batch()][:12]
    assert flat_a == flat_b == AdapterStream.permutation(12, 3, 0)
    assert AdapterStream.permutation(12, 4, 0) != flat_a
    assert AdapterStream.permutation(12, 3, 1) != flat_a


def test_stream_state_round_trip():
    s = AdapterStream(9, 4, seed=0)
    for _ in range(4):  # into the second epoch
        s.next_batch()
    state = json.loads(json.dumps(s.get_state()))
    expected = [s.next_batch() for _ in range(6)]
    t = AdapterStream(9, 4, seed=0)
    t.set_state(state)
    assert [t.next_batch() for _ in range(6)] == expected
    assert t.epoch == s.epoch and t.epochs_done == s.epochs_done == 31 / 9
    with pytest.raises(ValueError, match="seed"):
        AdapterStream(9, 4, seed=1).set_state(state)
    with pytest.raises(ConfigError, match="batch_size=10"):
        AdapterStream(9, 10, seed=0, drop_last=True)


# ---------------------------------------------------------------------------- packing


def _ex(n, start=10, prompt=2):
    ids = list(range(start, start + n))
    return Example(input_ids=ids, labels=[IGNORE_INDEX] * prompt + ids[prompt:], prompt="p")


def test_pack_batch_layout():
    rows = [
        [_ex(4), _ex(6, 20)],
        [],
        [_ex(3, 30)],
        [_ex(5, 40), _ex(2, 50, prompt=1), _ex(1, 60, prompt=0)],
    ]
    pb = pack_batch(rows, pad_id=0)
    assert pb.input_ids.shape == pb.labels.shape == pb.attention_mask.shape == (6, 6)
    assert [(s.slot, s.start, s.stop) for s in pb.segments] == [
        (0, 0, 2),
        (1, 2, 2),
        (2, 2, 3),
        (3, 3, 6),
    ]
    flat = [ex for r in rows for ex in r]
    for r, ex in enumerate(flat):
        n = len(ex.input_ids)
        assert (
            pb.input_ids[r, :n].tolist() == ex.input_ids and pb.labels[r, :n].tolist() == ex.labels
        )
        assert (pb.input_ids[r, n:] == 0).all() and (pb.labels[r, n:] == IGNORE_INDEX).all()
        assert pb.attention_mask[r].tolist() == [1] * n + [0] * (6 - n)
    # predicted tokens per slot: labels[1:] that are not masked
    assert pb.target_tokens() == {0: 2 + 4, 1: 0, 2: 1, 3: 3 + 1 + 0}
    assert pack_batch(rows, pad_id=0, pad_to_multiple_of=8).input_ids.shape == (6, 8)
    assert pb.to("cpu").segments == pb.segments
    with pytest.raises(ValueError, match="no examples"):
        pack_batch([[], []], pad_id=0)


def test_pack_batch_rows_reproduce_solo_forward():
    """A packed row gives the same logits as its example alone (right padding is inert)."""
    model, tok = load_model("tiny-llama")
    ds = load_dataset(DatasetSpec(builtin="sentiment", num_examples=8), tok)
    rows = [ds.train[:3], ds.train[3:5]]
    pb = pack_batch(rows, tok.pad_token_id)
    with torch.no_grad():
        packed = model(input_ids=pb.input_ids, attention_mask=pb.attention_mask).logits
        for r, ex in enumerate(ds.train[:5]):
            solo = model(input_ids=torch.tensor([ex.input_ids])).logits[0]
            torch.testing.assert_close(packed[r, : len(ex.input_ids)], solo, atol=1e-5, rtol=1e-5)


def test_micro_batches():
    assert micro_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert micro_batches([], 2) == []
    with pytest.raises(ValueError):
        micro_batches([1], 0)
