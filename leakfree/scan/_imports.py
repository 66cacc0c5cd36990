"""What one file of a package imports from its own package, found on disk, never imported.

pre-commit hands the scanner only the files that changed. Transformer Engine 2.15's op
fuser releases its ctx through ``restore_from_func_ctx``, which lives in another file
(``from ..quantized_tensor import restore_from_func_ctx``): scanned alone, the fuser
would look like 2.13's leak. So for a file given by path, the scanner works out its dotted
name from the ``__init__.py`` files above it, reads its ``from ... import`` statements
that point into the same top-level package, and adds those modules to the project as
*context*: rules follow helpers into them, but they are not checked and not counted. A
package's ``__init__`` that re-exports a name is followed one level further.
"""

from __future__ import annotations

import ast
import functools
import os
import tokenize
from pathlib import Path

from leakfree.scan._model import Project, parse
from leakfree.scan._syntax import absolute, walk

#: how many levels of imports are followed from the scanned file (an ``__init__`` that
#: re-exports counts as one)
DEPTH = 2


def _package_root(path: Path) -> Path | None:
    """The folder that holds ``path``'s top-level package (None outside a package)."""
    return _root_of(path.parent)


@functools.lru_cache(maxsize=4096)
def _root_of(folder: Path) -> Path | None:
    # once per folder: a tree's files share their folders' look-ups
    if not (folder / "__init__.py").is_file():
        return None
    while (folder.parent / "__init__.py").is_file():
        folder = folder.parent
    return folder.parent


def module_of(path: Path) -> str:
    """``path``'s dotted module name from the ``__init__.py`` files above it ("" outside a
    package); a package's ``__init__.py`` is named for the package."""
    path = Path(os.path.realpath(path))
    base = _package_root(path)
    if base is None:
        return ""
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _file_of(module: str, base: Path) -> Path | None:
    candidate = base.joinpath(*module.split("."))
    for path in (candidate.with_suffix(".py"), candidate / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported_modules(tree: ast.Module, module: str, package: str) -> set[str]:
    """Modules of the same top-level package that ``tree`` imports names from (``from
    ..quantized_tensor import x`` and ``from .ops import fuser``: both the module and the
    name as a submodule)."""
    top = module.split(".", 1)[0]
    out: set[str] = set()
    for node in walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = absolute(node, package)
            if source.split(".", 1)[0] != top:
                continue
            out.add(source)
            out.update(f"{source}.{a.name}" for a in node.names)
    return out


def add_imported(project: Project, path: Path) -> None:
    """Add to ``project``, as context, the files of ``path``'s own package that it imports
    from. Files that do not read or parse are skipped: they only ever add helpers."""
    base = _package_root(path.resolve())
    if base is None:
        return
    known = {Path(p).resolve() for p in project.texts}
    todo = [(path.resolve(), module_of(path), 0)]
    while todo:
        file, module, depth = todo.pop()
        try:
            with tokenize.open(file) as f:
                tree = parse(str(file), f.read()).tree
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        package = module if file.name == "__init__.py" else module.rpartition(".")[0]
        for name in sorted(_imported_modules(tree, module, package)):
            found = _file_of(name, base)
            if found is None or found in known:
                continue
            known.add(found)
            try:
                with tokenize.open(found) as f:
                    text = f.read()
            except (OSError, SyntaxError, UnicodeDecodeError):
                continue
            project.add_text(str(found), text, name, context=True)
            if depth + 1 < DEPTH:
                todo.append((found, name, depth + 1))
