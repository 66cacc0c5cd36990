"""Stand-in Transformer Engine packages, written to disk per version, for CPU tests.

Transformer Engine cannot be installed without CUDA. These packages reproduce what the
patches depend on, written from scratch: the import paths and class names of each release
line, package metadata with the version, and the ``prepare_for_saving`` /
``restore_from_saved`` / ``ctx.tensor_objects`` pattern with quantized-storage objects
that hold their buffers outside autograd. Per version:

* 2.0: attention in one module (``transformer_engine.pytorch.attention``); ``_Linear``,
  ``_LayerNormLinear``, ``_LayerNormMLP`` leak too; no op fuser.
* 2.1 / 2.2: the linear modules release ``ctx.tensor_objects`` themselves.
* 2.3+: attention split into ``attention.dot_product_attention.{backends,context_parallel}``.
* 2.6+: the op fuser (``ops.fuser._OperationFuserAutogradFunction``, ``func_ctx``, per-op
  contexts in ``basic_op_ctxs``); 2.14+ the fuser releases ``tensor_objects`` itself.
* 2.11+: ``_LayerNormMLP.backward`` restores (and releases) in ``_recompute(ctx)``.
* 2.15+: ``restore_from_func_ctx(ctx)`` in ``transformer_engine.pytorch.quantized_tensor``,
  used by every Function: all fixed upstream. ``_Linear.backward`` restores in the
  module-level ``_linear_backward``; from 2.16 in ``LinearBwdArgs.setup_saved_tensors``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from packaging.version import Version

QUANTIZED = '''
"""Quantized storage objects: buffers live outside autograd, in plain Python objects."""
import torch


class Float8TensorStorage:
    """Holds an FP8-like payload and its scale; autograd never sees it."""

    def __init__(self, data, scale_inv):
        self._data = data
        self._scale_inv = scale_inv

    def buffers(self):
        return [self._data, self._scale_inv]

    def clear(self):
        self._data = None
        self._scale_inv = None

    def restore(self, data, scale_inv):
        self._data = data
        self._scale_inv = scale_inv

    def dequantize(self):
        return self._data * self._scale_inv


def quantize(t):
    scale_inv = t.abs().amax().clamp(min=1e-6) / 448.0
    return Float8TensorStorage((t / scale_inv).round(), scale_inv)


def prepare_for_saving(*tensors):
    """Buffers to pass to save_for_backward, and the emptied objects to keep on ctx."""
    to_save, objects = [], []
    for t in tensors:
        if isinstance(t, Float8TensorStorage):
            to_save.extend(t.buffers())
            t.clear()
            objects.append(t)
        else:
            to_save.append(t)
            objects.append(None)
    return to_save, objects


def restore_from_saved(tensor_objects, saved_tensors):
    """Put the saved buffers back into the very objects kept on ctx; return the tensors."""
    out, i = [], 0
    for obj in tensor_objects:
        if obj is None:
            out.append(saved_tensors[i])
            i += 1
        else:
            obj.restore(saved_tensors[i], saved_tensors[i + 1])
            out.append(obj)
            i += 2
    return out
'''

FIXED_HELPER = '''
from transformer_engine.pytorch.tensor.quantized_tensor import restore_from_saved


def restore_from_func_ctx(ctx):
    """2.15's fix: restore, then drop the reference ctx held."""
    tensors = restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
    ctx.tensor_objects = None
    return tensors
'''

# TE's forward: quantize, strip the buffers out of the storage objects, park the objects.
FORWARD = """
    @staticmethod
    def forward(ctx, x, w):
        xq = quantize(x)
        out = xq.dequantize() @ w
        tensors_to_save, tensor_objects = prepare_for_saving(xq, w)
        ctx.save_for_backward(*tensors_to_save)
        ctx.tensor_objects = tensor_objects
        return out
"""

# One autograd Function with TE's pattern. {restore} is the backward's restore statement.
FUNCTION = """
class {name}(torch.autograd.Function):
{forward}
    @staticmethod
    def backward(ctx, grad_output):
{restore}
        x = xq.dequantize()
        return grad_output @ w.t(), x.t() @ grad_output
"""

LEAKY_RESTORE = "        xq, w = restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)"
SELF_FIXED_RESTORE = (
    "        xq, w = restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)\n"
    "        ctx.tensor_objects = None"
)
FUNC_CTX_FIXED_RESTORE = "        xq, w = restore_from_func_ctx(ctx)"

FUSER = '''
class OperationContext:
    """Per-op context: what one fused op saved for its own backward."""

    def __init__(self):
        self.saved_tensors = ()


class _OperationFuserAutogradFunction(torch.autograd.Function):
    @staticmethod
    def forward(func_ctx, x, w):
        xq = quantize(x)
        out = xq.dequantize() @ w
        op_ctx = OperationContext()
        op_ctx.saved_tensors = (torch.zeros(4096),)  # what an op that may not run kept
        func_ctx.basic_op_ctxs = [op_ctx]
        tensors_to_save, tensor_objects = prepare_for_saving(xq, w)
        func_ctx.save_for_backward(*tensors_to_save)
        func_ctx.tensor_objects = tensor_objects
        return out

    @staticmethod
    def backward(func_ctx, grad_output):
        xq, w = restore_from_saved(func_ctx.tensor_objects, func_ctx.saved_tensors)
{fix}
        x = xq.dequantize()
        return grad_output @ w.t(), x.t() @ grad_output
'''

HEADER = """
import torch
from transformer_engine.pytorch.tensor.quantized_tensor import (
    prepare_for_saving,
    quantize,
    restore_from_saved,
)
"""


def _write(root: Path, module: str, text: str) -> None:
    """Write ``module`` ("a.b.c" -> a/b/c.py, "a.b.__init__" -> a/b/__init__.py)."""
    parts = module.split(".")
    directory = root
    for part in parts[:-1]:
        directory = directory / part
        directory.mkdir(exist_ok=True)
        init = directory / "__init__.py"
        if not init.exists():
            init.write_text("")
    (directory / f"{parts[-1]}.py").write_text(textwrap.dedent(text).lstrip())


# Where later releases moved the restore: out of backward, into code of the same module.
MLP_RECOMPUTE = """
class _LayerNormMLP(torch.autograd.Function):
{forward}
    @staticmethod
    def _recompute(ctx):
{restore}
        return xq, w

    @staticmethod
    def backward(ctx, grad_output):
        xq, w = _LayerNormMLP._recompute(ctx)
        x = xq.dequantize()
        return grad_output @ w.t(), x.t() @ grad_output
"""

LINEAR_HELPER = """
class LinearBwdArgs:
    def setup_saved_tensors(self, ctx):
        self.xq, self.w = restore_from_func_ctx(ctx)


def _linear_backward(ctx, grad_output):
{restore}
    x = xq.dequantize()
    return grad_output @ w.t(), x.t() @ grad_output


class _Linear(torch.autograd.Function):
{forward}
    @staticmethod
    def backward(ctx, grad_output):
        return _linear_backward(ctx, grad_output)
"""


def _functions(names: list[str], restore: str, fixed_helper: bool) -> str:
    head = HEADER
    if fixed_helper:
        head += "from transformer_engine.pytorch.quantized_tensor import restore_from_func_ctx\n"
    return head + "".join(FUNCTION.format(name=n, restore=restore, forward=FORWARD) for n in names)


def build(root: Path, version: str) -> Path:
    """Write a stand-in ``transformer_engine`` of ``version`` under ``root``; return root."""
    v = Version(version)
    root.mkdir(parents=True, exist_ok=True)
    dist = root / f"transformer_engine-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: transformer_engine\nVersion: {version}\n"
    )
    (dist / "RECORD").write_text("")
    _write(root, "transformer_engine.__init__", f'__version__ = "{version}"\n')
    _write(root, "transformer_engine.pytorch.__init__", "")
    _write(root, "transformer_engine.pytorch.tensor.quantized_tensor", QUANTIZED)

    all_fixed = v >= Version("2.15")
    if all_fixed:
        _write(root, "transformer_engine.pytorch.quantized_tensor", FIXED_HELPER)
    leaky = FUNC_CTX_FIXED_RESTORE if all_fixed else LEAKY_RESTORE

    attention = ["FusedAttnFunc"]
    context_parallel = ["AttnFuncWithCPAndKVP2P", "AttnFuncWithCPAndQKVOA2A"]
    if v >= Version("2.3"):
        _write(root, "transformer_engine.pytorch.attention.__init__", "")
        _write(
            root,
            "transformer_engine.pytorch.attention.dot_product_attention.backends",
            _functions(attention, leaky, all_fixed),
        )
        _write(
            root,
            "transformer_engine.pytorch.attention.dot_product_attention.context_parallel",
            _functions(context_parallel, leaky, all_fixed),
        )
    else:
        _write(
            root,
            "transformer_engine.pytorch.attention",
            _functions(attention + context_parallel, leaky, all_fixed),
        )
    _write(
        root,
        "transformer_engine.pytorch.module.grouped_linear",
        _functions(["_GroupedLinear"], leaky, all_fixed),
    )
    linear_restore = (
        LEAKY_RESTORE
        if v < Version("2.1")
        else (FUNC_CTX_FIXED_RESTORE if all_fixed else SELF_FIXED_RESTORE)
    )
    for module, cls in (
        ("linear", "_Linear"),
        ("layernorm_linear", "_LayerNormLinear"),
        ("layernorm_mlp", "_LayerNormMLP"),
    ):
        if cls == "_LayerNormMLP" and v >= Version("2.11"):
            text = _functions([], "", all_fixed) + MLP_RECOMPUTE.format(
                restore=linear_restore, forward=FORWARD
            )
        elif cls == "_Linear" and all_fixed:
            restore = (
                "    args = LinearBwdArgs()\n"
                "    args.setup_saved_tensors(ctx)\n"
                "    xq, w = args.xq, args.w"
                if v >= Version("2.16")
                else "    xq, w = restore_from_func_ctx(ctx)"
            )
            text = _functions([], "", all_fixed) + LINEAR_HELPER.format(
                restore=restore, forward=FORWARD
            )
        else:
            text = _functions([cls], linear_restore, all_fixed)
        _write(root, f"transformer_engine.pytorch.module.{module}", text)
    if v >= Version("2.6"):
        fix = "        func_ctx.tensor_objects = None" if v >= Version("2.14") else "        pass"
        _write(root, "transformer_engine.pytorch.ops.fuser", HEADER + FUSER.format(fix=fix))
    return root


#: Where each patch's class lives, per layout (for the tests).
def location(patch: str, version: str) -> tuple[str, str]:
    v = Version(version)
    new = v >= Version("2.3")
    table = {
        "fuser": ("transformer_engine.pytorch.ops.fuser", "_OperationFuserAutogradFunction"),
        "fused_attention": (
            "transformer_engine.pytorch.attention.dot_product_attention.backends"
            if new
            else "transformer_engine.pytorch.attention",
            "FusedAttnFunc",
        ),
        "cp_attention_p2p": (
            "transformer_engine.pytorch.attention.dot_product_attention.context_parallel"
            if new
            else "transformer_engine.pytorch.attention",
            "AttnFuncWithCPAndKVP2P",
        ),
        "cp_attention_a2a": (
            "transformer_engine.pytorch.attention.dot_product_attention.context_parallel"
            if new
            else "transformer_engine.pytorch.attention",
            "AttnFuncWithCPAndQKVOA2A",
        ),
        "grouped_linear": ("transformer_engine.pytorch.module.grouped_linear", "_GroupedLinear"),
        "linear": ("transformer_engine.pytorch.module.linear", "_Linear"),
        "layernorm_linear": (
            "transformer_engine.pytorch.module.layernorm_linear",
            "_LayerNormLinear",
        ),
        "layernorm_mlp": ("transformer_engine.pytorch.module.layernorm_mlp", "_LayerNormMLP"),
    }
    return table[patch]
