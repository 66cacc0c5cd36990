"""The public surface: what ``__all__`` promises, small enough to learn, and all of it real.

torch.autograd.graph exports 12 names and torch.utils.checkpoint 17; leakfree's package
and subpackages together export at most :data:`BUDGET`. Everything else (pools, records,
the registry, the scan's project model) stays importable from the module that defines it.
"""

from __future__ import annotations

import importlib

import pytest

#: the package, its subpackages, and its one public module
PUBLIC = (
    "leakfree",
    "leakfree.diagnostics",
    "leakfree.integrations",
    "leakfree.offload",
    "leakfree.patches",
    "leakfree.pipeline",
    "leakfree.scan",
    "leakfree.testing",
)
BUDGET = 60


def _exported() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for module in PUBLIC:
        for name in importlib.import_module(module).__all__:
            names.setdefault(name, set()).add(module)
    return names


def test_at_most_sixty_public_names() -> None:
    """Before, 84 distinct names (92 entries), internals among them: ``LossList``,
    ``HostBlockPool``, ``PoolStats``, ``Patch``, ``Sweep``, scan's ``Project``...; then 57
    distinct in 70 entries, a name exported by its subpackage listed again at the top.
    Counted as entries: a name in two ``__all__`` is two to learn where it lives."""
    names = _exported()
    entries = sum(len(modules) for modules in names.values())
    assert entries <= BUDGET, sorted(names)
    for internal in ("LossList", "RunningLoss", "HostBlockPool", "PoolStats", "Project"):
        assert internal not in names


@pytest.mark.parametrize("module", PUBLIC)
def test_every_exported_name_resolves(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, missing


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("leakfree.losses", "RunningLoss"),
        ("leakfree.losses", "LossList"),
        ("leakfree.function", "ReleaseHandle"),
        ("leakfree.offload.pool", "HostBlockPool"),
        ("leakfree.offload.pool", "PROCESS_BUDGET"),
        ("leakfree.pipeline.p2p", "PendingSends"),
        ("leakfree.pipeline.buffers", "PoolCounters"),
        ("leakfree.diagnostics.retention", "Retained"),
        ("leakfree.diagnostics.syncs", "HostSyncCounter"),
        ("leakfree.scan._model", "Project"),
    ],
)
def test_internals_stay_importable_from_their_modules(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name)


def test_the_top_level_export_lists_agree() -> None:
    """``_EXPORTS`` (what is reachable), ``__all__`` (what is listed) and the names the
    ``TYPE_CHECKING`` block imports (what a type checker sees) describe one surface."""
    import ast
    from pathlib import Path

    import leakfree

    source = Path(leakfree.__file__).read_text()
    typed: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom):
                    typed.update(alias.asname or alias.name for alias in stmt.names)
    exports = set(leakfree._EXPORTS)
    assert typed == exports | set(leakfree._SUBMODULES)
    assert set(leakfree.__all__) <= exports | set(leakfree._SUBMODULES)
    for name, module in leakfree._EXPORTS.items():
        assert getattr(importlib.import_module(module), name) is getattr(leakfree, name)
