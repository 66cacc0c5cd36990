"""The torchtune patch against the real torchtune (the version in the test extras) and a
tiny torchtune Llama 3 (component builder, random weights, nothing downloaded).

Without leakfree, torchtune's offloader cannot even be built on a machine without CUDA;
with ``patch_all()`` the same torchtune names train, with gradients equal to training
without offloading, nothing of a step left on the manager, and ``unpatch_all()`` puts
torchtune's objects back. Each scenario runs in a fresh interpreter (``run_py``): the
patch rebinds names in every imported module.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
from pathlib import Path
from textwrap import dedent
from typing import Any

import pytest
import torch

from tests._fresh import run_py

# find_spec, not importorskip: collecting the fast suite must not import torchtune (seconds)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtune") is None, reason="torchtune is in the test extras"
)

MODULE = "torchtune.training._activation_offloading"

TINY = """
import contextlib, json
import torch

SIZES = dict(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
             max_seq_len=16, intermediate_dim=64)

def tiny(builder, **extra):
    torch.manual_seed(0)
    return builder(**SIZES, **extra)

def batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(n)]

def loss_of(model, x):
    return model(x).float().logsumexp(-1).mean()

def train(model, make_ctx, steps=3):
    # plain SGD steps; the gradients of each step, cloned
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for x in batches(steps):
        opt.zero_grad(set_to_none=True)
        with make_ctx():
            loss = loss_of(model, x)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads

def same(a, b):
    return all(torch.equal(x, y) for ga, gb in zip(a, b) for x, y in zip(ga, gb))

def head_hooks(module):
    return len(module._forward_pre_hooks) + len(module._forward_hooks)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="torchtune's offloader works with CUDA")
def test_torchtune_offloader_fails_on_cpu_without_leakfree_and_when_opted_out() -> None:
    result = run_py(
        TINY
        + dedent(
            """
        import torchtune.training as training
        from torchtune.models.llama3 import llama3

        def attempt(make):
            try:
                make()
            except Exception as e:
                return f"{type(e).__name__}: {e}"
            return "built"

        model = tiny(llama3)
        original = training.OffloadActivations
        before = [attempt(training.OffloadActivations),
                  attempt(lambda: training.get_act_offloading_ctx_manager(model, True))]
        import leakfree
        leakfree.patch_all(torchtune=False)
        statuses = {r.name: f"{r.outcome}: {r.reason}" for r in leakfree.patch_report()
                    if r.integration == "torchtune"}
        opted_out = [attempt(training.OffloadActivations),
                     training.OffloadActivations is original]
        cuda = attempt(torch.cuda.default_stream)
        print(json.dumps(dict(before=before, statuses=statuses, opted_out=opted_out, cuda=cuda)))
        """
        )
    )
    # torchtune asks torch.cuda for its default stream in __init__ (on a CPU build of torch:
    # "AssertionError: Torch not compiled with CUDA enabled")
    assert result["cuda"] != "built"
    assert result["before"] == [result["cuda"]] * 2
    assert result["statuses"] == {
        "torchtune.offload_activations": "off: disabled by the caller",
        "torchtune.act_offloading_ctx_manager": "off: disabled by the caller",
    }
    assert result["opted_out"] == [result["cuda"], True]


@pytest.mark.parametrize("order", ["patch_first", "import_first"])
def test_patch_all_trains_a_tiny_torchtune_llama(order: str, tmp_path: Path) -> None:
    # a user module that imported torchtune's names before patch_all() is rebound too
    (tmp_path / "usercode.py").write_text(
        "from torchtune.training import OffloadActivations, get_act_offloading_ctx_manager\n"
    )
    patch = "import leakfree\nleakfree.patch_all()\n"
    imports = (
        "import torchtune.training as training\n"
        f"import {MODULE} as ao\n"
        "from torchtune.models.llama3 import llama3\n"
        "from torchtune.models.llama3_2 import llama3_2\n"
    )
    if order == "patch_first":
        prelude = patch + imports + "usercode = None\n"
    else:
        prelude = imports + "import usercode\n" + patch
    result = run_py(
        TINY
        + prelude
        + dedent(
            """
        import leakfree.patches.torchtune as adapter
        import leakfree.testing
        from leakfree.patches import get_original

        statuses = {r.name: str(r.outcome) for r in leakfree.patch_report()
                    if r.integration == "torchtune"}
        original = get_original(ao, "OffloadActivations")
        original_helper = get_original(ao, "get_act_offloading_ctx_manager")
        names = [training.OffloadActivations, ao.OffloadActivations]
        helpers = [training.get_act_offloading_ctx_manager, ao.get_act_offloading_ctx_manager]
        if usercode is not None:
            names.append(usercode.OffloadActivations)
            helpers.append(usercode.get_act_offloading_ctx_manager)
        everywhere = (all(n is adapter.OffloadActivations for n in names)
                      and all(h is adapter.get_act_offloading_ctx_manager for h in helpers))

        expected = train(tiny(llama3), contextlib.nullcontext)

        # torchtune's positional order: max_fwd_stash_size=5, then min_offload_size=0 (every
        # saved activation); force_host_copy: copy on this CPU-only machine too
        model = tiny(llama3)
        ctx = training.OffloadActivations(True, True, 5, 0, force_host_copy=True)
        offloaded = train(model, lambda: ctx)
        copies = ctx.pool.stats.allocations + ctx.pool.stats.reuses

        # the graph owns the host copies: alive with it, gone with it, backward or not
        x = batches(1)[0]
        with ctx:
            loss = loss_of(model, x)
        held = ctx.pool.stats.in_use_bytes
        loss.backward()
        after_backward = ctx.pool.stats.in_use_bytes
        with ctx:
            loss = loss_of(model, x)  # never backpropagated (an eval forward, a skipped step)
        del loss
        after_drop = ctx.pool.stats.in_use_bytes

        def step():
            with ctx:
                loss = loss_of(model, x)
            loss.backward()
            model.zero_grad(set_to_none=True)

        growth = leakfree.testing.assert_no_leak(step, steps=12, warmup=2)

        # what torchtune's recipes call: once per run, or per trainer built (hooks must not
        # pile up); on this machine it offloads nothing, and trains all the same
        recipe_model = tiny(llama3)
        for _ in range(3):
            recipe_ctx = training.get_act_offloading_ctx_manager(recipe_model, True)
        recipe = train(recipe_model, lambda: recipe_ctx)
        off = training.get_act_offloading_ctx_manager(recipe_model, False)
        tied = tiny(llama3_2, tie_word_embeddings=True)
        for _ in range(3):
            tied_ctx = training.get_act_offloading_ctx_manager(tied, True)

        result = dict(
            statuses=statuses,
            everywhere=everywhere,
            same=same(offloaded, expected),
            copies=copies,
            held=held,
            after_backward=after_backward,
            after_drop=after_drop,
            growth=growth.bytes_per_step,
            recipe_same=same(recipe, expected),
            recipe_kind=type(recipe_ctx).__module__,
            head_hooks=head_hooks(recipe_model.output),
            off=type(off).__name__,
            tied_hooks=head_hooks(tied.output.linear),
        )
        leakfree.unpatch_all()
        result["restored"] = (
            training.OffloadActivations is ao.OffloadActivations is original
            and training.get_act_offloading_ctx_manager is ao.get_act_offloading_ctx_manager
            is original_helper
            and original.__module__ == original_helper.__module__ == ao.__name__
            and (usercode is None or (usercode.OffloadActivations is original
                                      and usercode.get_act_offloading_ctx_manager
                                      is original_helper))
        )
        print(json.dumps(result))
        """
        ),
        tmp_path,
        timeout=300,
    )
    assert result["statuses"] == {
        "torchtune.offload_activations": "applied",
        "torchtune.act_offloading_ctx_manager": "applied",
    }
    assert result["everywhere"]
    assert result["copies"] > 0  # activations really went through host copies
    assert result["same"]  # bit-identical to training without offloading
    assert result["held"] > 0
    assert result["after_backward"] == 0
    assert result["after_drop"] == 0
    assert result["recipe_same"]
    assert result["recipe_kind"] == "leakfree.offload"
    assert result["head_hooks"] == 2  # torchtune's helper: 6 after three calls, unremovable
    assert result["off"] == "nullcontext"
    assert result["tied_hooks"] == 2  # a TiedLinear output: its .linear stays on the device
    assert result["restored"]


# --- the constructor adapter, against torchtune's own signature ------------------------------

NAMES = ("use_pin_memory", "use_streams", "max_fwd_stash_size", "min_offload_size")
#: none of them torchtune's default, so every misplaced value shows
VALUES = {
    "use_pin_memory": False,
    "use_streams": False,
    "max_fwd_stash_size": 3,
    "min_offload_size": 77,
}


def _torchtune_class() -> Any:
    from leakfree.patches import get_original

    module = importlib.import_module(MODULE)
    return get_original(module, "OffloadActivations")  # torchtune's, patched here or not


def _calls() -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Every way to pass the four: the first k positionally, any subset of the rest by
    keyword (31 calls)."""
    out = []
    for k in range(len(NAMES) + 1):
        args = tuple(VALUES[n] for n in NAMES[:k])
        rest = NAMES[k:]
        for r in range(len(rest) + 1):
            for chosen in itertools.combinations(rest, r):
                out.append((args, {n: VALUES[n] for n in chosen}))
    return out


def _configuration(ctx: Any) -> dict[str, Any]:
    return {n: getattr(ctx, n) for n in NAMES}


def test_adapter_maps_every_positional_and_keyword_call_as_torchtune_binds_it(
    accelerator: torch.device,
) -> None:
    from leakfree import OffloadActivations as Plain
    from leakfree.patches.torchtune import TORCHTUNE_PARAMETERS, OffloadActivations

    signature = inspect.signature(_torchtune_class())
    assert tuple(signature.parameters) == NAMES == TORCHTUNE_PARAMETERS
    calls = _calls()
    assert len(calls) == 31
    for args, kwargs in calls:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        expected = {n: bound.arguments[n] for n in NAMES}
        # on an accelerator (the simulated one without a GPU) use_streams and
        # use_pin_memory are kept as given
        got = _configuration(OffloadActivations(*args, **kwargs, device=accelerator))
        assert got == expected, (args, kwargs)
    # why the adapter exists: leakfree's own order reads torchtune's call the other way
    swapped = _configuration(Plain(True, True, 5, 1024, device=accelerator))
    assert (swapped["max_fwd_stash_size"], swapped["min_offload_size"]) == (1024, 5)


def test_adapter_defaults_and_none_streams_are_torchtune_s(accelerator: torch.device) -> None:
    from leakfree.patches.torchtune import OffloadActivations

    assert _configuration(OffloadActivations(device=accelerator)) == {
        "use_pin_memory": True,
        "use_streams": True,
        "max_fwd_stash_size": 5,
        "min_offload_size": 1024,
    }
    # torchtune 0.3.1 / 0.4.0: use_streams=None meant "streams when torch can"
    assert OffloadActivations(True, None, device=accelerator).use_streams is True


def test_adapter_refuses_what_torchtune_refuses_naming_the_argument() -> None:
    from leakfree.patches.torchtune import OffloadActivations

    signature = inspect.signature(_torchtune_class())
    with pytest.raises(TypeError):
        signature.bind(min_offload_bytes=0)
    with pytest.raises(TypeError, match=r"OffloadActivations\(min_offload_bytes=0\): no such"):
        OffloadActivations(min_offload_bytes=0)
    with pytest.raises(TypeError):
        signature.bind(True, True, 5, 1024, 7)
    with pytest.raises(TypeError, match="positional"):
        OffloadActivations(True, True, 5, 1024, 7)  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"max_fwd_stash_size=0"):
        OffloadActivations(True, True, 0)
