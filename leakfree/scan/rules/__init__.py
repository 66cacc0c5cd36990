"""The rules, one module per leak shape; :data:`RULES` is the table the scanner runs.

* :mod:`~leakfree.scan.rules.ctx`: LF001 ctx state that outlives backward, LF002 an output
  stored on ctx;
* :mod:`~leakfree.scan.rules.kept_losses`: LF003 a loss logged with its graph into a
  long-lived container;
* :mod:`~leakfree.scan.rules.hooks`: LF004 a saved-tensor pack hook that parks payloads in
  a table its manager owns;
* :mod:`~leakfree.scan.rules.buffers`: LF005 leaf receive buffers made in a loop.

A rule module holds its rule's decision and wording; the private ``_<rule>_*.py`` beside it
hold the parts of that decision large enough to read on their own (what backward releases,
which names are outputs, a loss's vocabulary, a function's scope, a buffer's reads). All of
them read code through the one syntax layer: :mod:`leakfree.scan._syntax` (names, scopes,
imports, autograd Functions, annotations), :mod:`leakfree.scan._flow` (where values go),
:mod:`leakfree.scan._tensors` (what holds tensors) and :mod:`leakfree.scan._callables`
(which function a call reaches, and what it returns).
"""

from __future__ import annotations

from leakfree.scan._model import ScanRule
from leakfree.scan.rules import buffers, ctx, hooks, kept_losses

__all__ = ["RULES"]

#: every rule, in code order
RULES: tuple[ScanRule, ...] = tuple(
    sorted((*ctx.RULES, *kept_losses.RULES, *hooks.RULES, *buffers.RULES), key=lambda r: r.code)
)
