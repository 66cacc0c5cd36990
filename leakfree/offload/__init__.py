"""Activation offloading whose payloads the autograd graph owns.

``OffloadActivations`` moves the tensors autograd saves for backward to host memory during
forward and brings them back in backward, optionally on a side stream. It is a drop-in for
TRL's / torchtune's class of the same name (same constructor, ``update_model_params``),
built the other way round: the pack hook returns a handle object, and that handle owns
the host copy (and, through it, the group of copies whose host block holds its bytes).
The autograd graph owns the handle. So:

* a graph that is dropped without backward frees its payloads with it;
* two forwards under separate ``with`` blocks, then one backward, just work (nothing is
  wiped on ``__enter__``: there is no table to wipe);
* ``backward(retain_graph=True)`` twice works: unpack reads the handle, never consumes it;
* nothing per-step lives in the context manager: it keeps a pool of *free* host blocks
  (bounded by a byte budget), the in-flight window, weak references to its copies (their
  order, for prefetch and the device budget's plan), and configuration.

Lifetime contract
-----------------
*A handle* lives exactly as long as autograd keeps the saved tensor: until the node's
backward has run in a pass that does not keep the graph, or until the graph is dropped.
Its group's host block returns to the pool when the last copy of the group has died.
*The device tensor* of an offloaded activation is kept by its group until the group is
sent (full, needed by a backward, or at ``__exit__``), then by the in-flight window while
its copy is in flight: at most ``max_fwd_stash_size`` of them per context, and none after
``__exit__``. One a device budget keeps on the device is held by its host copy (detached)
until its handles die or the budget moves it. A small storage the plan keeps where it is
(``keep_small``) is held by its handle, as any tensor that is not offloaded: detached if it
has a ``grad_fn``, until autograd drops the handle.
*A restored (device) group* belongs to autograd (the views unpacked from it), which drops
them after the nodes' backward; the group keeps it for its other handles until the last is
unpacked in that backward pass, or the pass ends; one a sibling restored earlier and that
is still alive is shared.
*What a graph keeps*: its handles, their host copies and groups (the pool blocks holding
its bytes). Never the context manager nor its pool: both are
referenced weakly. Drop the manager while a graph lives and that graph's backward still
restores its bytes (a synchronous copy, without prefetch); the blocks are freed rather
than returned to a pool that is gone.

Layout
------
A front that holds its parts, each owning its state and called under the front's lock:
``hooks`` (the context managers: the hooks, the settings, a forward's bounds) holds
``transfers`` (the copies, their streams and the in-flight window), ``keeping`` (what
stays on the device), ``plan`` (the planner, over ``options``: the options and the mode
they make), ``measurer`` (a goal's measured and checked steps, each measured by
``measure``) and ``backward`` (the passes: restore, prefetch, the order learned).
``handles`` is what the graph owns (handles, host copies, their groups, a forward's
record), ``pool`` the host blocks, ``budget`` the bytes they may pin (a process's share
of the node), ``streams`` the order's bookkeeping, ``stats`` what was moved, ``models``
``offload_model`` and head discovery.
"""

from leakfree.offload.hooks import NoOffload, OffloadActivations
from leakfree.offload.models import offload_model, remove_offload_hooks
from leakfree.offload.pool import OffloadWarning

#: TRL's / torchtune's name for :class:`NoOffload`, so swapping the import is enough
#: (``from leakfree.offload import NoOpManager``). Unlike theirs it keeps what it saves
#: detached: their identity hooks make a cycle of every saved output (docs/offload.md).
NoOpManager = NoOffload

__all__ = [
    "NoOffload",
    "OffloadActivations",
    "OffloadWarning",
    "offload_model",
    "remove_offload_hooks",
]

# Public classes and functions report the package as their home (reprs, pickles, docs),
# as they did before the split into modules.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) or (callable(_obj) and hasattr(_obj, "__code__")):
        _obj.__module__ = __name__
del _name, _obj
