"""Turn what the user typed (files, folders, installed packages) into Python files.

A package is found by its import name *without importing it*: importing Transformer
Engine needs CUDA, and importing anything runs its code. Only the top-level name is
looked up with :func:`importlib.util.find_spec` (which locates, never executes); the rest
of a dotted name is followed on disk, since ``find_spec("a.b")`` would import ``a``.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: folders never entered: caches, VCS data, virtual environments, build output
SKIPPED_DIRS = frozenset(
    {"__pycache__", ".git", ".hg", ".svn", ".tox", ".nox", ".mypy_cache", ".ruff_cache",
     ".pytest_cache", "node_modules", "build", "dist", "site-packages"}
)  # fmt: skip


class UsageError(ValueError):
    """What the user asked for cannot be scanned (exit status 2)."""


@dataclass(frozen=True)
class Target:
    """A root to scan: ``path`` (a file or folder) and ``base``, the folder that reported
    paths are relative to; ``module`` is the dotted name of ``path`` where it is a package."""

    path: Path
    base: Path
    module: str = ""


def _package(name: str) -> Target | None:
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        roots = [Path(p) for p in spec.submodule_search_locations]
    elif spec.origin and spec.origin not in ("built-in", "frozen"):
        if len(parts) > 1:
            return None  # a plain module has no submodules
        origin = Path(spec.origin)
        return Target(origin, origin.parent, name) if origin.suffix == ".py" else None
    else:
        return None
    for root in roots:
        path = root.joinpath(*parts[1:])
        if path.is_dir():
            return Target(path, root.parent, name)
        module_file = path.with_suffix(".py")
        if len(parts) > 1 and module_file.is_file():
            return Target(module_file, root.parent, name)
    return None


def resolve(arguments: Iterable[str]) -> list[Target]:
    """Each argument as a path if one exists there, else as an importable package name.
    Raises :class:`UsageError` naming the first argument that is neither."""
    targets = []
    for argument in arguments:
        path = Path(argument)
        if path.exists():
            if path.is_file() and path.suffix != ".py":
                raise UsageError(f"scan {argument!r}: not a Python file (.py)")
            targets.append(Target(path, Path(".")))
            continue
        package = _package(argument)
        if package is None:
            raise UsageError(
                f"scan {argument!r}: no such file or folder, and no installed package of "
                "that import name (packages are found without importing them: give the "
                "import name, e.g. transformer_engine, not the distribution name)"
            )
        targets.append(package)
    return targets


def python_files(target: Target, exclude: Iterable[str] = ()) -> Iterator[Path]:
    """The ``.py`` files under ``target`` (sorted, so reports are stable), skipping
    :data:`SKIPPED_DIRS`, hidden folders and paths matching an ``exclude`` glob."""
    patterns = list(exclude)

    def excluded(path: Path) -> bool:
        if not patterns:
            return False
        text = path.as_posix()
        return any(fnmatch.fnmatch(text, p) or fnmatch.fnmatch(path.name, p) for p in patterns)

    if target.path.is_file():
        if not excluded(target.path):
            yield target.path
        return
    for folder, dirs, files in os.walk(target.path):
        dirs[:] = sorted(
            d for d in dirs
            if d not in SKIPPED_DIRS and not d.startswith(".") and not excluded(Path(folder, d))
        )  # fmt: skip
        for name in sorted(files):
            path = Path(folder, name)
            if name.endswith(".py") and not excluded(path):
                yield path
