"""Fuzzing the door (issue 14, item 7): valid sweep and dataset files mutated by hypothesis --
values of other types, unknown and missing keys, unicode, sizes, a different YAML shape, broken
text -- and ``plora validate`` / ``plora plan`` must answer with exit 0 or exactly one ``error:``
line and exit 2: never a traceback, never a hang (each call within seconds).

Runs in-process (typer's CliRunner) with a modest example budget for a 2-core CI."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from plora.cli import app

ROOT = Path(__file__).resolve().parents[2]
#: Seconds one command may take on a loaded 2-core machine (validate tokenizes the data).
BUDGET_S = 20.0

ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(6) for b in range(5)]


def base_sweep(data: Path) -> dict[str, Any]:
    sweep = yaml.safe_load((ROOT / "sweeps" / "quickstart.yaml").read_text())
    sweep["dataset"] = {"path": str(data), "max_seq_len": 32, "eval_fraction": 0.2}
    return sweep


# -- values: every YAML type, unicode, edge sizes -------------------------------------------
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, -1, 2**31, 10**12, 0.0, -0.0, 1e-300, 1e308]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", " ", "cpu", "tiny-qwen2", "all", "grid", "é", "\u202e", "💥", "a" * 500,
                     "1.0e-4", "null", "~", "yes", "[1, 2]", "{a: 1}", "../../etc", "Qwen/Qwen2-0.5B"]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _parent(doc: Any, path: tuple) -> Any:
    for k in path[:-1]:
        doc = doc[k]
    return doc


@st.composite
def mutated_sweep(draw: st.DrawFn, data: Path) -> str:
    """A sweep file's text: the valid base with 1-3 mutations."""
    doc: Any = base_sweep(data)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc) if isinstance(doc, dict | list) else []
        op = draw(st.sampled_from(["replace", "replace", "delete", "add", "rename", "shape"]))
        if op == "shape" or not paths:
            doc = draw(st.one_of(values, st.just([doc]), st.just({"sweep": doc})))
            continue
        path = draw(st.sampled_from(paths))
        parent = _parent(doc, path)
        key = path[-1]
        if op == "replace":
            parent[key] = draw(values)
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(values)
        elif op == "rename" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = parent.pop(key)
    text = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)
    if draw(st.booleans()) and text:  # break the text itself: insert, cut or duplicate a line
        lines = text.splitlines()
        i = draw(st.integers(0, len(lines) - 1))
        how = draw(st.sampled_from(["insert", "cut", "dup"]))
        if how == "insert":
            j = draw(st.integers(0, len(lines[i])))
            lines[i] = (
                lines[i][:j]
                + draw(st.sampled_from([":", "- ", "{", "'", "\t", "  ", "&a", "*"]))
                + lines[i][j:]
            )
        elif how == "cut":
            lines = [*lines[:i], lines[i][: len(lines[i]) // 2]]  # the file ends mid-line
        else:
            lines.insert(i, lines[i])
        text = "\n".join(lines) + "\n"
    return text


@st.composite
def mutated_rows(draw: st.DrawFn) -> str:
    """A JSONL dataset's text: the valid rows with mutations of values, keys, sizes and lines."""
    rows: list[Any] = [dict(r) for r in ROWS]
    for _ in range(draw(st.integers(1, 4))):
        if not rows:
            break
        i = draw(st.integers(0, len(rows) - 1))
        op = draw(st.sampled_from(["value", "drop_key", "rename", "not_object", "huge", "clear"]))
        row = rows[i]
        if not isinstance(row, dict) or not row:
            rows[i] = draw(values)
            continue
        key = draw(st.sampled_from(sorted(row)))
        if op == "value":
            row[key] = draw(values)
        elif op == "drop_key":
            del row[key]
        elif op == "rename":
            row[draw(st.sampled_from(["text", "messages", "Prompt", "completion ", "é"]))] = (
                row.pop(key)
            )
        elif op == "not_object":
            rows[i] = draw(values)
        elif op == "huge":
            row[key] = draw(st.sampled_from(["x" * 20000, "é💥" * 3000, "\n" * 500]))
        else:
            rows = rows[:i] if draw(st.booleans()) else []
    lines = [json.dumps(r, ensure_ascii=draw(st.booleans())) for r in rows]
    if lines and draw(st.booleans()):  # a broken line
        i = draw(st.integers(0, len(lines) - 1))
        lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
    return "\n".join(lines) + ("\n" if lines else "")


def check_answer(args: list[str]) -> None:
    t0 = time.perf_counter()
    result = CliRunner().invoke(app, args)
    took = time.perf_counter() - t0
    out = result.output
    assert took < BUDGET_S, f"{args[0]} took {took:.1f}s"
    assert "Traceback" not in out, out
    assert result.exit_code in (0, 2), (result.exit_code, out, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    if result.exit_code == 2:
        lines = [line for line in out.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), out


def fuzz_settings(max_examples: int) -> settings:
    return settings(SETTINGS, max_examples=max_examples)


SETTINGS = settings(
    deadline=None,
    derandomize=True,  # the same examples on every CI run; a failure is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_the_base_files_are_valid(tmp_path, data_file) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(base_sweep(data_file)))
    for command in ("validate", "plan"):
        result = CliRunner().invoke(app, [command, str(path)])
        assert result.exit_code == 0, result.output


@pytest.mark.timeout(300)  # a hang fails here, not at CI's end
@fuzz_settings(40)
@given(data=st.data())
def test_mutated_sweep_files_get_an_answer(tmp_path, data_file, data) -> None:
    text = data.draw(mutated_sweep(data_file))
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    for command in ("validate", "plan"):
        check_answer([command, str(path)])


@pytest.mark.timeout(300)
@fuzz_settings(20)
@given(rows=mutated_rows())
def test_mutated_dataset_files_get_an_answer(tmp_path, data_file, rows) -> None:
    data_file.write_text(rows)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(base_sweep(data_file)))
    check_answer(["validate", str(path)])


@pytest.mark.timeout(300)
@fuzz_settings(15)
@given(
    changes=st.dictionaries(
        st.sampled_from(
            [
                "num_examples",
                "eval_fraction",
                "max_seq_len",
                "seed",
                "metric",
                "format",
                "completion_only",
                "eval_path",
                "builtin",
            ]
        ),
        values,
        min_size=1,
        max_size=3,
    )
)
def test_mutated_builtin_dataset_sections_get_an_answer(tmp_path, data_file, changes) -> None:
    """Sizes and types in a built-in task's section (e.g. ``num_examples: 2**64``): an answer
    within seconds, not rows generated for ever."""
    doc = base_sweep(data_file)
    doc["dataset"] = {"builtin": "arithmetic", "num_examples": 200, "max_seq_len": 32, **changes}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    for command in ("validate", "plan"):
        check_answer([command, str(path)])
