"""The TRL patch against the real TRL: the installed release and an affected one (1.3.0,
from .ci-deps), in subprocesses; and the real ``SFTTrainer(activation_offloading=True)``
on a tiny random Llama, with and without the default ``patch_all()``."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from leakfree._device import accelerator
from tests._fresh import run_py, run_python
from tests.test_patches import ROOT, old_trl, trl_check

BENCHMARK = ROOT / "benchmarks" / "trl_versions.py"
STEPS = 4


def sft(mode: str, *paths: Path) -> dict[str, Any]:
    """One ``SFTTrainer`` run (benchmarks/trl_versions.py's worker) in a fresh process
    (forked from one that has imported torch only), with ``paths`` (an older TRL) first on
    its path."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, (*paths, ROOT)))
    argv = (str(BENCHMARK), "--worker", mode, "--steps", str(STEPS))
    status, stdout, stderr = run_python(*argv, cwd=ROOT, env=env, timeout=600)
    assert status == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def check_sft_trainer(*paths: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """TRL's own offloading, then the default ``patch_all()``, each against no offloading."""
    # three child interpreters, mostly import time: run them side by side
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = [pool.submit(sft, mode, *paths) for mode in ("none", "upstream", "patch_all()")]
        reference, upstream, patched = (run.result() for run in runs)
    assert reference["ok"] and len(reference["losses"]) == STEPS
    if accelerator() is None:
        # TRL's constructor reads torch.accelerator.current_accelerator().type: None.type
        assert not upstream["ok"]
        assert upstream["error"] == "AttributeError: 'NoneType' object has no attribute 'type'"
        assert upstream["stage"] == "SFTTrainer(...)"
        assert upstream["where"].startswith("trl/models/activation_offloading.py:")
        assert upstream["where"].endswith(" in __init__")
    assert patched["ok"], patched["error"]
    assert patched["context"] == "leakfree.offload"  # leakfree's manager drives the steps
    assert patched["losses"] == reference["losses"]  # exact, every step
    live = patched["live_bytes"]
    assert len(live) == STEPS and live[-1] <= live[1], live  # no growth after step 1
    assert patched["head_hooks"] == 2  # two more helper calls replaced the pair
    return upstream, patched


def test_sft_trainer_offloading_runs_on_the_installed_trl_with_the_default_patch() -> None:
    _, patched = check_sft_trainer()
    outcome, detail = patched["patches"]["trl.offload_activations"]
    assert outcome == "applied"
    if accelerator() is None:
        assert "raises AttributeError without an accelerator" in detail


def test_sft_trainer_offloading_runs_on_trl_1_3_with_the_default_patch() -> None:
    path = old_trl()
    _, patched = check_sft_trainer(path)
    assert patched["trl"] == "1.3.0"
    outcome, detail = patched["patches"]["trl.offload_activations"]
    assert (outcome, "keeps offloaded payloads past the step" in detail) == ("applied", True)


def test_trl_current_version_default_patch_follows_the_machine() -> None:
    result = trl_check("patch_first", None)
    if accelerator() is None:  # TRL's own class cannot be built here: replaced
        assert result["applied"]["trl.offload_activations"] == "applied"
        assert result["patched"] and result["everywhere"] and result["restored"]
        assert result["same_grads"] and result["head_hooks"] == 2
    else:  # 1.5+ on an accelerator: TRL's class works, left in place
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
