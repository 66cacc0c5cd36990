"""``python -m leakfree doctor``: what is installed, which known leaks affect it, what
``patch_all()`` would do, whether an accelerator is there, and every known failure mode
of the installed integrations on this machine with the call that repairs it."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

import leakfree
from leakfree._device import accelerator
from leakfree._text import format_table
from leakfree.patches import torchtune as torchtune_patches
from leakfree.patches import trl as trl_patches
from leakfree.patches._registry import REGISTRY, Outcome, Reason, installed_version
from leakfree.patches.transformer_engine import DISTRIBUTIONS as TE_DISTRIBUTIONS

#: the columns of the failure-mode table: one row per known failure mode of an installed
#: package on this machine
FAILURE_HEADER = ("package", "failure mode", "what happens", "repaired by")


#: the integrations whose known failure modes the doctor lists: (name, module with
#: ``DISTRIBUTIONS`` and ``failure_modes(version)``)
WITH_FAILURE_MODES = (("trl", trl_patches), ("torchtune", torchtune_patches))


def failure_rows() -> list[tuple[str, str, str, str]]:
    """The failure-mode table's rows, for the installed versions on this machine."""
    rows: list[tuple[str, str, str, str]] = []
    for name, module in WITH_FAILURE_MODES:
        version = installed_version(module.DISTRIBUTIONS)
        if version is not None:
            modes = module.failure_modes(version)
            rows += [(f"{name} {version}", m.name, m.what, fix) for m, fix in modes]
    return rows


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
    print(f"transformer_engine: {te if te is not None else Reason.NOT_INSTALLED}")
    for name, module in WITH_FAILURE_MODES:
        version = installed_version(module.DISTRIBUTIONS)
        print(f"{name}: {version if version is not None else Reason.NOT_INSTALLED}")
    print()
    plan = REGISTRY.plan(REGISTRY.select({}))
    affecting = [r for r in plan if r.outcome in (Outcome.WOULD_APPLY, Outcome.APPLIED)]
    print(f"known leaks ({_where_documented()}) and what patch_all() would do:")
    print(plan)
    print()
    if affecting:
        names = ", ".join(r.name for r in affecting)
        print(f"{len(affecting)} known problem(s) affect the installed versions: {names}.")
        print("call leakfree.patch_all() at startup to repair them.")
    else:
        print("no known leak affects the installed versions.")
    rows = failure_rows()
    print()
    if rows:
        print("known failure modes of the installed packages on this machine:")
        print(format_table(FAILURE_HEADER, rows))
    else:
        print("no known failure mode of the installed packages on this machine.")
    print()
    print(
        "the next leak, before it runs: python -m leakfree scan PATH_OR_PACKAGE finds the "
        "leak shapes in source code (ctx state kept past backward, outputs on ctx, logged "
        "losses with graphs, offloader side tables, leaf receive buffers) without importing "
        "it; see docs/scan.md"
    )
    return 0
