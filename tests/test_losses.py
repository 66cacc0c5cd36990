"""LossLog and detach_tree: nothing with a graph gets in, reductions are exact and unbiased."""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import pickle
import sys
import threading
import types
import weakref
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leakfree
from leakfree._shapes import context_loss
from leakfree.diagnostics import count_host_syncs
from leakfree.losses import RunningLoss, _check
from tests._functions import parking

# --- the real leak shape: a loss from a Function whose ctx holds a big tensor -----------------


_contexts: list[weakref.ref[torch.Tensor]] = []
#: Fast-LLM's shape: the loss Function keeps a 256 KiB context on ctx.
ContextLoss: Any = context_loss(64 * 1024, lambda t: ContextLoss.refs.append(weakref.ref(t)))
ContextLoss.refs = _contexts


def _microbatches(losses: Any, n: int = 8) -> None:
    w = torch.randn(16, requires_grad=True)
    for _ in range(n):
        loss = ContextLoss.apply(w * torch.randn(16))
        loss.backward()
        losses["lm"].append(loss)  # the call site forgets .detach()


def test_plain_dict_keeps_every_microbatch_context(no_gc: None) -> None:
    ContextLoss.refs = []
    losses: dict[str, list[torch.Tensor]] = {"lm": []}
    _microbatches(losses)
    assert sum(r() is not None for r in ContextLoss.refs) == 8  # the leak
    assert all(t.grad_fn is not None for t in losses["lm"])


def test_losslog_keeps_none(no_gc: None) -> None:
    ContextLoss.refs = []
    losses = leakfree.LossLog(["lm"])
    _microbatches(losses)
    assert sum(r() is not None for r in ContextLoss.refs) == 0  # fixed
    assert len(losses["lm"]) == 8
    assert all(t.grad_fn is None and not t.requires_grad for t in losses["lm"])


# --- every entry path detaches ----------------------------------------------------------------


def _graphy() -> torch.Tensor:
    return (torch.randn(3, requires_grad=True) * 2).sum()


ENTRY_PATHS = {
    "append": lambda log, v: log["a"].append(v),
    "extend": lambda log, v: log["a"].extend([v, v]),
    "insert": lambda log, v: log["a"].insert(0, v),
    "iadd": lambda log, v: log.__setitem__("a", log["a"].__iadd__([v])),
    "iadd_operator": None,  # below: real `+=` syntax
    "assign": lambda log, v: log.__setitem__("a", [v, 2.0]),
    "index_assign": lambda log, v: (log["a"].append(1.0), log["a"].__setitem__(0, v)),
    "slice_assign": lambda log, v: log["a"].__setitem__(slice(0, None), [v]),
    "update": lambda log, v: log.update({"a": [v]}),
    "update_kwargs": lambda log, v: log.update(a=[v]),
    "setdefault": lambda log, v: log.setdefault("a", []).append(v),
    "constructor_list": lambda log, v: log.__setitem__("a", (x for x in [v])),
}


POSITIONAL = ("insert", "index_assign", "slice_assign")  # no positions in running mode


@pytest.mark.parametrize(
    ("path", "running"),
    [(p, False) for p in sorted(ENTRY_PATHS)]
    + [(p, True) for p in sorted(ENTRY_PATHS) if p not in POSITIONAL],
)
def test_every_entry_path_detaches(path: str, running: bool) -> None:
    log = leakfree.LossLog(["a"], running=running)
    v = _graphy()
    if path == "iadd_operator":
        log["a"] += [v]
    else:
        ENTRY_PATHS[path](log, v)
    if running:
        assert log["a"].sum is not None and not log["a"].sum.requires_grad
        assert log["a"]._pending == [] or all(
            not (isinstance(t, torch.Tensor) and t.requires_grad) for t in log["a"]._pending
        )
    else:
        assert len(log["a"]) >= 1
        for item in log["a"]:
            assert not isinstance(item, torch.Tensor) or (
                item.grad_fn is None and not item.requires_grad
            )


def test_mul_copy_pickle_stay_detached() -> None:
    log = leakfree.LossLog(["a"])
    log["a"].append(_graphy())
    log["a"] *= 2
    assert len(log["a"]) == 2
    assert all(t.grad_fn is None for t in log["a"])
    assert type(copy.copy(log["a"])) is list
    assert all(t.grad_fn is None for t in pickle.loads(pickle.dumps(log["a"])))


def test_parameter_and_leaf_requiring_grad_are_detached() -> None:
    log = leakfree.LossLog(["a"])
    p = torch.nn.Parameter(torch.tensor(1.5))
    log["a"].append(p)
    assert type(log["a"][0]) is torch.Tensor and not log["a"][0].requires_grad


def test_view_of_big_tensor_is_not_pinned(no_gc: None) -> None:
    log = leakfree.LossLog(["a"])
    per_sample = torch.randn(1 << 16)
    r = weakref.ref(per_sample.untyped_storage())
    log["a"].append(per_sample[3])
    value = per_sample[3].item()
    del per_sample
    assert r() is None  # the log holds a 1-element copy, not the 256 KiB storage
    assert log["a"][0].item() == value


def test_python_numbers_accepted() -> None:
    log = leakfree.LossLog({"a": "sum"})
    log["a"].append(1)
    log["a"].append(2.5)
    log["a"].append(torch.tensor(0.5))
    assert log.reduce() == {"a": 4.0}


def test_dict_behaviour() -> None:
    log = leakfree.LossLog(["lm", "z_loss"])
    log["lm"].append(torch.tensor(1.0))
    assert list(log) == ["lm", "z_loss"]
    assert list(log.keys()) == ["lm", "z_loss"]
    assert [k for k, _ in log.items()] == ["lm", "z_loss"]
    assert len(log) == 2 and len(log["lm"]) == 1 and len(log["z_loss"]) == 0
    assert "lm" in log and "other" not in log
    assert isinstance(log["lm"], list)
    assert repr(log) == "{'lm': [tensor(1.)], 'z_loss': []}"  # as the dict it replaces
    assert isinstance(log, dict) and log.copy() == {"lm": [log["lm"][0]], "z_loss": []}
    assert log.reductions == {"lm": "mean", "z_loss": "mean"}
    log.clear()
    assert len(log["lm"]) == 0 and list(log) == ["lm", "z_loss"]


# --- bad input: clear errors, nothing stored --------------------------------------------------


def test_unknown_key_lists_declared() -> None:
    log = leakfree.LossLog(["lm", "z_loss"])
    with pytest.raises(KeyError, match=r"'aux' is not a declared loss; declared: 'lm', 'z_loss'"):
        log["aux"].append(1.0)
    with pytest.raises(KeyError, match="declared"):
        log["aux"] = [1.0]
    with pytest.raises(TypeError, match="keys are fixed"):
        del log["lm"]


@pytest.mark.parametrize("running", [False, True])
def test_multi_element_tensor_rejected_naming_key_and_shape(running: bool) -> None:
    log = leakfree.LossLog(["lm"], running=running)
    with pytest.raises(ValueError, match=r"LossLog\['lm'\].*shape \(2, 3\)"):
        log["lm"].append(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        log["lm"].extend([torch.tensor(1.0), torch.ones(4)])  # the good one is not stored
    assert len(log["lm"]) == 0
    with pytest.raises(ValueError, match="shape"):
        log["lm"] = [1.0, torch.ones(2)]
    assert len(log["lm"]) == 0


def test_mixed_devices_rejected() -> None:
    log = leakfree.LossLog(["a", "b"])
    log["a"].append(torch.tensor(1.0))
    meta = torch.empty((), device="meta")
    with pytest.raises(
        ValueError, match=r"LossLog\['b'\]: tensor on meta, but this log's tensors are on cpu"
    ):
        log["b"].append(meta)
    fresh = leakfree.LossLog(["a"])
    with pytest.raises(ValueError, match="tensor on meta"):
        fresh["a"].extend([torch.tensor(1.0), meta])
    assert len(fresh["a"]) == 0 and fresh.device is None
    pinned = leakfree.LossLog(["a"], device="meta")
    with pytest.raises(ValueError, match="tensor on cpu, but this log's tensors are on meta"):
        pinned["a"].append(torch.tensor(1.0))


@pytest.mark.parametrize("bad", ["x", None, True, 1 + 2j, [1.0]])
def test_non_numbers_rejected(bad: Any) -> None:
    log = leakfree.LossLog(["a"])
    with pytest.raises(TypeError, match=r"LossLog\['a'\]"):
        log["a"].append(bad)
    assert len(log["a"]) == 0


def test_bad_constructor_arguments() -> None:
    with pytest.raises(
        ValueError, match=r"unknown reduction 'avg' for key 'lm'.*sum, mean, min, max"
    ):
        leakfree.LossLog({"lm": "avg"})
    with pytest.raises(TypeError, match=r"pass a list of names"):
        leakfree.LossLog("lm")
    with pytest.raises(ValueError, match="duplicate"):
        leakfree.LossLog(["a", "a"])
    with pytest.raises(ValueError, match="at least one key"):
        leakfree.LossLog([])


def test_running_mode_rejects_positional_operations() -> None:
    log = leakfree.LossLog(["a"], running=True)
    with pytest.raises(TypeError, match="running mode"):
        log["a"].insert(0, 1.0)
    with pytest.raises(TypeError, match="running mode"):
        log["a"][0]


def test_reduce_without_distributed_but_with_groups() -> None:
    log = leakfree.LossLog(["a"])
    log["a"].append(1.0)
    with pytest.raises(RuntimeError, match="not initialized"):
        log.reduce(groups=[None])
    assert len(log["a"]) == 1  # nothing cleared


# --- reductions -------------------------------------------------------------------------------


VALUES = {
    "s": [1.5, -2.0, 4.25, 0.125],
    "m": [3.0, 5.0, -1.0],
    "lo": [2.0, -7.5, 3.0],
    "hi": [2.0, -7.5, 3.0, 11.0],
}
SPEC = {"s": "sum", "m": "mean", "lo": "min", "hi": "max", "empty": "mean"}


@pytest.mark.parametrize("running", [False, True])
def test_reduce_matches_hand_computation(running: bool) -> None:
    log = leakfree.LossLog(SPEC, running=running)
    for k, vs in VALUES.items():
        for v in vs:
            log[k].append(torch.tensor(v, requires_grad=True) * 1.0)
    with count_host_syncs() as syncs:
        out = log.reduce(clear=False)
    assert syncs.count == 1
    assert out["s"] == sum(VALUES["s"])
    assert out["m"] == sum(VALUES["m"]) / 3
    assert out["lo"] == min(VALUES["lo"])
    assert out["hi"] == max(VALUES["hi"])
    assert math.isnan(out["empty"])
    assert list(out) == list(SPEC)
    again = log.reduce()  # clear=False kept the values: the same result
    assert {k: v for k, v in again.items() if k != "empty"} == {
        k: v for k, v in out.items() if k != "empty"
    }
    assert all(len(log[k]) == 0 for k in log)


def test_reduce_clears_unless_told_not_to() -> None:
    log = leakfree.LossLog(["a"])
    log["a"].append(2.0)
    assert log.reduce(clear=False) == {"a": 2.0}
    assert len(log["a"]) == 1
    assert log.reduce() == {"a": 2.0}
    assert len(log["a"]) == 0


def test_running_mode_is_constant_size_and_exact() -> None:
    log = leakfree.LossLog({"a": "mean", "b": "max"}, running=True)
    for i in range(1000):
        log["a"].append(torch.tensor(float(i)))
        log["b"].append(torch.tensor(float(i % 17)))
        assert len(log["a"]._pending) < RunningLoss.FOLD
    assert len(log["a"]) == 1000
    assert log["a"].count == 1000 and log["a"].sum.item() == sum(range(1000))
    out = log.reduce()
    assert out == {"a": 499.5, "b": 16.0}


def test_one_host_sync_however_many_keys_and_microbatches() -> None:
    keys = {f"k{i}": ("sum", "mean", "min", "max")[i % 4] for i in range(12)}
    log = leakfree.LossLog(keys)
    for _ in range(200):
        for k in keys:
            log[k].append(torch.rand(()))
    with count_host_syncs() as syncs:
        log.reduce()
    assert syncs.count == 1


# --- detach_tree ------------------------------------------------------------------------------


class Pair(NamedTuple):
    a: torch.Tensor
    b: Any


@dataclasses.dataclass(frozen=True)
class Out:
    loss: torch.Tensor
    extras: dict[str, Any]
    derived: torch.Tensor | None = dataclasses.field(default=None, init=False)


def test_detach_tree() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    out = Out(y.sum(), {"logits": [y, (y, 3)], "pair": Pair(y, "s"), "set": {1}})
    object.__setattr__(out, "derived", y)
    od = collections.OrderedDict(z=y)
    tree = {"out": out, "od": od, "n": None, "x": x}
    d = leakfree.detach_tree(tree)
    assert type(d["out"]) is Out and type(d["od"]) is collections.OrderedDict
    assert type(d["out"].extras["pair"]) is Pair and d["out"].extras["pair"].b == "s"
    tensors = [
        d["out"].loss,
        d["out"].derived,
        d["out"].extras["logits"][0],
        d["out"].extras["logits"][1][0],
        d["out"].extras["pair"].a,
        d["od"]["z"],
        d["x"],
    ]
    assert all(t.grad_fn is None and not t.requires_grad for t in tensors)
    assert torch.equal(d["out"].extras["logits"][0], y)
    assert d["out"].extras["logits"][1][1] == 3 and d["out"].extras["set"] == {1}
    # originals untouched
    assert out.loss.grad_fn is not None and tree["x"].requires_grad


def test_detach_tree_frees_graph(no_gc: None) -> None:
    y = parking(numel=1000).apply(torch.randn(3, requires_grad=True))
    r = weakref.ref(y.grad_fn.big)
    logged = leakfree.detach_tree({"y": [y]})
    del y
    assert r() is None
    assert logged["y"][0].shape == (3,)


# --- two processes, gloo on 127.0.0.1 ---------------------------------------------------------


def test_dict_mutation_paths_are_guarded() -> None:
    log = leakfree.LossLog(["a", "b"])
    with pytest.raises(KeyError, match="declared"):
        log.update({"a": [1.0], "zzz": [2.0]})
    assert len(log["a"]) == 0  # nothing replaced: the unknown key was found first
    with pytest.raises(ValueError, match="shape"):
        log.update(a=[1.0], b=[torch.ones(3)])
    assert len(log["a"]) == 0 and len(log["b"]) == 0
    log |= {"a": [_graphy()]}
    assert log["a"][0].grad_fn is None
    for op in (lambda: log.pop("a"), log.popitem, lambda: log.__delitem__("a")):
        with pytest.raises(TypeError, match="keys are fixed"):
            op()
    assert log.setdefault("b") is log["b"]
    clone = pickle.loads(pickle.dumps(log))
    assert type(clone) is leakfree.LossLog and clone.reductions == log.reductions
    assert torch.equal(clone["a"][0], log["a"][0])


# --- drop-in promises that broke on real code -------------------------------------------------


@pytest.mark.parametrize("how", ["detach", "data", "view"])
@pytest.mark.parametrize("running", [False, True], ids=["list", "running"])
def test_detached_view_does_not_pin_the_storage(how: str, running: bool, no_gc: None) -> None:
    """`per_sample[3].detach()` and `.data` have `_base is None` yet share the whole storage:
    the log decides by storage size."""
    log = leakfree.LossLog(["lm"], running=running)
    per_sample = torch.randn(1 << 16)
    storage = weakref.ref(per_sample.untyped_storage())
    value = {"detach": per_sample[3].detach(), "data": per_sample[3].data, "view": per_sample[3]}
    log["lm"].append(value[how])
    expected = per_sample[3].item()
    del per_sample, value
    assert storage() is None  # the log holds a one-element copy, not the 256 KiB storage
    assert log.reduce() == {"lm": pytest.approx(expected)}


def test_own_scalar_is_stored_without_a_copy() -> None:
    """The fast path: a fresh 0-d loss is stored as a detached alias (no clone)."""
    log = leakfree.LossLog(["lm"])
    loss = torch.randn(3, requires_grad=True).sum()
    log["lm"].append(loss)
    assert log["lm"][0].data_ptr() == loss.data_ptr() and log["lm"][0].grad_fn is None


def _filled(running: bool) -> leakfree.LossLog:
    log = leakfree.LossLog({"lm": "mean", "lo": "min", "hi": "max", "n": "sum"}, running=running)
    for i in range(100):  # more than one fold in running mode
        for key in log:
            log[key].append(torch.tensor(float(i % 7) - 2.5))
    log["n"].append(3)  # a Python number too
    return log


@pytest.mark.parametrize("running", [False, True], ids=["list", "running"])
@pytest.mark.parametrize(
    "how",
    ["copy.copy", "copy.deepcopy", "pickle", "method"],
)
def test_copies_round_trip_exactly_and_are_independent(running: bool, how: str) -> None:
    log = _filled(running)
    make = {
        "copy.copy": copy.copy,
        "copy.deepcopy": copy.deepcopy,
        "pickle": lambda x: pickle.loads(pickle.dumps(x)),
        "method": lambda x: x.copy(),
    }[how]
    clone = make(log)
    assert type(clone) is leakfree.LossLog and clone.running == running
    assert clone.reductions == log.reductions and clone.device == log.device
    expected = log.reduce(clear=False)
    assert clone.reduce(clear=False) == expected  # exact, not approximate
    assert not any(math.isnan(v) for v in expected.values())
    # independent: appending to one changes nothing in the other
    clone["lm"].append(torch.tensor(1000.0))
    clone["hi"].append(torch.tensor(1000.0))
    assert log.reduce(clear=False) == expected
    if running:
        assert clone["lm"] is not log["lm"] and clone["lm"]._acc is not log["lm"]._acc
    log.clear()
    assert clone.reduce()["hi"] == 1000.0


def test_running_entry_alone_copies_and_pickles() -> None:
    log = _filled(True)
    entry = log["lm"]
    for clone in (copy.copy(entry), copy.deepcopy(entry), pickle.loads(pickle.dumps(entry))):
        assert len(clone) == len(entry)
        assert torch.equal(clone.sum, entry.sum) and torch.equal(clone.max, entry.max)


@pytest.mark.parametrize("running", [False, True], ids=["list", "running"])
def test_threads_append_each_value_once(running: bool) -> None:
    """8 threads appending 1.0 at once: the first version double-counted in running mode.
    The interpreter switches threads every microsecond here instead of every 5 ms, and ten
    short rounds replace one long one: each round catches a missing lock about half the
    time, so ten miss it about once in a thousand runs (one round of 160,000 appends at
    the default interval caught it about half the time, in ten times as long)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(10):
            log = leakfree.LossLog({"lm": "mean", "n": "sum"}, running=running)
            _append_from_threads(log, threads=8, each=1_000)
            assert len(log["n"]) == 8_000
            assert log.reduce() == {"lm": 1.0, "n": 8_000.0}
    finally:
        sys.setswitchinterval(interval)


def _append_from_threads(log: leakfree.LossLog, threads: int, each: int) -> None:
    one = torch.tensor(1.0)
    barrier = threading.Barrier(threads)

    def work() -> None:
        barrier.wait(timeout=30)
        for _ in range(each):
            log["lm"].append(one)
            log["n"].append(one)

    started = [threading.Thread(target=work) for _ in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join(timeout=120)


@pytest.mark.parametrize("running", [False, True], ids=["list", "running"])
def test_in_place_update_after_append_is_an_error_not_a_wrong_number(running: bool) -> None:
    """`total += x` logged each step: every entry aliased `total`, so the history was
    rewritten. Now a value modified after append raises at reduce, naming key and position."""
    log = leakfree.LossLog({"total": "max"}, running=running)
    total = torch.zeros(())
    log["total"].append(total)  # version 0: stored as an alias
    total += 5.0
    with pytest.raises(ValueError, match=r"LossLog\['total'\]: the value at position 0 .*clone"):
        log.reduce()


def test_value_already_modified_is_copied_so_running_totals_log_correctly() -> None:
    log = leakfree.LossLog({"total": "sum"})
    total = torch.zeros(())
    for x in (1.0, 2.0, 3.0):
        total += x  # version moves before each append: the log stores a copy
        log["total"].append(total)
    assert log.reduce() == {"total": 1.0 + 3.0 + 6.0}


def test_parameter_updated_by_the_optimizer_after_append_is_an_error() -> None:
    w = torch.nn.Parameter(torch.tensor(1.0))
    opt = torch.optim.SGD([w], lr=0.5)
    log = leakfree.LossLog(["w"])
    log["w"].append(w)
    (w * 2).backward()
    opt.step()
    with pytest.raises(ValueError, match=r"LossLog\['w'\].*position 0.*append\(x\.clone\(\)\)"):
        log.reduce()
    log = leakfree.LossLog(["w"])
    log["w"].append(w.clone())  # the documented fix
    opt.step()
    assert log.reduce() == {"w": 0.0}


class _Point(NamedTuple):
    x: torch.Tensor
    y: Any


@pytest.mark.parametrize(
    "make",
    [
        lambda t: collections.defaultdict(list, {"a": [t]}),
        lambda t: collections.OrderedDict([("a", t), ("b", [t])]),
        lambda t: collections.ChainMap({"a": t}, {"b": t}),
        lambda t: types.MappingProxyType({"a": t}),
        lambda t: collections.deque([t, {"k": t}], maxlen=5),
        lambda t: _Point(t, [t]),
        lambda t: collections.Counter({"a": 1}),
    ],
    ids=[
        "defaultdict",
        "OrderedDict",
        "ChainMap",
        "MappingProxyType",
        "deque",
        "namedtuple",
        "Counter",
    ],
)
def test_detach_tree_rebuilds_each_type_with_its_state(make: Any) -> None:
    t = torch.randn(2, requires_grad=True) * 2
    obj = make(t)
    out = leakfree.detach_tree(obj)
    assert type(out) is type(obj)
    leaves: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            leaves.append(x)
        elif isinstance(x, (dict, types.MappingProxyType, collections.ChainMap)):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple, collections.deque)):
            for v in x:
                walk(v)

    walk(out)
    assert all(leaf.grad_fn is None for leaf in leaves)
    assert len(leaves) == (0 if isinstance(obj, collections.Counter) else len(leaves))
    if isinstance(obj, collections.defaultdict):
        assert out.default_factory is list and out["missing"] == []
    if isinstance(obj, collections.ChainMap):
        assert len(out.maps) == 2 and out["b"].grad_fn is None
    if isinstance(obj, collections.deque):
        assert out.maxlen == 5
    if isinstance(obj, types.MappingProxyType):
        assert out["a"].grad_fn is None


def test_detach_tree_refuses_what_it_cannot_rebuild() -> None:
    class Frozen(collections.abc.Mapping):  # type: ignore[type-arg]
        def __init__(self, data: dict[str, Any]) -> None:
            self._data = data

        def __getitem__(self, k: str) -> Any:
            return self._data[k]

        def __iter__(self) -> Any:
            return iter(self._data)

        def __len__(self) -> int:
            return len(self._data)

    with pytest.raises(TypeError, match=r"detach_tree: cannot rebuild a .*Frozen"):
        leakfree.detach_tree({"outer": Frozen({"a": torch.ones(1, requires_grad=True) * 2})})


def test_reduce_uploads_nothing_from_the_host() -> None:
    """On a device, `torch.tensor(python_list, device=...)` is a blocking upload: reduce
    must make identities and counts on the device. The meta device stands in for one here:
    every operation runs but the final copy to the host, so the counter sees all that
    reduce does before its one transfer."""
    log = leakfree.LossLog({"a": "mean", "b": "min", "c": "max", "d": "sum"}, device="meta")
    for key in "abc":
        log[key].append(torch.empty((), device="meta"))
    log["d"].append(2.5)  # a Python number on a device log
    with count_host_syncs() as syncs, pytest.raises(NotImplementedError):
        log.reduce(clear=False)
    assert dict(syncs.ops) == {"to_host": 1}


def test_count_host_syncs_counts_every_blocking_operation() -> None:
    x = torch.tensor([1.0, -2.0, 3.0])
    cases: dict[str, Any] = {
        "_local_scalar_dense": lambda: x.sum().item(),
        "to_host": lambda: x.to("cpu", copy=True),
        "from_host": lambda: torch.ones(3).to("meta"),  # pageable (nothing is pinned here)
        "nonzero": lambda: x.nonzero(),
        "masked_select": lambda: x.masked_select(x > 0),
        "_unique2": lambda: torch.unique(x),
        "mask_indexing": lambda: x[x > 0],
        "repeat_interleave": lambda: torch.repeat_interleave(x, torch.tensor([1, 2, 1])),
        "cpu.synchronize": lambda: torch.cpu.synchronize(),
    }
    for name, op in cases.items():
        with count_host_syncs() as syncs:
            op()
        assert dict(syncs.ops) == {name: 1}, name
    with count_host_syncs() as syncs:
        torch.tensor([1.0, 2.0], device="meta")  # built on the host, uploaded below aten
        torch.as_tensor([1.0], device="meta")
    assert dict(syncs.ops) == {"from_host": 2}
    with count_host_syncs() as syncs:  # none of these waits
        torch.repeat_interleave(x, torch.tensor([1, 2, 1]), output_size=4)
        torch.full((3,), 1.0, device="meta")
        torch.zeros(3, device="meta").nonzero_static(size=2)  # a static shape: no wait
        torch.tensor([1.0, 2.0])  # stays on the host
    assert syncs.count == 0, dict(syncs.ops)
    assert torch.cpu.synchronize.__module__ != __name__  # restored after the block
    assert "wait" not in repr(torch.cpu.synchronize)


def test_reduce_groups_bad_groups_name_the_argument_before_any_change() -> None:
    log = leakfree.LossLog(["lm"])
    log["lm"].append(torch.tensor(2.0))
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized"):
        log.reduce(groups=(None,), clear=False)  # a group named: needs a process group
    for bad in (5, "dp", object()):
        with pytest.raises(TypeError, match=r"LossLog.reduce\(groups=.*expected a sequence"):
            log.reduce(groups=bad, clear=False)
    assert log.reduce() == {"lm": 2.0}  # nothing was cleared by the failed calls


def _collectives(call: Any) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return sum(1 for e in prof.events() if e.name == "gloo:all_reduce")


def test_plain_reduce_is_the_default_group_and_empty_groups_this_process() -> None:
    """``groups`` has one meaning, which processes take part: a plain ``reduce()`` is the
    default group once torch.distributed is initialised (before, it never communicated,
    however many ranks there were), ``()`` is this process alone."""
    import torch.distributed as dist

    from tests._dist import free_port

    log = leakfree.LossLog({"lm": "mean", "best": "min", "worst": "max"})
    for k in log:
        log[k].append(torch.tensor(2.0))
    assert log.reduce(clear=False) == dict.fromkeys(log, 2.0)  # uninitialised: this process
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        assert _collectives(lambda: log.reduce(clear=False)) == 3  # sum, min, max
        assert _collectives(lambda: log.reduce(groups=(None, None), clear=False)) == 6
        assert _collectives(lambda: log.reduce(groups=(), clear=False)) == 0
        assert log.reduce() == dict.fromkeys(log, 2.0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("device", "match"),
    [
        ("cdua", r"LossLog\(device='cdua'\): not a device"),
        ("cuda:9", r"LossLog\(device='cuda:9'\): there is no cuda device"),
        (3.5, r"LossLog\(device=3.5\): not a device"),
    ],
)
def test_unavailable_or_misspelled_device_fails_at_construction(device: Any, match: str) -> None:
    if torch.cuda.is_available() and device == "cuda:9":
        match = r"LossLog\(device='cuda:9'\): this machine has \d+ cuda"
    with pytest.raises(ValueError, match=match):
        leakfree.LossLog(["lm"], device=device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sync debug mode)")
def test_reduce_syncs_once_on_cuda_by_cudas_own_account() -> None:
    """The authoritative check: CUDA's sync debug mode warns at every synchronising call."""
    import warnings

    log = leakfree.LossLog({"a": "mean", "b": "min", "c": "max", "d": "sum"}, device="cuda")
    for i in range(100):
        for key in "abc":
            log[key].append(torch.full((), float(i), device="cuda"))
    log["d"].append(2.5)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = log.reduce()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert out == {"a": 49.5, "b": 0.0, "c": 99.0, "d": 2.5}


# --- resumable: state_dict, load_state_dict, torch.load's defaults -------------------------


def _values(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand((), generator=g, requires_grad=True) * 3 for _ in range(n)]


@pytest.mark.parametrize("running", [False, True])
def test_a_run_resumed_mid_accumulation_reduces_to_the_same_floats(running: bool) -> None:
    import io

    keys = {"lm": "mean", "aux": "sum", "best": "min"}
    first, second = _values(0, 70), _values(1, 9)  # 70 > RunningLoss.FOLD: folded and pending
    whole = leakfree.LossLog(keys, running=running)
    for v in first + second:
        for k in keys:
            whole[k].append(v)
    before = leakfree.LossLog(keys, running=running)
    for v in first:
        for k in keys:
            before[k].append(v)
    buf = io.BytesIO()
    torch.save({"step": 70, "losses": before.state_dict()}, buf)
    buf.seek(0)
    checkpoint = torch.load(buf)  # the default: weights_only=True
    resumed = leakfree.LossLog(keys, running=running)
    resumed.load_state_dict(checkpoint["losses"])
    for v in second:
        for k in keys:
            resumed[k].append(v)
    assert resumed.reduce() == whole.reduce()


def test_load_state_dict_refuses_a_different_log_before_changing_anything() -> None:
    log = leakfree.LossLog({"lm": "mean", "aux": "sum"})
    log["lm"].append(torch.tensor(1.0))
    other = leakfree.LossLog({"lm": "mean", "aux": "max"}).state_dict()
    with pytest.raises(ValueError, match="key 'aux' differs"):
        log.load_state_dict(other)
    with pytest.raises(ValueError, match="key 'extra' differs"):
        wider = leakfree.LossLog({"lm": "mean", "aux": "sum", "extra": "sum"})
        log.load_state_dict(wider.state_dict())
    running = leakfree.LossLog({"lm": "mean", "aux": "sum"}, running=True).state_dict()
    with pytest.raises(ValueError, match="the state is running mode, this log is list mode"):
        log.load_state_dict(running)
    with pytest.raises(TypeError, match="expected the dict LossLog.state_dict"):
        log.load_state_dict({"lm": [1.0]})
    bad = leakfree.LossLog({"lm": "mean", "aux": "sum"}, running=True)
    state = bad.state_dict()
    state["values"]["lm"] = {"count": 3, "folded": 0, "pending": [], "acc": None}
    with pytest.raises(ValueError, match="counts 3 values but holds 0 folded and 0 pending"):
        bad.load_state_dict(state)
    assert [float(v) for v in log["lm"]] == [1.0] and list(log["aux"]) == []


def test_state_dict_is_plain_data_and_shares_no_accumulator() -> None:
    log = leakfree.LossLog(["lm"], running=True)
    log["lm"].extend(_values(2, 65))
    state = log.state_dict()
    assert set(state) == {"reductions", "running", "device", "fixed_device", "values"}
    acc = state["values"]["lm"]["acc"]
    log["lm"].extend(_values(3, 64))  # folds into the live accumulator
    assert not torch.equal(acc, log["lm"]._fold())  # the state kept its own copy
    assert all(t.grad_fn is None for t in state["values"]["lm"]["pending"])


def test_a_list_mode_copy_or_checkpoint_refuses_a_value_rewritten_in_place() -> None:
    """Review: the check meant for copies of list-mode logs was dead code, so a copy (or a
    checkpoint) laundered a value modified after it was appended; running mode checked."""
    log = leakfree.LossLog(["lm"])
    total = torch.zeros(())
    log["lm"].append(total)
    total.add_(1.0)  # a running total appended without .clone()
    for copy_of in (copy.copy, copy.deepcopy, pickle.dumps, leakfree.LossLog.state_dict):
        with pytest.raises(ValueError, match="modified in place after it was appended"):
            copy_of(log)


# --- the per-microbatch fast path stores only what the full check stores ------------------

_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]
_SHAPES = [(), (1,), (1, 1), (2,), (0,)]
_HOWS = ["plain", "leaf", "graph", "view_of_big", "detached_view", "modified", "sparse"]
_NUMBERS = st.one_of(
    st.floats(allow_nan=False), st.integers(-(2**40), 2**40), st.booleans(), st.complex_numbers()
)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], how: str, device: torch.device) -> Any:
    t = torch.ones(shape, dtype=dtype, device=device)
    if how == "leaf" and (dtype.is_floating_point or dtype.is_complex):
        t.requires_grad_()
    elif how == "graph" and (dtype.is_floating_point or dtype.is_complex):
        t = t.requires_grad_() * 2
    elif how in ("view_of_big", "detached_view"):
        big = torch.ones((4, *shape), dtype=dtype, device=device)
        t = big[1] if how == "view_of_big" else big[1].detach()
    elif how == "modified":
        t.copy_(t.clone())  # moves the version counter
    elif how == "sparse" and device.type == "cpu" and t.dim():
        t = t.to_sparse()
    return t


def _stored(entry: Any, value: Any) -> Any:
    try:
        entry.append(value)
    except (TypeError, ValueError) as e:
        return type(e)
    return entry[-1]


def _same_storing(by_log: Any, by_check: Any, value: Any) -> None:
    if isinstance(by_check, type) or isinstance(by_log, type):
        assert by_log is by_check
        return
    assert type(by_log) is type(by_check)
    if not isinstance(by_check, torch.Tensor):
        assert by_log == by_check
        return
    assert by_log.requires_grad is by_check.requires_grad is False and by_log.grad_fn is None
    assert (by_log.dtype, by_log.shape, by_log.device) == (
        by_check.dtype,
        by_check.shape,
        by_check.device,
    )
    assert by_log.layout == by_check.layout
    if by_check.layout == torch.strided:  # a copy by both, or an alias by both
        ptr = value.untyped_storage().data_ptr()
        aliases = by_check.untyped_storage().data_ptr() == ptr
        assert (by_log.untyped_storage().data_ptr() == ptr) is aliases
    if by_check.device.type != "meta":
        assert torch.equal(by_log.cpu().to_dense(), by_check.cpu().to_dense())


@settings(
    max_examples=200,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_every_value_the_log_stores_is_one_the_full_check_stores(sim: Any, data: Any) -> None:
    """Over value kinds, dtypes, shapes and devices (the log's and the value's), appending
    stores exactly what ``_check`` would store, or raises what it raises; a refused value
    leaves the log as it was, and it keeps reducing."""
    devices = [torch.device("cpu"), torch.device("meta"), sim.device]
    log_device = data.draw(st.sampled_from(devices), label="log device")
    if data.draw(st.booleans(), label="tensor"):
        value = _tensor(
            data.draw(st.sampled_from(_DTYPES), label="dtype"),
            data.draw(st.sampled_from(_SHAPES), label="shape"),
            data.draw(st.sampled_from(_HOWS), label="how"),
            data.draw(st.sampled_from(devices), label="device"),
        )
    else:
        value = data.draw(st.one_of(_NUMBERS, st.sampled_from(["1.0", None, [1.0]])))
    log = leakfree.LossLog(["lm"], device=log_device)
    log["lm"].append(torch.zeros((), device=log_device))  # the log holds one tensor already
    try:
        by_check = _check("lm", value, log_device)
    except (TypeError, ValueError) as e:
        by_check = type(e)
    by_log = _stored(log["lm"], value)
    _same_storing(by_log, by_check, value)
    if isinstance(by_log, type):
        assert len(log["lm"]) == 1  # refused: nothing stored
        if log_device.type != "meta":
            assert log.reduce() == {"lm": 0.0}


def test_a_complex_scalar_is_refused_by_a_log_that_holds_a_tensor_and_it_keeps_reducing() -> None:
    log = leakfree.LossLog(["lm"])
    log["lm"].append(torch.tensor(2.0))
    with pytest.raises(TypeError, match=r"LossLog\['lm'\]: complex"):
        log["lm"].append(torch.tensor(1 + 1j))
    assert len(log["lm"]) == 1
    assert log.reduce() == {"lm": 2.0}


# --- the all-reduce is waited for, within the timeout: a second rank simulated in-process ------


class _PeerWork(torch.distributed._Work):  # type: ignore[name-defined, misc]
    """The other rank's side of one all-reduce, applied when (and only when) this rank
    waits for it, as a real collective's result is only there after ``wait()``."""

    def __init__(self, tensor: torch.Tensor, op: Any, peer: Any) -> None:
        super().__init__()
        self.tensor, self.op, self.peer = tensor, op, peer

    def wait(self, timeout: Any = None) -> bool:
        ops = torch.distributed.ReduceOp
        name = "sum" if self.op == ops.SUM else "min" if self.op == ops.MIN else "max"
        theirs = self.peer(name, timeout)
        if name == "sum":
            self.tensor.add_(theirs)
        elif name == "min":
            torch.minimum(self.tensor, theirs, out=self.tensor)
        else:
            torch.maximum(self.tensor, theirs, out=self.tensor)
        return True


class _PeerGroup(torch.distributed.ProcessGroup):  # type: ignore[misc]
    """A process group of two ranks in one process: rank 1 is simulated by ``peer``,
    which returns its contribution to a collective (or raises, as a rank that never
    joins makes the wait time out)."""

    peer: Any = None

    def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
        super().__init__(rank, size)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return _PeerWork(tensors[0], opts.reduceOp, _PeerGroup.peer)

    def getBackendName(self) -> str:
        return "leakfree-peer"


@pytest.fixture
def peer_rank() -> Any:
    dist = torch.distributed
    if "leakfree-peer" not in dist.Backend.backend_list:
        dist.Backend.register_backend("leakfree-peer", _PeerGroup, devices=["cpu"])
    dist.init_process_group("leakfree-peer", store=dist.HashStore(), rank=0, world_size=2)
    try:
        yield _PeerGroup
    finally:
        _PeerGroup.peer = None
        dist.destroy_process_group()


def test_reduce_waits_for_the_other_ranks_contribution(peer_rank: Any) -> None:
    """The results are read after the collective completes: without the wait they would
    be this rank's alone."""
    mine = leakfree.LossLog({"lm": "mean", "low": "min", "high": "max"})
    theirs = leakfree.LossLog({"lm": "mean", "low": "min", "high": "max"})
    for log, values in ((mine, (1.0, 3.0)), (theirs, (5.0, 7.0, 9.0))):
        for v in values:
            for key in log:
                log[key].append(torch.tensor(v))
    packs = theirs._local_packs(list(theirs))  # what rank 1 all-reduces, by op
    peer_rank.peer = lambda op, timeout: packs[op]
    assert mine.reduce() == {"lm": 5.0, "low": 1.0, "high": 9.0}  # over both ranks' 5 values


def test_reduce_names_the_group_a_rank_never_joined_within_its_timeout(peer_rank: Any) -> None:
    def never(op: Any, timeout: Any) -> torch.Tensor:
        assert timeout.total_seconds() == 0.5  # the bounded wait, not the group's 30 minutes
        raise RuntimeError("Wait timeout: the peer never joined")

    peer_rank.peer = never
    log = leakfree.LossLog(["lm"])
    log["lm"].append(torch.tensor(1.0))
    with pytest.raises(TimeoutError, match=r"default process group \(2 ranks\).*0\.5 s"):
        log.reduce(timeout=0.5)
    assert len(log["lm"]) == 1  # not cleared after an error
