"""LossLog vs the hand-written patterns, 4096 microbatches x 4 keys, in one run.

Reports:
  * bytes retained after the step by the logged losses: a plain dict of non-detached
    losses (the bug) vs LossLog, with a loss Function that keeps a context on ctx;
  * device-to-host syncs: LossLog.reduce() vs `.item()` per microbatch per key;
  * append cost: LossLog vs `lst.append(t.detach())` (list level) and vs
    `d[key].append(t.detach())` (dict level), list and running mode;
  * on an accelerator: wall time of the whole logging step vs the per-item pattern.

    python benchmarks/losslog.py [--microbatches N] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import StorageWatch, Timings, compare, print_table, write_json

import leakfree
from leakfree._shapes import context_loss
from leakfree.diagnostics import count_host_syncs

KEYS = ("lm", "z_loss", "aux", "total")


def _loss_function(watch: StorageWatch) -> Any:
    return context_loss(1024, watch.watch)  # 4 KiB kept per microbatch


def retained_bytes(microbatches: int, device: torch.device) -> dict[str, int]:
    out = {}
    for name in ("plain dict", "LossLog"):
        watch = StorageWatch()
        fn = _loss_function(watch)
        log: Any = {k: [] for k in KEYS} if name == "plain dict" else leakfree.LossLog(list(KEYS))
        w = torch.randn(8, device=device, requires_grad=True)
        for _ in range(microbatches):
            loss = fn.apply(w * 1.0)
            loss.backward()
            for k in KEYS:
                log[k].append(loss)  # the call site forgets .detach()
        del loss  # only the container may hold anything now
        gc.collect()
        out[name] = watch.live_bytes()
        del log
    return out


def host_syncs(microbatches: int, device: torch.device) -> dict[str, int]:
    values = [torch.rand((), device=device) for _ in range(microbatches)]
    with count_host_syncs() as per_item:
        floats: dict[str, float] = {k: 0.0 for k in KEYS}
        for v in values:
            for k in KEYS:
                floats[k] += v.item()  # the common pattern
    log = leakfree.LossLog(list(KEYS))
    for v in values:
        for k in KEYS:
            log[k].append(v)
    with count_host_syncs() as lf:
        log.reduce()
    return {"per-item .item()": per_item.count, "LossLog.reduce": lf.count}


def append_cost(microbatches: int, device: torch.device, repeat: int) -> Timings:
    values = [torch.rand((), device=device, requires_grad=True) * 1.0 for _ in range(microbatches)]

    def plain_list() -> None:
        lst: list[torch.Tensor] = []
        for v in values:
            lst.append(v.detach())

    def lf_list() -> None:
        lst = leakfree.LossLog(["lm"])["lm"]
        for v in values:
            lst.append(v)

    def plain_dict() -> None:
        d: dict[str, list[torch.Tensor]] = {"lm": []}
        for v in values:
            d["lm"].append(v.detach())

    def lf_dict() -> None:
        log = leakfree.LossLog(["lm"])
        for v in values:
            log["lm"].append(v)

    def lf_running() -> None:
        log = leakfree.LossLog(["lm"], running=True)
        for v in values:
            log["lm"].append(v)

    t = compare(
        {
            "plain list": plain_list,
            "LossLog list": lf_list,
            "plain dict": plain_dict,
            "LossLog dict": lf_dict,
            "LossLog running": lf_running,
        },
        repeat=repeat,
        number=1,
    )
    return Timings({k: [x / microbatches for x in v] for k, v in t.samples.items()})


def wall_time(microbatches: int, device: torch.device, repeat: int) -> dict[str, float]:
    """Logging-step wall time on an accelerator, where .item() waits for the device."""
    sync = torch.get_device_module(device).synchronize
    x = torch.randn(4096, 4096, device=device)

    def step(use_log: bool) -> float:
        log = leakfree.LossLog(list(KEYS))
        floats = dict.fromkeys(KEYS, 0.0)
        sync()
        t0 = time.perf_counter()
        for _ in range(microbatches // 64):  # device work between logs, as in training
            y = (x @ x).mean()
            for k in KEYS:
                if use_log:
                    log[k].append(y)
                else:
                    floats[k] += y.item()
        if use_log:
            log.reduce()
        sync()
        return (time.perf_counter() - t0) * 1e3

    res = {"per-item .item() ms": [], "LossLog ms": []}
    for _ in range(repeat):
        res["per-item .item() ms"].append(step(False))
        res["LossLog ms"].append(step(True))
    return {k: sorted(v)[len(v) // 2] for k, v in res.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="fewer samples (CI smoke run)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    n = args.microbatches
    device = (
        torch.accelerator.current_accelerator() or torch.device("cpu")
        if torch.accelerator.is_available()
        else torch.device("cpu")
    )
    repeat = 5 if args.quick else 41

    retained = retained_bytes(n, device)
    print_table(
        f"bytes retained after {n} microbatches x {len(KEYS)} keys "
        "(the loss Function keeps 4 KiB on ctx)",
        ["container", "bytes retained"],
        list(retained.items()),
    )
    syncs = host_syncs(n, device)
    print_table(
        "device-to-host syncs for one step's logging", ["pattern", "syncs"], list(syncs.items())
    )
    cost = append_cost(n, device, repeat)
    pairs = [
        ("list level", "plain list", "LossLog list"),
        ("dict level", "plain dict", "LossLog dict"),
        ("dict level, running", "plain dict", "LossLog running"),
    ]
    rows = []
    for call, base, ours in pairs:
        r = cost.ratio(ours, base)
        rows.append(
            (
                call,
                cost[base],
                cost[ours],
                r.median,
                f"{r.q1:.2f}-{r.q3:.2f}",
                f"{r.low:.2f}-{r.high:.2f}",
            )
        )
    print_table(
        "append cost, us per append (baseline: .append(t.detach())); ratio = median of "
        "per-round ratios",
        ["call", "baseline us", "LossLog us", "ratio", "IQR", "min-max"],
        rows,
    )
    payload: dict[str, Any] = {
        "microbatches": n,
        "keys": len(KEYS),
        "retained_bytes": retained,
        "host_syncs": syncs,
        "append_us": dict(cost),
        "append_ratio": {r[0]: r[3] for r in rows},
        "append_ratio_spread": {c: cost.ratio(o, b).as_dict() for c, b, o in pairs},
        "goal": {"dict level": "ratio <= 1.3"},
    }
    if device.type != "cpu":
        wt = wall_time(n, device, 5)
        print_table(f"logging step wall time on {device}", ["pattern", "ms"], list(wt.items()))
        payload["wall_time_ms"] = wt
    else:
        print("\n(no accelerator: wall time vs per-item .item() is measured on GPU only)")
    write_json("losslog", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
