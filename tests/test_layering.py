"""The package's imports against the layer order in README.md ("## Layers"): no module imports a
higher layer, and no modules import each other in a cycle.

Every module is parsed with `ast`, never imported, so TYPE_CHECKING-only and function-local
imports count like top-level ones: they hide a dependency from Python's import machinery, not
from the design. Only `import` statements of `mlaserve` names are edges (a module named by a
string, as the backend registry does, is not). The package `__init__` a submodule's import runs
implicitly is not an edge either: every module would otherwise depend on its package's
re-export list.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mlaserve"
README = ROOT / "README.md"


@dataclass(frozen=True)
class Edge:
    """`src` imports `dst` (module names) at `path`:`line`."""

    src: str
    dst: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Layer:
    rank: int  # 1 = the bottom of the README's list
    entries: tuple[str, ...]  # as written there: `ops/`, `engine/forward_batch.py`, `__init__.py`

    def label(self) -> str:
        return f"layer {self.rank} ({', '.join(self.entries)})"


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package's `__init__.py`
    under the package's own name)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_edges(name: str, path: Path, source: str, modules: dict[str, Path]) -> list[Edge]:
    """Every import of a package module in `source` (module `name`, file `path`), wherever it
    sits in the file. `from X import y` is an edge to `X.y` when that is a module, else to `X`;
    relative imports are resolved against the module's package."""
    is_package = path.name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    edges = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package[: len(package) - (node.level - 1)]
                if len(base_parts) != len(package) - (node.level - 1):
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond the top")
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            while target not in modules and "." in target:  # `import a.b.c` of a name in a.b
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                edges.append(Edge(name, target, path, node.lineno))
    return edges


def read_layers(readme: Path) -> list[Layer]:
    """The numbered list of README.md's "## Layers" section, lowest layer first. Each line names
    its modules in backticks before the first ": " (a `/` entry: a subpackage and all it holds;
    a `.py` entry: that module; `__init__.py`: the top-level package's own module)."""
    text = readme.read_text()
    match = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"{readme.name} has no '## Layers' section (tests/test_layering.py reads it)"
    layers = []
    for line in match.group(1).splitlines():
        item = re.match(r"\d+\.\s+(.*)", line)
        if item:
            head = item.group(1).split(": ", 1)[0]
            entries = tuple(re.findall(r"`([^`]+)`", head))
            assert entries, f"README Layers line names no module in backticks: {line!r}"
            layers.append(Layer(len(layers) + 1, entries))
    assert layers, "README's Layers section has no numbered list"
    return layers


def entry_module(entry: str) -> str:
    """README entry -> dotted name (a prefix for `/` entries)."""
    if entry == "__init__.py":
        return PACKAGE
    return ".".join([PACKAGE, *entry.removesuffix("/").removesuffix(".py").split("/")])


def layer_of(module: str, layers: list[Layer]) -> tuple[Layer, str] | None:
    """The layer of `module`, by the most specific README entry that covers it."""
    best = None
    for layer in layers:
        for entry in layer.entries:
            dotted = entry_module(entry)
            covers = module == dotted or (entry.endswith("/") and module.startswith(dotted + "."))
            if covers and (best is None or len(dotted) > len(entry_module(best[1]))):
                best = (layer, entry)
    return best


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node (the import cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return module_names(ROOT / PACKAGE)


@pytest.fixture(scope="module")
def edges(modules: dict[str, Path]) -> list[Edge]:
    found = []
    for name, path in modules.items():
        found += import_edges(name, path, path.read_text(), modules)
    return found


@pytest.fixture(scope="module")
def layers() -> list[Layer]:
    return read_layers(README)


def test_readme_layers_name_existing_paths_once(layers: list[Layer]) -> None:
    seen: dict[str, int] = {}
    problems = []
    for layer in layers:
        for entry in layer.entries:
            if not (ROOT / PACKAGE / entry).exists():
                problems.append(f"README Layers {layer.label()}: {PACKAGE}/{entry} does not exist")
            if entry in seen:
                problems.append(
                    f"README Layers: {entry} is in layers {seen[entry]} and {layer.rank}"
                )
            seen[entry] = layer.rank
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_every_module_has_a_layer(modules: dict[str, Path], layers: list[Layer]) -> None:
    unplaced = [
        f"{path.relative_to(ROOT)}: no layer in README.md's Layers list covers {name}; add it "
        "there on purpose"
        for name, path in modules.items()
        if layer_of(name, layers) is None
    ]
    if unplaced:
        pytest.fail("\n".join(unplaced), pytrace=False)


def test_no_upward_imports(edges: list[Edge], layers: list[Layer]) -> None:
    problems = []
    for edge in edges:
        src, dst = layer_of(edge.src, layers), layer_of(edge.dst, layers)
        if src is None or dst is None:
            continue  # test_every_module_has_a_layer reports it
        if dst[0].rank > src[0].rank:
            problems.append(
                f"{edge.where()}: {edge.src} imports {edge.dst}, upward: {src[1]} is in "
                f"{src[0].label()}, {dst[1]} in {dst[0].label()}; imports must point down "
                "README.md's Layers list"
            )
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_no_import_cycles(edges: list[Edge]) -> None:
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.src, set()).add(edge.dst)
    problems = []
    for component in strongly_connected(graph):
        members = set(component)
        inside = sorted(
            (e for e in edges if e.src in members and e.dst in members),
            key=lambda e: (e.src, e.line),
        )
        lines = "\n".join(f"  {e.where()}: {e.src} imports {e.dst}" for e in inside)
        problems.append(f"import cycle among {', '.join(component)} (no cycles allowed):\n{lines}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


# The checker's own pieces, on made-up input.


def test_relative_imports_resolve_and_every_import_counts() -> None:
    modules = dict.fromkeys(
        ["mlaserve", "mlaserve.a", "mlaserve.a.b", "mlaserve.a.c", "mlaserve.d"], Path("x.py")
    )
    source = """
from typing import TYPE_CHECKING
from . import c
from .. import d
import numpy
if TYPE_CHECKING:
    from mlaserve.a.c import Thing
def f():
    import mlaserve.d.missing
"""
    found = import_edges("mlaserve.a.b", ROOT / "mlaserve/a/b.py", source, modules)
    assert sorted((e.line, e.dst) for e in found) == [
        (3, "mlaserve.a.c"),
        (4, "mlaserve.d"),
        (7, "mlaserve.a.c"),
        (9, "mlaserve.d"),
    ]


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_most_specific_entry_places_a_module() -> None:
    layers = [Layer(1, ("engine/forward_batch.py",)), Layer(2, ("engine/", "__init__.py"))]
    assert layer_of("mlaserve.engine.forward_batch", layers) == (
        layers[0],
        "engine/forward_batch.py",
    )
    assert layer_of("mlaserve.engine.scheduler", layers) == (layers[1], "engine/")
    assert layer_of("mlaserve", layers) == (layers[1], "__init__.py")
    assert layer_of("mlaserve.config", layers) is None
