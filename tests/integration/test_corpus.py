"""The held-out corpus (tests/integration/corpus/) under ``python -m leakfree run --fail --json``
at its defaults: what the runtime finders must do on training scripts nobody tuned them on.

Each script reproduces a public 2025-2026 report (corpus/manifest.py names them; corpus/
README.md describes them; corpus/BEFORE.md has what the finders did on them before any change
made for them). The runtime-finders work item is done when:

- every leaky script is detected (exit 79) at 16, 40 and 160 optimizer steps, its holder
  named (manifest ``holder``: e.g. ``Restraint.ctx.forces`` with "the collector is
  disabled", ``reports[*]['explainer'].softmax.input`` with the hook ``_keep_io``, the
  ``SpeechTextDataset.__getitem__`` cache) and the ``# MADE`` line cited; the Hugging Face
  Trainer script also at 4 steps of 4 microbatches (what each microbatch keeps, used
  whether or not it outlives the step);
- every fixed twin and control is quiet (exit 0, verdict ``clean``, no finding) at 16, 40
  and 160 steps. Two exceptions, both from the rule (leakfree/diagnostics/rule.py: the
  ``watching`` context warms up for 3 steps and judges a window of 10, so a verdict needs
  13 steps): a 4-step run cannot be judged clean, so the 4-step fixed Trainer must say
  ``not judged`` (exit 78) and find nothing; and a control still filling its bounded store
  when the run ends (16 steps of the replay deque, full at step 16, of the lru_cache, full
  at 24, and of the lazily made optimizer state, last made at 21) has no flat history to
  judge, so it must find nothing and not say ``leak`` (exit 0 or 78);
- a control that filled a bounded store and then stayed flat (the replay deque, the
  bounded lru_cache, the optimizer state) says so in its final report at 40 and 160 steps:
  ``grew by X over steps a-b, then flat for n steps``, with b where the filling stopped.

The runs are made a few at a time in the background, in the order the tests ask for them,
each in a process forked from the test session's fork server (torch imported once), as
tests/integration/test_run.py makes its own; a test waits only for its own run.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from leakfree.cli.run import EXIT_NOT_JUDGED
from leakfree.diagnostics.rule import Rule
from tests.integration.corpus import reading
from tests.integration.corpus.manifest import BY_NAME, CASES, Case
from tests.integration.test_run import EXIT_LEAK, Run, leakfree_run

pytestmark = pytest.mark.integration

#: steps a verdict needs at leakfree run's defaults (the warm-up, then a window)
NEEDED = Rule.default("warmup", "watching") + Rule.default("window", "watching")
#: how far from the step where filling stops the report may place it (steps)
SLACK = 4

LEAKS = [(c.name, s) for c in CASES if c.role == "leak" for s in c.steps]
QUIET = [(c.name, s) for c in CASES if c.role != "leak" for s in c.steps]
FILLED = [
    (c.name, s) for c in CASES if c.flat_after is not None for s in c.steps if s > c.flat_after
]


class Corpus:
    """The corpus's runs: each made once, on first demand or ahead of it, four at a time."""

    def __init__(self, folder: Path, order: list[tuple[str, int]]) -> None:
        self.folder = folder
        self.pool = ThreadPoolExecutor(max_workers=4)
        self.futures: dict[tuple[str, int], Future[Run]] = {}
        self.lock = threading.Lock()
        for key in order:
            self._submit(key)

    def _submit(self, key: tuple[str, int]) -> Future[Run]:
        with self.lock:
            if key not in self.futures:
                self.futures[key] = self.pool.submit(self._run, *key)
            return self.futures[key]

    def _run(self, name: str, steps: int) -> Run:
        cwd = self.folder / f"{name}-{steps}"
        cwd.mkdir()
        return leakfree_run(cwd, "--fail", str(BY_NAME[name].path), str(steps), fork=True)

    def __call__(self, name: str, steps: int) -> Run:
        return self._submit((name, steps)).result()


@pytest.fixture(scope="module")
def corpus(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every run the selected tests of this module read, started in their order."""
    order = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and "name" in params:
            order.append((params["name"], params["steps"]))
    runs = Corpus(tmp_path_factory.mktemp("corpus"), order)
    yield runs
    runs.pool.shutdown(wait=True, cancel_futures=True)


def _messages(run: Run) -> str:
    return "\n".join(str(f["message"]) for f in reading.findings(run.report))


def _ids(params: list[tuple[str, int]]) -> list[str]:
    return [f"{name}-{steps}" for name, steps in params]


@pytest.mark.parametrize(("name", "steps"), LEAKS, ids=_ids(LEAKS))
def test_a_leak_is_found_with_its_holder_and_the_line_that_made_it(
    name: str, steps: int, corpus: Corpus
) -> None:
    case = BY_NAME[name]
    run = corpus(name, steps)
    assert run.status == EXIT_LEAK, run.stderr[-3000:]
    assert run.report["verdict"] == "leak", run.report
    # named as a holder (its path, its cycle, the message outside the creation sites)
    assert reading.holder_named(case, run.report), (case.holder, case.says, _messages(run))
    assert reading.line_cited(case, run.report), (reading.made_site(case), _messages(run))


@pytest.mark.parametrize(("name", "steps"), QUIET, ids=_ids(QUIET))
def test_a_fixed_twin_or_a_control_is_quiet(name: str, steps: int, corpus: Corpus) -> None:
    case: Case = BY_NAME[name]
    run = corpus(name, steps)
    assert run.report.get("findings") == [], _messages(run)[-3000:] or run.stderr[-3000:]
    if steps < NEEDED:  # too short for any verdict but a leak: a clean run says so
        assert run.status == EXIT_NOT_JUDGED, run.stderr[-3000:]
        assert run.report["verdict"] == "not judged"
    elif case.flat_after is not None and steps <= case.flat_after:  # still filling at the end
        assert run.status in (0, EXIT_NOT_JUDGED), run.stderr[-3000:]
        assert run.report["verdict"] in ("clean", "not judged")
    else:
        assert run.status == 0, run.stderr[-3000:]
        assert run.report["verdict"] == "clean", run.report


@pytest.mark.parametrize(("name", "steps"), FILLED, ids=_ids(FILLED))
def test_a_bounded_store_that_filled_is_reported_as_grown_then_flat(
    name: str, steps: int, corpus: Corpus
) -> None:
    case = BY_NAME[name]
    assert case.flat_after is not None
    run = corpus(name, steps)
    said = reading.grew_then_flat(run.stderr)
    assert said is not None, run.stderr[-3000:]
    _, first, last, flat = said
    assert first <= last and abs(last - case.flat_after) <= SLACK, said
    assert flat >= steps - case.flat_after - SLACK, said
