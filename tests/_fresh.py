"""Run code in a fresh interpreter state, cheaply: a child forked from a server process that
has imported torch and nothing else (no leakfree, no packaging, no stand-in), so a run costs
a fork rather than a torch import. The server also imports ``torch._dynamo``, which torch
itself imports on the first optimizer step or dispatch mode (a second each time, in every
child, otherwise). This module imports only the standard library: it is
what the child imports to find :func:`_run_child`."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import textwrap
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: the start method of every fresh process the tests make (tests/_dist.py's ranks too)
START_METHOD = "forkserver"
_FRESH = multiprocessing.get_context(START_METHOD)
#: what the server imports before forking (tests/test_docs.py uses the same server)
PRELOAD = ["torch", "torch._dynamo"]
_FRESH.set_forkserver_preload(PRELOAD)


def _run_child(code: str, paths: Sequence[str], conn: Any) -> None:
    import sys

    sys.path[:0] = paths
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<run_py>", "exec"), {"__name__": "__main__"})
        conn.send((True, out.getvalue()))
    except BaseException:
        conn.send((False, out.getvalue() + traceback.format_exc()))
    finally:
        conn.close()


def run_py(code: str, *paths: Path, timeout: float = 180) -> Any:
    """Run ``code`` in a fresh interpreter state with ``paths`` (then the repository) first
    on sys.path; parse the JSON it prints last."""
    receive, send = _FRESH.Pipe(duplex=False)
    child = _FRESH.Process(
        target=_run_child, args=(textwrap.dedent(code), [*map(str, paths), str(ROOT)], send)
    )
    child.start()
    send.close()
    try:
        if not receive.poll(timeout):
            raise AssertionError(f"run_py: no result within {timeout} s")
        ok, output = receive.recv()
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if not ok:
        raise AssertionError(f"run_py failed:\n{output}")
    return json.loads(output.strip().splitlines()[-1])
