"""Soak-test helpers: how big every container leakfree owns is, and what leakfree's own
code allocated that is still alive.

:func:`container_sizes` finds the containers by walking, not by name: from the objects a
test hands it (a manager, a watch, a log) through the attributes of leakfree's own
classes, and every module-level container of every loaded ``leakfree`` module (patch
registries, caches), so a container added later is soaked too without a line here.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import tracemalloc
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

#: what counts as a container: its len() is its size
_CONTAINERS = (
    dict,
    list,
    deque,
    set,
    frozenset,
    weakref.WeakSet,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
)


def _ours(obj: object) -> bool:
    return type(obj).__module__.startswith("leakfree") and not isinstance(obj, type)


def _attributes(obj: object) -> Iterator[tuple[str, Any]]:
    seen = set()
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in seen and not name.startswith("__"):
                seen.add(name)
                with contextlib.suppress(AttributeError):
                    yield name, getattr(obj, name)
    yield from getattr(obj, "__dict__", {}).items()


def container_sizes(roots: Mapping[str, object], depth: int = 4) -> dict[str, int]:
    """``{path: len}`` for every container reachable from ``roots`` through leakfree's own
    objects (and containers of them: the largest of each path), and for every container
    at module level in ``leakfree.*``."""
    sizes: dict[str, int] = {}
    visited: set[int] = set()

    def visit(path: str, obj: object, left: int) -> None:
        if isinstance(obj, _CONTAINERS):
            sizes[path] = max(sizes.get(path, 0), len(obj))
            if left and isinstance(obj, (dict, list, deque)):
                items = obj.values() if isinstance(obj, dict) else obj
                for item in list(items)[:256]:
                    visit(path + "[*]", item, left - 1)
            return
        if not _ours(obj) or id(obj) in visited or not left:
            return
        visited.add(id(obj))
        for name, value in _attributes(obj):
            visit(f"{path}.{name}", value, left - 1)

    for name, root in roots.items():
        visit(name, root, depth)
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("leakfree") and module is not None:
            for name, value in list(vars(module).items()):
                if not name.startswith("__"):
                    visit(f"{module_name}.{name}", value, depth)
    return sizes


class Soak:
    """Container sizes and leakfree's live allocations over a long run.

    ``settle(roots)`` at the step from which state must stay bounded (step 100): the sizes
    then set the bounds (twice plus 64 entries, or a container's declared cap, ``caps``:
    path -> the most it may hold), and tracing starts. ``check(roots, step)``
    at later steps: every container within its bound (a container first seen later may
    hold 64), and the bytes leakfree allocated since ``settle`` and still alive
    recorded. ``growth()``: those bytes at the last check, less the most at any check in
    the first half of the run.
    """

    SLACK = 64

    def __init__(self, caps: Mapping[str, int] | None = None) -> None:
        self.caps = dict(caps or {})
        self.bounds: dict[str, int] = {}
        self.alive: list[tuple[int, int]] = []  # (step, bytes)

    def settle(self, roots: Mapping[str, object]) -> None:
        gc.collect()
        sizes = container_sizes(roots)
        self.bounds = {k: max(2 * n + self.SLACK, self.caps.get(k, 0)) for k, n in sizes.items()}
        tracemalloc.start()

    def check(self, roots: Mapping[str, object], step: int) -> None:
        gc.collect()
        over = {
            path: (n, self.bounds.get(path, self.SLACK))
            for path, n in container_sizes(roots).items()
            if n > self.bounds.get(path, self.SLACK)
        }
        assert not over, f"step {step}: containers past their bound (size, bound): {over}"
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, "*/leakfree/*")]
        )
        self.alive.append((step, sum(stat.size for stat in snapshot.statistics("filename"))))

    def stop(self) -> None:
        tracemalloc.stop()

    def growth(self) -> int:
        half = self.alive[len(self.alive) // 2][0]
        early = max(n for step, n in self.alive if step <= half)
        return self.alive[-1][1] - early

    def where(self) -> str:
        return ", ".join(f"{step}: {n} B" for step, n in self.alive)
