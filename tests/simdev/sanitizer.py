"""A stream sanitizer for the simulated device: PyTorch's CUDA Sanitizer algorithm, reused.

``torch.cuda._sanitizer`` keeps, per stream, a vector clock of what it has waited for, and
per storage, the last write and the reads since; a launch whose access is not ordered
after a conflicting access on another stream is a race. Its ``EventHandler`` and
``ArgumentHandler`` work over integer ids, so they are used as they are; only the
argument filter, which tests ``is_cuda``, is overridden. Its dispatch mode needs CUDA
streams, so the simulated device feeds launches and stream events in itself.

Two checks are added, for what the CUDA Sanitizer leaves to the caching allocator:

* **use after free**: a device storage is freed while a stream other than the one it was
  allocated on may still access it, and that stream was neither given to
  ``record_stream`` nor ordered before the allocation stream's current point (the
  allocator would hand the memory out again on the allocation stream at once);
* **pinned host memory** is tracked like device memory wherever a device operation reads
  or writes it (the non-blocking copies), so a pool block reused on another stream before
  the copy that last used it has completed is a race;
* **use before allocation**: memory the allocator hands out on a stream may be a block
  that stream freed while its earlier work still used it (the allocator orders reuse on
  the allocation stream only), so another stream that accesses a fresh allocation must
  first be ordered after the allocation stream's point at allocation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.cuda._sanitizer import (
    ArgumentHandler,
    EventHandler,
    SynchronizationError,
)

from . import device as _device

_FACTORY = re.compile(r"^aten::(empty|full|ones|zeros|rand|randn|arange|linspace|scalar_tensor)")


class _Arguments(ArgumentHandler):  # type: ignore[misc]
    """Tracks device tensors and pinned host tensors, by storage (views alias)."""

    def _handle_argument(
        self,
        value: Any,
        is_write: bool,
        metadata_only: bool,
        name: str | None = None,
        is_output: bool = False,
    ) -> None:
        if not isinstance(value, torch.Tensor):
            return
        if not (value.device.type == _device.NAME or _device._pinned(value)):
            return
        if value.untyped_storage().nbytes() == 0:
            return
        ptr = value.untyped_storage().data_ptr()
        if is_write:
            self.dataptrs_written.add(ptr)
        elif not metadata_only:
            self.dataptrs_read.add(ptr)
        self.tensor_aliases.setdefault(ptr, [])
        if name is not None:
            self.tensor_aliases[ptr].append(name)
        if is_output:
            self.outputs.add(ptr)


class UseAfterFree(SynchronizationError):  # type: ignore[misc]
    def __init__(self, ptr: int, alloc_stream: int, access: Any) -> None:
        super().__init__()
        self.ptr, self.alloc_stream, self.access = ptr, alloc_stream, access

    def __str__(self) -> str:
        a = self.access
        return (
            f"storage {self.ptr:#x}, allocated on stream {self.alloc_stream}, was freed "
            f"while stream {a.stream} may still be {a.type} it ({a.operator}); neither "
            "record_stream nor an event orders that access before the memory is reused"
        )


class UseBeforeAllocation(SynchronizationError):  # type: ignore[misc]
    def __init__(self, ptr: int, alloc_stream: int, stream: int, operator: Any) -> None:
        super().__init__()
        self.ptr, self.alloc_stream = ptr, alloc_stream
        self.stream, self.operator = stream, operator

    def __str__(self) -> str:
        return (
            f"storage {self.ptr:#x}, allocated on stream {self.alloc_stream}, was used by "
            f"stream {self.stream} ({self.operator}) before that stream waited for the "
            "allocation stream: the memory may be a block the allocation stream's earlier "
            "work still uses"
        )


@dataclass
class _Allocation:
    stream: int
    seq_num: int = 0  #: the allocation stream's own point when the memory was handed out
    recorded: set[int] = field(default_factory=set)
    checked: set[int] = field(default_factory=set)  #: other streams found ordered after it


class Sanitizer:
    """Collects the races of the simulated device while attached (``errors``)."""

    def __init__(self) -> None:
        self.handler = EventHandler()
        self.errors: list[SynchronizationError] = []
        self.allocations: dict[int, _Allocation] = {}
        self.launches = 0

    # -- feed from the device -------------------------------------------------------------

    def launch(
        self, schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, stream: int
    ) -> None:
        factory = bool(_FACTORY.match(schema.name))
        arguments = _Arguments()
        arguments.parse_inputs(schema, args, kwargs, is_factory=factory)
        arguments.parse_outputs(schema, out, is_factory=factory)
        self.launches += 1
        self._check_allocated_before(
            arguments.dataptrs_read | arguments.dataptrs_written, stream, schema
        )
        self.errors += self.handler._handle_kernel_launch(
            stream,
            arguments.dataptrs_read - arguments.dataptrs_written,
            arguments.dataptrs_written,
            arguments.outputs,
            schema,
            arguments.tensor_aliases,
        )

    def event(self, handler: str, *args: Any) -> None:
        if handler == "allocate":
            ptr, stream = args
            self.handler._handle_memory_allocation(ptr)
            self.handler.syncs._ensure_stream_exists(stream)
            own = self.handler.syncs.current_sync_states[stream].get(stream, 0)
            self.allocations[ptr] = _Allocation(stream, own)
        elif handler == "allocate_pinned":
            self.handler._handle_memory_allocation(args[0])
        elif handler == "record_stream":
            ptr, stream = args
            if ptr in self.allocations:
                self.allocations[ptr].recorded.add(stream)
        elif handler == "free":
            self._free(args[0])
        else:
            getattr(self.handler, handler)(*args)

    def _check_allocated_before(self, ptrs: set[int], stream: int, operator: Any) -> None:
        for ptr in ptrs:
            allocation = self.allocations.get(ptr)
            if allocation is None or stream == allocation.stream or stream in allocation.checked:
                continue
            syncs = self.handler.syncs
            syncs._ensure_stream_exists(stream)
            if allocation.seq_num and not syncs.is_ordered_after(
                stream, allocation.seq_num, allocation.stream
            ):
                self.errors.append(UseBeforeAllocation(ptr, allocation.stream, stream, operator))
            allocation.checked.add(stream)

    def _free(self, ptr: int) -> None:
        allocation = self.allocations.pop(ptr, None)
        info = self.handler.tensors_accessed.accesses.get(ptr)
        if allocation is None or info is None:
            return
        syncs = self.handler.syncs
        for access in [*info.reads, *([info.write] if info.write else [])]:
            if access.stream == allocation.stream or access.stream in allocation.recorded:
                continue
            if not syncs.is_ordered_after(allocation.stream, access.seq_num, access.stream):
                self.errors.append(UseAfterFree(ptr, allocation.stream, access))
        self.handler._handle_memory_deallocation(ptr)

    # -- reading the result ------------------------------------------------------------

    def report(self) -> str:
        return "\n\n".join(str(e) for e in self.errors)

    def check(self) -> None:
        """Raise ``AssertionError`` listing every race seen."""
        if self.errors:
            raise AssertionError(f"stream sanitizer: {len(self.errors)} race(s)\n{self.report()}")


class attach:
    """``with attach() as sanitizer:`` feeds the simulated device's launches to a new
    :class:`Sanitizer` (the device must be on)."""

    def __init__(self) -> None:
        self.sanitizer = Sanitizer()

    def __enter__(self) -> Sanitizer:
        if _device._STATE.sanitizer is not None:
            raise RuntimeError("a sanitizer is already attached")
        _device._STATE.sanitizer = self.sanitizer
        return self.sanitizer

    def __exit__(self, *exc: object) -> None:
        _device._STATE.sanitizer = None
