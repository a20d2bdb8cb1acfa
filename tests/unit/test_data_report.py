"""Nothing in the data changes silently: rows cut to ``max_seq_len`` and rows left out (no target
token left) are counted per split, eval rows with no target are not scored, unknown chat roles
are an error. Counts are checked against the tokenizer itself (the reference)."""

from __future__ import annotations

import json

import pytest

from plora.config import ConfigError, DatasetSpec
from plora.engine.data import load_dataset
from plora.models import load_model

MAX = 24


@pytest.fixture(scope="module")
def tok():
    return load_model("tiny-qwen2")[1]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(prefix: str):
    """Short rows, rows whose completion runs past MAX (cut, kept) and rows whose prompt alone
    fills MAX (nothing left to learn or score)."""
    short = [{"prompt": f"{prefix} {i}+1=", "completion": str(i + 1)} for i in range(6)]
    long_answer = [{"prompt": "say:", "completion": " ".join(["yes"] * 40)} for _ in range(3)]
    long_prompt = [{"prompt": " ".join(["word"] * 60) + "?", "completion": "no"} for _ in range(2)]
    return short + long_answer + long_prompt


def _expected(tok, rows):
    """(cut, left out) by the tokenizer alone: ids = prompt + completion + eos, labels on the
    completion; a row is left out when no completion token is within MAX (minus the shift)."""
    cut = left_out = 0
    for r in rows:
        p = tok(r["prompt"])["input_ids"]
        c = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        cut += len(p) + len(c) > MAX
        left_out += len(p) >= MAX  # label positions start at len(p) (>= 1): none survive
    return cut, left_out


def test_cut_and_left_out_rows_are_counted_per_split(tmp_path, tok) -> None:
    train, evals = _rows("train"), _rows("eval")
    spec = DatasetSpec(path=_jsonl(tmp_path / "t.jsonl", train), metric="exact_match",
                       eval_path=_jsonl(tmp_path / "e.jsonl", evals), max_seq_len=MAX)  # fmt: skip
    data = load_dataset(spec, tok)
    report = data.report
    assert report is not None and report.changed
    for split, rows in (("train", train), ("eval", evals)):
        s = getattr(report, split)
        cut, left_out = _expected(tok, rows)
        assert (s.rows, s.truncated, s.dropped) == (len(rows), cut, left_out), split
        assert cut > left_out > 0
    assert len(data.train) == report.train.kept == len(train) - report.train.dropped
    # eval rows with nothing to score are left out of eval (loss and exact match)
    assert len(data.eval) == report.eval.kept == len(evals) - report.eval.dropped
    assert all(ex.prompt_len < MAX for ex in data.eval)
    lines = report.lines()
    assert len(lines) == 2 and "train 5 of 11 rows cut" in lines[0] and "2 left out" in lines[1]
    assert json.loads(json.dumps(report.to_dict()))["eval"]["kept"] == len(data.eval)


def test_nothing_cut_reports_nothing(tmp_path, tok) -> None:
    rows = _rows("x")[:6]
    data = load_dataset(DatasetSpec(path=_jsonl(tmp_path / "t.jsonl", rows), max_seq_len=64), tok)
    assert data.report is not None and not data.report.changed and data.report.lines() == []
    assert data.report.train.rows + data.report.eval.rows == 6


@pytest.mark.parametrize("role", ["human", "gpt", "Assistant", ""])
def test_unknown_chat_role_is_an_error_naming_the_row(tmp_path, tok, role) -> None:
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "system", "content": "s"}, {"role": role, "content": "hi"},
                        {"role": "assistant", "content": "yo"}]}  # fmt: skip
    path = _jsonl(tmp_path / "chat.jsonl", [ok, ok, bad, ok])
    with pytest.raises(ConfigError) as err:
        load_dataset(DatasetSpec(path=path, max_seq_len=64), tok)
    text = str(err.value)
    assert "chat.jsonl:3" in text and "messages[1].role" in text and "unknown chat role" in text
