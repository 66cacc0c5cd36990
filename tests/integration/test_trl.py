"""The TRL patch against the real TRL: the installed release and an affected one (1.3.0,
from .ci-deps), in subprocesses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._fresh import run_py
from tests.test_patches import old_trl, trl_check


def test_trl_current_version_not_affected_by_default() -> None:
    result = trl_check("patch_first", None)
    assert result["applied"]["trl.offload_activations"] == "skipped"
    assert not result["patched"]


@pytest.mark.parametrize("order", ["patch_first", "import_first"])
def test_trl_always_replaces_everywhere_and_reverts(order: str) -> None:
    result = trl_check(order, "always")
    assert result["applied"] == {
        "trl.offload_activations": "applied",
        "trl.act_offloading_ctx_manager": "applied",
    }
    assert result["patched"] and result["everywhere"]
    assert result["kind"] == "leakfree.offload"  # TRL's own class raises without a GPU
    assert result["same_grads"]
    assert result["head_hooks"] == 2  # TRL's helper: 6 after three calls, unremovable
    assert result["restored"]


def test_trl_affected_release_is_patched_by_default() -> None:
    result = trl_check("patch_first", None, old_trl())
    assert result["version"] == "1.3.0"
    assert result["applied"]["trl.offload_activations"] == "applied"
    assert result["patched"] and result["everywhere"]
    assert result["same_grads"] and result["head_hooks"] == 2
    assert result["restored"]


def test_trl_unpatch_never_rebinds_user_modules(tmp_path: Path) -> None:
    (tmp_path / "usercode.py").write_text("from leakfree import OffloadActivations\n")
    result = run_py(
        """
        import json, leakfree
        leakfree.patch_all(trl="always")
        import trl.models.activation_offloading
        import usercode
        leakfree.unpatch_all()
        print(json.dumps(usercode.OffloadActivations is leakfree.OffloadActivations))
        """,
        tmp_path,
    )
    assert result is True


def test_trl_originals_table_names_every_rebound_module() -> None:
    result = run_py(
        """
        import json
        import trl.trainer.sft_trainer as sft
        import trl.models.activation_offloading as ao
        import leakfree
        from leakfree.patches import get_original, is_object_patched

        original = ao.OffloadActivations
        helper = ao.get_act_offloading_ctx_manager
        leakfree.patch_all(trl="always")
        during = dict(
            patched=[is_object_patched(ao, "OffloadActivations"),
                     is_object_patched(sft, "get_act_offloading_ctx_manager")],
            original=[get_original(ao, "OffloadActivations") is original,
                      get_original(sft, "get_act_offloading_ctx_manager") is helper],
            replaced=ao.OffloadActivations is leakfree.OffloadActivations,
        )
        leakfree.unpatch_all()
        after = dict(
            patched=[is_object_patched(ao, "OffloadActivations"),
                     is_object_patched(sft, "get_act_offloading_ctx_manager")],
            restored=[ao.OffloadActivations is original,
                      sft.get_act_offloading_ctx_manager is helper],
        )
        print(json.dumps(dict(during=during, after=after)))
        """,
        timeout=240,
    )
    assert result["during"] == {
        "patched": [True, True],
        "original": [True, True],
        "replaced": True,
    }
    assert result["after"] == {"patched": [False, False], "restored": [True, True]}
