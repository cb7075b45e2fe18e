"""No import cycles between hf_zero's modules.

The graph has an edge A -> B when module A imports hf_zero module B at import time: a statement
at module level or in a class body (inside ``try`` / ``with`` / ``if`` too), not one inside a
function (a lazy import, run at call time) nor under ``if TYPE_CHECKING:`` (annotations only).
``from hf_zero.pkg import name`` is an edge to the submodule ``hf_zero.pkg.name`` when there is
one, else to the package ``hf_zero.pkg``. A package's ``__init__`` running before its submodules
is not an edge (every package would otherwise be a cycle with its ``__init__``).

Run as a script to print the graph's strongly connected components of more than one module:
``python tests/unit/test_import_graph.py`` (``--lazy``: counting imports inside functions too, to
see which lazy imports stand in for a cycle).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "hf_zero"


def module_files(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``src``, by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_imports(body: list[ast.stmt], lazy: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported (``lazy``: and those inside
    functions, which run at call time)."""
    if lazy:
        return [node for stmt in body for node in ast.walk(stmt) if isinstance(node, (ast.Import, ast.ImportFrom))]
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue  # runs at call time
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _import_time_imports(node.body)
            found += _import_time_imports(node.orelse)
        elif isinstance(node, ast.ClassDef):
            found += _import_time_imports(node.body)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            found += _import_time_imports(node.body)
            for handler in node.handlers:
                found += _import_time_imports(handler.body)
            found += _import_time_imports(node.orelse) + _import_time_imports(node.finalbody)
        elif isinstance(node, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
            found += _import_time_imports(node.body) + _import_time_imports(getattr(node, "orelse", []))
    return found


def import_graph(modules: dict[str, Path] | None = None, package: str = PACKAGE,
                 lazy: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports at import time (``lazy``: or at all, function
    bodies and ``TYPE_CHECKING`` blocks included)."""
    modules = module_files() if modules is None else modules
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _import_time_imports(ast.parse(path.read_text(), str(path)).body, lazy):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:  # relative: from the module's package, up level - 1 more
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                           for alias in node.names]
            for target in targets:
                while target and target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]  # import a.b.c of a name c in a.b
                if target in modules and target != name and (target == package or target.startswith(package + ".")):
                    graph[name].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node (sorted), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "hf_zero.engine.initialize" in graph
    assert "hf_zero.engine.engine" in graph["hf_zero.engine.initialize"]
    assert "hf_zero.comm" in graph["hf_zero.engine.engine"]


def test_a_cycle_is_found(tmp_path: Path) -> None:
    """The check itself: two modules importing each other at module level, and one only under
    TYPE_CHECKING or inside a function (not a cycle)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("from pkg import a\ndef f():\n    from pkg.c import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import f\n"
                              "from . import d\n")
    (pkg / "d.py").write_text("def g():\n    from pkg import c\n")
    graph = import_graph(module_files(tmp_path, "pkg"), "pkg")
    assert graph["pkg.c"] == {"pkg.d"}
    assert strongly_connected(graph) == [["pkg.a", "pkg.b"]]


def test_no_import_cycles() -> None:
    cycles = strongly_connected(import_graph())
    assert cycles == [], (
        "hf_zero modules import each other at module level (each list is a cycle): "
        f"{cycles}; move the shared piece into a module both import, or import inside the function "
        "that needs it at call time")


if __name__ == "__main__":
    graph = import_graph(lazy="--lazy" in sys.argv)
    components = strongly_connected(graph)
    print(f"{len(graph)} modules, {sum(len(v) for v in graph.values())} import-time edges, "
          f"{len(components)} cycle(s)")
    for component in components:
        print(f"  {len(component)} modules: " + ", ".join(component))
        for module in component:
            print(f"    {module} -> {sorted(graph[module] & set(component))}")
    sys.exit(1 if components else 0)


# The engine's layers, lowest first: a layer imports only the layers below it at import time
# (an annotation under TYPE_CHECKING may look up). engine.policy, the resolved config every
# layer reads, sits below them all; engine.engine and engine.initialize, above them all.
ENGINE_LAYERS = ("hf_zero.engine.sharding", "hf_zero.engine.schedule", "hf_zero.engine.optim")


def _engine_layer(module: str) -> int | None:
    for level, layer in enumerate(ENGINE_LAYERS):
        if module == layer or module.startswith(layer + "."):
            return level
    return None


def test_each_engine_layer_imports_only_the_layers_below_it():
    upward = [(a, b) for a, targets in import_graph().items() for b in targets
              if _engine_layer(a) is not None and _engine_layer(b) is not None and _engine_layer(b) > _engine_layer(a)]
    assert upward == [], f"imports from a lower engine layer into a higher one: {upward}"
    below_all = [(a, b) for a, targets in import_graph().items() for b in targets
                 if _engine_layer(a) is not None and b in ("hf_zero.engine.engine", "hf_zero.engine.initialize")]
    assert below_all == [], f"a layer imports the engine built on it: {below_all}"
