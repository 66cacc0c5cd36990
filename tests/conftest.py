from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Run with the cyclic collector off: what is freed here is freed by refcounting alone."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


requires_accelerator = pytest.mark.skipif(
    not torch.accelerator.is_available(), reason="needs an accelerator (GPU)"
)
