"""The import graph of plora/ and kernels/: no cycle, every arrow points down a layer.

The rules and the graph live in ``scripts/import_graph.py`` (run it to print the graph); these
tests fail when a rule breaks, and check that the checker itself catches a broken rule.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def graph_mod():
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts/import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def graph(graph_mod):
    return graph_mod.build_graph()


def test_the_graph_covers_plora_and_kernels(graph) -> None:
    known, edges = graph
    assert {"plora.config", "plora.planner.schedule", "plora.kernels.ops", "plora.cli"} <= set(
        known
    )
    assert any(e.src.startswith("plora.cli") and e.dst.startswith("plora.") for e in edges)


def test_no_import_cycles(graph_mod, graph) -> None:
    assert graph_mod.find_cycles(*graph) == []
    assert graph_mod.find_cycles(*graph, packages=True) == []  # nor between packages


def test_layers_point_down(graph_mod, graph) -> None:
    assert graph_mod.layer_violations(*graph) == []


def test_every_module_sits_in_a_layer(graph_mod, graph) -> None:
    known, _ = graph
    top = len(graph_mod.LAYERS)
    assert [m for m in known if graph_mod._layer(m) == top] == []


@pytest.mark.parametrize(
    ("src", "dst", "why"),
    [
        ("plora.planner.schedule", "torch", "pure"),
        ("plora.cost.model", "ray", "pure"),
        ("plora.kernels.ops", "plora.config", "nothing from plora"),
        ("plora.engine.trainer", "plora.runtime.actors.worker", "never imports the runtime"),
        ("plora.analysis.load", "plora.cli", "nothing imports the CLI"),
        ("plora.api", "plora.cli.app", "nothing imports the CLI"),
        ("plora.config.sweep", "plora.planner.types", "upward"),
        ("plora.runtime.coordinator.machine", "ray", "no Ray, no torch"),
        ("plora.runtime.coordinator.endings", "torch.nn", "no Ray, no torch"),
    ],
)
def test_the_checker_catches_a_broken_rule(graph_mod, graph, src, dst, why) -> None:
    known, edges = graph
    bad = graph_mod.Edge(src, dst, 1)
    assert any(why in p for p in graph_mod.layer_violations(known, [*edges, bad]))


def test_the_cli_modules_may_import_each_other(graph_mod, graph) -> None:
    known, edges = graph
    assert any(e.src == "plora.cli.planning" and e.dst == "plora.cli.app" for e in edges)
    inner = graph_mod.Edge("plora.cli.results", "plora.cli.app", 1)
    assert graph_mod.layer_violations(known, [*edges, inner]) == []


def test_the_checker_catches_a_cycle(graph_mod, graph) -> None:
    known, edges = graph
    back = graph_mod.Edge("plora.config.lora", "plora.config.sweep", 1)
    assert graph_mod.find_cycles(known, [*edges, back]) != []
    across = graph_mod.Edge("plora.tune.search", "plora.runtime.records", 1)  # issue 11's case
    assert graph_mod.find_cycles(known, [*edges, across]) == []  # no module cycle ...
    assert (
        graph_mod.find_cycles(known, [*edges, across], packages=True) != []
    )  # ... but a package one


def test_the_script_exits_nonzero_on_a_problem(graph_mod, monkeypatch, capsys) -> None:
    assert graph_mod.main(["--check"]) == 0
    monkeypatch.setattr(graph_mod, "LAYERS", list(reversed(graph_mod.LAYERS)))
    assert graph_mod.main(["--check"]) == 1
    assert "upward" in capsys.readouterr().out


@pytest.mark.parametrize(
    "package",
    ["plora.engine", "plora.runtime", "plora.sweepdir", "plora.analysis", "plora.kernels"],
)
def test_lazy_package_exports_resolve(package: str) -> None:
    """Every name a package lists (many load lazily) still names something after a move."""
    module = importlib.import_module(package)
    missing = []
    for name in module.__all__:
        try:
            getattr(module, name)
        except (AttributeError, ImportError):
            missing.append(name)
    assert missing == []


def test_the_coordinator_loads_neither_ray_nor_torch() -> None:
    """Importing the coordinator (and driving it: its lazy imports aside) pulls in no Ray and
    no torch: it is a plain state machine, testable with a fake clock."""
    import subprocess

    code = (
        "import sys; import plora.runtime.coordinator as c; c.Coordinator; "
        "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
