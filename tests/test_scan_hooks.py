"""LF004 (leakfree.scan.rules.hooks): pack hooks that return a key into a long-lived table."""

from __future__ import annotations

import textwrap

import pytest

from leakfree.scan._model import ScanFinding
from leakfree.scan.rules.hooks import RULES
from tests._scan import CASES, line_of, project_of, source

(RULE,) = RULES


def scan(text: str, *others: tuple[str, str]) -> list[ScanFinding]:
    src = source("case.py", text)
    return list(RULE.check(src, project_of(src, *(source(p, t) for p, t in others))))


def test_trl_tracker_flagged() -> None:
    text = (CASES / "trl_offload_leaky.py").read_text()
    found = scan(text)
    assert [(f.rule, f.line, f.symbol) for f in found] == [
        (
            "LF004",
            line_of(text, "self.tracker[tensor_id] = (activation, False)"),
            "OffloadActivations.tracker",
        ),
        ("LF004", line_of(text, "self.fwd_stash[tensor_id] ="), "OffloadActivations.fwd_stash"),
    ]
    assert "leakfree.offload.OffloadActivations" in found[0].message
    assert RULE.confirm == "leakfree.testing.assert_no_leak"


def test_handle_owning_payload_silent() -> None:
    assert scan((CASES / "trl_offload_fixed.py").read_text()) == []


def test_method_hooks_and_super_init() -> None:
    found = scan(
        """
        import torch

        class Stash(torch.autograd.graph.saved_tensors_hooks):
            def __init__(self):
                self.table = {}
                self.n = 0
                super().__init__(self.pack, self.unpack)

            def pack(self, t):
                self.n += 1
                key = self.n
                self.table[key] = t.cpu()
                return key

            def unpack(self, key):
                return self.table.pop(key).cuda()
        """
    )
    assert [(f.line, f.symbol) for f in found] == [(13, "Stash.table")]


def test_global_table_and_push_default_hooks() -> None:
    found = scan(
        """
        import itertools, torch
        _STORE = {}
        _IDS = itertools.count()

        def pack(t):
            k = next(_IDS)
            _STORE[k] = t
            return k

        def unpack(k):
            return _STORE.pop(k)

        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        """
    )
    assert [(f.line, f.symbol) for f in found] == [(8, "_STORE")]


def test_closure_table_keyword_and_tuple_key() -> None:
    found = scan(
        """
        from torch.autograd.graph import saved_tensors_hooks

        def offloading():
            store = {}
            def pack(t):
                k = len(store)
                store[k] = t.to("cpu", non_blocking=True)
                return (t.device, k)
            return saved_tensors_hooks(pack_hook=pack, unpack_hook=lambda p: store.pop(p[1]))
        """
    )
    assert [(f.line, f.symbol) for f in found] == [(8, "offloading.store")]


def test_partial_bound_table() -> None:
    found = scan(
        """
        import functools
        import torch

        def pack(table, t):
            table[id(t)] = t
            return id(t)

        table = {}
        hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(pack, table), None)
        """
    )
    assert [(f.line, f.symbol) for f in found] == [(6, "pack.table")]


def test_helper_followed_across_files() -> None:
    helper = """
    class Manager:
        def __init__(self):
            self.payloads = {}
            self.counter = 0

        def offload(self, t):
            self.counter += 1
            self.payloads[self.counter] = t.detach().cpu()
            return self.counter
    """
    found = scan(
        """
        from torch.autograd.graph import saved_tensors_hooks

        def hooks(manager):
            def pack(t):
                return manager.offload(t)
            return saved_tensors_hooks(pack, manager.restore)
        """,
        ("manager.py", helper),
    )
    assert [(f.path, f.line, f.symbol) for f in found] == [("manager.py", 9, "Manager.payloads")]


SILENT = {
    "metadata and weak references only": """
        class Meta(saved_tensors_hooks):
            def __init__(self):
                self.meta = {}
                self.seen = {}
                self.n = 0
                def pack(t):
                    self.n += 1
                    self.meta[self.n] = (t.shape, t.dtype, t.device, t.numel(), t.stride())
                    self.seen[self.n] = weakref.ref(t)
                    return self.n
                super().__init__(pack, lambda k: None)
    """,
    "weak table keyed by a graph-owned handle": """
        class Weak(saved_tensors_hooks):
            def __init__(self):
                self.original = weakref.WeakKeyDictionary()
                def pack(t):
                    handle = object()
                    self.original[handle] = t
                    return handle
                super().__init__(pack, lambda h: self.original[h])
    """,
    "table local to the hook": """
        def local_pack(t):
            table = {}
            table[0] = t
            return 0

        hooks = saved_tensors_hooks(local_pack, None)
    """,
    "returns the tensor itself": """
        class Cache(saved_tensors_hooks):
            def __init__(self):
                self.cache = {}
                def pack(t):
                    self.cache[id(t)] = t
                    return t
                super().__init__(pack, lambda t: t)
    """,
    "stores a key, returns the payload's owner": """
        class Owner(saved_tensors_hooks):
            def __init__(self):
                self.by_id = {}
                def pack(t):
                    box = [t.cpu()]
                    self.by_id[len(self.by_id)] = len(box)
                    return box
                super().__init__(pack, lambda b: b[0])
    """,
    "lambda hooks": """
        hooks = saved_tensors_hooks(lambda t: t.cpu(), lambda t: t.cuda())
    """,
    "the same body, never registered as a hook": """
        class Cache:
            def __init__(self):
                self.table = {}
            def put(self, t):
                self.table[len(self.table)] = t
                return len(self.table) - 1
        hooks = saved_tensors_hooks(print, print)
    """,
}


@pytest.mark.parametrize("case", SILENT, ids=list(SILENT))
def test_not_this_shape_silent(case: str) -> None:
    header = "import weakref\nfrom torch.autograd.graph import saved_tensors_hooks\n"
    assert scan(header + textwrap.dedent(SILENT[case])) == []


# --- offloaders that key a list by index or store through dict.update ---------------------


def test_a_list_stash_returning_the_index_is_flagged() -> None:
    text = """
        import torch
        from torch.autograd.graph import saved_tensors_hooks

        class ListOffload(saved_tensors_hooks):
            def __init__(self):
                self.stash = []

                def pack(t):
                    self.stash.append(t.cpu())
                    return len(self.stash) - 1

                def unpack(i):
                    return self.stash[i].cuda()

                super().__init__(pack, unpack)
    """
    (f,) = scan(text)
    assert (f.symbol, f.line) == ("ListOffload.stash", line_of(text, "self.stash.append"))
    # returning the tensor itself after recording it is not the shape
    assert scan(text.replace("return len(self.stash) - 1", "return t")) == []


def test_a_dict_update_store_is_flagged() -> None:
    text = """
        from torch.autograd.graph import saved_tensors_hooks

        class DictOffload(saved_tensors_hooks):
            def __init__(self):
                self.table = {}
                self.n = 0

                def pack(t):
                    self.n += 1
                    key = self.n
                    self.table.update({key: t.to("cpu", non_blocking=True)})
                    return key

                super().__init__(pack, lambda key: self.table.pop(key))
    """
    (f,) = scan(text)
    assert f.symbol == "DictOffload.table"


def test_trl_1_16_and_1_3_are_told_apart_by_how_long_the_entry_stays() -> None:
    # TRL 1.16 (and torchtune) clear the tables in __enter__ (from TRL 1.5); TRL 1.3 has no
    # __enter__: an entry of a graph freed without backward stays for the manager's life
    text = (CASES / "trl_offload_leaky.py").read_text()
    new = scan(text)[0].message
    assert "until __enter__ clears it at the next `with` block" in new
    head, _, _ = text.partition("    def __enter__(self):")
    old = scan(head)[0].message
    assert "for the manager's life" in old and "__enter__" not in old
