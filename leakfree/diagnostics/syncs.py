"""Count device-to-host synchronisations at the aten level.

Every ``.item()``, ``float(t)``, ``bool(t)``, ``t.to("cpu")`` or ``t.cpu()`` of an
accelerator tensor makes the host wait for the device. In a training loop they serialise
the step; a loss logger that calls ``.item()`` per microbatch makes thousands of them.

:func:`count_host_syncs` counts the aten operations that imply such a wait, under a
``TorchDispatchMode``, so the count is the same on a CPU-only machine as on a GPU for the
same code path. It sees ``_local_scalar_dense`` (``item``, ``float``, ``bool``, ``int``),
copies whose destination is the CPU (``to("cpu")``, ``cpu()`` of a non-CPU tensor,
``to("cpu", copy=True)``), and the data-dependent ``nonzero``, ``equal`` and
``is_nonzero``. Limits: ``Tensor.tolist()`` / ``numpy()`` of a tensor that is *already* on
the CPU do not reach the dispatcher (and need no device wait); on CUDA,
``torch.cuda.set_sync_debug_mode("warn")`` is the authoritative check.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter", "count_host_syncs"]

_aten = torch.ops.aten
_ALWAYS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.equal.default,
    _aten.is_nonzero.default,
}


class HostSyncCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode that counts device-to-host synchronisation points.

    ``counter.count`` is the total; ``counter.ops`` counts them per aten op.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _ALWAYS or _copies_to_host(func, args, kwargs):
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)


def _copies_to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func is _aten._to_copy.default:
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu"
    if func is _aten.copy_.default and len(args) >= 2:
        dst, src = args[0], args[1]
        return (
            isinstance(dst, torch.Tensor)
            and isinstance(src, torch.Tensor)
            and dst.device.type == "cpu"
            and src.device.type != "cpu"
        )
    return False


@contextmanager
def count_host_syncs() -> Iterator[HostSyncCounter]:
    """``with count_host_syncs() as c: ...`` then read ``c.count`` / ``c.ops``."""
    with HostSyncCounter() as counter:
        yield counter
