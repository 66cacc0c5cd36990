"""``python -m leakfree run [options] SCRIPT [ARGS...]``: a training script, unchanged, watched.

The script runs in this process exactly as ``python SCRIPT ARGS...`` would run it
(``__main__``, ``sys.argv``, ``sys.path[0]``; ``-m MODULE`` as ``python -m``), under a
:class:`~leakfree.diagnostics.watch.Watch`: each finding is printed to stderr when it is
made, and all of them again in a summary when the script ends, however it ends.

Exit status: the script's own (``sys.exit(3)`` gives 3, an uncaught exception 1 after its
traceback, Ctrl-C the interrupt's own); with ``--fail``, when the script ended with 0,
:data:`EXIT_LEAK` if a leak was found (in this process or in a child) and
:data:`EXIT_NOT_JUDGED` if none was but the run was too short to be judged (a process that
trained ended before the detector could call it clean); 2 for a usage error.

Child processes (``torch.multiprocessing`` workers, a ``torchrun``-style launcher's ranks)
are watched too: the ``LEAKFREE_RUN`` environment variable carries the options, and a
``sitecustomize`` module put first on their ``PYTHONPATH`` arms a watch in each child
that imports torch, started by its first backward pass or optimizer step (a data loader
worker never pays for it). Each child prints
its own findings, prefixed with its rank, and leaves them in a file the parent's summary
reads. Not reached: processes started with a clean environment, or another interpreter.
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import contextlib
import glob
import importlib.machinery
import importlib.util
import json
import os
import re
import runpy
import shutil
import signal
import sys
import tempfile
import tokenize
import types
from collections.abc import Sequence
from typing import Any

from leakfree.diagnostics.rule import Rule  # torch-free: the help reads its defaults

#: exit status with ``--fail`` when the script succeeded and a leak was found
EXIT_LEAK = 79
#: exit status with ``--fail`` when the script succeeded, no leak was found, and the run
#: (or a child that trained) ended before it could be judged: not a clean run
EXIT_NOT_JUDGED = 78

_ENV = "LEAKFREE_RUN"
_HERE = os.path.dirname(os.path.abspath(__file__))
_CHILD_DIR = os.path.join(_HERE, "_child")
_OPTIONS_WITH_VALUE = {"--json", "--warmup", "--window", "--sample-every", "--floor", "--device"}


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{prog} run",
        description="Run a training script unchanged, with leakfree's finders on: "
        "steps are optimizer steps, microbatches backward passes. Exit status: the "
        f"script's own; with --fail, when it succeeded: {EXIT_LEAK} if a leak was found, "
        f"{EXIT_NOT_JUDGED} if none was but the run ended before it could be judged "
        "(fewer steps than --warmup + --window); 2 for a usage error.",
        usage=f"{prog} run [options] (SCRIPT | -m MODULE) [ARGS...]",
    )
    p.add_argument(
        "--fail",
        action="store_true",
        help=f"exit {EXIT_LEAK} on a leak, {EXIT_NOT_JUDGED} on a run too short to judge",
    )
    p.add_argument("--json", metavar="FILE", help="write the findings here (JSON)")
    p.add_argument(
        "--warmup",
        type=int,
        metavar="N",
        help=f"steps not judged across steps ({Rule.default('warmup', 'watching')})",
    )
    p.add_argument(
        "--window",
        type=int,
        metavar="N",
        help=f"the recent steps judged ({Rule.default('window', 'watching')})",
    )
    p.add_argument(
        "--sample-every",
        type=int,
        default=8,
        metavar="K",
        help="on the CPU, track storages on one step in K (8; 1: exact, about 3x slower)",
    )
    p.add_argument(
        "--floor",
        type=float,
        metavar="BYTES",
        help="bytes per step of growth accepted when no autograd graph holds it "
        f"({Rule.default('floor', 'watching')})",
    )
    p.add_argument(
        "--device", default=None, help="the device judged (default: the accelerator, else cpu)"
    )
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m")
    p.add_argument(
        "script", nargs="?", metavar="SCRIPT", help="the script; what follows it is its own"
    )
    return p


def split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Our options, then the target and its arguments: the first word that is not one of
    our options (or the word after ``-m``) starts the script's own command line."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "-m":
            return list(argv[: i + 2]), list(argv[i + 2 :])
        if word == "--":
            return list(argv[:i]) + list(argv[i + 1 : i + 2]), list(argv[i + 2 :])
        if not word.startswith("-") or word == "-":
            return list(argv[: i + 1]), list(argv[i + 1 :])
        i += 2 if word in _OPTIONS_WITH_VALUE else 1
    return list(argv), []


def options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "warmup": args.warmup,
        "window": args.window,
        "sample_every": args.sample_every,
        "floor": args.floor,
        "device": args.device,
    }


def main(argv: Sequence[str], prog: str) -> int:
    p = parser(prog)
    ours, rest = split(argv)
    args = p.parse_args(ours)
    if (args.module is None) == (args.script is None):
        p.error("give a SCRIPT or -m MODULE (one of them)")
    if args.script is not None and not os.path.exists(args.script):
        # As python says it, and with its status.
        print(
            f"{prog} run: can't open file {os.path.abspath(args.script)!r}: "
            "[Errno 2] No such file or directory",
            file=sys.stderr,
        )
        return 2
    if args.module is not None and not _importable(args.module):
        # As python says it, and with its status: nothing ran, so there is no verdict.
        print(f"{prog} run: No module named {args.module}", file=sys.stderr)
        return 1
    from leakfree.diagnostics.watch import Watch

    try:
        watch = Watch(on_finding=_printer(""), owner="leakfree run", **options(args))
    except (TypeError, ValueError) as e:  # "watch(sample_every=0): ..." as "--sample-every 0"
        flag = lambda m: f"--{m[1].replace('_', '-')} {m[2]}"  # noqa: E731
        p.error(re.sub(r"^watch\((\w+)=(.*?)\)", flag, str(e)))
    run_dir = tempfile.mkdtemp(prefix="leakfree-run-")
    os.environ[_ENV] = json.dumps({"options": options(args), "dir": run_dir})
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = _CHILD_DIR + (os.pathsep + path if path else "")
    target = args.script if args.script is not None else f"-m {args.module}"
    _banner(target, watch)
    status, interrupted = _execute(args, rest, watch)
    children = _children(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # the children's reports, read: nothing stays
    _summary(watch, children)
    here = watch.as_dict()
    if args.json:
        data = {"target": target, "status": status, **here, "children": children}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    found = bool(here["findings"]) or any(c["findings"] for c in children)
    trained = [v for v in (here, *children) if v["steps"] or v["backward_passes"]]
    unjudged = not trained or any(v.get("verdict") == "not judged" for v in trained)
    if interrupted:  # die of the interrupt, as python does: the parent sees SIGINT
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if args.fail and status == 0:
        if found:
            return EXIT_LEAK
        if unjudged:
            return EXIT_NOT_JUDGED
    return status


def _importable(name: str) -> bool:
    """Whether ``python -m name`` would find a module to run (importing its parent
    packages, as python does; an error in one counts as found: the run reports it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
    except Exception:
        return True


def _execute(args: argparse.Namespace, rest: list[str], watch: Any) -> tuple[int, bool]:
    """Run the target as python would; its exit status, and whether it was interrupted."""
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    if args.script is not None:
        sys.argv = [args.script, *rest]
        here = os.path.dirname(os.path.abspath(args.script))
    else:
        sys.argv = [args.module, *rest]  # run_module puts the module's path in argv[0]
        here = os.getcwd()
    if sys.path:
        sys.path[0] = here
    else:
        sys.path.append(here)
    watch.start()
    _summary_on_sigterm(watch)
    try:
        if args.script is not None:
            _run_script(args.script)
        else:
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        return 0, False
    except SystemExit as e:
        return _exit_status(e.code), False
    except KeyboardInterrupt as e:
        _report(e)
        return 130, True
    except BaseException as e:
        oom = watch.out_of_memory(e)  # read before the watch stops, the frames still here
        _report(e)
        if oom is not None:
            print(oom.text, file=sys.stderr, flush=True)
        return 1, False
    finally:
        watch.stop()
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0


def _summary_on_sigterm(watch: Any) -> None:
    """A scheduler's SIGTERM (SLURM, Kubernetes) ends the process as python's default does,
    killed by the signal, but after the summary: the findings are what the user came for.
    A handler the script installs replaces this one, as it would python's default."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def die(signum: int, frame: Any) -> None:
        watch.stop()
        _summary(watch, [])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, die)


def _run_script(script: str) -> None:
    """What ``python SCRIPT`` does with it: a fresh ``__main__`` module whose ``__file__``
    is the absolute path (tracebacks name it so), ``sys.argv[0]`` left as given, the
    source read with its declared encoding; the module stays ``__main__`` (as python
    leaves it), so ``multiprocessing``'s spawned children find it."""
    path = os.path.abspath(script)
    with tokenize.open(path) as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _report(error: BaseException) -> None:
    """The traceback python would print: from the script's frames on, not ours or runpy's
    (through ``sys.excepthook``, which the script may have replaced)."""
    tb = error.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
        or os.path.dirname(os.path.abspath(tb.tb_frame.f_code.co_filename)) == _HERE
    ):
        tb = tb.tb_next
    sys.excepthook(type(error), error.with_traceback(tb), tb)


def _exit_status(code: Any) -> int:
    """What python makes of ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _banner(target: str, watch: Any) -> None:
    tracked = (
        "the heap's count read at every step, tensor storages followed on 1 step in "
        f"{watch.sample_every} and on every step while growth is confirmed (--sample-every 1: "
        "every step)"
        if watch.device.type == "cpu"
        else "the allocator read at every step (free)"
    )
    rule = watch.rule
    tracked += (
        f"; a verdict after {rule.warmup + rule.window} steps ({rule.warmup} of warm-up, "
        f"{rule.window} judged)"
    )
    print(
        f"leakfree run: watching {target} on {watch.device}: steps = optimizer.step(), "
        f"microbatches = backward(); {tracked}; findings on stderr and at exit",
        file=sys.stderr,
        flush=True,
    )


def _printer(prefix: str) -> Any:
    def show(finding: Any) -> None:
        print(f"{prefix}{finding.message}", file=sys.stderr, flush=True)

    return show


def _summary(watch: Any, children: list[dict[str, Any]]) -> None:
    if children and not (watch.steps or watch.backwards):  # a launcher: its ranks trained
        lines = [f"leakfree: no backward pass here; {len(children)} child process(es) trained:"]
    else:
        lines = [watch.report()]
    for child in children:
        found = child["findings"]
        who = child["label"]
        verdict = f"{len(found)} leak(s) found" if found else "no leak found"
        if not found and child.get("verdict") == "not judged":
            verdict = f"not judged: {child.get('not_judged_because', '')}"
        lines.append(
            f"leakfree [{who}]: {child['steps']} steps, {child['backward_passes']} backward "
            f"passes: {verdict}"
        )
        lines.extend(f["message"] for f in found)
    print("\n".join(lines), file=sys.stderr, flush=True)


def _children(run_dir: str) -> list[dict[str, Any]]:
    out = []
    for name in sorted(glob.glob(os.path.join(run_dir, "*.json"))):
        with contextlib.suppress(OSError, ValueError), open(name, encoding="utf-8") as f:
            out.append(json.load(f))
    return out


# --- in a child process ------------------------------------------------------------------


def child_start() -> None:
    """Watch a child of a watched script (sitecustomize calls this once torch is imported)
    from its first backward pass or optimizer step; report at exit, into the parent's run
    directory."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from leakfree.diagnostics.boundaries import on_backward
    from leakfree.diagnostics.watch import Watch

    config = json.loads(os.environ[_ENV])
    watch = Watch(owner="leakfree run", **config["options"])
    watch.on_finding = lambda f: _printer(f"[{_label(watch.rank)}] ")(f)

    # Tracking starts at the child's first backward pass or optimizer step: a data loader
    # worker, a tokenizer process, never pays for it. (The hook stays registered, inert:
    # torch iterates its hooks while calling them.)
    def first(*_: Any) -> None:
        if not armed:
            return
        armed.clear()
        listener.remove()
        watch.start()

    armed = [True]
    listener = on_backward(first)
    register_optimizer_step_post_hook(first)

    def finish() -> None:
        watch.stop()
        if not (watch.steps or watch.backwards):
            return  # a helper process that never trained: nothing to say
        label = _label(watch.rank)
        report = watch.report().replace("leakfree: ", f"leakfree [{label}]: ")
        print(report, file=sys.stderr, flush=True)
        data = {"label": label, "pid": os.getpid(), **watch.as_dict()}
        path = os.path.join(config["dir"], f"{os.getpid()}.json")
        with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)

    atexit.register(finish)


def _label(rank: int | None) -> str:
    """``rank N`` (the process group's, else torchrun's RANK), or ``pid N``."""
    name = str(rank) if rank is not None else os.environ.get("RANK")
    return f"rank {name}" if name is not None else f"pid {os.getpid()}"
