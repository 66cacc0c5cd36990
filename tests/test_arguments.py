"""Every public constructor and function refuses a bad argument before any state changes,
with an error that names the argument (a ``TypeError`` or ``ValueError``: leakfree's own
checks raise one that is both).

One row per argument: the call, the arguments with one of them bad, and the name the
message must give. Calls that change state (hooks, patches, registries) are also checked
to have changed nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import leakfree
import leakfree.diagnostics as dg
import leakfree.pipeline as pl
import leakfree.scan as sc
from leakfree import _args
from leakfree.integrations._growth import WatchingCallback
from leakfree.testing import assert_no_leak


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))


def _output() -> torch.Tensor:
    return torch.ones(2, requires_grad=True) * 2


_HOST = {"force_host_copy": True}
_T = torch.ones(2)

#: (call, positional, keywords, the argument named): each row's arguments hold one bad value
ROWS: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], str]] = [
    # offloading
    *[
        (leakfree.OffloadActivations, (), {**_HOST, name: bad}, name)
        for name, bad in [
            ("use_pin_memory", "yes"),
            ("use_streams", 1),
            ("force_host_copy", None),
            ("min_offload_size", -1),
            ("max_fwd_stash_size", 0),
            ("prefetch_bytes", 1.5),
            ("device_budget", "1GB"),
            ("max_overhead", -0.1),
            ("max_overhead", "5%"),
            ("device_limit", 1.5),
            ("batch_bytes", None),
            ("keep_small", 1),
            ("pin_memory_budget", -5),
            ("device", "nope"),
        ]
    ],
    (leakfree.offload_model, ("not a module",), {}, "model"),
    (leakfree.offload_model, (_model(),), {"head": 3}, "head"),
    (leakfree.offload_model, (_model(),), {"head": "no.such"}, "head"),
    (leakfree.offload_model, (_model(),), {"no_offload": 3}, "no_offload"),
    (leakfree.offload_model, (_model(),), {"warn_if_no_head": "no"}, "warn_if_no_head"),
    (leakfree.offload_model, (_model(),), {**_HOST, "batch_bytes": -1}, "batch_bytes"),
    (leakfree.remove_offload_hooks, ("model",), {}, "model"),
    # losses
    (leakfree.LossLog, (["a"],), {"running": "yes"}, "running"),
    (leakfree.LossLog, (["a"],), {"device": 3}, "device"),
    (leakfree.LossLog, ("a",), {}, "keys"),
    (leakfree.LossLog(["a"]).reduce, (), {"clear": None}, "clear"),
    (leakfree.LossLog(["a"]).reduce, (3,), {}, "groups"),
    # functions
    (leakfree.release_after_backward, (_F,), {"attrs": 3}, "attrs"),
    (leakfree.release_after_backward, (3,), {}, "cls"),
    (leakfree.released_attributes, (3,), {}, "cls"),
    (leakfree.patch_functions, ("not a module!",), {}, "prefix"),
    (leakfree.patch_all, (), {"strict": "yes"}, "strict"),
    (leakfree.patch_all, (), {"no_such_integration": False}, "no_such_integration"),
    (leakfree.patches.get_original, (torch, 3), {}, "name"),
    (leakfree.patches.get_original, ("torch", "x"), {}, "owner"),
    (leakfree.patches.is_object_patched, (torch, 3), {}, "name"),
    # finders
    *[
        (leakfree.watch, (), {name: bad}, name)
        for name, bad in [
            ("warmup", -1),
            ("window", 2),
            ("sample_every", 0),
            ("floor", float("nan")),
            ("tolerance", "x"),
            ("device", "nope"),
            ("roots", 3),
            ("fallback", 0),
            ("on_finding", 3),
            ("owner", None),
        ]
    ],
    *[
        (dg.MemoryTracker, (), {name: bad}, name)
        for name, bad in [
            ("devices", 3),
            ("use_allocator", "yes"),
            ("sample_every", 0),
            ("seed", 1.5),
            ("rule", 3),
            ("roots", 3),
            ("microbatches", 1),
            ("sites", None),
            ("warn", "no"),
        ]
    ],
    *[
        (dg.Rule, (), {name: bad}, name)
        for name, bad in [("warmup", -1), ("window", 1.5), ("tolerance", -1.0), ("floor", "64 B")]
    ],
    (dg.StorageTracker, (), {"sites": "yes"}, "sites"),
    *[
        (dg.find_retained, (), {name: bad}, name)
        for name, bad in [
            ("names", 3),
            ("depth", -1),
            ("since", object()),
            ("everything", 1),
            ("sites", 3),
        ]
    ],
    (dg.fit_growth, (3,), {}, "values"),
    (dg.fit_growth, ([1, 2],), {"at": [0]}, "at"),
    *[
        (assert_no_leak, (fn,), {name: bad}, name)
        for fn in [lambda: None]
        for name, bad in [
            ("steps", 3),
            ("warmup", -1),
            ("tolerance", "x"),
            ("floor", -1),
            ("device", "nope"),
            ("roots", 3),
        ]
    ],
    (assert_no_leak, (3,), {}, "step_fn"),
    *[
        (WatchingCallback, (), {name: bad}, name)
        for name, bad in [
            ("warmup", -1),
            ("window", 0),
            ("tolerance", "x"),
            ("fail", "yes"),
            ("floor", "64 B"),
            ("sample_every", 0),
            ("device", "nope"),
            ("roots", 3),
            ("log", 1),
        ]
    ],
    # pipelines (each checked before the process group is looked for)
    (pl.send_forward, (3, 1), {}, "activation"),
    (pl.send_forward, (_T, "1"), {}, "dst"),
    (pl.send_forward, (_T, 1), {"pending": 3}, "pending"),
    (pl.send_forward, (_T, 1), {"then": 3}, "then"),
    (pl.send_backward, (3, 1), {}, "grad"),
    (pl.send_backward, (_T, -1), {}, "dst"),
    (pl.send_abort, ("1",), {}, "dst"),
    (pl.recv_forward, ("0",), {}, "src"),
    (pl.recv_forward, (0,), {"shape": 3}, "shape"),
    (pl.recv_forward, (0,), {"dtype": "float"}, "dtype"),
    (pl.recv_forward, (0,), {"device": "nope"}, "device"),
    (pl.recv_forward, (0,), {"pool": 3}, "pool"),
    (pl.recv_forward, (0,), {"callback": 3}, "callback"),
    (pl.recv_forward, (0,), {"timeout": 0}, "timeout"),
    (pl.recv_backward, (-1,), {}, "src"),
    (pl.recv_backward, (0,), {"timeout": "1"}, "timeout"),
    (pl.GradSlot, (3,), {}, "callback"),
    (pl.GradSlot, (), {"accumulate": "yes"}, "accumulate"),
    (pl.PipelineLosses, (3,), {}, "log"),
    (pl.release_output, (3,), {}, "y"),
    (pl.release_output, (_T.requires_grad_() * 2,), {"aliases": 3}, "aliases"),
    (
        pl.release_output,
        (torch.ones(2, requires_grad=True) * 2,),
        {"keep_shape": "y"},
        "keep_shape",
    ),
    (pl.as_nonleaf, (3, pl.GradSlot()), {}, "buf"),
    (pl.as_nonleaf, (torch.ones(2), 3), {}, "slot"),
    (pl.backward_from, (3, torch.ones(2)), {}, "handle"),
    # the scanner
    (sc.scan, (3,), {}, "paths"),
    (sc.scan, (["leakfree"],), {"select": 3}, "select"),
    (sc.scan, (["leakfree"],), {"ignore": [3]}, "ignore"),
    (sc.scan, (["leakfree"],), {"exclude": 3}, "exclude"),
    (sc.scan, (["leakfree"],), {"jobs": 0}, "jobs"),
    (sc.render, (3, "text"), {}, "result"),
    (sc.render, (sc.ScanResult(), "xml"), {}, "fmt"),
]


def _id(row: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], str]) -> str:
    call = getattr(row[0], "__qualname__", repr(row[0]))
    return f"{call}-{row[3]}"


@pytest.mark.parametrize(("call", "args", "kwargs", "name"), ROWS, ids=[_id(r) for r in ROWS])
def test_a_bad_argument_is_refused_naming_it(
    call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], name: str
) -> None:
    with pytest.raises((TypeError, ValueError)) as caught:
        call(*args, **kwargs)
    assert f"{name}=" in str(caught.value) or f"{name!r}" in str(caught.value), caught.value


def test_leakfree_s_own_checks_raise_an_error_that_is_both_kinds() -> None:
    with pytest.raises(TypeError, match=r"OffloadActivations\(use_pin_memory='yes'\)"):
        leakfree.OffloadActivations(use_pin_memory="yes", force_host_copy=True)
    with pytest.raises(ValueError, match=r"OffloadActivations\(use_pin_memory='yes'\)"):
        leakfree.OffloadActivations(use_pin_memory="yes", force_host_copy=True)
    assert issubclass(_args.ArgumentError, TypeError) and issubclass(
        _args.ArgumentError, ValueError
    )


def test_offload_model_refusing_an_argument_leaves_the_model_s_hooks_as_they_were() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    model.lm_head = nn.Linear(2, 2)
    leakfree.offload_model(model, **_HOST)
    hooks = dict(model.lm_head._forward_pre_hooks)
    assert hooks
    for bad in ({"head": "no.such"}, {"no_offload": [3]}, {"batch_bytes": -1}):
        with pytest.raises((TypeError, ValueError)):
            leakfree.offload_model(model, **_HOST, **bad)
        assert dict(model.lm_head._forward_pre_hooks) == hooks  # the first call's, still
    assert leakfree.remove_offload_hooks(model) == 2


def test_watch_refusing_an_argument_registers_nothing() -> None:
    from torch.optim.optimizer import _global_optimizer_post_hooks

    before = dict(_global_optimizer_post_hooks)
    with pytest.raises((TypeError, ValueError), match="owner="):
        leakfree.watch(owner=3)
    assert dict(_global_optimizer_post_hooks) == before
    assert torch._C._len_torch_dispatch_stack() == 0


def test_patch_all_refusing_an_argument_applies_nothing() -> None:
    before = [(r.name, r.outcome) for r in leakfree.patch_report()]
    with pytest.raises((TypeError, ValueError), match="strict="):
        leakfree.patch_all(strict="yes")
    assert [(r.name, r.outcome) for r in leakfree.patch_report()] == before
