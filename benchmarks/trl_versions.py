"""TRL's ``SFTTrainer(activation_offloading=True)`` across TRL releases, three ways.

For each TRL version, in its own virtual environment, the real ``SFTTrainer`` trains a tiny
random Llama (a ``transformers`` config, no download) for a few steps:

* ``none``: ``activation_offloading=False``, the reference;
* ``upstream``: TRL's own offloading, leakfree not imported;
* ``patch_all()``: ``leakfree.patch_all()`` at startup, the default;
* ``trl='always'``: ``leakfree.patch_all(trl="always")``.

Recorded per run: whether it trains or raises (the exception, and the TRL line that
raised it), the patch report's TRL rows, live tensor bytes after every step (a ``gc``
walk over every tensor's storage, counted once), their growth per step, bytes above the
reference after step 1, whether every step's loss equals the reference's exactly, and the
output head's hook count after two more calls of ``get_act_offloading_ctx_manager`` on the
trained model. Not step time: this is about correctness (timings: benchmarks/offload.py);
runs in separate processes on a shared machine would not be comparable anyway.

Each version gets a venv made with ``--system-site-packages`` (torch, transformers,
accelerate and datasets come from the running interpreter's environment: every 1.x
requires only ``transformers>=4.56.2``, ``accelerate>=1.4``, ``datasets>=4.7``), with only
``trl==<version>`` installed into it, ``--no-deps``: the versions differ in TRL alone.

Then, where there is no real accelerator and torch is one the test suite's simulated
accelerator supports (``tests/simdev``, torch 2.13), TRL's ``get_act_offloading_ctx_manager``
and leakfree's replacement drive the same model in a plain loop on that device, where
TRL's class can be built: what stays between steps, what a forward without backward
keeps, the head hooks (``--no-sim`` skips it).

    python benchmarks/trl_versions.py [--versions 1.0.0 1.3.0 1.16.0] [--steps 6]
        [--venvs DIR] [--json PATH] [--quick] [--no-sim]

``--venvs`` defaults to ``$LEAKFREE_TRL_VENVS``, else ``<tmp>/trl-venvs``.
``--worker MODE`` and ``--sim-worker MODE`` are the children: each runs one configuration
in the current interpreter and prints one JSON line (the integration tests run
``--worker``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("none", "upstream", "patch_all()", "trl='always'")
VERSIONS = ("1.0.0", "1.3.0", "1.16.0")
DEFAULT_VENVS = Path(
    os.environ.get("LEAKFREE_TRL_VENVS", Path(tempfile.gettempdir()) / "trl-venvs")
)


# --- the child: one configuration, in this interpreter ----------------------------------------


def live_tensor_bytes() -> int:
    """Bytes of every storage a Python-reachable tensor holds, each storage once."""
    import torch

    gc.collect()
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            storage = obj.untyped_storage()
        except Exception:  # a tensor without storage (meta, sparse...), or a lazy proxy
            continue
        key = storage.data_ptr() or id(storage)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _where(error: BaseException) -> str:
    """The innermost frame of the traceback inside TRL (else the innermost), as file:line."""
    frames = traceback.extract_tb(error.__traceback__)
    inside = [f for f in frames if f"{os.sep}trl{os.sep}" in f.filename] or frames
    frame = inside[-1]
    path = frame.filename
    short = (
        path[path.rindex(f"{os.sep}trl{os.sep}") + 1 :] if f"{os.sep}trl{os.sep}" in path else path
    )
    return f"{short}:{frame.lineno} in {frame.name}"


def worker(mode: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps in configuration ``mode``; everything the table needs."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    if mode != "none" and mode != "upstream":
        import leakfree

        leakfree.patch_all(**({"trl": "always"} if mode == "trl='always'" else {}))
    import torch
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import (
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        TrainerCallback,
    )
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    vocab = 64
    model = LlamaForCausalLM(_tiny_config(vocab))
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", pad_token="t1", eos_token="t2"
    )
    rows = torch.randint(3, vocab, (64, 24), generator=torch.Generator().manual_seed(0))
    dataset = Dataset.from_dict({"input_ids": rows.tolist()})

    live: list[int] = []
    losses: list[float] = []

    class Measure(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            live.append(live_tensor_bytes())

    class Recording(SFTTrainer):  # type: ignore[misc]
        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            loss = super().training_step(*args, **kwargs)
            losses.append(loss.item())
            return loss

    out_dir = tempfile.mkdtemp(prefix="trl-versions-")
    args = SFTConfig(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=10_000,
        report_to="none",
        save_strategy="no",
        activation_offloading=mode != "none",
        seed=0,
        bf16=False,
        use_cpu=not torch.accelerator.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    result: dict[str, Any] = {"trl": trl.__version__, "mode": mode, "ok": False, "error": None}
    try:
        trainer = Recording(
            model=model,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Measure()],
        )
        result["context"] = type(trainer.maybe_activation_offload_context).__module__
        trainer.train()
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["where"] = _where(e)
        result["stage"] = "train()" if "trainer" in locals() else "SFTTrainer(...)"
    else:
        result["ok"] = True
        if mode != "none":  # the helper again, as another trainer on this model would
            helper = sys.modules[type(trainer).__mro__[1].__module__].get_act_offloading_ctx_manager
            for _ in range(2):
                helper(model=trainer.model)
            head = trainer.model.lm_head
            result["head_hooks"] = len(head._forward_pre_hooks) + len(head._forward_hooks)
    result.update(losses=losses, live_bytes=live)
    if "leakfree" in sys.modules:
        report = sys.modules["leakfree"].patch_report()
        result["patches"] = {
            r.name: [str(r.outcome), r.detail] for r in report if r.integration == "trl"
        }
    return result


# --- on the simulated accelerator (tests/simdev): what TRL's class does where it runs ---------

SIM_MODES = ("upstream", "leakfree")


def sim_worker(mode: str, steps: int) -> dict[str, Any]:
    """TRL's helper (``upstream``) or leakfree's replacement on the test suite's simulated
    accelerator, in a plain loop (the HF ``Trainer`` does not place models on it): what
    stays between steps, a forward whose backward never runs, the head hooks. (Not the
    two ``with`` blocks then one backward: TRL's ``ValueError``, raised in the unpack
    hook on the device's autograd thread, aborts the process on the simulated device.)"""
    import contextlib

    import trl

    from tests import simdev

    simdev.register()
    result: dict[str, Any] = {"trl": trl.__version__, "mode": mode}
    with simdev.enabled():
        if mode == "upstream":
            from trl.models.activation_offloading import get_act_offloading_ctx_manager
        else:
            from leakfree.patches.trl import get_act_offloading_ctx_manager  # type: ignore[assignment]
        model, batches = _tiny_llama("sim", steps)
        reference, reference_live = [], []
        for ids in batches:
            reference.append(_step(model, ids, contextlib.nullcontext()))
            reference_live.append(live_tensor_bytes())
        result["reference_live_bytes"] = reference_live
        try:
            ctx = get_act_offloading_ctx_manager(model)
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"
            result["where"] = _where(e)
            return result
        losses, live = [], []
        for ids in batches:
            losses.append(_step(model, ids, ctx))
            live.append(live_tensor_bytes())
        result.update(losses_equal_none=losses == reference, live_bytes=live)
        pool = getattr(ctx, "pool", None)
        result["pool_cached_bytes"] = None if pool is None else pool.stats.cached_bytes
        for _ in range(2):
            get_act_offloading_ctx_manager(model)
        head = model.lm_head
        result["head_hooks"] = len(head._forward_pre_hooks) + len(head._forward_hooks)
        ids = batches[0]
        before = live_tensor_bytes()
        with ctx:  # a forward whose backward never runs (an evaluation with grad on)
            out = model(input_ids=ids, labels=ids)
        del out
        result["forward_without_backward_kept_bytes"] = live_tensor_bytes() - before
    return result


def _tiny_config(vocab: int) -> Any:
    """The random 2-layer Llama every run of this script trains (no download)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def _tiny_llama(device: str, steps: int) -> tuple[Any, list[Any]]:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config(64)).to(device)
    g = torch.Generator().manual_seed(0)
    return model, [torch.randint(3, 64, (4, 24), generator=g).to(device) for _ in range(steps)]


def _step(model: Any, ids: Any, ctx: Any) -> float:
    with ctx:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.item())


# --- the parent: venvs, runs, table -----------------------------------------------------------


def venv_python(venvs: Path, version: str) -> Path:
    """The interpreter of ``venvs/trl-<version>``, made on first use: the running
    environment's packages, plus ``trl==<version>`` alone (``--no-deps``)."""
    venv = venvs / f"trl-{version}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True
        )
    probe = "import importlib.metadata as m; print(m.version('trl'))"
    have = subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip()
    if have != version:
        subprocess.run(
            [python, "-m", "pip", "install", "-q", "--no-deps", f"trl=={version}"], check=True
        )
    return python


def run_worker(
    python: Path | str, mode: str, steps: int, timeout: float = 600, *, flag: str = "--worker"
) -> dict[str, Any]:
    """One configuration in a child interpreter (``python``), with this checkout's leakfree
    (``flag``: ``--worker`` for ``SFTTrainer``, ``--sim-worker`` for the simulated device)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [str(python), str(Path(__file__).resolve()), flag, mode, "--steps", str(steps)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"worker {mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def summarise(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration, against the ``none`` run of the same version."""
    from leakfree.diagnostics.growth import fit_growth

    ref = runs["none"]
    rows = []
    for mode in MODES:
        run = runs[mode]
        row: dict[str, Any] = {"trl": run["trl"], "config": mode, "ok": run["ok"]}
        for key in ("error", "stage", "where", "context", "head_hooks", "patches"):
            row[key] = run.get(key)
        if run["ok"]:
            growth = fit_growth(run["live_bytes"][1:])  # from step 2: step 1 builds state
            row["growth_bytes_per_step"] = growth.bytes_per_step
            row["growth_noise_bytes"] = growth.noise
            row["after_step1_vs_none_bytes"] = run["live_bytes"][0] - ref["live_bytes"][0]
            row["losses_equal_none"] = run["losses"] == ref["losses"]
        row["losses"] = run["losses"]
        row["live_bytes"] = run["live_bytes"]
        rows.append(row)
    return rows


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        if r["patches"]:
            outcome, detail = r["patches"]["trl.offload_activations"]
            patch = f"{outcome}: {detail.split(': ', 1)[-1]}"  # the why, not the description
        else:
            patch = "-" if r["config"] == "none" else "(leakfree not imported)"
        if not r["ok"]:
            error = r["error"].split(":", 1)[0]
            out.append([r["trl"], r["config"], f"{error} in {r['where']}", patch, *"----"])
            continue
        hooks = r["head_hooks"]
        out.append(
            [
                r["trl"],
                r["config"],
                "trains",
                patch,
                f"{r['growth_bytes_per_step']:.0f}",
                f"{r['after_step1_vs_none_bytes']:+d}",
                "yes" if r["losses_equal_none"] else "NO",
                "-" if hooks is None else str(hooks),
            ]
        )
    return out


def sim_rows(runs: dict[str, dict[str, Any]]) -> list[list[str]]:
    out = []
    for mode in SIM_MODES:
        r = runs[mode]
        helper = "TRL's" if mode == "upstream" else "leakfree's"
        if "error" in r:
            error = r["error"].split(":", 1)[0]
            out.append([r["trl"], helper, f"{error} in {r['where']}", *"-----"])
            continue
        live, ref = r["live_bytes"], r["reference_live_bytes"]
        pool = r["pool_cached_bytes"]
        out.append(
            [
                r["trl"],
                helper,
                "trains",
                "yes" if r["losses_equal_none"] else "NO",
                f"{live[0] - ref[0]:+d}" + ("" if pool is None else f" (pool: {pool})"),
                f"{live[-1] - live[0]:+d}",
                str(r["forward_without_backward_kept_bytes"]),
                str(r["head_hooks"]),
            ]
        )
    return out


SIM_HEADER = (
    "trl",
    "get_act_offloading_ctx_manager",
    "plain loop",
    "losses == none",
    "live B after step 1 vs none",
    "growth after step 1 (B)",
    "forward without backward: B kept",
    "head hooks after 3 calls",
)


HEADER = (
    "trl",
    "config",
    "SFTTrainer(activation_offloading=True)",
    "leakfree patch",
    "growth B/step",
    "live B after step 1 vs none",
    "losses == none",
    "head hooks after 3 calls",
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--venvs", type=Path, default=DEFAULT_VENVS)
    parser.add_argument("--quick", action="store_true", help="3 steps")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-sim", action="store_true", help="skip the simulated device")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--sim-worker", choices=SIM_MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = 3 if args.quick else args.steps
    if args.worker or args.sim_worker:
        run = worker(args.worker, steps) if args.worker else sim_worker(args.sim_worker, steps)
        print(json.dumps(run))
        return {}

    sys.path.insert(0, str(HERE))
    import torch
    from _common import environment, print_table, write_json

    sys.path.insert(0, str(ROOT))
    from tests import simdev

    sim = not args.no_sim and simdev.supported() and not torch.accelerator.is_available()
    results: list[dict[str, Any]] = []
    simulated: list[dict[str, Any]] = []
    for version in args.versions:
        python = venv_python(args.venvs, version)
        runs = {mode: run_worker(python, mode, steps) for mode in MODES}
        if sim:
            sims = {m: run_worker(python, m, steps, flag="--sim-worker") for m in SIM_MODES}
            simulated.append(sims)
            runs.update({f"sim {m}": r for m, r in sims.items()})
        got = {run["trl"] for run in runs.values()}
        if got != {version}:
            raise RuntimeError(f"venv for {version} imported trl {got}")
        results.extend(summarise(runs))
    print_table(
        f"SFTTrainer(activation_offloading=True), tiny Llama, {steps} steps, "
        f"accelerator: {environment()['accelerator'] or 'none'}",
        HEADER,
        table_rows(results),
    )
    if simulated:
        print_table(
            f"the same model on the simulated accelerator (tests/simdev), {steps} steps",
            SIM_HEADER,
            [row for sims in simulated for row in sim_rows(sims)],
        )
    payload = {
        "steps": steps,
        "versions": args.versions,
        "results": results,
        "simulated_accelerator": simulated,
    }
    write_json("trl_versions", payload, args.json)
    return payload


if __name__ == "__main__":
    main()
