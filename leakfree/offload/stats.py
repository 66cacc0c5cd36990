"""What an :class:`~leakfree.offload.OffloadActivations` reports it moved
(:class:`OffloadStats`): counts and bytes, written by the parts that move and keep."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OffloadStats:
    """What a manager moved, since it was made: copies to the host (``to_host``, one per
    saved storage moved), the groups they were sent in (``groups``), copies back to the
    device (``to_device``, one per group brought back), their bytes, and the most bytes
    a device budget held on the device at once (``peak_held_bytes``). Numbers only."""

    to_host: int = 0
    groups: int = 0
    to_host_bytes: int = 0
    to_device: int = 0
    to_device_bytes: int = 0
    peak_held_bytes: int = 0
