"""Free a sent output's memory at once; run its backward later from the gradient edge.

Once a stage's output has been sent to the next stage, only its graph is still needed.
:func:`release_output` frees the output's storage and returns a :class:`ReleasedOutput`
that keeps just the gradient edge; :func:`backward_from` runs the backward from it with
the gradient the next stage sends back (Megatron's trick, with public autograd API).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

import leakfree._args as _args
from leakfree.errors import LeakfreeWarning

__all__ = ["PipelineWarning", "ReleasedOutput", "backward_from", "release_output"]


class PipelineWarning(LeakfreeWarning):
    """A pipeline primitive could not do what it promised (and did nothing instead)."""


_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)
_increment_version: Callable[[torch.Tensor], None] = getattr(
    torch.autograd.graph, "increment_version", torch._C._increment_version
)


@dataclass(frozen=True)
class ReleasedOutput:
    """What :func:`backward_from` needs once an output's storage was released.

    Kept: the output's graph (through ``edge``, its ``grad_fn`` and input number), by this
    handle, until the handle is dropped; after :func:`backward_from` the graph's saved
    tensors are freed as by any backward, so keep the handle no longer than that. Nothing
    else: no reference to the output tensor or its storage (unless ``freed`` is False,
    where that storage stays with whoever else held it: ``held_bytes``).
    """

    edge: GradientEdge
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    freed: bool
    held_bytes: int = 0  #: bytes still held because the storage could not be freed


def _others_hold(t: torch.Tensor, aliases: int = 0) -> bool | None:
    """Does anything besides ``t`` (and ``aliases`` known aliases of it) hold its storage?
    None if this torch cannot tell."""
    if _use_count is None:
        return None
    # One reference per tensor (``t`` and its aliases), one from the temporary storage
    # object made here.
    return int(_use_count(t.untyped_storage()._cdata)) > 2 + aliases


_RELEASED_MARK = "_leakfree_released_output"


def swap_out(y: torch.Tensor, aliases: Sequence[torch.Tensor], keep_shape: bool) -> bool:
    """Free ``y``'s storage if ``y`` and ``aliases`` are its only holders; True if freed.

    The one place that frees a sent output. Swaps in a new storage rather than resizing
    the old one to 0: whatever holds this very tensor (a later node that saved it as an
    input, a list) then sees a valid tensor, and the version bump makes such a node raise
    autograd's "modified by an inplace operation" instead of reading freed memory.
    ``keep_shape``: the swapped-in data is one element expanded to ``y``'s shape (stride
    0), so code that still checks the output's shape against its gradient (autograd's own
    ``backward(tensors, grad_tensors)``) keeps working; else an empty ``(0,)`` tensor.
    """
    if y._base is not None or _others_hold(y, len(aliases)) is not False:
        return False
    if any(a.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for a in aliases):
        return False
    if keep_shape:
        empty = torch.empty((), dtype=y.dtype, device=y.device).expand(y.shape)
    else:
        empty = torch.empty((0,), dtype=y.dtype, device=y.device)
    for alias in aliases:  # e.g. the send's own tensor, still held by its Work
        alias.data = empty
    y.data = empty
    _increment_version(y)
    return True


def release_output(
    y: torch.Tensor, *, aliases: Sequence[torch.Tensor] = (), keep_shape: bool = False
) -> ReleasedOutput:
    """Free the storage of an output that was sent to the next stage; keep its graph.

    Returns a :class:`ReleasedOutput` holding the output's gradient edge (public API,
    ``torch.autograd.graph.get_gradient_edge``), which keeps the graph alive for
    :func:`backward_from`. ``y`` is left holding an empty storage (its memory is freed;
    reading it gives an empty tensor) and its version is bumped, so a later node that
    saved ``y`` as an input fails with autograd's in-place error rather than reading
    garbage. If anything else still references the storage (a node saved ``y`` as its
    output, a view of it is alive), nothing is freed and a :class:`PipelineWarning` says
    so.

    ``aliases``: tensors known to share ``y``'s storage that are freed with it (the
    ``y.detach()`` a send was posted with, which its ``Work`` may still hold).
    ``keep_shape=True``: ``y`` keeps its shape (one element, stride 0) instead of
    becoming ``(0,)``, so ``torch.autograd.backward(y, grad)`` still runs from it.

    Only call it once the send has completed (for ``isend``, after ``work.wait()`` or
    ``is_completed()``). Refuses leaves (parameters, inputs: they have no graph to keep) and
    a second call on the same output, before changing anything.
    """
    if not isinstance(y, torch.Tensor):
        raise _args.refuse("release_output", "y", y, "a tensor")
    _args.flag("release_output", "keep_shape", keep_shape)
    if not y.requires_grad:
        raise ValueError(
            "release_output(y=...): the output does not require grad, so there is no "
            "backward to run later; just drop it"
        )
    if y.is_leaf:
        what = "a parameter" if isinstance(y, torch.nn.Parameter) else "a leaf tensor"
        raise ValueError(
            f"release_output(y=...): y is {what} {tuple(y.shape)}, not the output of a "
            "stage's forward. release_output frees the storage of an activation that was "
            "sent to the next stage, keeping its graph for backward_from; a leaf has no "
            "graph, and emptying it would break whatever uses it next"
        )
    if y.__dict__.get(_RELEASED_MARK):
        raise ValueError(
            f"release_output(y=...): this output was already released (it was "
            f"{y.__dict__[_RELEASED_MARK]}); use the ReleasedOutput the first call returned"
        )
    if isinstance(aliases, (str, bytes, torch.Tensor)) or not isinstance(aliases, Sequence):
        raise _args.refuse("release_output", "aliases", aliases, "a sequence of tensors")
    for i, alias in enumerate(aliases):
        if not isinstance(alias, torch.Tensor):
            raise TypeError(
                f"release_output(aliases=...): aliases[{i}] is a {type(alias).__name__}, "
                "not a tensor"
            )
    edge = get_gradient_edge(y)
    held = _others_hold(y, len(aliases))
    nbytes = y.untyped_storage().nbytes()
    shape, dtype, device = y.shape, y.dtype, y.device
    freed = swap_out(y, aliases, keep_shape)
    if not freed:
        why = (
            "this torch cannot count storage references"
            if held is None
            else "it is a view"
            if y._base is not None
            else "its storage is still referenced elsewhere (saved for backward, or a view)"
        )
        warnings.warn(
            f"release_output: not freeing the output's storage ({tuple(shape)}, "
            f"{dtype}): {why}. Its memory stays until the graph is done with it.",
            PipelineWarning,
            stacklevel=2,
        )
    # What it was, for the error a second call gets (a string: no reference to the graph).
    y.__dict__[_RELEASED_MARK] = f"{tuple(shape)}, {dtype}"
    return ReleasedOutput(edge, shape, dtype, device, freed, 0 if freed else nbytes)


def backward_from(handle: ReleasedOutput, grad: torch.Tensor) -> None:
    """Run the backward of a released output with the gradient the next stage sent.

    As ``y.backward(grad)`` would, without ``retain_graph``: the graph's saved tensors are
    freed afterwards, and only the handle still references the (now spent) graph.
    """
    if not isinstance(handle, ReleasedOutput):
        raise TypeError(
            f"backward_from(handle=...): expected what release_output returned, got "
            f"{type(handle).__name__}"
        )
    if grad.shape != handle.shape or grad.dtype != handle.dtype or grad.device != handle.device:
        raise ValueError(
            f"backward_from: gradient {tuple(grad.shape)} {grad.dtype} on {grad.device} does "
            f"not match the released output {tuple(handle.shape)} {handle.dtype} on "
            f"{handle.device}"
        )
    torch.autograd.backward(handle.edge, grad_tensors=grad)  # type: ignore[arg-type]
