"""Print the import graph of `plora/` and `kernels/` (as `plora.kernels`) and check its rules.

Every `import` statement counts, wherever it sits (module top, function body, `TYPE_CHECKING`
block): a lazy import is still an arrow. Module names are the installed ones, so
`kernels/ops.py` is `plora.kernels.ops`.

Usage:
    python scripts/import_graph.py            # print the graph, the cycles and the broken rules
    python scripts/import_graph.py --check    # print only problems; exit 1 if there are any

`tests/unit/test_layers.py` calls `build_graph`, `find_cycles` and `layer_violations`.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES: dict[str, Path] = {"plora": ROOT / "plora", "plora.kernels": ROOT / "kernels"}

# Layers, lowest first. A module may import from its own layer's package or from lower layers,
# never from a higher one. Packages not listed (the top-level `plora` package) sit at the top.
LAYERS: list[tuple[str, ...]] = [
    ("plora.kernels",),
    ("plora.utils", "plora.config", "plora.model_spec", "plora.tasks"),
    ("plora.cost",),
    ("plora.planner",),
    ("plora.sweepdir", "plora.curves"),  # the sweep directory and the curves its writer feeds
    ("plora.models", "plora.engine"),
    ("plora.parallel",),
    ("plora.tune",),
    ("plora.runtime",),
    # the Tune proxy trainable starts the runtime's TuneService: the one module of plora.tune
    # above the runtime (plora.tune's other modules stay below it; the runtime never imports it)
    ("plora.tune.trainable",),
    ("plora.analysis",),
    ("plora.api",),
    ("plora.cli",),
]

# (importer prefix, forbidden import prefixes, why)
FORBIDDEN: list[tuple[str, tuple[str, ...], str]] = [
    ("plora.planner", ("ray", "torch"), "the planner is pure: no Ray, no torch"),
    ("plora.cost", ("ray", "torch"), "the cost model is pure: no Ray, no torch"),
    ("plora.config", ("ray", "torch"), "configs are plain data: no Ray, no torch"),
    ("plora.kernels", ("plora",), "kernels are reusable alone: nothing from plora outside them"),
    ("plora.engine", ("plora.runtime", "ray"), "the engine never imports the runtime or Ray"),
    (
        "plora.runtime.coordinator",
        ("ray", "torch", "plora.runtime.actors"),
        "the coordinator is a plain state machine: no Ray, no torch",
    ),
    ("plora", ("plora.cli",), "nothing imports the CLI"),
]


@dataclass(frozen=True, slots=True)
class Edge:
    """One import: `src` imports `dst` (both module names) at `line` of `src`'s file."""

    src: str
    dst: str
    line: int


def _module_name(package: str, root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            name = _module_name(package, root, path)
            if package == "plora" and name.startswith("plora.kernels"):
                continue
            found[name] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str:
    """The longest known module that `name` names or lies in (`a.b.C` -> `a.b`); else `name`."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return name


def _imports(module: str, path: Path, known: dict[str, Path]) -> list[Edge]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    edges: list[Edge] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                edges.append(Edge(module, _resolve(alias.name, known), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                edges.append(
                    Edge(module, _resolve(full if full in known else target, known), node.lineno)
                )
    return edges


def build_graph() -> tuple[dict[str, Path], list[Edge]]:
    """All modules of plora and plora.kernels, and every import between or out of them."""
    known = _modules()
    edges: list[Edge] = []
    for module, path in known.items():
        seen: set[str] = set()
        for e in sorted(_imports(module, path, known), key=lambda e: e.line):
            if e.dst != module and e.dst not in seen:
                seen.add(e.dst)
                edges.append(e)
    return known, edges


def package_of(module: str) -> str:
    """The top-level package a module belongs to: ``plora.engine.lora`` -> ``plora.engine``; a
    module with a layer of its own (``plora.tune.trainable``) is its own package."""
    for packages in LAYERS:
        for p in packages:
            if p.count(".") > 1 and (module == p or module.startswith(p + ".")):
                return p
    parts = module.split(".")
    return ".".join(parts[:2])


def find_cycles(
    known: dict[str, Path], edges: list[Edge], *, packages: bool = False
) -> list[list[str]]:
    """Strongly connected components of more than one module among plora's own modules (with
    ``packages``: of more than one top-level package, e.g. ``plora.tune`` <-> ``plora.runtime``).

    A package's `__init__` importing its own submodules is not counted (that is how a package
    re-exports), but a submodule importing its package's `__init__` is.
    """
    graph: dict[str, set[str]] = {}
    for m in known:
        graph.setdefault(package_of(m) if packages else m, set())
    for e in edges:
        if e.dst in known and not e.dst.startswith(e.src + "."):
            src, dst = (package_of(e.src), package_of(e.dst)) if packages else (e.src, e.dst)
            if src != dst:
                graph[src].add(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # Tarjan's algorithm
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def _layer(module: str) -> int:
    """The layer of the most specific LAYERS entry ``module`` lies in."""
    best, rank_of = -1, len(LAYERS)
    for rank, packages in enumerate(LAYERS):
        for p in packages:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank_of = len(p), rank
    return rank_of


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _own(module: str, package: str) -> bool:
    """``module`` lies in ``package``, a subpackage of plora (never plora itself)."""
    return package != "plora" and _within(module, package)


def layer_violations(known: dict[str, Path], edges: list[Edge]) -> list[str]:
    """Imports that point up the layer list or break a FORBIDDEN rule, one line each."""
    problems: list[str] = []
    for e in edges:
        where = f"{known[e.src].relative_to(ROOT)}:{e.line}: {e.src} imports {e.dst}"
        for importer, banned, why in FORBIDDEN:
            if not _within(e.src, importer) or (_within(e.dst, importer) and importer != "plora"):
                continue  # a package may import itself (kernels: plora.kernels.*)
            # ... and a banned package's own modules each other (plora.cli.* import plora.cli.app)
            if any(_within(e.dst, b) and not _own(e.src, b) for b in banned):
                problems.append(f"{where} ({why})")
        if e.dst in known and _layer(e.dst) > _layer(e.src):
            problems.append(
                f"{where} (upward: layer {_layer(e.src)} imports layer {_layer(e.dst)})"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print only problems")
    args = parser.parse_args(argv)
    known, edges = build_graph()
    if not args.check:
        for module in sorted(known):
            inner = sorted({e.dst for e in edges if e.src == module and e.dst in known})
            print(f"{module} -> {', '.join(inner) if inner else '(nothing of plora)'}")
    cycles = find_cycles(known, edges) + find_cycles(known, edges, packages=True)
    problems = layer_violations(known, edges)
    for cycle in cycles:
        print("cycle: " + " <-> ".join(cycle))
    for problem in problems:
        print(problem)
    if not cycles and not problems:
        print(f"ok: {len(known)} modules, no cycle, no upward or forbidden import")
    return 1 if cycles or problems else 0


if __name__ == "__main__":
    sys.exit(main())
