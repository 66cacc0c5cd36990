# ruff: noqa
# Stand-in (data file: never imported). Imitates Transformer Engine 2.15
# `transformer_engine/pytorch/ops/fuser.py` (read at v2.15, lines 15 and 160-220): forward
# parks the quantized storage objects on `func_ctx.tensor_objects` as 2.6-2.13 did, and
# backward restores them through `restore_from_func_ctx`, which lives in
# `..quantized_tensor` and sets `ctx.tensor_objects = None`. Scanned alone (as pre-commit
# does), the scanner must read that helper from the package to see the release.
from typing import Any, Optional

import torch

from ..quantized_tensor import prepare_for_saving, restore_from_func_ctx


class _OperationFuserAutogradFunction(torch.autograd.Function):
    """Runs a pipeline of fusible ops as one autograd node."""

    @staticmethod
    def forward(func_ctx: Optional[torch.autograd.function.FunctionCtx], input_: torch.Tensor, fuser, basic_op_kwargs, *params_and_extra_inputs):
        x = input_
        to_save = []
        for op, ctx in zip(fuser._basic_ops, fuser._basic_op_ctxs):
            x = op.op_forward(ctx, x, **basic_op_kwargs)
            to_save.extend(ctx.to_save or ())
        if func_ctx is not None:
            tensors_to_save, tensor_objects = prepare_for_saving(*to_save)
            func_ctx.save_for_backward(*tensors_to_save)
            func_ctx.tensor_objects = tensor_objects
            func_ctx.fuser = fuser
        return x

    @staticmethod
    def backward(func_ctx: Any, grad_output: torch.Tensor):
        fuser = func_ctx.fuser
        saved_tensors = restore_from_func_ctx(func_ctx)
        dx = grad_output
        for op, ctx in reversed(list(zip(fuser._basic_ops, fuser._basic_op_ctxs))):
            ctx.saved_tensors = saved_tensors[: len(ctx.to_save or ())]
            saved_tensors = saved_tensors[len(ctx.to_save or ()) :]
            dx = op.op_backward(ctx, dx)
        return (dx, None, None) + (None,) * func_ctx.num_params
