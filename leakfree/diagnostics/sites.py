"""Which code is the user's, and which line of it created a tensor.

A *creation site* is recorded for every storage a watching
:class:`~leakfree.diagnostics.StorageTracker` sees created (only while a tracker,
``assert_no_leak`` or a callback is watching): the innermost frame of the creating call
outside torch, leakfree and the standard library, and, when that frame is in an installed
package (``transformers``' modeling code), the innermost frame of the user's own code below
it too. So a retained graph whose root ``entropy`` came from ``compute_entropy`` reads
``created at train.py:42 in compute_entropy``, and logits made inside a Hugging Face model
read ``created at modeling_llama.py:512 in forward (from train.py:40 in step)``.

What is kept per storage: two ``(code object, line)`` pairs, never a frame (a frame holds
its locals: keeping one would be a leak of its own). A :class:`Site` is built from them
only when a report names it.

Cost: one walk up the Python stack per op that creates a storage, with one dictionary
look-up per frame (the verdict per code object is cached), on tracked steps only.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any, cast

import torch

__all__ = [
    "LIBRARY",
    "SKIPPED",
    "USER",
    "WATCHING",
    "Site",
    "active_site",
    "capture",
    "kind_of",
    "site_of",
]

#: kinds of code: torch/leakfree/stdlib (never a site), installed packages, the user's own
SKIPPED, LIBRARY, USER = 0, 1, 2

_TORCH = os.path.dirname(torch.__file__) + os.sep
_LEAKFREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = tuple(
    {
        os.path.realpath(p) + os.sep
        for key in ("stdlib", "platstdlib")
        if (p := sysconfig.get_paths().get(key))
    }
)
_PACKAGES = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)

_by_file: dict[str, int] = {}
_by_code: dict[CodeType, int] = {}


def kind_of(filename: str) -> int:
    """:data:`SKIPPED`, :data:`LIBRARY` or :data:`USER` for a source file name."""
    kind = _by_file.get(filename)
    if kind is None:
        if filename.startswith("<frozen") or filename.startswith("<built-in"):
            kind = SKIPPED
        else:
            path = os.path.realpath(filename) if os.path.isabs(filename) else filename
            if path.startswith((_TORCH, _LEAKFREE)) or filename.startswith((_TORCH, _LEAKFREE)):
                kind = SKIPPED
            elif any(p in path for p in _PACKAGES):
                kind = LIBRARY
            elif path.startswith(_STDLIB):
                kind = SKIPPED
            else:
                kind = USER
        _by_file[filename] = kind
    return kind


#: A recorded site: (code, line) of the innermost non-skipped frame, and (code, line) of
#: the innermost user frame when the first is a library's (else None).
Raw = tuple[CodeType, int, "tuple[CodeType, int] | None"]


def capture(frame: FrameType | None) -> Raw | None:
    """The creation site of a call made from ``frame`` (walking outward), or None when no
    frame outside torch, leakfree and the standard library is on the stack."""
    inner: tuple[CodeType, int] | None = None
    while frame is not None:
        code = frame.f_code
        kind = _by_code.get(code)
        if kind is None:
            kind = _by_code[code] = kind_of(code.co_filename)
        if kind == USER:
            if inner is None:
                return (code, frame.f_lineno, None)
            return (inner[0], inner[1], (code, frame.f_lineno))
        if kind == LIBRARY and inner is None:
            inner = (code, frame.f_lineno)
        frame = frame.f_back
    return (inner[0], inner[1], None) if inner is not None else None


@dataclass(frozen=True)
class Site:
    """Where a tensor was created: ``train.py:42 in compute_entropy``."""

    filename: str
    line: int
    function: str
    #: the user's own line below a library's (``from train.py:40 in step``), if any
    caller: Site | None = None
    #: the code that made it (a code object holds no frame, nothing of a run's values)
    code: CodeType | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        here = f"{_short(self.filename)}:{self.line} in {self.function}"
        return here if self.caller is None else f"{here} (from {self.caller})"


def site_of(raw: Raw | None) -> Site | None:
    """The :class:`Site` of a raw record from :func:`capture`."""
    if raw is None:
        return None
    code, line, caller = raw
    outer = None if caller is None else Site(caller[0].co_filename, caller[1], _name(caller[0]))
    return Site(code.co_filename, line, _name(code), outer, code)


def _name(code: CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)  # 3.11+: Class.method


def _short(filename: str) -> str:
    """An installed package's file from the package directory on
    (``transformers/models/llama/modeling_llama.py``, even in a virtual environment under
    the working directory); any other file relative to the working directory when under
    it, else absolute."""
    for marker in _PACKAGES:  # an installed package, wherever the environment lives
        at = filename.rfind(marker)
        if at >= 0:
            return filename[at + len(marker) :]
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive
        return filename
    return filename if rel.startswith("..") else rel


#: the storage trackers watching now (each answers ``site(tensor)``; a tracker adds itself
#: while it is active): :func:`active_site` asks them where a tensor was made
WATCHING: list[Any] = []


def active_site(tensor: torch.Tensor) -> Site | None:
    """Where ``tensor`` was created, according to the trackers watching now (None when
    none saw it made)."""
    for storages in reversed(WATCHING):
        found = storages.site(tensor)
        if found is not None:
            return cast("Site | None", found)
    return None
