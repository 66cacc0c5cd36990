# ruff: noqa
# Stand-in for the LF004 scan rule (data file: never imported).
# The fixed shape of trl 1.16.0 `trl/models/activation_offloading.py`, as
# `leakfree/offload/hooks.py` does it: the pack hook (a module-level closure over a weak
# reference to the manager) returns a handle object that owns the host copy, so the graph
# frees the payload with itself. The manager keeps only weak references (in-flight copies)
# and a dedup table of weak references keyed by storage address.
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks


class _Handle:
    __slots__ = ("__weakref__", "host", "shape", "device")

    def __init__(self, host, t):
        self.host = host
        self.shape = t.shape
        self.device = t.device

    def unpack(self):
        return self.host.to(self.device, non_blocking=True)


class _Kept:
    __slots__ = ("tensor",)

    def __init__(self, t):
        self.tensor = t.detach()

    def unpack(self):
        return self.tensor


def _pack_hook(manager_ref):
    def pack(t):
        manager = manager_ref()
        return _Kept(t) if manager is None else manager._pack(t)

    return pack


def _unpack_hook(packed):
    return packed.unpack()


class OffloadActivations(saved_tensors_hooks):
    def __init__(self, min_offload_size=1024):
        self.min_bytes = min_offload_size
        self.next_id = 0
        self.in_flight = []  # weak references to handles whose copy is in flight
        self.by_storage = {}  # storage address -> weak reference to its handle
        self.shapes = {}
        super().__init__(_pack_hook(weakref.ref(self)), _unpack_hook)

    def _pack(self, t):
        if t.element_size() * t.nelement() < self.min_bytes:
            return _Kept(t)
        self.next_id += 1
        key = t.untyped_storage().data_ptr()
        self.shapes[self.next_id] = t.shape  # metadata only
        known = self.by_storage.get(key)
        handle = known() if known is not None else None
        if handle is None:
            host = torch.empty_like(t, pin_memory=True, device="cpu")
            host.copy_(t, non_blocking=True)
            handle = _Handle(host, t)
            self.by_storage[key] = weakref.ref(handle)
            self.in_flight.append(weakref.ref(handle))
        return handle
