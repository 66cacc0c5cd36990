"""``PipelineLosses``: the ``losses=`` container for ``torch.distributed.pipelining``.

``schedule.step(x, target=y, losses=lst)`` hands back each microbatch's loss as the
schedule computed it: with its ``grad_fn``, so ``lst`` keeps every microbatch's graph
(the nodes, and whatever custom ``Function``\\ s left on their ``ctx``) until the next step
replaces them. Torch fills the container by calling ``clear()`` then ``extend()`` on it
(2.4 to 2.13; newer releases also check ``isinstance(losses, list)``), so a ``list``
subclass that detaches on the way in is enough; no torch internals are touched.

Lifetime contract
-----------------
*Stored*: after each ``step``, that step's per-microbatch losses, detached (a scalar that
shares a bigger storage is copied, so the container never pins it). Never a graph.
*Released*: the previous step's losses, when the schedule clears the container at the
next step (or whenever you call ``clear()``).
*Forwarded*: with ``log=``, every loss the schedule stores is also added to ``log[key]``
(a :class:`leakfree.LossLog`, list or running mode), which torch never clears: the log
keeps its history across steps until ``log.reduce()`` or ``log.clear()``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from leakfree.losses import AdmittingList, LossLog, pins_more

__all__ = ["PipelineLosses"]


def _stored(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"PipelineLosses: expected the schedule's loss tensors, got {type(value).__name__}"
        )
    out = value.detach()
    # A loss that is a view of a bigger tensor (per_sample[0]) would pin all of it.
    return out.clone() if pins_more(out) else out


class PipelineLosses(AdmittingList):
    """A ``list`` for ``schedule.step(..., losses=...)`` that never holds a graph.

    Args:
        log: optional :class:`leakfree.LossLog`; every loss the schedule stores here is
            also appended to ``log[key]``, so the log collects the losses of every step
            (torch clears this container at each step, never the log).
        key: the log's key for the losses; may be left out when the log has one key.

    After ``schedule.step(...)`` it holds that step's losses (one per microbatch, on the
    last stage; the other stages' schedules never touch it), detached: read them as from
    the plain list (``torch.stack(losses).mean()``). ``append``, ``extend``, ``insert``,
    ``+=`` and item assignment all detach; reading, removing and ``clear()`` behave as for
    a plain list (``clear()`` never touches the log). A bad value raises ``TypeError``
    before anything is stored, here or in the log. Pickles and copies as a plain list.

    Example::

        log = LossLog(["loss"])
        sink = PipelineLosses(log)
        for step in range(steps):
            schedule.step(x, target=y, losses=sink)  # x on the first stage only
            ...
            if stage.is_last and step % 10 == 9:
                print(log.reduce(groups=()))  # this stage alone: 10 steps x n_microbatches
    """

    __slots__ = ("_key", "_log")

    def __init__(self, log: LossLog | None = None, key: str | None = None) -> None:
        if log is not None:
            if not isinstance(log, LossLog):
                raise TypeError(
                    f"PipelineLosses(log=...): expected a leakfree.LossLog, got "
                    f"{type(log).__name__}"
                )
            if key is None:
                if len(log) != 1:
                    raise ValueError(
                        f"PipelineLosses(key=...): the log has keys {list(log)}; name the "
                        "one the pipeline's losses go to"
                    )
                key = next(iter(log))
            if key not in log:
                raise KeyError(f"PipelineLosses(key={key!r}): not a key of the log ({list(log)})")
        elif key is not None:
            raise ValueError("PipelineLosses(key=...): a key needs a log= to go to")
        super().__init__()
        self._log = log
        self._key: str = key or ""

    def _admit_many(self, values: Iterable[Any]) -> list[Any]:
        stored = [_stored(v) for v in values]
        if self._log is not None:
            # Looked up each time: ``log[key] = [...]`` replaces the entry object.
            # The entry validates all values first: it raises before storing any.
            self._log[self._key].extend(stored)
        return stored

    def __repr__(self) -> str:
        return f"PipelineLosses({list.__repr__(self)})"
