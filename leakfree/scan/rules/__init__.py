"""The rules, one module per leak shape; :data:`RULES` is the table the scanner runs.

* :mod:`~leakfree.scan.rules.ctx`: LF001 ctx state that outlives backward, LF002 an output
  stored on ctx;
* :mod:`~leakfree.scan.rules.losses`: LF003 a loss logged with its graph into a
  long-lived container;
* :mod:`~leakfree.scan.rules.hooks`: LF004 a saved-tensor pack hook that parks payloads in
  a table its manager owns;
* :mod:`~leakfree.scan.rules.buffers`: LF005 leaf receive buffers made in a loop.
"""

from __future__ import annotations

from leakfree.scan._model import Rule
from leakfree.scan.rules import buffers, ctx, hooks, losses

__all__ = ["RULES"]

#: every rule, in code order
RULES: tuple[Rule, ...] = tuple(
    sorted((*ctx.RULES, *losses.RULES, *hooks.RULES, *buffers.RULES), key=lambda r: r.code)
)
