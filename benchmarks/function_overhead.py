"""leakfree.Function vs torch.autograd.Function: forward+backward time of the same op.

Two ops: a 1-element multiply (where per-call overhead dominates) and a 1024x1024 matmul
(where it should vanish). Samples are interleaved round by round in one process; the
ratio is the median of the per-round ratios, with its interquartile range and extremes.

    python benchmarks/function_overhead.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, print_table, write_json

import leakfree


def make_scale(base: type, *, with_tensor: bool) -> type:
    class Scale(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            if with_tensor:
                ctx.buf = x.new_empty(4)  # a tensor on ctx: leakfree releases it
            else:
                ctx.note = "scale"  # metadata: checked at apply and at release, then kept
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g * w, g * x

    return Scale


def make_ops(base: type) -> tuple[type, type, type]:
    class MatMul(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            ctx.shape = x.shape
            return x @ w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.T, x.T @ g

    return make_scale(base, with_tensor=False), make_scale(base, with_tensor=True), MatMul


def _step(op: type, x: torch.Tensor, w: torch.Tensor, backward: bool) -> Callable[[], None]:
    def step() -> None:
        y = op.apply(x, w)
        if backward:
            y.sum().backward()

    return step


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (CI smoke run)")
    parser.add_argument("--json", default=None, help="where to write the JSON result")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    plain_scale, plain_state, plain_mm = make_ops(torch.autograd.Function)
    lf_scale, lf_state, lf_mm = make_ops(leakfree.Function)

    cases = []
    x1 = torch.randn(1, requires_grad=True)
    w1 = torch.randn(1, requires_grad=True)
    number = 50 if args.quick else 500
    cases.append(("1-element mul", plain_scale, lf_scale, x1, w1, number, True))
    cases.append(("1-element mul, tensor on ctx", plain_state, lf_state, x1, w1, number, True))
    # Where the fixed cost sits: apply's output-on-ctx check alone (forward, no backward).
    cases.append(("1-element mul, forward only", plain_scale, lf_scale, x1, w1, number, False))
    xm = torch.randn(1024, 1024, requires_grad=True)
    wm = torch.randn(1024, 1024, requires_grad=True)
    cases.append(("1024x1024 matmul", plain_mm, lf_mm, xm, wm, 1 if args.quick else 10, True))

    rows, results = [], []
    for name, plain, lf, x, w, number, backward in cases:
        repeat = 5 if args.quick else (121 if number > 100 else 31)
        steps = {"plain": _step(plain, x, w, backward), "leakfree": _step(lf, x, w, backward)}
        t = compare(steps, repeat=repeat, number=number)
        ratio = t.ratio("leakfree", "plain")
        rows.append(
            (
                name,
                t["plain"],
                t["leakfree"],
                t["leakfree"] - t["plain"],
                ratio.median,
                f"{ratio.q1:.3f}-{ratio.q3:.3f}",
                f"{ratio.low:.3f}-{ratio.high:.3f}",
            )
        )
        results.append(
            {
                "op": name,
                "plain_us": t["plain"],
                "leakfree_us": t["leakfree"],
                "ratio": ratio.median,
                "ratio_spread": ratio.as_dict(),
            }
        )
    print_table(
        "forward+backward, median us per step (leakfree.Function vs torch.autograd.Function);"
        " ratio = median of per-round ratios",
        ["op", "plain us", "leakfree us", "extra us", "ratio", "IQR", "min-max"],
        rows,
    )
    payload = {
        "results": results,
        "goal": {"1-element mul": "ratio <= 1.05", "1-element mul, tensor on ctx": "ratio <= 1.05"},
    }
    write_json("function_overhead", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
