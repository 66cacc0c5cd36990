"""patch_all / unpatch_all / patch_report against Transformer Engine stand-ins and real TRL.

Every scenario runs in a fresh interpreter: patches and post-import hooks are
process-global, and "patch first, import later" needs an import that has not happened.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests._fresh import run_py
from tests.standins.transformer_engine_factory import build, location

ROOT = Path(__file__).resolve().parents[1]
TE_PATCHES = [
    "fuser",
    "fused_attention",
    "cp_attention_p2p",
    "cp_attention_a2a",
    "grouped_linear",
    "linear",
    "layernorm_linear",
    "layernorm_mlp",
]

# Exercise every stand-in Function: is its quantized storage object (and the restored
# buffers inside it) still alive after backward, while the output (and graph) is alive?
PROBE = """
import importlib, json, sys, warnings, weakref
import torch
from torch.multiprocessing.reductions import StorageWeakRef
LOCATIONS = {locations}

def probe():
    out = {{}}
    for name, (module, cls_name) in LOCATIONS.items():
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            continue
        x = torch.randn(4, 8, requires_grad=True)
        w = torch.randn(8, 3, requires_grad=True)
        y = cls.apply(x, w)
        node = y.grad_fn
        obj = weakref.ref(node.tensor_objects[0])
        data = StorageWeakRef(node.saved_tensors[0].untyped_storage())
        op_ctx = weakref.ref(node.basic_op_ctxs[0]) if hasattr(node, "basic_op_ctxs") else None
        y.sum().backward()
        out[name] = {{
            "leaks": obj() is not None or not data.expired(),
            "op_ctx_kept": None if op_ctx is None else op_ctx() is not None,
        }}
        del y, node
    return out
"""


def te_script(version: str, *parts: str) -> str:
    """The probe for ``version``'s layout, then ``parts`` (each dedented on its own)."""
    locations = {p: location(p, version) for p in TE_PATCHES}
    return PROBE.format(locations=repr(locations)) + "".join(
        textwrap.dedent(part) for part in parts
    )


@pytest.fixture(scope="module")
def te(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("te")
    return {v: build(base / v, v) for v in ("2.0.0", "2.1.0", "2.13.0", "2.15.0")}


def statuses(report: list[dict[str, Any]]) -> dict[str, str]:
    """Each Transformer Engine patch's outcome, by its short name."""
    return {
        r["name"].split(".", 1)[1]: r["outcome"]
        for r in report
        if r["integration"] == "transformer_engine"
    }


REPORT = """
def report():
    return [dict(name=r.name, integration=r.integration, outcome=r.outcome, reason=r.reason,
                 detail=r.detail, version=r.version) for r in leakfree.patch_report()]
"""


def test_te_unpatched_leaks_patched_frees_unpatch_restores(te: dict[str, Path]) -> None:
    result = run_py(
        te_script(
            "2.13.0",
            """
            import leakfree
            """,
            REPORT,
            """
            before = probe()
            originals = {n: importlib.import_module(m).__dict__[c].__dict__["backward"]
                         for n, (m, c) in LOCATIONS.items()
                         if hasattr(importlib.import_module(m), c)}
            leakfree.patch_all()   # modules already imported: applied at once
            after = probe()
            leakfree.unpatch_all()
            restored = all(importlib.import_module(m).__dict__[c].__dict__["backward"]
                           is originals[n] for n, (m, c) in LOCATIONS.items() if n in originals)
            again = probe()
            print(json.dumps(dict(before=before, after=after, again=again,
                                  restored=restored, report=report())))
            """,
        ),
        te["2.13.0"],
    )
    affected = [
        "fuser",
        "fused_attention",
        "cp_attention_p2p",
        "cp_attention_a2a",
        "grouped_linear",
    ]
    for name in affected:
        assert result["before"][name]["leaks"], name  # the leak exists unpatched
        assert not result["after"][name]["leaks"], name  # gone patched
        assert result["again"][name]["leaks"], name  # back after unpatch_all
    for name in ("linear", "layernorm_linear", "layernorm_mlp"):  # fixed upstream in 2.1
        assert not result["before"][name]["leaks"]
    assert result["restored"]
    assert set(statuses(result["report"]).values()) <= {"reverted", "skipped"}


def test_te_lazy_patch_in_a_fresh_process(te: dict[str, Path]) -> None:
    result = run_py(
        te_script(
            "2.13.0",
            """
            import leakfree
            """,
            REPORT,
            """
            leakfree.patch_all()
            not_imported = not any(m.startswith("transformer_engine") for m in sys.modules)
            pending = report()
            leaks = probe()             # imports the modules now: hooks apply the patches
            print(json.dumps(dict(not_imported=not_imported, pending=pending,
                                  applied=report(), leaks=leaks)))
            """,
        ),
        te["2.13.0"],
    )
    assert result["not_imported"]  # patch_all() itself imports no TE module
    pending = statuses(result["pending"])
    assert pending["fused_attention"] == "pending import"
    assert pending["linear"] == "skipped"  # 2.13 is not affected (fixed in 2.1)
    applied = statuses(result["applied"])
    for name in (
        "fuser",
        "fused_attention",
        "cp_attention_p2p",
        "cp_attention_a2a",
        "grouped_linear",
    ):
        assert applied[name] == "applied", name
        assert not result["leaks"][name]["leaks"], name
    why = {r["name"]: (r["reason"], r["detail"]) for r in result["applied"]}
    assert why["transformer_engine.linear"] == ("version not affected", "fixed in 2.1")


@pytest.mark.parametrize(
    ("version", "expect_applied"),
    [
        (
            "2.0.0",
            {
                "fused_attention",
                "cp_attention_p2p",
                "cp_attention_a2a",
                "grouped_linear",
                "linear",
                "layernorm_linear",
                "layernorm_mlp",
            },
        ),
        ("2.1.0", {"fused_attention", "cp_attention_p2p", "cp_attention_a2a", "grouped_linear"}),
        ("2.15.0", set()),
    ],
)
def test_te_versions(te: dict[str, Path], version: str, expect_applied: set[str]) -> None:
    result = run_py(
        te_script(
            version,
            """
            import leakfree
            """,
            REPORT,
            """
            leakfree.patch_all()
            leaks = probe()
            print(json.dumps(dict(report=report(), leaks=leaks)))
            """,
        ),
        te[version],
    )
    st = statuses(result["report"])
    assert {n for n, s in st.items() if s == "applied"} == expect_applied
    assert not any(v["leaks"] for v in result["leaks"].values())  # nothing leaks, anywhere
    if version == "2.15.0":
        assert all(s == "skipped" for s in st.values())


def test_te_fixed_upstream_detected_by_code_even_when_forced(te: dict[str, Path]) -> None:
    result = run_py(
        te_script(
            "2.15.0",
            """
            import leakfree
            """,
            REPORT,
            """
            with warnings.catch_warnings():
                warnings.simplefilter("error")   # already fixed is not a warning
                leakfree.patch_all(transformer_engine="always")
                probe()
            print(json.dumps(report()))
            """,
        ),
        te["2.15.0"],
    )
    reasons = {r["name"]: r["reason"] for r in result}
    assert reasons["transformer_engine.fused_attention"] == "already fixed upstream"
    assert reasons["transformer_engine.fuser"] == "already fixed upstream"


@pytest.mark.parametrize("version", ["2.13.0", "2.15.0"])
def test_te_fuser_hardening_releases_per_op_contexts(te: dict[str, Path], version: str) -> None:
    """Before and after upstream's tensor_objects fix (2.14): no release clears the fuser's
    per-op contexts, so the hardening applies on both sides of it."""
    result = run_py(
        te_script(
            version,
            """
            import leakfree
            leakfree.patch_all()
            plain = probe()["fuser"]
            leakfree.unpatch_all()
            leakfree.patch_all(transformer_engine="harden")
            hardened = probe()["fuser"]
            print(json.dumps(dict(plain=plain, hardened=hardened)))
            """,
        ),
        te[version],
    )
    assert not result["plain"]["leaks"] and result["plain"]["op_ctx_kept"]
    assert not result["hardened"]["leaks"] and not result["hardened"]["op_ctx_kept"]


def test_te_target_not_found_warns_and_skips_or_raises_when_strict(
    te: dict[str, Path], tmp_path: Path
) -> None:
    broken = build(tmp_path / "broken", "2.13.0")
    (broken / "transformer_engine/pytorch/module/grouped_linear.py").write_text(
        "class SomethingElse:\n    pass\n"
    )
    code = """
        import json, warnings
        import leakfree
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            leakfree.patch_all()
            import transformer_engine.pytorch.module.grouped_linear
        rec = leakfree.patch_report()["transformer_engine.grouped_linear"]
        leakfree.unpatch_all()
        strict = None
        import transformer_engine.pytorch.module.grouped_linear as m2
        try:
            leakfree.patch_all(strict=True)
        except RuntimeError as e:
            strict = str(e)
        print(json.dumps(dict(outcome=rec.outcome, reason=rec.reason, detail=rec.detail,
            strict=strict,
            warned=[str(w.message) for w in caught
                    if issubclass(w.category, leakfree.PatchWarning)])))
    """
    result = run_py(code, broken)
    assert (result["outcome"], result["reason"]) == ("skipped", "target not found")
    assert "grouped_linear" in result["detail"]
    assert any("grouped_linear" in w and "target not found" in w for w in result["warned"])
    assert result["strict"] is not None and "target not found" in result["strict"]


def test_idempotent_and_thread_safe(te: dict[str, Path]) -> None:
    result = run_py(
        te_script(
            "2.13.0",
            """
            import threading
            import leakfree
            from leakfree.function import _ORIGINAL
            probe()
            threads = [threading.Thread(target=leakfree.patch_all) for _ in range(8)]
            for t in threads: t.start()
            for t in threads: t.join()
            leakfree.patch_all()
            module, name = LOCATIONS["fused_attention"]
            cls = getattr(importlib.import_module(module), name)
            fn = cls.__dict__["backward"].__func__
            inner = getattr(fn, _ORIGINAL).__func__
            print(json.dumps(dict(wrapped_once=not hasattr(inner, _ORIGINAL),
                                  attrs=leakfree.released_attributes(cls))))
            """,
        ),
        te["2.13.0"],
    )
    assert result == {"wrapped_once": True, "attrs": ["tensor_objects"]}


def test_bad_arguments_raise_before_any_change() -> None:
    result = run_py(
        """
        import json, leakfree
        try:
            leakfree.patch_all(trl=False, flash_attn=True)
        except TypeError as e:
            msg = str(e)
        states = {(r.outcome, r.reason) for r in leakfree.patch_report()}
        print(json.dumps(dict(msg=msg, states=sorted(states))))
        """
    )
    assert "unknown integration or patch 'flash_attn'" in result["msg"]
    assert "transformer_engine" in result["msg"] and "trl" in result["msg"]
    assert result["states"] == [["off", "not requested"]]


def test_importing_leakfree_imports_no_target_library() -> None:
    result = run_py(
        """
        import json, sys
        import leakfree
        leakfree.patch_all()
        targets = ("trl", "transformer_engine", "transformers")
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in targets)))
        """
    )
    assert result == []


# --- generic sweep ---------------------------------------------------------------------------

#: a module of the sweep tests' library: one Function that parks a tensor on ctx
_LEAKY_MODULE = """
    import torch

    class {name}(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.big = torch.zeros(1000)
            return x * {factor}

        @staticmethod
        def backward(ctx, g):
            return g * {factor}
"""

SWEEP_LIB = {
    "sweeplib/__init__.py": "",
    "sweeplib/ops.py": _LEAKY_MODULE.format(name="Leaky", factor=2),
    "sweeplib/later.py": _LEAKY_MODULE.format(name="LeakyLater", factor=3),
    # outside the swept prefix: the tests' probe, not a swept module
    "sweepprobe.py": """
        import weakref

        import torch

        def leaks(cls):
            \"\"\"Does ``cls`` keep its ctx tensor after a backward?\"\"\"
            y = cls.apply(torch.randn(3, requires_grad=True))
            r = weakref.ref(y.grad_fn.big)
            y.sum().backward()
            return r() is not None
    """,
}


def write_sweeplib(root: Path) -> None:
    """The sweep tests' little library, under ``root``."""
    for rel, text in SWEEP_LIB.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))


def test_patch_functions_sweeps_defined_and_later_modules(tmp_path: Path) -> None:
    write_sweeplib(tmp_path)
    result = run_py(
        """
        import json, leakfree
        from sweeplib.ops import Leaky
        from sweepprobe import leaks

        before = leaks(Leaky)
        sweep = leakfree.patch_functions("sweeplib")
        from sweeplib.later import LeakyLater   # defined after the sweep started
        after = [leaks(Leaky), leaks(LeakyLater)]
        names = sorted(c.__name__ for c in sweep.classes)
        in_report = any(r.name == "sweep.sweeplib" for r in leakfree.patch_report())
        leakfree.unpatch_all()
        again = [leaks(Leaky), leaks(LeakyLater)]
        print(json.dumps(dict(before=before, after=after, again=again, names=names,
                              in_report=in_report)))
        """,
        tmp_path,
    )
    assert result["before"] is True
    assert result["after"] == [False, False]
    assert result["again"] == [True, True]
    assert result["names"] == ["Leaky", "LeakyLater"]
    assert result["in_report"]


def test_patch_functions_bad_input() -> None:
    import leakfree

    with pytest.raises(ValueError, match="patch_functions"):
        leakfree.patch_functions("not a module")
    with pytest.raises(TypeError, match=r"attrs=\('x',\)"):
        leakfree.patch_functions("json", attrs="x")


# --- TRL ------------------------------------------------------------------------------------------

TRL_SCENARIO = """
import json, sys, warnings
import torch
from torch import nn
import leakfree
import importlib.metadata

class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.lm_head = nn.Linear(16, 32)

    def forward(self, x):
        return self.lm_head(self.body(x))

def head_hooks(model):
    return len(model.lm_head._forward_pre_hooks) + len(model.lm_head._forward_hooks)

def train_step(model, make_ctx):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ctx = make_ctx(model)
    with ctx:
        loss = model(x).square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], type(ctx).__module__
"""


def trl_check(order: str, option: str | None, *paths: Path) -> dict[str, Any]:
    patch_call = "leakfree.patch_all()" if option is None else f"leakfree.patch_all(trl={option!r})"
    if order == "patch_first":
        prelude = f"{patch_call}\nimport trl.trainer.sft_trainer as sft\n"
    else:
        prelude = f"import trl.trainer.sft_trainer as sft\n{patch_call}\n"
    body = (
        prelude
        + """
import trl.models.activation_offloading as ao
import trl.models as models
applied = {r.name: r.outcome for r in leakfree.patch_report() if r.integration == "trl"}
patched = ao.OffloadActivations is leakfree.OffloadActivations
everywhere = (models.get_act_offloading_ctx_manager is ao.get_act_offloading_ctx_manager
              is sft.get_act_offloading_ctx_manager)
model = TinyLM()
ref = TinyLM(); x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
ref(x).square().mean().backward()
expected = [p.grad for p in ref.parameters()]
result = dict(version=importlib.metadata.version("trl"), applied=applied, patched=patched,
              everywhere=everywhere)
if patched:
    # a trainer-style call, three times (trainers build it per run): hooks must not stack
    for _ in range(3):
        model.zero_grad()
        grads, kind = train_step(model, lambda m: sft.get_act_offloading_ctx_manager(
            model=m, use_pin_memory=True, use_streams=True, min_offload_size=1024,
            max_fwd_stash_size=5))
    result["kind"] = kind
    result["same_grads"] = all(torch.equal(a, b) for a, b in zip(grads, expected))
    result["head_hooks"] = head_hooks(model)
leakfree.unpatch_all()
result["restored"] = (ao.OffloadActivations is not leakfree.OffloadActivations
                      and sft.get_act_offloading_ctx_manager.__module__ == ao.__name__)
print(json.dumps(result))
"""
    )
    return run_py(TRL_SCENARIO + body, *paths, timeout=240)  # type: ignore[no-any-return]


def old_trl() -> Path:
    """TRL 1.3.0 (leaky release), installed by .ci/run into its own directory."""
    path = Path(os.environ.get("LEAKFREE_OLD_TRL", ROOT / ".ci-deps" / "trl-1.3.0"))
    if not (path / "trl").is_dir():
        pytest.skip(
            f"TRL 1.3.0 not found at {path}; install it with: pip install --no-deps "
            f"--target {path} trl==1.3.0 (.ci/run does)"
        )
    return path


@pytest.mark.parametrize(
    ("version", "has_accelerator", "option", "verdict", "why"),
    [
        ("1.0.0", False, True, "applies", "keeps offloaded payloads past the step"),
        ("1.3.0", True, True, "applies", "keeps offloaded payloads past the step"),
        ("1.4.0", True, True, "applies", "keeps offloaded payloads past the step"),
        ("1.5.0", True, True, "already fixed upstream", "runs on this machine's accelerator"),
        ("1.5.0", False, True, "applies", "raises AttributeError without an accelerator"),
        ("1.16.0", False, True, "applies", "raises AttributeError without an accelerator"),
        ("1.16.0", True, True, "already fixed upstream", "clears its stashes (1.5)"),
        ("1.16.0", True, "always", "applies", "patch_all(trl='always')"),
        ("2.0.0", False, True, "not present in this version", "newer than the releases"),
        ("2.0.0", True, "always", "applies", "patch_all(trl='always')"),
    ],
)
def test_trl_default_decision_per_version_and_machine(
    version: str, has_accelerator: bool, option: Any, verdict: str, why: str
) -> None:
    from packaging.version import Version

    from leakfree.patches._registry import Applies
    from leakfree.patches.trl import expect

    decision = expect(Version(version), option, has_accelerator=has_accelerator)
    got = "applies" if isinstance(decision, Applies) else str(decision.reason)
    assert (got, why in decision.detail) == (verdict, True), decision


def test_trl_a_constructor_that_no_longer_reads_the_accelerator_is_not_patched() -> None:
    from packaging.version import Version

    from leakfree.patches import Reason
    from leakfree.patches.trl import expect

    decision = expect(Version("1.16.0"), True, has_accelerator=False, reads_accelerator=False)
    assert decision.reason is Reason.NOT_PRESENT  # type: ignore[union-attr]
    assert "does not call current_accelerator()" in decision.detail


def test_trl_failure_modes_on_an_accelerator_without_cuda_streams() -> None:
    from packaging.version import Version

    from leakfree.patches.trl import failure_modes

    def names(version: str, device_type: str) -> list[tuple[str, str]]:
        modes = failure_modes(Version(version), has_accelerator=True, device_type=device_type)
        return [(mode.name, fix) for mode, fix in modes]

    assert ("torch.cuda streams", "patch_all(trl='always')") in names("1.10.0", "mps")
    assert ("torch.cuda streams", "patch_all()") in names("1.3.0", "mps")  # the leak's patch
    assert "torch.cuda streams" not in {n for n, _ in names("1.10.0", "cuda")}
    assert "torch.cuda streams" not in {n for n, _ in names("1.16.0", "mps")}


@pytest.mark.parametrize(
    ("version", "has_accelerator", "expected"),
    [
        ("1.16.0", False, [("crash without an accelerator", "patch_all()")]),
        (
            "1.16.0",
            True,
            [
                ("forward without backward kept", "patch_all(trl='always')"),
                ("two with blocks, one backward", "patch_all(trl='always')"),
                ("retain_graph twice", "patch_all(trl='always')"),
                ("head hooks stack", "patch_all(trl='always')"),
            ],
        ),
        (
            "1.3.0",
            True,
            [
                ("stashes never cleared", "patch_all()"),
                ("unfinished forwards kept", "patch_all()"),
                ("stale dedup keys", "patch_all()"),
                ("stream race", "patch_all()"),
                ("retain_graph twice", "patch_all()"),
                ("head hooks stack", "patch_all()"),
            ],
        ),
        ("1.3.0", False, [("crash without an accelerator", "patch_all()")]),
        ("1.10.0", False, [("crash without an accelerator", "patch_all()")]),
    ],
)
def test_trl_failure_modes_name_the_call_that_repairs_them(
    version: str, has_accelerator: bool, expected: list[tuple[str, str]]
) -> None:
    from packaging.version import Version

    from leakfree.patches.trl import failure_modes

    modes = failure_modes(Version(version), has_accelerator=has_accelerator)
    assert [(mode.name, fix) for mode, fix in modes] == expected


def test_registry_reports_why_a_patch_applied_and_plans_what_expect_says() -> None:
    """``check`` may return ``Applies(why)``: the report says why; ``expect`` lets the plan
    (the doctor) tell a patch that the code check will skip, without importing anything."""
    import sys
    import types

    from leakfree.patches import Outcome, Reason
    from leakfree.patches._registry import Applies, Patch, Registry, Skip

    module = types.ModuleType("leakfree_demo_target")
    module.thing = object()  # type: ignore[attr-defined]
    decision: list[Skip | Applies] = [Applies("the reason")]
    registry = Registry()
    registry.add(
        (
            Patch(
                name="demo.thing",
                integration="demo",
                distributions=("packaging",),  # installed wherever leakfree is
                modules=(("", module.__name__),),
                target="thing",
                affected=">=0",
                fixed_in="-",
                check=lambda target, mod, option: decision[0],
                apply=lambda target, mod, option, changes: changes.setattr(mod, "thing", 1),
                description="replaced",
                expect=lambda version, option: decision[0],
            ),
        )
    )
    plan = registry.plan(registry.select({}))
    assert (plan["demo.thing"].outcome, plan["demo.thing"].reason, plan["demo.thing"].detail) == (
        Outcome.WOULD_APPLY,
        None,
        "replaced: the reason (leakfree_demo_target.thing)",
    )
    original = module.thing  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        registry.request(registry.select({}), strict=False)
        record = registry.report()["demo.thing"]
        assert (record.outcome, record.reason, record.detail) == (
            Outcome.APPLIED,
            None,
            "replaced: the reason",
        )
        registry.revert_all()
        assert module.thing is original  # type: ignore[attr-defined]
        decision[0] = Skip(Reason.ALREADY_FIXED, "fixed here")
        plan = registry.plan(registry.select({}))
        assert (
            plan["demo.thing"].outcome,
            plan["demo.thing"].reason,
            plan["demo.thing"].detail,
        ) == (
            Outcome.SKIPPED,
            Reason.ALREADY_FIXED,
            "fixed here",
        )
    finally:
        del sys.modules[module.__name__]


# --- regressions from review: state changes, re-imports, overlapping owners ------------------


def test_option_changes_reapply_and_false_reverts(te: dict[str, Path]) -> None:
    result = run_py(
        te_script(
            "2.13.0",
            """
            import leakfree
            leakfree.patch_all()
            plain = probe()["fuser"]
            leakfree.patch_all(transformer_engine="harden")   # a different option: re-applied
            hardened = probe()["fuser"]
            leakfree.patch_all(transformer_engine=False)       # off: reverted
            off = probe()["fused_attention"]
            record = leakfree.patch_report()["transformer_engine.fused_attention"]
            print(json.dumps(dict(plain=plain, hardened=hardened, off=off,
                                  state=[record.outcome, record.reason])))
            """,
        ),
        te["2.13.0"],
    )
    assert result["plain"]["op_ctx_kept"] and not result["hardened"]["op_ctx_kept"]
    assert result["off"]["leaks"] and result["state"] == ["off", "disabled by the caller"]


def test_reimport_after_unpatch_is_patched_again(te: dict[str, Path]) -> None:
    result = run_py(
        te_script(
            "2.13.0",
            """
            import leakfree
            leakfree.patch_all()
            probe()
            leakfree.unpatch_all()
            for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
                del sys.modules[name]
            leakfree.patch_all()
            leaks = probe()["fused_attention"]["leaks"]
            outcome = leakfree.patch_report()["transformer_engine.fused_attention"].outcome
            print(json.dumps(dict(leaks=leaks, outcome=outcome)))
            """,
        ),
        te["2.13.0"],
    )
    assert result == {"leaks": False, "outcome": "applied"}


def test_sweep_and_patch_do_not_undo_each_other(te: dict[str, Path]) -> None:
    result = run_py(
        te_script(
            "2.13.0",
            """
            import leakfree
            probe()
            leakfree.patch_all()
            sweep = leakfree.patch_functions("transformer_engine")
            swept = sorted(c.__name__ for c in sweep.classes)
            sweep.remove()
            leaks = probe()["fused_attention"]["leaks"]   # the patch is still in place
            print(json.dumps(dict(swept=swept, leaks=leaks)))
            """,
        ),
        te["2.13.0"],
    )
    # the five patched classes were skipped by the sweep; the self-fixed 2.1+ ones were swept
    assert "FusedAttnFunc" not in result["swept"] and "_Linear" in result["swept"]
    assert result["leaks"] is False


def test_decorated_backward_is_still_recognised(tmp_path: Path) -> None:
    root = build(tmp_path / "te", "2.13.0")
    path = root / "transformer_engine/pytorch/module/grouped_linear.py"
    text = path.read_text().replace(
        "    @staticmethod\n    def backward(",
        "    @staticmethod\n    @_decorate\n    def backward(",
    )
    decorator = (
        "import functools\n\n\ndef _decorate(fn):\n    @functools.wraps(fn)\n"
        "    def wrapper(*args):\n        return fn(*args)\n\n    return wrapper\n"
    )
    path.write_text(decorator + text)
    result = run_py(
        te_script(
            "2.13.0",
            """
            import leakfree
            leakfree.patch_all()
            leaks = probe()["grouped_linear"]["leaks"]
            print(json.dumps(dict(leaks=leaks,
                outcome=leakfree.patch_report()["transformer_engine.grouped_linear"].outcome)))
            """,
        ),
        root,
    )
    assert result == {"leaks": False, "outcome": "applied"}


# --- option values and development builds -----------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"trl": "Always"}, r"patch_all\(trl='Always'\): not an accepted value; trl accepts "),
        ({"trl": "sometimes"}, r"trl accepts True, False, 'always'$"),
        ({"transformer_engine": 3}, r"transformer_engine accepts .*'harden'"),
        ({"trl": 1}, r"patch_all\(trl=1\)"),  # 1 == True, but it is not True
        ({"transformer_engine_fuser": "hardened"}, r"transformer_engine_fuser accepts"),
    ],
)
def test_misspelled_option_values_raise_before_any_change(kwargs: Any, match: str) -> None:
    import leakfree

    before = [(r.name, r.outcome, r.reason, r.detail) for r in leakfree.patch_report()]
    with pytest.raises(ValueError, match=match):
        leakfree.patch_all(**kwargs)
    assert [(r.name, r.outcome, r.reason, r.detail) for r in leakfree.patch_report()] == before


DEV_BUILD = "2.14.0.dev0+f122b07"  # upstream main before the fuser fix merged


@pytest.fixture(scope="module")
def te_dev(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("te-dev"), DEV_BUILD)


def test_te_development_build_of_the_fixing_release_is_patched(te_dev: Path) -> None:
    """A dev build of 2.14 may or may not carry the fuser fix: it must pass the version gate
    so that the code check decides (this stand-in has the leaky code, as main had)."""
    result = run_py(
        te_script(
            DEV_BUILD,
            """
            import leakfree
            """,
            REPORT,
            """
            leakfree.patch_all()
            leaks = probe()
            print(json.dumps(dict(report=report(), leaks=leaks)))
            """,
        ),
        te_dev,
    )
    st = statuses(result["report"])
    assert st["fuser"] == "applied" and st["fused_attention"] == "applied", result["report"]
    assert not any(v["leaks"] for v in result["leaks"].values())


VERSION_TABLE = [
    # (installed, specifier, matches)
    ("2.14.0.dev0+f122b07", ">=2.6,<2.14", True),  # a dev build of the fixing release
    ("2.14.0rc1", ">=2.6,<2.14", True),
    ("2.13.0.dev0", ">=2.0,<2.15", True),  # a pre-release inside the range
    ("2.14.0.dev0", ">=2.6", True),  # a location table entry
    ("2.15.0.dev0", ">=2.6,<2.14", False),  # past the fixing release
    ("2.5.0.dev0", ">=2.6,<2.14", False),  # before the range
    ("2.14.0", ">=2.6,<2.14", False),
    ("2.13.1", ">=2.6,<2.14", True),
]


def _packaging_dirs() -> list[Path]:
    return sorted((ROOT / ".ci-deps").glob("packaging-*"))


@pytest.mark.parametrize("where", ["installed", *[p.name for p in _packaging_dirs()]])
def test_version_gate_is_the_same_on_every_packaging_version(where: str) -> None:
    paths = [] if where == "installed" else [ROOT / ".ci-deps" / where]
    result = run_py(
        f"""
        import json, packaging
        from packaging.version import Version
        from leakfree.patches._registry import version_matches
        table = {VERSION_TABLE!r}
        print(json.dumps(dict(
            packaging=packaging.__version__,
            got=[version_matches(Version(v), s) for v, s, _ in table],
        )))
        """,
        *paths,
    )
    if where != "installed":
        assert result["packaging"] == where.split("-", 1)[1]
    assert result["got"] == [m for _, _, m in VERSION_TABLE]


@pytest.fixture(scope="module")
def te_moved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("te-moved")
    return {v: build(base / v, v) for v in ("2.11.0", "2.15.0", "2.16.0")}


@pytest.mark.parametrize(
    ("version", "moved"),
    [("2.11.0", "layernorm_mlp"), ("2.15.0", "linear"), ("2.16.0", "linear")],
)
def test_te_always_reports_restores_moved_into_helpers_as_fixed_upstream(
    te_moved: dict[str, Path], version: str, moved: str
) -> None:
    """2.11 moved _LayerNormMLP's restore into _recompute, 2.15 _Linear's into
    _linear_backward (2.16: LinearBwdArgs.setup_saved_tensors): no false warning."""
    result = run_py(
        te_script(
            version,
            """
            import leakfree
            """,
            REPORT,
            """
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # any PatchWarning fails the run
                leakfree.patch_all(transformer_engine="always")
                leaks = probe()
            print(json.dumps(dict(report=report(), leaks=leaks)))
            """,
        ),
        te_moved[version],
    )
    reasons = {r["name"].split(".", 1)[1]: r["reason"] for r in result["report"]}
    assert reasons[moved] == "already fixed upstream", result["report"]
    assert not any(v["leaks"] for v in result["leaks"].values())


def test_te_class_without_the_pattern_is_not_present_not_a_warning(tmp_path: Path) -> None:
    plain = build(tmp_path / "plain", "2.13.0")
    (plain / "transformer_engine/pytorch/module/grouped_linear.py").write_text(
        textwrap.dedent(
            """
            import torch

            class _GroupedLinear(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x, w):
                    ctx.save_for_backward(x, w)
                    return x @ w

                @staticmethod
                def backward(ctx, g):
                    x, w = ctx.saved_tensors
                    return g @ w.t(), x.t() @ g
            """
        )
    )
    result = run_py(
        te_script(
            "2.13.0",
            """
            import leakfree
            """,
            REPORT,
            """
            import transformer_engine.pytorch.module.grouped_linear
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                leakfree.patch_all()
            print(json.dumps(report()))
            """,
        ),
        plain,
    )
    reasons = {r["name"]: r["reason"] for r in result}
    assert reasons["transformer_engine.grouped_linear"] == "not present in this version"


# --- one patch system: sweeps are records, one table of originals ----------------------------


def write_sweep_lib(root: Path) -> Path:
    for rel, text in SWEEP_LIB.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_sweep_originals_are_in_the_table_and_unpatch_clears_them(tmp_path: Path) -> None:
    result = run_py(
        """
        import json, sys
        import leakfree
        from leakfree.function import _ORIGINAL
        from leakfree.patches import get_original, is_object_patched
        from sweeplib.ops import Leaky

        original = Leaky.__dict__["backward"]

        def finders():  # leakfree's own import-system finders
            return len([f for f in sys.meta_path if type(f).__module__.startswith("leakfree")])

        before = is_object_patched(Leaky, "backward")
        sweep = leakfree.patch_functions("sweeplib")
        again = leakfree.patch_functions("sweeplib")       # a second sweep: nothing stacks
        from sweeplib.later import LeakyLater               # swept by the post-import hook
        later_original = get_original(LeakyLater, "backward")
        during = dict(
            patched=[is_object_patched(Leaky, "backward"),
                     is_object_patched(LeakyLater, "backward")],
            original=get_original(Leaky, "backward") is original,
            replaced=Leaky.__dict__["backward"] is not original,
            wrapped_once=getattr(Leaky.__dict__["backward"].__func__, _ORIGINAL) is original,
            later_is_users=later_original.__func__.__module__ == "sweeplib.later"
                           and not hasattr(later_original.__func__, _ORIGINAL),
            second_sweep=[c.__name__ for c in again.classes],
            new_finders=finders(),
        )
        sweep.remove()
        removed = dict(
            patched=[is_object_patched(Leaky, "backward"),
                     is_object_patched(LeakyLater, "backward")],
            restored=[Leaky.__dict__["backward"] is original,
                      LeakyLater.__dict__["backward"] is later_original],
            current=get_original(Leaky, "backward") is original,
            classes=sweep.classes,
            in_report=[r.name for r in leakfree.patch_report() if r.integration == "sweep"],
        )
        leakfree.unpatch_all()
        print(json.dumps(dict(before=before, during=during, removed=removed,
                              finders_after=finders())))
        """,
        write_sweep_lib(tmp_path),
    )
    assert result["before"] is False
    assert result["during"] == {
        "patched": [True, True],
        "original": True,
        "replaced": True,
        "wrapped_once": True,
        "later_is_users": True,
        "second_sweep": [],
        "new_finders": 1,  # one prefix watch for both sweeps (wrapt's finder does the rest)
    }
    assert result["removed"] == {
        "patched": [False, False],
        "restored": [True, True],
        "current": True,
        "classes": [],
        "in_report": ["sweep.sweeplib"],  # the second sweep is still a record
    }
    assert result["finders_after"] == 0


def test_te_originals_table_survives_option_changes_and_sweeps(te: dict[str, Path]) -> None:
    result = run_py(
        te_script(
            "2.13.0",
            """
            import leakfree
            from leakfree.patches import get_original, is_object_patched
            probe()
            cls = {n: getattr(importlib.import_module(m), c) for n, (m, c) in LOCATIONS.items()
                   if hasattr(importlib.import_module(m), c)}
            originals = {n: k.__dict__["backward"] for n, k in cls.items()}

            def table():
                return {n: [is_object_patched(k, "backward"),
                            get_original(k, "backward") is originals[n]]
                        for n, k in cls.items()}

            sweep = leakfree.patch_functions("transformer_engine")  # first: all classes
            swept = table()
            leakfree.patch_all()                  # the patches take over their classes
            leakfree.patch_all(transformer_engine="harden")    # re-applied: same originals
            patched = table()
            sweep.remove()                        # puts back only what it still holds
            after_sweep = table()
            leaks = probe()
            leakfree.unpatch_all()
            restored = all(k.__dict__["backward"] is originals[n] for n, k in cls.items())
            print(json.dumps(dict(swept=swept, patched=patched, after_sweep=after_sweep,
                                  leaks=leaks, unpatched=table(), restored=restored)))
            """,
        ),
        te["2.13.0"],
    )
    affected = {
        "fuser",
        "fused_attention",
        "cp_attention_p2p",
        "cp_attention_a2a",
        "grouped_linear",
    }
    assert all(v == [True, True] for v in result["swept"].values()), result["swept"]
    assert all(v == [True, True] for v in result["patched"].values()), result["patched"]
    for name, (patched, original) in result["after_sweep"].items():
        assert original, name
        assert patched == (name in affected), name
        assert not result["leaks"][name]["leaks"] or name not in affected, name
    assert all(v == [False, True] for v in result["unpatched"].values()), result["unpatched"]
    assert result["restored"]


def test_get_original_of_an_unpatched_object_and_bad_owners() -> None:
    import json as json_module

    from leakfree.patches import get_original, is_object_patched

    assert get_original(json_module, "dumps") is json_module.dumps
    assert not is_object_patched(json_module, "dumps")
    assert get_original(PatchLike, "method") is PatchLike.__dict__["method"]  # raw entry
    assert get_original(SubPatchLike, "method") is PatchLike.__dict__["method"]  # inherited
    with pytest.raises(TypeError, match=r"pass sys.modules\['json'\]"):
        get_original("json", "dumps")
    with pytest.raises(TypeError, match="expected a module or a class"):
        is_object_patched(object(), "x")
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        get_original(json_module, "missing")


class PatchLike:
    @staticmethod
    def method() -> None:
        pass


class SubPatchLike(PatchLike):
    pass


def test_outcome_and_reason_are_words_in_report_plan_and_doctor() -> None:
    import leakfree
    from leakfree.patches import Outcome, Reason
    from leakfree.patches._registry import REGISTRY

    words: list[str] = ["applied", "pending import"]  # record.outcome == "applied"
    assert words == [Outcome.APPLIED, Outcome.PENDING]
    assert str(Reason.NOT_INSTALLED) == "not installed" and f"{Outcome.SKIPPED}" == "skipped"
    assert json.dumps({"outcome": Outcome.WOULD_APPLY, "reason": Reason.NO_LOCATION}) == (
        '{"outcome": "would apply", "reason": "no known location"}'
    )
    plan = REGISTRY.plan(REGISTRY.select({}))
    for record in (*leakfree.patch_report(), *plan):
        assert isinstance(record.outcome, Outcome), record
        assert record.reason is None or isinstance(record.reason, Reason), record
        assert isinstance(record.detail, str), record
    # printed as words, whatever state earlier tests left the registry in
    for text in (str(leakfree.patch_report()), str(plan)):
        assert "Outcome." not in text and "Reason." not in text
        assert text.splitlines()[0].split() == [
            "patch",
            "target",
            "version",
            "outcome",
            "reason",
            "detail",
        ]


# --- the review's fixes: outcome and reason are two axes -------------------------------------


def test_outcome_and_reason_do_not_overlap_and_each_reason_explains_one_outcome() -> None:
    """Review: one ``Status`` enum held three axes (what happened, what a plan would do,
    why the code check skipped) and two words for "off" (``DISABLED``, ``OFF``)."""
    from leakfree.patches import Outcome, Reason
    from leakfree.patches._registry import PAIRS

    assert not {o.value for o in Outcome} & {r.value for r in Reason}
    assert not {o.name for o in Outcome} & {r.name for r in Reason}
    assert {o for o, _ in PAIRS} == set(Outcome)  # no outcome that never happens
    assert {r for _, r in PAIRS} == {*Reason, None}  # no reason that never explains
    for reason in Reason:  # one meaning each: the same reason never explains two outcomes
        assert len({o for o, r in PAIRS if r is reason}) == 1, reason
    assert {r for r in Reason if r.warns} == {Reason.TARGET_NOT_FOUND, Reason.APPLY_FAILED}
    docs = (ROOT / "docs" / "patches.md").read_text()
    for word in (*Outcome, *Reason):
        assert f"`{word.value}`" in docs, f"docs/patches.md does not say what {word!r} means"


def test_patch_all_false_is_off_disabled_by_the_caller_and_the_pair_is_checked() -> None:
    import leakfree
    from leakfree.patches import Outcome, PatchRecord, Reason
    from leakfree.patches._registry import Skip

    try:
        report = leakfree.patch_all(trl=False)
        for name in ("trl.offload_activations", "trl.act_offloading_ctx_manager"):
            assert (report[name].outcome, report[name].reason) == (
                Outcome.OFF,
                Reason.DISABLED_BY_CALLER,
            )
    finally:
        leakfree.unpatch_all()
    bad = r"PatchRecord\('x'\): outcome=Outcome.APPLIED with reason=Reason.NOT_INSTALLED is"
    with pytest.raises(ValueError, match=bad):
        PatchRecord("x", "demo", "t", None, Outcome.APPLIED, Reason.NOT_INSTALLED)
    record = PatchRecord("x", "demo", "t", None, Outcome.OFF, Reason.NOT_REQUESTED)
    with pytest.raises(ValueError, match="reason=None is not one of"):
        record.mark(Outcome.SKIPPED)
    assert (record.outcome, record.reason) == (Outcome.OFF, Reason.NOT_REQUESTED)  # unchanged
    with pytest.raises(ValueError, match=r"Skip\(reason=Reason.NOT_INSTALLED\): a code check"):
        Skip(Reason.NOT_INSTALLED, "the gates say this, not a check")


def test_patches_exports_what_users_need_and_the_machinery_stays_in_its_modules() -> None:
    """Review: ``leakfree.patches.__all__`` exported 14 names, internals among them."""
    import leakfree.patches as patches

    assert sorted(patches.__all__) == sorted(
        [
            *("patch_all", "unpatch_all", "patch_report", "patch_functions"),
            *("get_original", "is_object_patched"),  # gevent.monkey's "what did you change?"
            *("PatchReport", "Outcome", "Reason", "PatchWarning", "PatchError"),
        ]
    )
    assert all(getattr(patches, name) is not None for name in patches.__all__)
    for name in ("Patch", "Sweep", "active_sweeps", "remove_all_sweeps", "Status"):
        assert not hasattr(patches, name), name
    from leakfree.patches._registry import Patch, Registry  # noqa: F401
    from leakfree.patches.sweep import Sweep, active_sweeps, remove_all_sweeps  # noqa: F401


def test_every_pair_from_patch_all_plan_and_unpatch_all_is_in_pairs_and_every_pair_occurs() -> None:
    """Drive one registry through every path (the gates, the code check, apply, import,
    off, revert, a sweep) and collect the (outcome, reason) pairs of its reports and plans:
    exactly the documented :data:`PAIRS`, no more (the axes stay apart), no less (no
    documented pair is dead)."""
    import sys
    import types
    import warnings

    from leakfree.patches import Outcome, Reason
    from leakfree.patches._registry import PAIRS, Patch, PatchReport, Registry, Skip, SweepRecord

    def fail(target: Any, mod: Any, option: Any, changes: Any) -> None:
        changes.setattr(mod, "thing", 1)
        raise RuntimeError("half-way")

    def patch(name: str, module: str, **kwargs: Any) -> Patch:
        fields: dict[str, Any] = dict(
            name=f"demo.{name}",
            integration="demo",
            distributions=("packaging",),  # installed wherever leakfree is
            modules=(("", module),),
            target="thing",
            affected=">=0",
            fixed_in="9",
            check=lambda target, mod, option: None,
            apply=lambda target, mod, option, changes: changes.setattr(mod, "thing", 1),
            description="replaced",
        )
        return Patch(**{**fields, **kwargs})

    def skip(reason: Reason) -> Any:
        return lambda target, mod, option: Skip(reason, "found so")

    here, later = "leakfree_demo_pairs_here", "leakfree_demo_pairs_later"
    registry = Registry()
    registry.add(
        (
            patch("applies", here),
            patch("waits", later),
            patch("off", here, default=False),
            patch("disabled", here),
            patch("absent", here, distributions=("leakfree-no-such-distribution",)),
            patch("old", here, affected="<0.0.1"),
            patch("nowhere", here, modules=((">=9999", here),)),
            patch("fixed", here, check=skip(Reason.ALREADY_FIXED)),
            patch("plain", here, check=skip(Reason.NOT_PRESENT)),
            patch("moved", here, check=skip(Reason.TARGET_NOT_FOUND)),
            patch("missing", here, target="no_such_thing"),
            patch("broken", here, apply=fail),
        )
    )

    class Probe(SweepRecord):
        def apply(self, module_names: set[str] | None, changes: Any) -> None:
            pass

    seen: set[tuple[Any, Any]] = set()

    def collect(report: PatchReport) -> None:
        seen.update((r.outcome, r.reason) for r in report)

    chosen = registry.select({"demo_disabled": False})
    collect(registry.report())  # nothing requested yet
    collect(registry.plan(chosen))
    for name in (here, later):
        module = types.ModuleType(name)
        module.thing = object()  # type: ignore[attr-defined]
        if name == here:
            sys.modules[name] = module
    sweep = Probe("leakfree_demo_pairs_sweep", "probed")
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            registry.request(chosen, strict=False)  # patch_all(demo_disabled=False)
        registry.add_sweep(sweep)
        collect(registry.report())
        collect(registry.plan(chosen))  # with some applied now
        registry.revert_all()  # unpatch_all(): applied, pending and the sweep go back
        collect(registry.report())
        collect(PatchReport([sweep]))
    finally:
        registry.revert_all()
        sys.modules.pop(here, None)
    assert seen <= PAIRS, seen - PAIRS
    assert seen == PAIRS, PAIRS - seen
    assert sweep.outcome is Outcome.REVERTED and sweep.detail == "unpatch_all()"


def test_revert_leaves_an_attribute_someone_replaced_after_the_patch() -> None:
    """Review: the table of originals put ours back only when ours was still there, but
    said nothing; a later replacement (another patcher) must be left, with a warning."""
    import sys
    import types

    from leakfree import PatchWarning
    from leakfree.patches._registry import Applies, Patch, Registry

    module = types.ModuleType("leakfree_demo_outer")
    module.thing = original = object()  # type: ignore[attr-defined]
    registry = Registry()
    registry.add(
        (
            Patch(
                name="demo.outer",
                integration="demo",
                distributions=("packaging",),
                modules=(("", module.__name__),),
                target="thing",
                affected=">=0",
                fixed_in="-",
                check=lambda target, mod, option: Applies("demo"),
                apply=lambda target, mod, option, changes: changes.setattr(mod, "thing", 1),
                description="replaced",
            ),
        )
    )
    sys.modules[module.__name__] = module
    try:
        registry.request(registry.select({}), strict=False)
        assert module.thing == 1  # type: ignore[attr-defined]
        theirs = object()
        module.thing = theirs  # type: ignore[attr-defined]  # someone else's, on top
        with pytest.warns(PatchWarning, match="leakfree_demo_outer.thing was replaced after"):
            registry.revert_all()
        assert module.thing is theirs and module.thing is not original  # type: ignore[attr-defined]
    finally:
        del sys.modules[module.__name__]


def test_patch_functions_sweeps_a_module_again_after_reload(tmp_path: Path) -> None:
    """Review: ``importlib.reload`` runs a module again and defines new Function classes; a
    post-import hook fires once, so they were never swept."""
    write_sweeplib(tmp_path)
    result = run_py(
        """
        import importlib, json, leakfree
        import sweeplib.ops as ops
        from sweepprobe import leaks

        sweep = leakfree.patch_functions("sweeplib")
        old = ops.Leaky
        importlib.reload(ops)
        new = ops.Leaky
        print(json.dumps(dict(distinct=old is not new, old=leaks(old), new=leaks(new),
                              swept=sorted(c.__qualname__ for c in sweep.classes).count("Leaky"))))
        """,
        tmp_path,
    )
    assert result == {"distinct": True, "old": False, "new": False, "swept": 2}


def test_strict_belongs_to_its_request_and_raises_a_patch_error_naming_the_fix() -> None:
    """Review: ``strict`` was stored registry-wide, so a later ``patch_all()`` silently made
    patches still waiting for their import lenient; a strict failure raised a bare
    RuntimeError naming neither the patch nor what to do."""
    import sys
    import types

    from leakfree import PatchError, PatchWarning
    from leakfree.patches._registry import Patch, Registry, Skip

    def patch(name: str, module: str) -> Patch:
        return Patch(
            name=name,
            integration="demo",
            distributions=("packaging",),
            modules=(("", module),),
            target="thing",
            affected=">=0",
            fixed_in="-",
            check=lambda target, mod, option: Skip(Reason.TARGET_NOT_FOUND, "moved"),
            apply=lambda target, mod, option, changes: None,
            description="replaced",
        )

    from leakfree.patches import Reason

    registry = Registry()
    registry.add(
        (patch("demo.strict", "leakfree_demo_s"), patch("demo.lenient", "leakfree_demo_l"))
    )
    registry.request({"demo.strict": True}, strict=True)  # waits for its import
    registry.request({"demo.lenient": True}, strict=False)  # a later, lenient request
    for name in ("leakfree_demo_s", "leakfree_demo_l"):
        module = types.ModuleType(name)
        module.thing = object()  # type: ignore[attr-defined]
        sys.modules[name] = module
    try:
        with pytest.raises(PatchError) as info:
            registry._on_import(sys.modules["leakfree_demo_s"])
        assert info.value.patch == "demo.strict" and isinstance(info.value, RuntimeError)
        assert "demo.strict could not be applied" in str(info.value)
        assert "patch_all(demo=False)" in str(info.value) and "patch_report()" in str(info.value)
        with pytest.warns(PatchWarning, match="demo.lenient skipped"):
            registry._on_import(sys.modules["leakfree_demo_l"])
    finally:
        for name in ("leakfree_demo_s", "leakfree_demo_l"):
            del sys.modules[name]
