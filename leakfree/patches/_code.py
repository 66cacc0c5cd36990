"""What a function's code does, read from its bytecode: the code gates of the patches.

A patch applies only to the code it expects (DESIGN: "gated on version *and* on the code").
:func:`code_facts` answers the two questions every gate asks (which names does this code
load or call, which attributes does it store) without running or importing anything.
"""

from __future__ import annotations

import dis
import types
from typing import Any


def code_facts(fn: Any) -> tuple[set[str], set[str]]:
    """Names a function's code loads or calls, and attribute names it stores: nested code,
    and through decorators (``functools.wraps`` chains, functions in closure cells, as
    ``torch.amp.custom_bwd`` makes)."""
    names: set[str] = set()
    stored: set[str] = set()
    stack: list[types.CodeType] = []
    seen_fns: set[int] = set()
    fns = [fn]
    while fns:
        f = fns.pop()
        if id(f) in seen_fns:
            continue
        seen_fns.add(id(f))
        code = getattr(f, "__code__", None)
        if code is not None:
            stack.append(code)
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None:
            fns.append(wrapped)
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, types.FunctionType):
                fns.append(value)
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        for ins in dis.get_instructions(c):
            if ins.opname == "STORE_ATTR":
                stored.add(str(ins.argval))
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names, stored
