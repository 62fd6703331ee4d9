"""rlbatch's layers go one way (docs/architecture.md, "Layers"): a package imports only packages of
its own layer or below, and no modules import each other in a circle, imports inside functions
included. An exception is an entry of ``ALLOWED``, with its reason beside it.

The graph is read from the source (``ast``), not by importing: ``import a.b`` and ``from a import b``
are edges to the module they name (``from a import name`` to ``a`` when ``name`` is not a module);
imports under ``if TYPE_CHECKING:`` are for the type checker only and are left out."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "rlbatch"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "osinfo"),
    ("config",),
    ("phases", "placement", "algos", "data", "models", "sandbox", "plugins", "engines.registry", "engines.defaults",
     "config.parse", "config.load"),
    ("rewards",),
    ("plan",),
    ("runtime",),
    ("engines",),
    ("checkpoint", "envs"),
    ("trackers",),
    ("checks",),
    ("loop",),
    ("launch", "worker", "export", "inspect", "plan.cli", "plan.search", "plan.measure", "plan.__main__"),
]
"""Bottom to top: rlbatch's packages (and top-level modules) by layer. A module named on its own
stands apart from its package: the engine registry and the engines' defaults are the vocabulary
placement and the planner read, below every engine (each engine's cost model, in its package,
builds on the planner's formulas); the planner's command line, its placement search and its
hardware measurement sit with the other entry points, above the checks and engines they run."""

ALLOWED: dict[tuple[str, str], str] = {}
"""(importing module, imported module) -> why it is allowed."""


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    out = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}  # type: ignore[union-attr]
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """rlbatch module -> the rlbatch modules it imports (anywhere in it)."""
    files = {_module_of(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            named: list[str] = []
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                named = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for name in named:
                while name and name not in files:  # a name inside a module: the module
                    name = name.rpartition(".")[0]
                if name.startswith("rlbatch") and name != module:
                    graph[module].add(name)
    return graph


_NAMED = sorted((name for names in LAYERS for name in names), key=len, reverse=True)


def _package(module: str) -> str:
    """The name ``LAYERS`` places ``module`` under: itself where named, else its package."""
    if "." not in module:
        return "errors"  # rlbatch/__init__.py, which imports nothing but the errors
    inner = module.split(".", 1)[1]
    return next((n for n in _NAMED if inner == n or inner.startswith(n + ".")), inner.split(".")[0])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _kept(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {d for d in ds if (m, d) not in ALLOWED} for m, ds in graph.items()}


def test_every_package_has_a_layer() -> None:
    layer = {p for names in LAYERS for p in names}
    packages = {_package(_module_of(p)) for p in ROOT.rglob("*.py")}
    assert packages - layer == set(), "place the new package in LAYERS (and docs/architecture.md)"
    assert layer - packages == set(), "a package in LAYERS that rlbatch no longer has"


def test_no_package_imports_a_layer_above_its_own() -> None:
    rank = {p: i for i, names in enumerate(LAYERS) for p in names}
    upward = sorted(f"{m} -> {d} (layer {rank[_package(m)]} -> {rank[_package(d)]})"
                    for m, ds in _kept(import_graph()).items() for d in ds
                    if rank[_package(d)] > rank[_package(m)])
    assert upward == [], "\n".join(upward)


def test_no_import_cycles_between_modules_or_packages() -> None:
    graph = _kept(import_graph())
    assert _cycles(graph) == []
    packages: dict[str, set[str]] = defaultdict(set)
    for m, ds in graph.items():
        packages[_package(m)] |= {_package(d) for d in ds} - {_package(m)}
    assert _cycles(packages) == []


def test_every_allowed_import_is_there_and_says_why() -> None:
    graph = import_graph()
    assert all(d in graph.get(m, ()) and len(why) > 20 for (m, d), why in ALLOWED.items()), "drop what is gone"


def test_the_reader_finds_what_it_must() -> None:
    """The reader's own teeth: a cycle, an upward import and a function-level import are seen."""
    graph = import_graph()
    assert "rlbatch.config.schema" in graph["rlbatch.checks.validate"]
    assert "rlbatch.engines.registry" in graph["rlbatch.checks.lora_rules"]
    assert "rlbatch.envs.scoring" in graph["rlbatch.loop.scorers"]  # imported inside a function
    assert "rlbatch.plan.memory" not in graph["rlbatch.plan.costs"]  # only under TYPE_CHECKING there
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
