# ruff: noqa
# Helper module for the te_fused_attention stand-ins (data file: never imported).
# Imitates Transformer Engine 2.15 `transformer_engine/pytorch/quantized_tensor.py`:
# `restore_from_func_ctx(ctx)` restores the saved buffers into `ctx.tensor_objects` and then
# drops the list from ctx, so a backward that calls it releases what forward parked there.
import torch


def prepare_for_saving(*tensors):
    plain, objects = [], []
    for t in tensors:
        if t is None or isinstance(t, torch.Tensor):
            plain.append(t)
            objects.append(None)
        else:
            buffers, emptied = t.prepare_for_saving()
            plain.extend(buffers)
            objects.append(emptied)
    return plain, objects


def restore_from_saved(objects, saved, return_saved_tensors=False):
    restored = []
    for obj in objects:
        if obj is None or isinstance(obj, torch.Tensor):
            restored.append(saved[0])
            saved = saved[1:]
        else:
            saved = obj.restore_from_saved(saved)
            restored.append(obj)
    return (restored, saved) if return_saved_tensors else restored


def restore_from_func_ctx(func_ctx, return_saved_tensors=False):
    if getattr(func_ctx, "tensor_objects", None) is None:
        raise AttributeError("ctx has no tensor_objects to restore from")
    result = restore_from_saved(
        func_ctx.tensor_objects, func_ctx.saved_tensors, return_saved_tensors=return_saved_tensors
    )
    func_ctx.tensor_objects = None  # the storage objects now hold the buffers: let them go
    return result
