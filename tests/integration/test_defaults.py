"""``python -m leakfree run --fail --json FILE script.py`` at its DEFAULT options (no
``--sample-every``, no ``--warmup``) on scripts written as a user writes them.

A leak is found in a run of 16 or 40 optimizer steps at the defaults, with its holder and
the line that made what it keeps; a clean run of 40 steps reports nothing and says it was
judged clean; a run too short to judge says so (``not judged``, how many steps were judged
and how many were needed) and exits with its own status, never "no leak found".

The scripts run concurrently, each in a process forked from the test session's fork
server (torch already imported), as tests/integration/test_run.py runs its own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.test_run import EXIT_LEAK, ROOT, Run, leakfree_run, line_of

#: a tiny causal transformer, AdamW, gradient accumulation: what every script starts with
TINY_LM = """
import collections
import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)
VOCAB, BATCH, SEQ, ACCUM = 50, 2, 16, 4


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layer = nn.TransformerEncoderLayer(
            d_model=32, nhead=2, dim_feedforward=64, batch_first=True
        )
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids):
        return self.head(self.layer(self.embed(ids)))


model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss()


def batch():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]
"""

#: a clean loop of 40 steps that logs LOGGED for every microbatch
CLEAN_LOOP = """
losses = []
for step in range(40):
    for micro in range(ACCUM):
        inputs, targets = batch()
        loss = criterion(model(inputs).reshape(-1, VOCAB), targets.reshape(-1)) / ACCUM
        loss.backward()
        losses.append(LOGGED)
    optimizer.step()
    optimizer.zero_grad()
print("trained", len(losses))
"""

#: name -> the script (each a whole file, as a user writes it)
SCRIPTS: dict[str, str] = {
    # the logged loss kept with its graph, 4 microbatches a step, 40 optimizer steps
    "losses_list": TINY_LM
    + """
losses = []
for step in range(40):
    for micro in range(ACCUM):
        inputs, targets = batch()
        logits = model(inputs)
        loss = criterion(logits.reshape(-1, VOCAB), targets.reshape(-1)) / ACCUM  # MADE
        loss.backward()
        losses.append(loss)  # for the log: with its graph
    optimizer.step()
    optimizer.zero_grad()
print("last loss", sum(l.item() for l in losses[-ACCUM:]))
""",
    # state parked on a custom Function's ctx (not save_for_backward), the graphs kept by
    # the last 100 losses: about 512 KiB a step
    "ctx_deque": """
import collections
import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)


class Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        mask = (torch.rand_like(x) > p).to(x.dtype) / (1 - p)  # MADE
        ctx.x = x
        ctx.mask = mask
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.mask).to(ctx.x.dtype), None


body, head = nn.Linear(512, 512), nn.Linear(512, 10)
optimizer = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=1e-3)
recent_losses = collections.deque(maxlen=100)
for step in range(40):
    x = torch.randn(128, 512)
    y = torch.randint(0, 10, (128,))
    hidden = body(x)  # 128 x 512 floats: 256 KiB, and its mask as much
    loss = nn.functional.cross_entropy(head(Dropout.apply(hidden, 0.1)), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    recent_losses.append(loss)  # with its graph, and the graph's ctx state
print("last loss", recent_losses[-1].item())
""",
    # the outputs kept "for metrics" with their graph, keyed by step: 16 steps
    "metrics_dict": TINY_LM
    + """
history = {}
for step in range(16):
    inputs, targets = batch()
    logits = model(inputs)  # MADE
    loss = criterion(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    history[step] = logits
print("steps", len(history))
""",
    # a module-level cache of detached activations, 4 KiB a step: 16 steps
    "detached_cache": TINY_LM
    + """
_cache = []
for step in range(16):
    inputs, targets = batch()
    hidden = model.layer(model.embed(inputs))
    logits = model.head(hidden)
    loss = criterion(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    _cache.append(hidden.detach().clone())  # MADE  2 x 16 x 32 floats: 4 KiB
print("cached", len(_cache))
""",
    # clean: the loss logged as a number, or detached (4 B a microbatch, no graph)
    "clean_item": TINY_LM + CLEAN_LOOP.replace("LOGGED", "loss.item()"),
    "clean_detach": TINY_LM + CLEAN_LOOP.replace("LOGGED", "loss.detach()"),
    # clean, and too short to judge: 3 steps
    "short": TINY_LM
    + """
for step in range(3):
    for micro in range(ACCUM):
        inputs, targets = batch()
        loss = criterion(model(inputs).reshape(-1, VOCAB), targets.reshape(-1)) / ACCUM
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print("trained", step + 1)
""",
}

#: leaky script -> what one of its finding's holders names (any of them)
LEAKS: dict[str, tuple[str, ...]] = {
    "losses_list": ("losses",),
    "ctx_deque": ("ctx.x", "ctx.mask", "recent_losses"),
    "metrics_dict": ("history",),
    "detached_cache": ("_cache",),
}
CLEAN = ("clean_item", "clean_detach")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every script under ``leakfree run --fail --json FILE`` at the defaults, a few at a
    time."""
    folder = tmp_path_factory.mktemp("defaults")
    for name, source in SCRIPTS.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            name: pool.submit(leakfree_run, folder, "--fail", f"{name}.py", fork=True)
            for name in SCRIPTS
        }
        return {name: f.result() for name, f in futures.items()}


def _holders(run: Run) -> list[dict[str, object]]:
    return [h for f in run.report.get("findings", []) for h in f["holders"]]


@pytest.mark.parametrize("name", list(LEAKS))
def test_a_leak_is_found_at_the_default_options(name: str, runs: dict[str, Run]) -> None:
    run = runs[name]
    assert run.status == EXIT_LEAK, run.stderr[-3000:]
    wheres = [str(h["where"]) for h in _holders(run)]
    assert any(part in where for where in wheres for part in LEAKS[name]), run.stderr[-3000:]


def test_the_logged_loss_is_named_with_the_line_that_made_it(runs: dict[str, Run]) -> None:
    run = runs["losses_list"]
    made = f"losses_list.py:{line_of(textwrap.dedent(SCRIPTS['losses_list']))}"
    held = [h for h in _holders(run) if "losses" in str(h["where"])]
    assert held, run.stderr[-3000:]
    assert any(made in str(h["created_at"]) for h in held), held


@pytest.mark.parametrize("name", CLEAN)
def test_a_clean_script_of_40_steps_reports_nothing(name: str, runs: dict[str, Run]) -> None:
    run = runs[name]
    assert run.status == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "trained 160"
    assert run.report["findings"] == []


@pytest.mark.parametrize(
    ("name", "verdict"),
    [*((name, "leak") for name in LEAKS), *((name, "clean") for name in CLEAN)],
)
def test_the_json_carries_the_verdict(name: str, verdict: str, runs: dict[str, Run]) -> None:
    assert runs[name].report.get("verdict") == verdict, runs[name].report


def test_a_run_too_short_to_judge_says_so_and_has_its_own_status(runs: dict[str, Run]) -> None:
    from leakfree.cli.run import EXIT_NOT_JUDGED

    run = runs["short"]
    assert EXIT_NOT_JUDGED not in (0, EXIT_LEAK)
    assert run.stdout.strip() == "trained 3"
    assert run.status == EXIT_NOT_JUDGED, run.stderr[-3000:]
    assert "no leak found" not in run.stderr
    report = run.report
    assert report["verdict"] == "not judged" and report["findings"] == []
    judged, needed = report["judged_steps"], report["needed_steps"]
    assert isinstance(judged, int) and isinstance(needed, int)
    assert 0 <= judged <= 3 < needed
    # the message says how many steps were judged and how many were needed
    said = [line for line in run.stderr.splitlines() if "not judged" in line]
    assert said, run.stderr[-3000:]
    assert any(
        re.search(rf"\b{judged}\b", line) and re.search(rf"\b{needed}\b", line) for line in said
    ), said


def test_the_not_judged_status_is_documented() -> None:
    from leakfree.cli.run import EXIT_NOT_JUDGED

    docs = (ROOT / "docs" / "diagnostics.md").read_text()
    paragraphs = [p for p in re.split(r"\n\s*\n", docs) if "not judged" in p]
    assert any(re.search(rf"\b{EXIT_NOT_JUDGED}\b", p) for p in paragraphs)


def test_a_run_leaves_nothing_behind_in_the_temporary_folder(tmp_path: Path) -> None:
    """The folder where children leave their reports is removed once they are read (each
    run used to leave an empty ``leakfree-run-*`` folder in /tmp)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    (tmp_path / "hello.py").write_text("print('hello')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(temp)}
    done = subprocess.run(
        [sys.executable, "-m", "leakfree", "run", "hello.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0 and done.stdout == "hello\n", done.stderr
    assert "not judged" in done.stderr  # nothing trained: no verdict, and it says so
    assert list(temp.iterdir()) == []
