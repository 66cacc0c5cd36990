"""The table of originals: what leakfree changed, and what was there before.

Every change a patch or a sweep makes goes through :class:`Changes`, which writes it
into the registry's one :class:`Originals` table; unpatching is one walk over that table,
putting the exact original objects back, and :func:`~leakfree.patches.get_original` /
:func:`~leakfree.patches.is_object_patched` answer from it (as ``gevent.monkey`` does).

The dependency goes one way: the registry (``_registry.py``) uses this module, and this
module knows nothing of the registry. A row's holder is any object the caller names (the
registry passes the record making the change) and is compared by identity only.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from leakfree.errors import PatchWarning

if TYPE_CHECKING:
    from leakfree.function import ReleaseHandle

#: In the table: the owner had no attribute of its own by that name (a class inherited it).
_ABSENT: Any = object()


@dataclass(eq=False)
class _Row:
    """One change: ``owner.name`` was ``original`` (its own namespace entry) before
    ``holder`` (for the registry, the record making the change) put ``current`` there.
    ``via``: the object that made the change and knows how to put it back (a
    :class:`~leakfree.function.ReleaseHandle`, which also clears its marker), or None for
    a plain attribute."""

    owner: Any
    name: str
    original: Any
    current: Any
    holder: object
    via: ReleaseHandle | None = None


def _own(owner: Any, name: str) -> Any:
    return vars(owner).get(name, _ABSENT)


def _write(owner: Any, name: str, value: Any) -> None:
    """``owner.name = value`` (``_ABSENT``: delete); a module's namespace directly."""
    namespace = vars(owner)
    if isinstance(namespace, dict):  # a module: past any __setattr__ of a lazy module
        if value is _ABSENT:
            namespace.pop(name, None)
        else:
            namespace[name] = value
    elif value is _ABSENT:  # a class: its namespace is read-only
        delattr(owner, name)
    else:
        setattr(owner, name, value)


def _check_owner(call: str, owner: Any, name: Any) -> None:
    """The arguments of :func:`get_original` and :func:`is_object_patched`."""
    if not isinstance(owner, (types.ModuleType, type)):
        hint = ""
        if isinstance(owner, str):
            hint = f"; for a module by name, pass sys.modules[{owner!r}]"
        raise TypeError(f"{call}(owner={owner!r}): expected a module or a class{hint}")
    if not isinstance(name, str):
        raise TypeError(f"{call}(name={name!r}): expected an attribute name (a str)")


class Originals:
    """The table of originals: one row per changed attribute, keyed by (owner, name).

    A row keeps the owner (a module or a class), the attribute's name, its original (its
    own namespace entry before the first change, or ``_ABSENT``), its current value, the
    record that holds it (the patch or sweep that made the latest change) and the undo
    handle (a :class:`~leakfree.function.ReleaseHandle`, or None for a plain attribute).
    Kept by the :class:`~leakfree.patches._registry.Registry` (its one instance, filled
    through :class:`Changes`) until the change is put back (:meth:`restore`:
    ``unpatch_all()``, ``sweep.remove()``, a patch turned off or failing); the owners and
    originals stay alive that long.

    Not thread-safe by itself: the caller holds the registry's lock around every call.
    """

    def __init__(self) -> None:
        self._rows: dict[tuple[int, str], _Row] = {}  # (id(owner), name) -> the change

    def hold(
        self,
        owner: Any,
        name: str,
        original: Any,
        current: Any,
        holder: object,
        via: ReleaseHandle | None,
    ) -> None:
        """Write one change into the table. The first original stays: a second record
        changing the same attribute (a patch over a sweep's class) takes the row over."""
        row = self._rows.get((id(owner), name))
        if row is None:
            self._rows[id(owner), name] = _Row(owner, name, original, current, holder, via)
        else:
            row.current, row.holder, row.via = current, holder, via

    def rows_of(self, holder: object) -> list[_Row]:
        """The changes ``holder`` made and has not put back, in the order it made them."""
        return [row for row in self._rows.values() if row.holder is holder]

    def restore(self, holder: object) -> None:
        """Put back every change of ``holder``, from the table; each row goes."""
        first: Exception | None = None
        for row in reversed(self.rows_of(holder)):  # the last change first
            del self._rows[id(row.owner), row.name]
            try:
                if row.via is not None:
                    row.via.restore()  # the original is the handle's too (see Changes)
                elif _own(row.owner, row.name) is row.current:
                    _write(row.owner, row.name, row.original)
                else:  # rebound since, by someone else: putting ours back would drop theirs
                    warnings.warn(
                        f"{getattr(row.owner, '__name__', row.owner)}.{row.name} was replaced "
                        "after leakfree patched it; left as it is (restoring leakfree's "
                        "original would drop that replacement)",
                        PatchWarning,
                        stacklevel=3,
                    )
            except Exception as e:  # put back the others anyway
                first = first or e
        if first is not None:
            raise first

    def get_original(self, owner: Any, name: str) -> Any:
        """See :func:`leakfree.patches.get_original` (``owner`` already checked)."""
        klasses = owner.__mro__ if isinstance(owner, type) else (owner,)
        for klass in klasses:
            row = self._rows.get((id(klass), name))
            if row is not None:
                if row.original is not _ABSENT:
                    return row.original
                continue  # inherited before leakfree gave it one of its own
            if name in vars(klass):
                return vars(klass)[name]
        raise AttributeError(f"get_original({owner!r}, {name!r}): it has no attribute {name!r}")

    def is_patched(self, owner: Any, name: str) -> bool:
        """See :func:`leakfree.patches.is_object_patched` (``owner`` already checked)."""
        return (id(owner), name) in self._rows


class Changes:
    """The only way an ``apply`` changes anything: each change is written into ``table``
    (the registry's table of originals) under ``holder`` (the record making it), so
    unpatching is one walk over the table and ``get_original`` answers for it.

    Made by the registry for one ``apply`` and used while it runs, under the registry's
    lock (which is what makes the table's updates safe: see :class:`Originals`)."""

    def __init__(self, table: Originals, holder: object) -> None:
        self._table = table
        self._holder = holder

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value`` (a module's namespace is written directly)."""
        self._table.hold(owner, name, _own(owner, name), value, self._holder, None)
        _write(owner, name, value)

    def release_after_backward(
        self, cls: type, attrs: Iterable[str] | Literal["all"]
    ) -> ReleaseHandle:
        """:func:`leakfree.release_after_backward` on ``cls``, its original ``backward`` /
        ``vjp`` kept in the table (a class that inherited it: absent, so the put-back
        deletes the wrapper and the inherited one shows again)."""
        from leakfree.function import release_after_backward

        handle = release_after_backward(cls, attrs)  # type: ignore[arg-type]
        own_raw = handle._own_raw  # what the class had before any release was installed
        original = _ABSENT if own_raw is None else own_raw
        self._table.hold(
            cls, handle.method, original, _own(cls, handle.method), self._holder, handle
        )
        return handle
