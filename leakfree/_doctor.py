"""``python -m leakfree doctor``: what is installed, which known leaks affect it, what
``patch_all()`` would do, and whether an accelerator is there."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

import leakfree
from leakfree._device import accelerator
from leakfree.patches import Status
from leakfree.patches._registry import REGISTRY, installed_version
from leakfree.patches.transformer_engine import DISTRIBUTIONS as TE_DISTRIBUTIONS


def _where_documented() -> str:
    """docs/patches.md where it exists (a checkout); otherwise what every install has."""
    docs = Path(leakfree.__file__).resolve().parents[1] / "docs" / "patches.md"
    if docs.is_file():
        return f"see {docs}"
    return "details: python -m pydoc leakfree.patches"


def run_doctor() -> int:
    print(f"leakfree {leakfree.__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}")
    acc = accelerator()
    if acc is not None:
        count = torch.accelerator.device_count()
        print(f"accelerator: {acc} ({count} device{'s' if count != 1 else ''})")
    else:
        print(
            "accelerator: none found (OffloadActivations offloads nothing here unless "
            "force_host_copy=True; the CPU storage tracker measures memory)"
        )
    te = installed_version(TE_DISTRIBUTIONS)
    print(f"transformer_engine: {te if te is not None else Status.NOT_INSTALLED}")
    trl = installed_version(("trl",))
    print(f"trl: {trl if trl is not None else Status.NOT_INSTALLED}")
    print()
    plan = REGISTRY.plan(REGISTRY.select({}))
    affecting = [r for r in plan if r.status in (Status.WOULD_APPLY, Status.APPLIED)]
    print(f"known leaks ({_where_documented()}) and what patch_all() would do:")
    print(plan)
    print()
    if affecting:
        names = ", ".join(r.name for r in affecting)
        print(f"{len(affecting)} known leak(s) affect the installed versions: {names}.")
        print("call leakfree.patch_all() at startup to repair them.")
    else:
        print("no known leak affects the installed versions.")
    return 0
