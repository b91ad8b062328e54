"""runlane's modules import in one direction: the graph of imports between them (read with
``ast``, without importing anything) has no cycle. A cycle makes a module's behaviour
depend on which of the two was imported first, and hides which one is the lower layer.

Counted: every ``import``/``from ... import`` anywhere in a module (a function's own
imports too) and ``__import__``/``importlib.import_module`` of a constant name. Not
counted: imports under ``if TYPE_CHECKING:``, which never run. Importing ``a.b.c``
counts as an edge to ``a.b.c`` only, not to the packages above it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "runlane"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, list[str]]]:
    """(module, names taken from it) for each import that runs."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join([*here, base] if base else here)
            yield base, [alias.name for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id == "__import__")
                   or (isinstance(node.func, ast.Attribute)
                       and node.func.attr == "import_module"))):
            yield node.args[0].value, []
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Each runlane module and the runlane modules it imports."""
    files = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for target, names in _imported(tree, name, path.name == "__init__.py"):
            # `from runlane.store import views`: the module views; a name that is not a
            # module is the package's own (its __init__.py).
            subs = {f"{target}.{n}" for n in names} & files.keys()
            graph[name] |= subs
            if target in files and (not names or len(subs) < len(names)):
                graph[name].add(target)
            graph[name].discard(name)
    return graph


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: modules each of which
    imports every other, directly or not (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A cycle through each tangle, as its modules in import order, the first again last."""
    return [_a_cycle(graph, tangle) for tangle in tangles(graph)]


def _a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth first)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in {component}")  # a component always has one


def test_the_scan_sees_imports_that_run_and_only_those() -> None:
    """The scan itself: a function's import counts, a TYPE_CHECKING one does not, and a
    cycle is found and printed in order."""
    tree = ast.parse("import runlane.a\nfrom typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from runlane.b import B\n"
                     "def f():\n    from . import c\n    __import__('runlane.d')\n")
    found = sorted(m for m, _ in _imported(tree, "runlane.x", False))
    assert found == ["runlane", "runlane.a", "runlane.d", "typing"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_runlane_imports_in_one_direction() -> None:
    graph = import_graph()
    assert len(graph) > 100 and "runlane.api" in graph["runlane.cli"]
    found = tangles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        " -> ".join(_a_cycle(graph, t)) + f"\n  (all of {', '.join(sorted(t))})" for t in found)
