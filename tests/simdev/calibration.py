"""The H100 timing model against the H100 measurements: what is fitted, what is held out.

:data:`MEASURED` is every table of the H100 run that the model can replay, each with its
own model config (``../shared/GPU.md``: one H100 80GB, torch 2.11, transformers 5.17,
TRL 1.16, measured 2026-11-27 at e7732f1; its correction of 2026-11-28 gives the first
table's intermediate size as 5632):

* ``first``: the first table, intermediate 5632, batch 2 x 4096;
* ``second``: the ``device_budget`` table, intermediate 5440, batch 2 x 4096;
* ``suite``: ``benchmarks/gpu_suite.py``'s run, intermediate 5440, batch 1 x 4096 (ratios
  and activation peaks only).

**The split, written before fitting.** :data:`FITTED`: the step without offloading of
``first`` and of ``second``; one parameter is fitted on them, the FLOP rate that large
kernels reach (:func:`fit_flops`: least squares of the log step time). Everything else
in :data:`timing.H100` is measured apart from these tables (the copy bandwidths) or
assumed (memory-bound kernels at 2.8 TB/s, 6 us per launch, 2.5 us per kernel at
least). Every other row is held out: each offloading row of the three tables (ratio to
its own table's step without offloading, activation peak, bytes sent to the host) and
the suite's step without offloading (activation peak). Nothing is fitted on activation
peaks or bytes: they follow from the model's shapes and the offloader's code. Caveat:
``second``'s offloading rows were looked at while the schedule of :func:`predict.as_measured`
and the model's engines were built; ``first`` (at its true size) and ``suite`` were not.

:func:`errors` gives each row's errors, :func:`report` prints them (the benchmarks call
it); ``tests/integration/test_h100_model.py`` holds the fitted and the held-out rows to
tolerances stated there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import device as _device
from . import predict, timing

GiB, MiB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class Measured:
    """One row: step ms (None where not published), its ratio to its table's step
    without offloading, the activation peak (GiB: ``max_memory_allocated`` over the step
    less what was allocated before it) and GiB sent to the host per step."""

    step_ms: float | None
    ratio: float
    activation_gib: float | None = None
    to_host_gib: float | None = None


@dataclass(frozen=True)
class Table:
    """One H100 run's table: its model's size and its rows."""

    intermediate: int
    batch: int
    rows: dict[str, Measured]


MEASURED: dict[str, Table] = {
    "first": Table(5632, 2, {
        "none": Measured(76.2, 1.00, 8.81),
        "save_on_cpu": Measured(554.1, 7.27, 2.93, 10.81),
        "trl class": Measured(327.0, 4.29, 4.74, 7.75),
        "trl": Measured(290.7, 3.81, 4.78),
        "default": Measured(215.4, 2.83, 3.87, 4.95),
        "use_streams=False": Measured(272.5, 3.58, 3.87, 4.95),
    }),
    "second": Table(5440, 2, {
        "none": Measured(78.7, 1.00, 8.73),
        "default": Measured(207.5, 2.64, 4.18, 4.78),
        "budget 0.75": Measured(140.6, 1.79, 5.55, 3.18),
        "budget 0.50": Measured(187.1, 2.38, 4.35, 4.37),
        "budget 0.25": Measured(235.0, 2.99, 3.15, 5.58),
        "trl": Measured(289.4, 3.68, 4.82),
    }),
    "suite": Table(5440, 1, {
        "none": Measured(None, 1.00, 4464 / 1024),
        "save_on_cpu": Measured(None, 6.83),
        "trl class": Measured(None, 4.01),
        "trl": Measured(None, 3.33, 2468 / 1024),
        "offload_model": Measured(None, 2.38, 2138 / 1024),
        "offload_model budget 0.50": Measured(None, 1.86, 3093 / 1024),
    }),
}  # fmt: skip
#: the rows the FLOP rate is fitted on: (table, mode)
FITTED = (("first", "none"), ("second", "none"))
#: leakfree's modes plan from earlier steps: two warm-up steps; the others' first step
#: is their last (checked: the same step time, peak and bytes with a warm-up step)
_WARMUP = {"none": 0, "save_on_cpu": 0, "trl class": 0, "trl": 0}


def _mode(table: str, mode: str, moved: int | None) -> Any:
    """What :func:`predict.predict` runs for a row: a mode name, or a function of the
    model giving the context of one step. ``moved``: what the table's unbudgeted
    leakfree row moved (the budgets are fractions of it)."""
    if mode == "trl class":
        return _trl_class
    if mode.startswith("offload_model"):
        budget = mode.partition(" budget ")[2]
        if budget and moved is None:
            raise ValueError(f"row {table}/{mode}: needs the bytes offload_model moves")
        options = {"device_budget": int(float(budget) * moved)} if budget and moved else {}
        return lambda model: _offload_model(model, **options)
    return mode


def _trl_class(model: torch.nn.Module) -> Callable[[], Any]:
    from trl.models.activation_offloading import OffloadActivations

    return OffloadActivations  # a new one each step, as TRL uses it


def _offload_model(model: torch.nn.Module, **options: Any) -> Callable[[], Any]:
    import leakfree

    ctx = leakfree.offload_model(model, pin_memory_budget=predict.PINNED, **options)
    return lambda: ctx


def calibration(
    sim: _device.SimDevice, *, trl: bool = True, rates: timing.Rates = timing.H100
) -> dict[tuple[str, str], predict.Prediction]:
    """Every row of :data:`MEASURED` predicted (``trl``: TRL's rows too), leakfree's
    with the schedule the H100 run measured (:func:`predict.as_measured`)."""
    out: dict[tuple[str, str], predict.Prediction] = {}
    with predict.as_measured():
        for name, table in MEASURED.items():
            moved = None
            for mode in table.rows:
                if mode.startswith("trl") and not trl:
                    continue
                p = predict.predict(
                    sim,
                    _mode(name, mode, moved),
                    moved=moved,
                    warmup=_WARMUP.get(mode, 2),
                    rates=rates,
                    batch=table.batch,
                    intermediate=table.intermediate,
                )
                out[name, mode] = p
                if mode == "default":
                    moved = p.to_host
                elif mode == "offload_model":  # as the GPU suite did: what a fresh model's
                    moved = p.first_to_host  # first step moved, which its budget halved
    return out


# --- the fit ---------------------------------------------------------------------------------


def fit_flops(predicted: dict[tuple[str, str], predict.Prediction]) -> float:
    """The FLOP rate that best fits :data:`FITTED`'s step times (least squares of the log
    error, by golden-section search), replaying their predicted steps' timelines."""
    rows = []
    for key in FITTED:
        timeline = predicted[key].timeline
        assert math.isclose(timeline.replay(timeline.rates).end, timeline.end), key
        step_ms = MEASURED[key[0]].rows[key[1]].step_ms
        assert step_ms is not None, key
        rows.append((timeline, step_ms / 1e3))

    def loss(log_flops: float) -> float:
        total = 0.0
        for timeline, measured in rows:
            rates = dataclasses.replace(timeline.rates, flops=math.exp(log_flops))
            total += math.log(timeline.replay(rates).end / measured) ** 2
        return total

    golden = (math.sqrt(5) - 1) / 2
    low, high = math.log(1e14), math.log(2e15)
    a, b = high - golden * (high - low), low + golden * (high - low)
    loss_a, loss_b = loss(a), loss(b)
    for _ in range(32):  # the bracket shrinks to a millionth of a percent of the rate
        if loss_a < loss_b:
            high, b, loss_b = b, a, loss_a
            a = high - golden * (high - low)
            loss_a = loss(a)
        else:
            low, a, loss_a = a, b, loss_b
            b = low + golden * (high - low)
            loss_b = loss(b)
    return math.exp((low + high) / 2)


# --- the errors ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowError:
    """One row, predicted against measured; errors are predicted / measured - 1."""

    table: str
    mode: str
    fitted: bool
    measured: Measured
    ratio: float  #: predicted, to the table's predicted step without offloading
    step_ms: float
    activation_gib: float
    to_host_gib: float

    @property
    def ratio_error(self) -> float | None:
        return None if self.mode == "none" else self.ratio / self.measured.ratio - 1

    @property
    def step_error(self) -> float | None:
        m = self.measured.step_ms
        return None if m is None or not self.fitted else self.step_ms / m - 1

    @property
    def activation_error(self) -> float | None:
        m = self.measured.activation_gib
        return None if m is None else self.activation_gib / m - 1

    @property
    def to_host_error(self) -> float | None:
        m = self.measured.to_host_gib
        return None if m is None else self.to_host_gib / m - 1


def errors(predicted: dict[tuple[str, str], predict.Prediction]) -> list[RowError]:
    """Each predicted row of :data:`MEASURED` against its measurement."""
    out = []
    for (table, mode), p in predicted.items():
        out.append(
            RowError(
                table=table,
                mode=mode,
                fitted=(table, mode) in FITTED,
                measured=MEASURED[table].rows[mode],
                ratio=p.step / predicted[table, "none"].step,
                step_ms=p.step * 1e3,
                activation_gib=p.activation_peak / GiB,
                to_host_gib=p.to_host / GiB,
            )
        )
    return out


HEADERS = ("table", "mode", "row", "ratio meas.", "pred.", "error", "act. GiB meas.",
           "pred.", "error", "GiB out meas.", "pred.", "error")  # fmt: skip


def rows(found: list[RowError]) -> list[tuple[str, ...]]:
    """:data:`HEADERS`' rows: each row's numbers and errors (``-`` where not measured);
    a fitted row's error is its step time's."""

    def pct(e: float | None) -> str:
        return "-" if e is None else f"{e:+.1%}"

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    out = []
    for e in found:
        m = e.measured
        error = e.step_error if e.fitted else e.ratio_error
        ratio = (num(m.ratio, ".2f"), f"{e.ratio:.2f}", pct(error))
        peak = (num(m.activation_gib, ".2f"), f"{e.activation_gib:.2f}")
        sent = (num(m.to_host_gib, ".2f"), f"{e.to_host_gib:.2f}", pct(e.to_host_error))
        row = "fitted" if e.fitted else "held out"
        out.append((e.table, e.mode, row, *ratio, *peak, pct(e.activation_error), *sent))
    return out


def summary(found: list[RowError]) -> dict[str, float]:
    """The largest absolute error of each kind over the held-out rows (and the mean for
    the ratio), and the fitted rows' largest step-time error."""
    held = [e for e in found if not e.fitted]

    def worst(values: list[float | None]) -> float:
        return max((abs(v) for v in values if v is not None), default=0.0)

    ratios = [abs(e.ratio_error) for e in held if e.ratio_error is not None]
    return {
        "fitted step, worst": worst([e.step_error for e in found if e.fitted]),
        "held-out ratio, worst": worst([e.ratio_error for e in held]),
        "held-out ratio, mean": sum(ratios) / len(ratios) if ratios else 0.0,
        "held-out activation peak, worst": worst([e.activation_error for e in held]),
        "held-out bytes out, worst": worst([e.to_host_error for e in held]),
    }


def report(found: list[RowError]) -> str:
    """The errors as a plain table, then the summary (what the benchmarks print)."""
    table = [HEADERS, *rows(found)]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADERS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{k}: {v:.1%}" for k, v in summary(found).items()]
    return "\n".join(lines)
