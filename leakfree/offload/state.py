"""What an :class:`~leakfree.offload.OffloadActivations` holds, declared once for the parts
that read it (:mod:`~leakfree.offload.transfers`, :mod:`~leakfree.offload.keeping`,
:mod:`~leakfree.offload.backward`, :mod:`~leakfree.offload.hooks`), and what it reports
(:class:`OffloadStats`).

Nothing here holds a payload: device tensors are held by the graph's handles, the
in-flight window (until their copies retire) and a budget's held copies only.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from leakfree.offload.handles import _Forward, _Group, _HostCopy, _Kept
from leakfree.offload.measure import StepMeasure
from leakfree.offload.plan import Planner
from leakfree.offload.pool import HostBlockPool
from leakfree.offload.streams import Flight, Order, _Copies, _Pass

#: the backward pass running on this thread (-1 outside one), and the engine's "run this
#: when the pass is over"
_graph_task: Callable[[], int] = torch._C._current_graph_task_id
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


@dataclass
class OffloadStats:
    """What a manager moved, since it was made: copies to the host (``to_host``, one per
    saved storage moved), the groups they were sent in (``groups``), copies back to the
    device (``to_device``, one per group brought back), their bytes, and the most bytes
    a device budget held on the device at once (``peak_held_bytes``)."""

    to_host: int = 0
    groups: int = 0
    to_host_bytes: int = 0
    to_device: int = 0
    to_device_bytes: int = 0
    peak_held_bytes: int = 0


class ManagerState:
    """The attributes of a manager, with what each means (set in its ``__init__``)."""

    device: torch.device | None
    use_streams: bool
    use_pin_memory: bool
    max_fwd_stash_size: int
    prefetch_bytes: int | None
    enabled: bool
    pool: HostBlockPool
    stats: OffloadStats
    #: what moves and what stays: the settings, and the plan of the last forward
    _planner: Planner
    #: a step being measured for a goal's plan; the bandwidths each way, once measured;
    #: under a limit, what the device held as the step checked against it began
    _measuring: StepMeasure | None
    _bandwidth: tuple[float, float] | None
    _checking: int | None
    #: of the bytes the plan keeps for small storages, what this forward has not kept yet
    _small_room: int
    #: whether moved tensors stay on the device while their copies are in flight
    _window: bool
    _device_type: str | None  #: for the pack hook
    _device_module: Any
    #: force_host_copy on the CPU: the "device" is the host itself, so copies out are
    #: plain host copies and restored tensors view the host bytes (no copy back)
    _on_host: bool
    #: (device, direction) -> its side stream: one for copies out and one for prefetch
    #: back per device, so the two directions run at once (a stream runs in order)
    _side_streams: dict[tuple[torch.device, bool], Any]
    _param_storages: frozenset[int]
    _forward: _Forward  #: what this forward saved, for dedup and the plan
    _depth: int  #: nested entries of the same manager
    _in_flight: deque[Flight]  #: device tensors whose copies out may still run
    _lock: threading.RLock  #: backward may unpack on several device threads
    _ref: weakref.ref[Any]  #: what handles hold
    _copies: _Copies  #: the live host copies, by creation number
    #: the groups copies join, one per dtype and device (weakly: a graph dropped
    #: mid-forward frees its group, and the bytes it would send)
    _open: dict[tuple[torch.dtype, torch.device], weakref.ref[_Group]]
    #: backward passes under way (graph task id -> its state), and the order the last
    #: finished pass used, which the next pass of the same shape prefetches in
    _passes: dict[int, _Pass]
    _order: Order
    #: a device budget's copies held on the device (weakly, oldest first, with sizes) and
    #: their bytes
    _held: deque[tuple[weakref.ref[_HostCopy], int]]
    _held_bytes: int
    #: a forward whose plan moves nothing keeps its saved tensors as they are: by
    #: storage, the tensors kept of it (weakly: the storage is kept while one lives)
    #: with its bytes (this forward's, by storage: ``_forward.kept``); the bytes kept;
    #: and whether it still does
    _kept: list[tuple[list[weakref.ref[_Kept]], int]]
    _kept_bytes: int
    _keep_all: bool
    _on_plan: bool  #: this forward still follows the plan
