"""Run a function in N processes with torch.distributed over gloo on 127.0.0.1, bounded in time.

Each worker gets (rank, world_size, out_dir, *args); it writes what it wants to check as
JSON to out_dir/rank{r}.json, which run_workers returns. Workers must be module-level
functions (the ranks import them by name).

The ranks are forked from the test session's fork server (tests/_fresh.py), which has
imported torch and nothing else: a fresh interpreter state, like a spawned process, without
paying torch's import once per rank (about 2 s of CPU each, with ``torch._dynamo``, which
an optimizer step imports). The server's environment is the one it started with, so each
rank takes the caller's environment, as a spawned process would.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._fresh import START_METHOD, adopt_environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    port: int,
    out: str,
    args: Any,
    barrier: bool,
    environ: dict[str, str],
) -> None:
    adopt_environment(environ)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The ranks share the machine's cores: intra-op threads beyond each rank's share only
    # spin against each other (a 2-rank pipeline step ran 5x slower on 2 cores).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result = fn(rank, world, *args)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        if barrier:
            dist.barrier()  # nobody tears down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    tmp: Path,
    *args: Any,
    timeout: float = 120.0,
    barrier: bool = True,
) -> list[Any]:
    """``barrier=False`` for workers that leave the group broken on purpose (a timed-out
    receive closes gloo's connection to that peer)."""
    port = free_port()
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, port, str(tmp), args, barrier, dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method=START_METHOD,
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__}: workers still running after {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world_size)]
