"""The simulated accelerator of leakfree's tests (see ``device``) and its stream sanitizer
(see ``sanitizer``). ``NOTES.md`` records how the design was chosen."""

from .device import NAME, SimDevice, enabled, host_alias, register, supported
from .sanitizer import Sanitizer, attach

__all__ = [
    "NAME",
    "Sanitizer",
    "SimDevice",
    "attach",
    "enabled",
    "host_alias",
    "register",
    "supported",
]
