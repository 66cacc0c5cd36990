# ruff: noqa
# Stand-in (data file: never imported). Imitates Transformer Engine 2.15
# `transformer_engine/pytorch/quantized_tensor.py` (read at v2.15): the helpers that split
# quantized storage objects from their tensors for `save_for_backward`, and
# `restore_from_func_ctx`, the release helper the 2.15 fix added, which drops
# `ctx.tensor_objects` once the objects have been rebuilt.
from typing import Optional

import torch


def prepare_for_saving(*tensors):
    tensor_list, tensor_objects_list = [], []
    for tensor in tensors:
        if tensor is None or isinstance(tensor, torch.Tensor):
            tensor_list.append(tensor)
            tensor_objects_list.append(None)
        else:
            t, t_obj = tensor.prepare_for_saving()
            tensor_list.extend(t)
            tensor_objects_list.append(t_obj)
    return tensor_list, tensor_objects_list


def restore_from_saved(tensor_objects, saved_tensors, return_saved_tensors=False):
    tensor_objects = [t if t is not None else saved_tensors.pop(0) for t in tensor_objects]
    if return_saved_tensors:
        return tensor_objects, saved_tensors
    return tensor_objects


def restore_from_func_ctx(ctx: torch.autograd.function.FunctionCtx, return_saved_tensors=False):
    """Recombine the tensor data and metadata during backward pass and delete tensor
    objects attached to function context."""
    if not hasattr(ctx, "tensor_objects") or ctx.tensor_objects is None:
        raise AttributeError("ctx must have .tensor_objects to restore saved tensors")
    out = restore_from_saved(
        ctx.tensor_objects, ctx.saved_tensors, return_saved_tensors=return_saved_tensors
    )
    ctx.tensor_objects = None
    return out
