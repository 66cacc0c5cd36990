"""Started in every Python child of a script run by ``python -m leakfree run``.

``leakfree run`` puts this folder first on its children's ``PYTHONPATH``; Python imports
``sitecustomize`` at startup. Here, once the child imports torch (a child that never does
pays nothing), a watch starts in it (``leakfree.cli.run.child_start``). Then the
``sitecustomize`` this one shadows, if any, runs as it would have.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps torch's loader to start the watch once torch is in."""

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_watch(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            try:
                from leakfree.cli.run import child_start

                child_start()
            except Exception as e:  # a watcher never breaks the child
                print(f"leakfree: could not watch this process ({e})", file=sys.stderr)

        loader.exec_module = exec_then_watch  # type: ignore[method-assign]
        return spec


if os.environ.get("LEAKFREE_RUN"):
    if "torch" in sys.modules:
        from leakfree.cli.run import child_start

        child_start()
    else:
        sys.meta_path.insert(0, _AfterTorch())


def _chain() -> None:
    """Run the sitecustomize this one shadows, further along sys.path."""
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
