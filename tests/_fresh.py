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
import os
import tempfile
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


def adopt_environment(env: dict[str, str]) -> None:
    """Make ``env`` this process's environment: a child forked from the server starts with
    the server's, as it was when the server started, not with its caller's."""
    os.environ.clear()
    os.environ.update(env)


def _python_child(argv: Sequence[str], cwd: str, env: dict[str, str], out: str) -> None:
    import os
    import runpy
    import sys

    os.chdir(cwd)
    adopt_environment(env)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        sink = os.open(f"{out}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(sink, fd)
        os.close(sink)
    # sys.path as python builds it: the script's folder (or, with -m, the working
    # directory), then PYTHONPATH, then the rest
    module = argv[1] if argv[0] == "-m" else None
    first = cwd if module is not None else os.path.dirname(os.path.abspath(argv[0]))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [first, *extra]
    sys.argv = [module, *argv[2:]] if module is not None else list(argv)
    try:
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as e:
        from leakfree.cli.run import _exit_status  # what python makes of sys.exit(code)

        status = _exit_status(e.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_python(
    *argv: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 180
) -> tuple[int, str, str]:
    """``python argv...`` (``SCRIPT ARGS`` or ``-m MODULE ARGS``) in ``cwd`` with environment
    ``env`` (default: this process's, as :mod:`subprocess` does), in a process forked from
    the server (torch already imported, nothing else):
    its exit status (negative: the signal that ended it, as :mod:`subprocess` reports it),
    stdout and stderr. The same code runs as in a new interpreter, with the same argv,
    path, environment and status, without paying torch's import again. One difference:
    the child ends with ``os._exit``, as multiprocessing's children do, so ``atexit``
    handlers do not run; code whose output depends on them needs a new interpreter (the
    ranks `leakfree run` watches report from one)."""
    environ = dict(os.environ) if env is None else env
    with tempfile.TemporaryDirectory(prefix="run_python-") as folder:
        out = str(Path(folder, "out"))
        child = _FRESH.Process(target=_python_child, args=(list(argv), str(cwd), environ, out))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise AssertionError(f"python {' '.join(argv)}: still running after {timeout} s")
        stdout, stderr = (Path(f"{out}.{name}").read_text() for name in ("stdout", "stderr"))
    return int(child.exitcode or 0), stdout, stderr
