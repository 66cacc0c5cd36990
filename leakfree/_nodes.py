"""Reading an autograd node's state without disturbing it: what it saved, and whether its
backward has run.

Only the raw ``SavedTensor`` handles are read (``_raw_saved_*``): nothing is unpacked, so
no saved-tensor hook (an offloader's) runs, and nothing is kept. :data:`RELEASED` is the
marker :mod:`leakfree.function` leaves in a released node's ``__dict__``.
"""

from __future__ import annotations

from typing import Any

from torch.autograd.function import BackwardCFunction

#: Left in a released node's __dict__: the names that were released.
RELEASED = "__leakfree_released__"

_raw_names: dict[type, tuple[str, ...]] = {}


def saved_handles(node: Any) -> list[Any]:
    """The raw handles (``SavedTensor``) of what ``node`` saved for its backward, from its
    ``_raw_saved_*`` attributes, lists flattened. Reading them unpacks nothing, so no
    saved-tensor hook runs; a handle's ``data`` is None once autograd freed it. Raises
    what the node raises (a custom Function's after its release)."""
    names = _raw_names.get(type(node))
    if names is None:
        names = _raw_names[type(node)] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
    handles: list[Any] = []
    for name in names:
        value = getattr(node, name)
        handles.extend(value if isinstance(value, (list, tuple)) else [value])
    return handles


def backward_ran(node: Any) -> bool:
    """Has ``node``'s backward already run, in a pass that did not keep the graph?

    For a custom Function's node: leakfree released its state, or autograd released its
    saved variables (marked even when none were saved). For a built-in node: it saved
    tensors and every ``_raw_saved_*`` handle is empty. Reads only the raw handles, never
    unpacks a saved tensor, so no saved-tensor hook (an offloader's) runs. False for a
    node that cannot tell (nothing saved, or an exotic node).
    """
    try:
        if isinstance(node, BackwardCFunction):
            if RELEASED in node.__dict__:
                return True
            try:
                node._raw_saved_tensors  # noqa: B018  (raises once they were released)
            except RuntimeError:
                return True
            return False
        saved = [h for h in saved_handles(node) if hasattr(h, "data")]
        return bool(saved) and all(h.data is None for h in saved)
    except Exception:  # an exotic node: say nothing rather than guess
        return False
