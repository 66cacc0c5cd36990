# ruff: noqa
# Stand-in for the LF001 scan rule (data file: never imported).
# Imitates Transformer Engine 2.6-2.13 `transformer_engine/pytorch/ops/fuser.py`
# (`_OperationFuserAutogradFunction`, read at v2.8): forward splits the quantized storage
# objects from their buffers with `prepare_for_saving`, saves the buffers, and parks the
# emptied objects on `func_ctx.tensor_objects`; backward restores the buffers into them and
# never drops the list, so the restored buffers live as long as the graph.
from typing import Any, Optional

import torch

from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from transformer_engine.pytorch.ops.op import OperationContext
from transformer_engine.pytorch.tensor.quantized_tensor import (
    prepare_for_saving,
    restore_from_saved,
)


class _OperationFuserAutogradFunction(torch.autograd.Function):
    """Runs a pipeline of fusible ops as one autograd node."""

    @staticmethod
    def forward(
        func_ctx: Optional[torch.autograd.function.FunctionCtx],
        input_: torch.Tensor,
        fuser: "OperationFuser",
        basic_op_kwargs: list[dict[str, Any]],
        *params_and_extra_inputs: torch.Tensor,
    ):
        # one context object per basic op; ops stash what they need on them
        basic_op_ctxs = [OperationContext() for _ in range(fuser._num_basic_ops)]
        for t in (input_,) + params_and_extra_inputs:
            t._do_not_clear = True

        x = input_
        extra_outputs = [None] * fuser._num_basic_ops
        for op, idxs in fuser._forward_ops:
            for i in idxs:
                basic_op_ctxs[i].requires_grad = i >= fuser.first_op_requiring_backward
            x, op_extra = op.fuser_forward(
                [basic_op_ctxs[i] for i in idxs],
                x,
                basic_op_kwargs=[basic_op_kwargs[i] for i in idxs],
            )
            for i, ys in zip(idxs, op_extra):
                extra_outputs[i] = ys
        extra_flat = [y for ys in extra_outputs for y in ys]

        if func_ctx is not None:
            # gather what every op asked to save, remembering each op's slice
            to_save = []
            for ctx in basic_op_ctxs:
                start = len(to_save)
                if ctx.to_save is not None:
                    to_save.extend(ctx.to_save)
                ctx.to_save = None
                ctx._saved_tensors_range = (start, len(to_save))

            tensors_to_save, tensor_objects = prepare_for_saving(*to_save)
            func_ctx.save_for_backward(*tensors_to_save)
            func_ctx.tensor_objects = tensor_objects

            first = False
            if fuser.first_op_requiring_backward < fuser._num_basic_ops:
                first = FP8GlobalStateManager.is_first_fp8_module()

            func_ctx.backward_ops = fuser._backward_ops
            func_ctx.basic_ops = fuser._basic_ops
            func_ctx.basic_op_ctxs = basic_op_ctxs
            func_ctx.basic_op_num_params = fuser._basic_op_num_params
            func_ctx.num_extra_inputs = fuser.num_extra_inputs
            func_ctx.num_extra_outputs = len(extra_flat)
            func_ctx.is_first_module = first

        x.requires_grad_(fuser.first_op_requiring_backward < fuser._num_basic_ops)
        if extra_flat:
            return x, *extra_flat
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(func_ctx: Any, grad_output: torch.Tensor, *grad_extra_outputs: torch.Tensor):
        basic_ops = func_ctx.basic_ops
        basic_op_ctxs = func_ctx.basic_op_ctxs

        # put the saved buffers back into the storage objects (in place)
        saved = restore_from_saved(func_ctx.tensor_objects, func_ctx.saved_tensors)
        for ctx in basic_op_ctxs:
            ctx.saved_tensors = saved[slice(*ctx._saved_tensors_range)]
            ctx._saved_tensors_range = None

        dx = grad_output
        grad_params = [None] * len(basic_ops)
        for op, idxs in func_ctx.backward_ops:
            if all(not basic_op_ctxs[i].requires_grad for i in idxs):
                dx = None
                break
            dx, op_grad_params, _ = op.fuser_backward([basic_op_ctxs[i] for i in idxs], dx)
            for i, dparams in zip(idxs, op_grad_params):
                grad_params[i] = dparams
                basic_op_ctxs[i].saved_tensors = None

        flat = []
        for i, dparams in enumerate(grad_params):
            n = func_ctx.basic_op_num_params[i]
            flat.extend([None] * n if dparams is None else dparams)
        if func_ctx.is_first_module:
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return (dx, None, None, *flat)
