"""leakfree's modules depend on each other one way only: no two import each other.

Read from the source with ``ast`` (nothing is imported): a module's imports are those that
run when it is imported (module level, class bodies, ``if`` / ``try`` / ``with`` blocks),
not those inside functions. ``from leakfree.x import y`` depends on ``leakfree.x``, and on
``leakfree.x.y`` where that is a module. Two graphs: what runs, which must be acyclic;
and what runs plus the type-only imports under ``if TYPE_CHECKING:`` (a "pure forward"
import still says the two modules know each other), which must be acyclic apart from the
circles listed in :data:`KNOWN_CIRCLES` while their removal is under way.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "leakfree"

#: Circles through type-only imports still to remove, each with who removes it. Nothing
#: may be added here: break the circle instead (move the shared piece to the module that
#: owns it, or pass what is needed in); and an entry leaves when its circle is gone.
#: (patches/_registry <-> _originals: removed with the Outcome / Reason split; offload
#: hooks <-> streams: offload/handles.py; diagnostics detector <-> memory: the growth fit
#: in diagnostics/growth.py and the detector reading its tracker through a Protocol.)
KNOWN_CIRCLES: dict[frozenset[str], str] = {}

#: an edge's source line, for the message: (importer, imported) -> line
Lines = dict[tuple[str, str], int]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(body: list[ast.stmt], type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run with the module (``type_checking``: and those under
    ``if TYPE_CHECKING:``); not those inside functions."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if type_checking or not _is_type_checking(node.test):
                yield from _imports(node.body, type_checking)
            yield from _imports(node.orelse, type_checking)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _imports(block, type_checking)
            for handler in node.handlers:
                yield from _imports(handler.body, type_checking)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _imports(node.body, type_checking)


def import_graph(root: Path, *, type_checking: bool) -> tuple[dict[str, set[str]], Lines]:
    """``{module: the leakfree modules it imports}`` for the package at ``root``."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    lines: Lines = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path)).body, type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                if target in paths and target != name:
                    graph[name].add(target)
                    lines.setdefault((name, target), node.lineno)
    return graph, lines


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycle_path(graph: dict[str, set[str]], members: list[str], lines: Lines) -> str:
    """One cycle inside ``members``, as ``a (line n) -> b (line m) -> a``."""
    inside = set(members)
    path = [members[0]]
    while True:
        nxt = min(graph[path[-1]] & inside)
        if nxt in path:
            path = [*path[path.index(nxt) :], nxt]
            break
        path.append(nxt)
    steps = [f"{a} (line {lines[a, b]}) -> " for a, b in pairwise(path)]
    return "".join(steps) + path[-1]


def problems(root: Path, *, type_checking: bool, known: dict[frozenset[str], str]) -> list[str]:
    """Each circle not in ``known`` as a path, then each entry of ``known`` that is no
    longer a circle (it must leave the list)."""
    graph, lines = import_graph(root, type_checking=type_checking)
    found = [frozenset(members) for members in circles(graph)]
    return [
        cycle_path(graph, sorted(members), lines) for members in found if members not in known
    ] + [
        f"{' <-> '.join(sorted(members))} is no longer a circle: remove it from KNOWN_CIRCLES"
        for members in known
        if members not in found
    ]


def test_no_two_leakfree_modules_import_each_other_when_imported() -> None:
    found = problems(PACKAGE, type_checking=False, known={})
    assert not found, "leakfree modules import each other at module level: " + "; ".join(found)


def test_dependencies_go_one_way_counting_type_only_imports() -> None:
    """Review: ``patches/_registry.py`` imported ``_originals.py`` and ``_originals.py``
    imported the registry's ``PatchRecord`` and ``Registry`` back, for annotations."""
    found = problems(PACKAGE, type_checking=True, known=KNOWN_CIRCLES)
    assert not found, (
        "leakfree modules import each other (counting `if TYPE_CHECKING:` imports): "
        + "; ".join(found)
        + ". Break the circle: move the shared piece to the module that owns it, or pass "
        "what is needed in"
    )


def test_the_finder_sees_a_circle_through_each_kind_of_import(tmp_path: Path) -> None:
    package = tmp_path / "leakfree"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from leakfree.sub.b import B\n"
    )
    (package / "sub" / "b.py").write_text(
        "def later():\n    from leakfree.sub import c\n\nfrom . import a\n"
    )
    (package / "sub" / "c.py").write_text("import leakfree.sub.b\n")
    assert problems(package, type_checking=False, known={}) == []  # c: only in a function
    assert problems(package, type_checking=True, known={}) == [
        "leakfree.sub.a (line 3) -> leakfree.sub.b (line 4) -> leakfree.sub.a"
    ]
    known = {frozenset({"leakfree.sub.a", "leakfree.sub.b"}): "being removed"}
    assert problems(package, type_checking=True, known=known) == []
    assert problems(package, type_checking=False, known=known) == [
        "leakfree.sub.a <-> leakfree.sub.b is no longer a circle: remove it from KNOWN_CIRCLES"
    ]
    (package / "sub" / "c.py").write_text("import leakfree.sub.b\nimport leakfree.sub.a\n")
    (package / "sub" / "a.py").write_text("from leakfree.sub import c\n")
    (package / "sub" / "b.py").write_text("")
    assert problems(package, type_checking=False, known={}) == [
        "leakfree.sub.a (line 1) -> leakfree.sub.c (line 2) -> leakfree.sub.a"
    ]
