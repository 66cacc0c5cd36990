"""``python -m leakfree run``: real scripts, unchanged, in subprocesses.

Each leak shape the finders know is a script here: run with ``--fail`` it names the holder and the
line that made what it keeps, and exits 79; the clean scripts exit 0 and report nothing;
a 2-rank gloo script reports per rank; scripts that exit non-zero, raise or are
interrupted keep their own status. The scripts run concurrently (a few at a time); the
clean and the multi-process ones in a new interpreter each, the others in a process forked
from one that has imported torch (``tests._fresh.run_python``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests._fresh import run_python

ROOT = Path(__file__).resolve().parents[2]
EXIT_LEAK = 79

MODEL = """
import gc, sys, torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
"""

# name -> (script body after MODEL, what the report must name, the line that makes it)
SHAPES: dict[str, tuple[str, str, str]] = {
    "verl": (
        """
def compute_entropy(logits):
    p = logits.softmax(-1)
    return -(p * p.log()).sum(-1)  # MADE

for step in range(4):
    output_lst = []
    for _ in range(4):
        logits = model(torch.randn(8, 32))
        (logits.logsumexp(-1).mean() / 4).backward()
        output_lst.append({"entropy": compute_entropy(logits)})
    opt.step(); opt.zero_grad()
""",
        "output_lst[*]['entropy']",
        "in compute_entropy",
    ),
    "fast_llm": (
        """
class FusedLoss(torch.autograd.Function):  # keeps its workspace on ctx, as fused kernels do
    @staticmethod
    def forward(ctx, x):
        ctx.workspace = torch.zeros(16 * 1024)
        ctx.save_for_backward(x)
        return x.square().mean()  # MADE
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 * x / x.numel()

class BatchContext:
    def __init__(self):
        self.losses = {"lm": []}

for step in range(3):
    context = BatchContext()
    for _ in range(4):
        loss = FusedLoss.apply(model(torch.randn(8, 32)))
        loss.backward()
        context.losses["lm"].append(loss)
    opt.step(); opt.zero_grad()
""",
        "context.losses['lm'][*]",
        "in FusedLoss.forward",
    ),
    "global_loss": (
        """
kept = []
for step in range(20):
    loss = model(torch.randn(8, 32)).square().mean()  # MADE
    loss.backward()
    opt.step(); opt.zero_grad()
    kept.append(loss)  # 4 B a step, with its graph
""",
        "kept[*]",
        "in <module>",
    ),
    "hooks": (
        """
for step in range(20):
    hidden = model[0](torch.randn(8, 32))  # MADE
    model[0].weight.register_hook(lambda g, h=hidden: g * h.detach().mean())
    model[2](model[1](hidden)).square().mean().backward()
    opt.step(); opt.zero_grad()
""",
        "_parameters['weight']._backward_hooks[*]",
        "in <module>",
    ),
    "retain_graph": (
        """
later = []
for step in range(20):
    out = model(torch.randn(8, 32))  # MADE
    out.square().mean().backward(retain_graph=True)
    later.append(out)
    opt.step(); opt.zero_grad()
""",
        "later[*]",
        "in <module>",
    ),
    "gc_disabled": (
        """
class Node:
    def __init__(self, out):
        self.out, self.me = out, self

gc.disable()
for step in range(20):
    out = model(torch.randn(8, 32)).tanh()  # MADE
    out.square().mean().backward()
    opt.step(); opt.zero_grad()
    Node(out)
""",
        "cycle: Node.me -> Node; holds it by .out",
        "in <module>",
    ),
    "offloader_table": (
        """
class Offloader:  # the table is reset at the last unpack; one tensor is never unpacked
    def __init__(self):
        self.tracker, self.pending = {}, set()
    def pack(self, t):
        key = len(self.tracker)
        self.tracker[key] = t.detach().clone()  # MADE
        self.pending.add(key)
        return key
    def unpack(self, key):
        out = self.tracker[key]
        self.pending.discard(key)
        if not self.pending:
            self.tracker.clear()
        return out

offloader = Offloader()
for step in range(20):
    with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
        out = model(torch.randn(8, 32))
        side = out.sigmoid()
    out.square().mean().backward()
    opt.step(); opt.zero_grad()
""",
        "offloader.tracker",
        "in Offloader.pack",
    ),
    "handle_cache": (
        """
import collectives
for step in range(20):
    hidden = model(torch.randn(8, 32))
    gathered = collectives.all_gather(hidden.detach(), step)  # an async handle's buffer
    (hidden.square().mean() + 0 * gathered.sum()).backward()
    opt.step(); opt.zero_grad()
""",
        "collectives._handle_cache",
        "collectives.py:",
    ),
}

COLLECTIVES = """
import torch
_handle_cache = {}  # cleared on one code path only


def all_gather(x, step):
    out = torch.cat([x, x])
    _handle_cache[step] = out
    return out
"""

CLEAN = (
    MODEL
    + """
losses = []
for step in range(20):
    for _ in range(2):
        loss = model(torch.randn(8, 32)).square().mean() / 2
        loss.backward()
    opt.step(); opt.zero_grad()
    losses.append(loss.item())
print("trained", len(losses))
"""
)

DIST = """
import socket, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

KEPT = []


def worker(rank, world, port, leak):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(14):
        loss = model(torch.randn(8, 16)).square().mean()  # MADE
        loss.backward()
        opt.step()
        opt.zero_grad()
        if leak and rank == 1:
            KEPT.append(loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, sys.argv[1:] == ["leak"]), nprocs=2)
    print("trained")
"""

TORCHRUN = """
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
KEPT = []
for step in range(14):
    loss = model(torch.randn(8, 16)).square().mean()  # MADE
    loss.backward()
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0:
        KEPT.append(loss)
dist.destroy_process_group()
"""

EXITS = """
import os, signal, sys, time, torch
x = torch.randn(4, requires_grad=True)
x.sum().backward()
what = sys.argv[1]
print("argv", sys.argv, flush=True)
if what == "exit":
    sys.exit(3)
if what == "raise":
    raise RuntimeError("boom")
if what == "interrupt":
    raise KeyboardInterrupt
if what == "terminate":  # a scheduler's SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
"""


@dataclass
class Run:
    status: int
    stdout: str
    stderr: str
    report: dict[str, Any]


def line_of(source: str, marker: str = "# MADE") -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if marker in text)


def leakfree_run(cwd: Path, *words: str, json_out: bool = True, fork: bool = False) -> Run:
    """``python -m leakfree run [--json FILE] words...`` in ``cwd``: a new interpreter, or
    (``fork``) a process forked from the test session's fork server, which has imported
    torch and nothing else, so it saves the imports (about 2 s of CPU per run) and runs
    the same code: ``python -m leakfree``'s, with the same argv, path, environment and
    exit status."""
    out = cwd / f"report-{abs(hash(words))}.json"
    command = ["run"]
    if json_out:
        command += ["--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if fork:
        status, stdout, stderr = run_python("-m", "leakfree", *command, *words, cwd=cwd, env=env)
    else:
        done = subprocess.run(
            [sys.executable, "-m", "leakfree", *command, *words],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        status, stdout, stderr = done.returncode, done.stdout, done.stderr
    report = json.loads(out.read_text()) if json_out and out.exists() else {}
    return Run(status, stdout, stderr, report)


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("scripts")
    for name, (body, _, _) in SHAPES.items():
        (folder / f"{name}.py").write_text(MODEL + textwrap.dedent(body))
    (folder / "collectives.py").write_text(COLLECTIVES)
    (folder / "clean.py").write_text(CLEAN)
    (folder / "dist.py").write_text(DIST)
    (folder / "torchrun_train.py").write_text(TORCHRUN)
    (folder / "exits.py").write_text(EXITS)
    return folder


#: every run the tests read, by name: (arguments to ``leakfree run``)
RUNS: dict[str, tuple[str, ...]] = {
    **{f"shape {name}": ("--fail", "--sample-every", "1", f"{name}.py") for name in SHAPES},
    # as python -m runs a module: the same shape, found the same way
    "shape global_loss": ("--fail", "--sample-every", "1", "-m", "global_loss"),
    "clean": ("--fail", "clean.py"),
    "dist leak": ("--fail", "--sample-every", "1", "dist.py", "leak"),
    "torchrun": (
        "--fail",
        "--sample-every",
        "1",
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(29400 + os.getpid() % 1000),
        "torchrun_train.py",
    ),
    "exit": ("--fail", "exits.py", "exit"),
    "raise": ("--fail", "exits.py", "raise"),
    "interrupt": ("--fail", "exits.py", "interrupt"),
    "terminate": ("--fail", "exits.py", "terminate"),
}
#: the runs made in a new interpreter, start to end as a user's would be (the clean one,
#: and the two whose ranks are found through the child environment); the others fork
NEW_INTERPRETER = {"clean", "dist leak", "torchrun"}


#: torch's own teardown of a gloo rank aborts it now and then, after the script (and
#: leakfree's report) ended: plain torchrun of TORCHRUN, without leakfree, aborted 8 runs in
#: 10 beside two busy processes (torch 2.13; pytorch #190489). Such a run is made again.
TEARDOWN_ABORT = "terminate called without an active exception"


def leakfree_run_again_on_teardown_abort(cwd: Path, *words: str, fork: bool) -> Run:
    """:func:`leakfree_run`, made again (twice at most) while a rank died of
    :data:`TEARDOWN_ABORT`, which is torch's, not leakfree's."""
    run = leakfree_run(cwd, *words, fork=fork)
    for _ in range(2):
        if TEARDOWN_ABORT not in run.stderr:
            break
        run = leakfree_run(cwd, *words, fork=fork)
    return run


@pytest.fixture(scope="module")
def runs(scripts: Path) -> dict[str, Run]:
    """Every run, a few at a time."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            name: pool.submit(
                leakfree_run_again_on_teardown_abort,
                scripts,
                *words,
                fork=name not in NEW_INTERPRETER,
            )
            for name, words in RUNS.items()
        }
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_leak_shape_is_named_with_holder_and_line(shape: str, runs: dict[str, Run]) -> None:
    run = runs[f"shape {shape}"]
    body, holder, function = SHAPES[shape]
    assert run.status == EXIT_LEAK, run.stderr[-3000:]
    if shape == "handle_cache":  # made in the helper module the script imports
        made = f"collectives.py:{line_of(COLLECTIVES, '_handle_cache[step]') - 1} in all_gather"
    else:
        made = f"{shape}.py:{line_of(MODEL + textwrap.dedent(body))} {function}"
    # reported when found, and again in the summary at exit
    assert run.stderr.count(holder) >= 2, run.stderr[-3000:]
    assert made in run.stderr, run.stderr[-3000:]
    assert run.stderr.splitlines()[0].startswith("leakfree run: watching")  # the banner
    [finding, *_] = run.report["findings"]
    assert holder in finding["message"]


def test_a_clean_script_reports_nothing_and_keeps_its_status(runs: dict[str, Run]) -> None:
    run = runs["clean"]
    assert run.status == 0 and run.stdout.strip() == "trained 20"
    assert "no leak found" in run.stderr and run.report["findings"] == []
    assert run.report["steps"] == 20 and run.report["backward_passes"] == 40


def test_each_rank_of_a_gloo_script_reports_for_itself(runs: dict[str, Run]) -> None:
    run = runs["dist leak"]  # rank 1 keeps its losses, rank 0 does not
    assert run.stdout.strip() == "trained", run.stderr[-3000:]
    assert run.status == EXIT_LEAK
    children = {c["label"]: c for c in run.report["children"]}
    assert set(children) == {"rank 0", "rank 1"}
    assert children["rank 0"]["findings"] == [] and children["rank 0"]["steps"] == 14
    [finding] = children["rank 1"]["findings"]
    assert "KEPT[*]" in finding["message"]
    assert f"dist.py:{line_of(DIST)} in worker" in finding["message"]
    assert "[rank 1] leakfree run: memory grows by" in run.stderr
    # the first backward pass starts the watch in a child: 13 of 14 are counted
    assert "leakfree [rank 0]: 14 steps, 13 backward passes: no leak found" in run.stderr


def test_a_torchrun_launchers_ranks_report_for_themselves(runs: dict[str, Run]) -> None:
    run = runs["torchrun"]  # the launcher runs under leakfree; its two workers are watched
    assert run.status == EXIT_LEAK, run.stderr[-3000:]
    children = {c["label"]: c for c in run.report["children"]}
    assert set(children) == {"rank 0", "rank 1"} and children["rank 1"]["findings"] == []
    [finding] = children["rank 0"]["findings"]
    assert f"torchrun_train.py:{line_of(TORCHRUN)} in <module>" in finding["message"]
    assert "no backward pass here; 2 child process(es) trained" in run.stderr


@pytest.mark.parametrize(
    ("what", "status"),
    [("exit", 3), ("raise", 1), ("interrupt", -signal.SIGINT), ("terminate", -signal.SIGTERM)],
)
def test_the_script_keeps_its_own_behaviour_and_status(
    runs: dict[str, Run], scripts: Path, what: str, status: int
) -> None:
    run = runs[what]
    assert run.status == status, run.stderr[-2000:]
    assert run.stdout.strip() == f"argv ['exits.py', '{what}']"  # as python sets it
    assert "leakfree: 0 steps" in run.stderr  # the summary, after the script's end
    if what == "raise":
        tail = run.stderr.split("Traceback (most recent call last):")[1]
        assert tail.splitlines()[1].strip().startswith(f'File "{scripts / "exits.py"}"')
        assert "RuntimeError: boom" in tail and "runpy" not in tail and "_run.py" not in tail


def test_a_module_runs_as_python_m_does(runs: dict[str, Run]) -> None:
    run = runs["shape global_loss"]  # run with -m global_loss
    assert run.status == EXIT_LEAK and "watching -m global_loss" in run.stderr
    assert "global_loss.py:" in run.stderr and "kept[*]" in run.stderr


def test_usage_errors_exit_2_with_a_clear_message(scripts: Path) -> None:
    missing = leakfree_run(scripts, "missing.py", json_out=False)
    assert missing.status == 2 and "can't open file" in missing.stderr
    bad = leakfree_run(scripts, "--sample-every", "0", "clean.py", json_out=False)
    assert bad.status == 2 and "--sample-every 0: expected an int >= 1" in bad.stderr
    none = leakfree_run(scripts, json_out=False)
    assert none.status == 2 and "give a SCRIPT or -m MODULE" in none.stderr


def test_a_module_that_cannot_be_imported_gets_python_s_error_and_status_and_no_verdict(
    scripts: Path,
) -> None:
    for args in (("-m", "no_such_module"), ("--fail", "-m", "no_such_package.sub")):
        run = leakfree_run(scripts, *args, json_out=False)
        assert run.status == 1, run.stderr
        assert f"No module named {args[-1]}" in run.stderr
        assert "leakfree:" not in run.stderr and "judged" not in run.stderr  # nothing ran


#: The PyTorch FAQ's "don't accumulate history across your training loop", in its
#: validation form: each validation loss kept with its graph (no ``torch.no_grad()``), its
#: activations alive, until the allocator refuses. The CPU's allocator refuses for real
#: under an address-space cap set after the first step (threads and optimizer state made).
OUT_OF_MEMORY = """
import resource, sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)


def train_step():
    loss = model(torch.randn(64, 256)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def validate():
    return model(torch.randn(512, 256)).pow(2).mean()  # MADE


train_step()
pages = int(open("/proc/self/statm").read().split()[0])
cap = pages * resource.getpagesize() + (int(sys.argv[1]) << 20)
resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
val_losses = []
for step in range(10_000):
    train_step()
    val_losses.append(validate())
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc")
def test_an_out_of_memory_error_ends_with_the_report_so_far_and_the_error_unchanged(
    tmp_path: Path,
) -> None:
    (tmp_path / "val_oom.py").write_text(OUT_OF_MEMORY)
    made = next(i for i, line in enumerate(OUT_OF_MEMORY.splitlines(), 1) if "# MADE" in line)
    run = leakfree_run(tmp_path, "--fail", "val_oom.py", "160", fork=True)
    assert run.status == 1, run.stderr[-3000:]  # python's status for the uncaught error
    error = "DefaultCPUAllocator: can't allocate memory"
    # python's traceback first, from the script's frames, then the report so far
    traceback, report = run.stderr.split("leakfree run: out of memory after ", 1)
    assert (
        "Traceback (most recent call last)" in traceback and "RuntimeError: [enforce" in traceback
    )
    assert error in traceback.splitlines()[-1]
    oom = run.report["out_of_memory"]
    assert error in oom["error"] and oom["step"] == run.report["optimizer_steps"] > 8
    assert oom["holders"][0]["where"] == "val_losses[*]" and oom["holders"][0]["kind"] == "graph"
    assert oom["holders"][0]["bytes"] > 100 << 20  # what a 160 MiB cap let it keep
    assert oom["lines"][0]["line"] == f"val_oom.py:{made} in validate"
    assert "who holds the most now:\n    val_losses[*]  graph" in report
    assert f"val_oom.py:{made} in validate" in report and run.report["verdict"] == "leak"
