"""No module of ``plora/runtime/`` reads another's private names.

A name with one leading underscore is its module's own: another module neither reads it as an
attribute (``coord._x``: only ``self._x`` / ``cls._x``) nor imports it (``from m import _x``).
What a module shares is public and typed (the coordinator's state is
:class:`plora.runtime.coordinator.state.CoordinatorState`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "plora" / "runtime"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reads(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of each private name ``source`` takes from another object or
    module."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found += [(node.lineno, f"from {node.module} import {a.name}")
                      for a in node.names if _private(a.name)]  # fmt: skip
    return found


def test_no_runtime_module_reads_another_modules_private_names() -> None:
    bad = [
        f"{path.relative_to(RUNTIME.parent.parent)}:{line}: {expr}"
        for path in sorted(RUNTIME.rglob("*.py"))
        for line, expr in private_reads(path.read_text())
    ]
    assert bad == []


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("coord._need_plan = True", True),
        ("x = coord.state._plans", True),
        ("from plora.engine.loss import _to_device", True),
        ("self._x = 1\ncls._y = 2", False),
        ("coord.plans.due = True\nobj.__class__", False),
    ],
)
def test_the_check_catches_a_private_read(source: str, caught: bool) -> None:
    assert bool(private_reads(source)) is caught
