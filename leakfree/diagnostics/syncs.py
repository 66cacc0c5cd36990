"""Count the operations that make the host wait for an accelerator.

In a training loop every such wait serialises the step: the host stops queueing work until
the device catches up. A loss logger that calls ``.item()`` per microbatch makes thousands.

:func:`count_host_syncs` counts them at the aten level, under a ``TorchDispatchMode``, so
the count is the same on a CPU-only machine as on a GPU for the same code path wherever
the operation itself is the same. It counts what blocks the host on CUDA:

* device-to-host copies: ``.item()`` / ``float(t)`` / ``bool(t)`` (``_local_scalar_dense``),
  ``to("cpu")``, ``cpu()``, ``tolist()`` of a device tensor (a copy whose destination is
  the CPU is counted even from a CPU tensor, so CPU runs count what a GPU run would),
  except a ``non_blocking`` copy into pinned memory, which the host does not wait for;
* host-to-device copies from pageable memory, or with ``non_blocking=False``, including
  ``torch.tensor`` / ``as_tensor`` / ``asarray`` of Python data with a device argument
  (that upload happens below the dispatcher, so those factories are wrapped while the
  counter is active); a ``non_blocking`` copy from pinned memory is not;
* operations whose output shape depends on the data: ``nonzero``, ``masked_select``,
  ``unique`` (all variants), boolean-mask indexing and index assignment, ``equal``,
  ``is_nonzero``, ``repeat_interleave`` without ``output_size``;
* explicit waits: ``torch.accelerator.synchronize``, the device modules' ``synchronize``
  (``torch.cpu``, every accelerator module torch knows and a PrivateUse1 backend's module),
  and the modules' ``Event`` /
  ``Stream`` ``synchronize`` (``torch.cuda.Event``...; the generic C-level ``torch.Event``
  cannot be wrapped). These are not aten operations: the counter wraps them while it
  is active (process-wide, for every thread).

Limits: ``Tensor.tolist()`` / ``numpy()`` of a tensor that is *already* on the CPU do not
reach the dispatcher (and need no device wait); a host-to-device copy cannot happen when
every tensor is on the CPU, so it is counted only where a device exists (a real one, or
the simulated one of leakfree's tests). On CUDA, ``torch.cuda.set_sync_debug_mode("warn")``
is the authoritative check.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter", "count_host_syncs"]

_aten = torch.ops.aten


def _ops(*names: str) -> set[Any]:
    """The overloads of the named aten ops that this torch has."""
    found: set[Any] = set()
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is not None:
            found.update(getattr(packet, o) for o in packet.overloads())
    return found


#: Operations whose output shape (or result) the host must read back from the device: the
#: one list, which the test suite's simulated accelerator reads too.
DATA_DEPENDENT_OPS = frozenset(
    {
        "nonzero",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "equal",
        "is_nonzero",
    }
)
#: Always a wait: a scalar read back, or an output whose shape depends on the data.
_ALWAYS = _ops("_local_scalar_dense", *sorted(DATA_DEPENDENT_OPS))
_REPEAT_INTERLEAVE = _ops("repeat_interleave")
_MASK_INDEXING = _ops("index", "index_put", "index_put_", "_index_put_impl_")
_TO_COPY = _ops("_to_copy")
_COPY = _ops("copy_")


class HostSyncCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode that counts host synchronisation points.

    ``counter.count`` is the total; ``counter.ops`` counts them per operation.
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
        name = _sync_kind(func, args, kwargs)
        if name is not None:
            self.ops[name] += 1
        return func(*args, **kwargs)

    def _count_wait(self, name: str) -> None:
        self.ops[name] += 1


def _sync_kind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """What kind of host wait ``func(*args, **kwargs)`` is, or None."""
    if func in _ALWAYS:
        return str(func.overloadpacket.__name__)
    if func in _TO_COPY:
        src, device = args[0], kwargs.get("device")
        if device is None:
            return None
        if torch.device(device).type == "cpu":
            # non_blocking: the device side copies into pinned memory and does not wait
            on_device = src.device.type != "cpu"
            return None if on_device and kwargs.get("non_blocking") else "to_host"
        if src.device.type == "cpu" and _blocking_transfer(src, kwargs.get("non_blocking")):
            return "from_host"
        return None
    if func in _COPY and len(args) >= 2:
        dst, src = args[0], args[1]
        if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)):
            return None
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking")
        if dst.device.type == "cpu" and src.device.type != "cpu":
            return "to_host" if _blocking_transfer(dst, non_blocking) else None
        if dst.device.type != "cpu" and src.device.type == "cpu":
            return "from_host" if _blocking_transfer(src, non_blocking) else None
        return None
    if func in _REPEAT_INTERLEAVE:
        output_size = kwargs.get("output_size")
        if output_size is None and any(isinstance(a, torch.Tensor) for a in args[1:2]):
            return "repeat_interleave"
        if output_size is None and len(args) == 1:  # repeat_interleave(repeats) form
            return "repeat_interleave"
        return None
    if func in _MASK_INDEXING and len(args) >= 2:
        indices = args[1]
        if any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in indices or ()
        ):
            return "mask_indexing"
    return None


def _blocking_transfer(host: torch.Tensor, non_blocking: Any) -> bool:
    """A copy between the host and a device waits unless it is non_blocking and its host
    side is pinned memory."""
    if not non_blocking:
        return True
    try:
        return not host.is_pinned()
    except RuntimeError:  # no accelerator to ask: nothing can be pinned
        return True


# --- explicit waits: not aten ops, so they are wrapped while a counter is active -------------


def _wait_targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, name) of every explicit-wait function this torch offers."""
    targets: list[tuple[Any, str, str]] = [
        (torch.accelerator, "synchronize", "accelerator.synchronize"),
        (torch.cpu, "synchronize", "cpu.synchronize"),
    ]
    backends = ["cuda", "xpu", "mps", "mtia", "npu", "hpu"]
    custom = torch._C._get_privateuse1_backend_name()
    if custom != "privateuseone":  # an out-of-tree backend registered under its name
        backends.append(custom)
    for backend in backends:
        module = getattr(torch, backend, None)
        if module is None:
            continue
        if callable(getattr(module, "synchronize", None)):
            targets.append((module, "synchronize", f"{backend}.synchronize"))
        for cls_name in ("Event", "Stream"):
            cls = getattr(module, cls_name, None)
            if isinstance(cls, type) and callable(cls.__dict__.get("synchronize")):
                targets.append((cls, "synchronize", f"{backend}.{cls_name}.synchronize"))
    for cls_name in ("Event", "Stream"):
        cls = getattr(torch, cls_name, None)
        if isinstance(cls, type) and "synchronize" in cls.__dict__:
            targets.append((cls, "synchronize", f"{cls_name}.synchronize"))
    return targets


#: Factories that build a tensor from Python data on the host; with a device, the upload
#: from pageable memory happens below the dispatcher, where no dispatch mode sees it.
_FACTORIES = ("tensor", "as_tensor", "asarray")


def _device_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    device = kwargs.get("device")
    data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
    if device is None or isinstance(data, torch.Tensor):
        return False  # no upload, or a tensor-to-tensor copy the dispatcher sees
    return torch.device(device).type != "cpu"


def _counting(
    fn: Callable[..., Any],
    name: str,
    counter: HostSyncCounter,
    when: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = None,
) -> Callable[..., Any]:
    """``fn``, counting each call (or each call for which ``when(args, kwargs)``) as ``name``."""

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if when is None or when(args, kwargs):
            counter._count_wait(name)
        return fn(*args, **kwargs)

    return counted


@contextmanager
def count_host_syncs() -> Iterator[HostSyncCounter]:
    """``with count_host_syncs() as c: ...`` then read ``c.count`` / ``c.ops``."""
    counter = HostSyncCounter()
    originals = []
    Condition = Callable[[tuple[Any, ...], dict[str, Any]], bool] | None
    targets: list[tuple[Any, str, str, Condition]] = [
        (o, a, n, None) for o, a, n in _wait_targets()
    ]
    targets += [(torch, f, "from_host", _device_arg) for f in _FACTORIES]
    for owner, attr, name, when in targets:
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        try:
            setattr(owner, attr, _counting(getattr(owner, attr), name, counter, when))
        except TypeError:  # a C type (torch.Event): its own subclasses are wrapped instead
            continue
        originals.append((owner, attr, original))
    try:
        with counter:
            yield counter
    finally:
        for owner, attr, original in reversed(originals):
            setattr(owner, attr, original)
