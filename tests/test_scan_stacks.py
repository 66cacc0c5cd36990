"""`leakfree scan` on the shapes of the stacks labelled store by store before the rules
were changed for them (benchmarks/labels/: gsplat, torchrec, DGL, mmcv, MinkowskiEngine,
verl, Lightning Thunder; and the backward stores added to the earlier labels).

Each case is a real shape cut to what decides the verdict, written for the test (not the
projects' code); its comment names the stack and version it comes from. Every rule change
of that round has one here, seen failing on the rules before it.
"""

from __future__ import annotations

import ast
import textwrap

from leakfree.scan._model import ScanFinding, Source
from leakfree.scan.rules import RULES
from tests._scan import project_of, source


def check(*sources: Source) -> list[ScanFinding]:
    """Every rule on the first source, the others in the project (helpers, callers)."""
    project = project_of(*sources)
    return sorted(
        f for rule in RULES if rule.wants(sources[0].text) for f in rule.check(sources[0], project)
    )


def warned(*sources: Source) -> list[str]:
    return sorted(f.symbol for f in check(*sources) if f.level == "warning")


def noted(*sources: Source) -> list[str]:
    return sorted(f.symbol for f in check(*sources) if f.level == "note")


def code(path: str, text: str) -> Source:
    return source(path, textwrap.dedent(text))


# --- precision: opaque values and annotations the callers contradict -----------------------

# gsplat 90d7b4b sensors/kernels/cameras/ops.py: a TorchScript custom class (camera model)
# handed to a torch.ops custom op and to its backward op, kept on ctx in 38 Functions
GSPLAT = """
import torch
from torch import Tensor

PinholeProjection = torch.classes.gsplat_sensors.OpenCVPinholeProjection


class _CameraRaysToImagePoints(torch.autograd.Function):
    @staticmethod
    def forward(ctx, camera_rays: Tensor, projection: PinholeProjection, distortion, focal: Tensor):
        del focal
        points, valid, scratch = torch.ops.gsplat_sensors.rays_to_points(
            projection, distortion, camera_rays
        )
        ctx.projection = projection
        ctx.distortion = distortion
        ctx.save_for_backward(camera_rays, scratch)
        ctx.mark_non_differentiable(valid)
        return points, valid

    @staticmethod
    def backward(ctx, grad_points, grad_valid):
        camera_rays, scratch = ctx.saved_tensors
        grad_rays, grad_focal = torch.ops.gsplat_sensors.rays_to_points_backward(
            ctx.projection, ctx.distortion, camera_rays, grad_points.contiguous(), scratch
        )
        return grad_rays, None, None, grad_focal
"""


def test_a_script_object_handed_to_a_custom_op_is_opaque() -> None:
    assert check(code("ops.py", GSPLAT)) == []


# mmcv 2.2.0 ops/multi_scale_deform_attn.py: `im2col_step: torch.Tensor`, while the one
# caller hands it the module's int (`im2col_step: int = 64` in __init__)
MMCV_MSDA = """
import torch
from torch import nn
from torch.autograd.function import Function


class MultiScaleDeformableAttnFunction(Function):
    @staticmethod
    def forward(ctx, value: torch.Tensor, shapes: torch.Tensor, locations: torch.Tensor,
                im2col_step: torch.Tensor) -> torch.Tensor:
        ctx.im2col_step = im2col_step
        output = ext_module.ms_deform_attn_forward(value, shapes, locations,
                                                   im2col_step=ctx.im2col_step)
        ctx.save_for_backward(value, shapes, locations)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        value, shapes, locations = ctx.saved_tensors
        grad_value = torch.zeros_like(value)
        ext_module.ms_deform_attn_backward(value, shapes, locations, grad_output.contiguous(),
                                           grad_value, im2col_step=ctx.im2col_step)
        return grad_value, None, None, None


class MultiScaleDeformableAttention(nn.Module):
    def __init__(self, embed_dims: int = 256, im2col_step: int = 64):
        super().__init__()
        self.im2col_step = im2col_step

    def forward(self, value, shapes, locations):
        return MultiScaleDeformableAttnFunction.apply(value, shapes, locations, self.im2col_step)
"""


def test_an_annotation_the_callers_contradict_loses_to_them() -> None:
    assert check(code("msda.py", MMCV_MSDA)) == []
    # the same Function whose one caller hands it a tensor: the annotation stands
    tensor_caller = MMCV_MSDA.replace(
        "locations, self.im2col_step)", "locations, torch.arange(locations.shape[0]))"
    )
    assert warned(code("msda.py", tensor_caller)) == [
        "MultiScaleDeformableAttnFunction.im2col_step"
    ]


# ColossalAI 0.5.1 moe/_operation.py (the other direction): `activated_experts: int`, and
# every caller hands it an element of a tensor
COLOSSAL_EXPERTS = """
import torch


class DPGradScalerIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, moe_dp_size: int, activated_experts: int):
        ctx.moe_dp_size = moe_dp_size
        ctx.activated_experts = activated_experts
        return inputs

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.moe_dp_size / ctx.activated_experts, None, None


def route(hidden, counts, dp_size: int):
    active = torch.sum(counts > 0, dim=0)
    for i in range(active.shape[0]):
        hidden = DPGradScalerIn.apply(hidden, dp_size, active[i])
    return hidden
"""


def test_callers_that_hand_a_tensor_to_an_int_annotation_win() -> None:
    assert warned(code("moe.py", COLOSSAL_EXPERTS)) == ["DPGradScalerIn.activated_experts"]


# mmcv 2.2.0 ops/deform_conv.py and thunder 0.2.6 triton_crossentropy_impl.py: empty
# workspaces and a full reduction are tensors of a few bytes
SMALL = """
import torch


class DeformConv2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, offset, weight):
        ctx.bufs_ = [input.new_empty(0), input.new_empty(0)]
        ctx.scale = (offset != 0).float().sum()
        output = input.new_empty(input.shape)
        ext_module.deform_conv_forward(input, weight, offset, output, ctx.bufs_[0], ctx.bufs_[1])
        ctx.save_for_backward(input, offset, weight)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, offset, weight = ctx.saved_tensors
        grad_input = torch.zeros_like(input)
        ext_module.deform_conv_backward(input, offset, grad_output, grad_input, ctx.bufs_[0])
        return grad_input / ctx.scale, None, None
"""


def test_constant_size_factories_and_full_reductions_are_notes() -> None:
    src = code("deform.py", SMALL)
    assert warned(src) == []
    assert noted(src) == ["DeformConv2dFunction.bufs_", "DeformConv2dFunction.scale"]


# DGL 2.4.0 nn/pytorch/conv/grouprevres.py: the module's weights, a slice of *args
DGL_WEIGHTS = """
import torch


class InvertibleCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, fn_inverse, num_inputs, *inputs_and_weights):
        ctx.fn = fn
        ctx.weights = inputs_and_weights[num_inputs:]
        inputs = inputs_and_weights[:num_inputs]
        with torch.no_grad():
            outputs = ctx.fn(*inputs).detach_()
        ctx.inputs = [inputs]
        ctx.outputs = [outputs]
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs = ctx.inputs.pop()
        outputs = ctx.outputs.pop()
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        grads = torch.autograd.grad(out, inputs + ctx.weights, grad_outputs)
        return (None, None, None) + grads
"""


def test_weights_sliced_from_the_inputs_are_a_note_and_popped_lists_are_released() -> None:
    src = code("grouprevres.py", DGL_WEIGHTS)
    # LF001 is quiet: backward pops both lists. The output kept in one is still a
    # reference cycle (output -> grad_fn -> ctx.outputs) until it does: LF002's
    found = [(f.rule, f.symbol) for f in check(src) if f.level == "warning"]
    assert found == [("LF002", "InvertibleCheckpoint.outputs")]
    assert noted(src) == ["InvertibleCheckpoint.weights"]


# --- evidence from use ------------------------------------------------------------------------

# MinkowskiEngine 0.5.4 MinkowskiPooling.py: the second result of the compiled forward
# (counts or max indices per output row), handed to the compiled backward of the same op
MINKOWSKI = """
import torch
from torch.autograd import Function


class MinkowskiLocalPoolingFunction(Function):
    @staticmethod
    def forward(ctx, input_features: torch.Tensor, pooling_mode, kernel_generator,
                in_key, out_key=None, manager=None):
        input_features = input_features.contiguous()
        ctx.input_features = input_features
        ctx.kernel_generator = kernel_generator
        ctx.manager = manager
        fw_fn = get_minkowski_function("LocalPoolingForward", input_features)
        out_feat, num_nonzero = fw_fn(ctx.input_features, kernel_generator.kernel_size,
                                      pooling_mode, in_key, out_key, manager._manager)
        ctx.num_nonzero = num_nonzero
        return out_feat

    @staticmethod
    def backward(ctx, grad_out_feat):
        grad_out_feat = grad_out_feat.contiguous()
        bw_fn = get_minkowski_function("LocalPoolingBackward", grad_out_feat)
        grad_in_feat = bw_fn(ctx.input_features, grad_out_feat, ctx.num_nonzero,
                             ctx.kernel_generator.kernel_size, ctx.manager._manager)
        return grad_in_feat, None, None, None, None, None
"""


def test_a_compiled_op_s_result_handed_to_its_backward_half_is_a_tensor() -> None:
    assert warned(code("pooling.py", MINKOWSKI)) == [
        "MinkowskiLocalPoolingFunction.input_features",
        "MinkowskiLocalPoolingFunction.num_nonzero",
    ]
    # an argument of the compiled op is not: the manager went in, it did not come out
    only_in = MINKOWSKI.replace("ctx.num_nonzero = num_nonzero", "del num_nonzero")
    assert warned(code("pooling.py", only_in)) == ["MinkowskiLocalPoolingFunction.input_features"]


# DGL 2.4.0 backend/pytorch/sparse.py: a tuple of unannotated inputs kept on ctx and
# unpacked in backward; GATHERMM uses B as a tensor there, SEGMENTMM returns a gradient
# for A and B (only tensor inputs get one)
DGL_MM = """
import torch as th


class SEGMENTMM(th.autograd.Function):
    @staticmethod
    def forward(ctx, A, B, seglen_A):
        if B.dim() != 3:
            raise ValueError("segment_mm expects B to be a 3D tensor.")
        C = th.empty((A.shape[0], B.shape[2]), device=A.device, dtype=A.dtype)
        C = _segment_mm(A, B, C, seglen_A)
        ctx.backward_cache = A, B, seglen_A
        return C

    @staticmethod
    def backward(ctx, dZ):
        A, B, seglen_A = ctx.backward_cache
        A_grad = th.empty(A.shape, device=A.device, dtype=A.dtype)
        A_grad = _segment_mm(dZ, B, A_grad, seglen_A, b_trans=True)
        B_grad = _segment_mm_backward_B(A, dZ, th.empty(B.shape), seglen_A)
        return A_grad, B_grad, None


class GATHERMM(th.autograd.Function):
    @staticmethod
    def forward(ctx, A, B, idx_a, idx_b):
        C = th.zeros((len(idx_a), B.shape[2]), device=A.device, dtype=A.dtype)
        C = _gather_mm(A, B, C, idx_a, idx_b)
        ctx.backward_cache = A, B, idx_a, idx_b
        return C

    @staticmethod
    def backward(ctx, dZ):
        A, B, idx_a, idx_b = ctx.backward_cache
        A_grad = _gather_mm_scatter(dZ, B.transpose(1, 2), idx_b=idx_b, idx_c=idx_a)
        return A_grad, None, None, None


def _segment_mm(A, B, out, seglen_A, b_trans=False):
    _CAPI_DGLKernelSEGMENTMM(to_dgl_nd(A), to_dgl_nd(B), to_dgl_nd_for_write(out))
    return out
"""


def test_a_stored_tuple_unpacked_in_backward_and_gradients_returned_for_inputs() -> None:
    found = {f.symbol: f for f in check(code("sparse.py", DGL_MM)) if f.level == "warning"}
    assert sorted(found) == ["GATHERMM.backward_cache", "SEGMENTMM.backward_cache"]
    assert "gradient for A" in found["SEGMENTMM.backward_cache"].message
    # without the gradient, backward's use of the unpacked B says it alone
    no_grad = DGL_MM.replace("return A_grad, None, None, None", "return None, None, None, None")
    found = {f.symbol: f for f in check(code("sparse.py", no_grad)) if f.level == "warning"}
    assert "B.transpose" in found["GATHERMM.backward_cache"].message


# torch 2.13 nn/utils/_expanded_weights/layer_norm_expanded_weights.py: a tuple of inputs
# split off by a helper the scan cannot read, kept whole on ctx; backward unpacks it and
# uses its first element as a tensor (found by the rules before this round, lost by a
# change of it, found again)
EXPANDED_ARGS = """
import torch

from .utils import standard_kwargs  # not in the scanned tree: its return is not read


class LayerNormPerSampleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kwarg_names, _, *expanded_args_and_kwargs):
        expanded_args, expanded_kwargs = standard_kwargs(kwarg_names, expanded_args_and_kwargs)
        ctx.args = expanded_args
        ctx.eps = expanded_kwargs["eps"]
        return expanded_args[0] * 2

    @staticmethod
    def backward(ctx, grad_output):
        input, normalized_shape = ctx.args
        if input.requires_grad:
            return None, None, grad_output * 2
        return None, None, None
"""


def test_a_tuple_kept_whole_whose_element_backward_uses_as_a_tensor() -> None:
    # inside torch, the helper's name resolves to a torch function: no evidence either way
    text = textwrap.dedent(EXPANDED_ARGS)
    module = "torch.nn.utils._expanded_weights.layer_norm_expanded_weights"
    found = warned(Source("layer_norm_expanded_weights.py", text, ast.parse(text), module))
    assert found == ["LayerNormPerSampleGrad.args"]


def test_matmul_and_arithmetic_whose_result_is_a_tensor_show_their_operands() -> None:
    # the work item's shape: a stored value floor-divided and used as an index tensor,
    # another multiplied as a matrix; a float multiplied into a gradient says nothing
    text = """
    import torch


    class Route(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, slots, proj, scale):
            ctx.slots = slots
            ctx.proj = proj
            ctx.scale = scale
            return x

        @staticmethod
        def backward(ctx, g):
            rows = (ctx.slots // 4).long()
            return g[rows] @ ctx.proj * ctx.scale, None, None, None
    """
    assert warned(code("route.py", text)) == ["Route.proj", "Route.slots"]


# --- objects that carry tensors, and releases where they happen ---------------------------

# torchrec v2025.09.29.00 distributed/comm_ops.py: a Request shared by a *_Req / *_Wait pair
# of Functions; the Req's forward parks the collective's output in myreq.tensor, the Wait's
# forward takes it out, the Wait's backward parks the gradient buffer there and the Req's
# backward clears it. ctx.tensor (the same output, on ctx) is never released.
TORCHREC = """
from typing import Generic, Optional, TypeVar

import torch
from torch import Tensor
from torch.autograd import Function

W = TypeVar("W")


class Request(Generic[W]):
    def __init__(self, pg, device: torch.device) -> None:
        self.pg = pg
        self.req = None
        self.tensor: Optional[W] = None
        self.wait_function = None
        self.dummy_tensor: torch.Tensor = torch.zeros_like(
            torch.empty(1, requires_grad=True, device=device)
        )


class All2Allv_Req(Function):
    @staticmethod
    def forward(ctx, pg, myreq: Request[Tensor], a2ai, inputs):
        input = torch.cat(inputs, dim=1).view([-1])
        output = input.new_empty(sum(a2ai.output_split_sizes))
        req = dist.all_to_all_single(output, input, group=pg, async_op=True)
        myreq.req = req
        myreq.tensor = output
        myreq.wait_function = All2Allv_Wait
        ctx.a2ai = a2ai
        ctx.myreq = myreq
        ctx.tensor = output
        return myreq.dummy_tensor

    @staticmethod
    def backward(ctx, *grad_output):
        myreq = ctx.myreq
        myreq.req.wait()
        myreq.req = None
        grad_input = myreq.tensor
        grad_inputs = grad_input.view([ctx.a2ai.B_global, -1]).split(ctx.a2ai.D_local_list, 1)
        myreq.tensor = None
        myreq.dummy_tensor = None
        return (None, None, None, *grad_inputs)


class All2Allv_Wait(Function):
    @staticmethod
    def forward(ctx, pg, myreq: Request[Tensor], *dummy_tensor):
        a2ai = myreq.a2ai
        ctx.a2ai = a2ai
        myreq.req.wait()
        myreq.req = None
        output = myreq.tensor
        myreq.tensor = None
        ctx.pg = pg
        ctx.myreq = myreq
        return tuple(out.view([a2ai.B_local, -1]) for out in output.split(a2ai.splits))

    @staticmethod
    def backward(ctx, *grad_outputs):
        myreq = ctx.myreq
        grad_output = torch.cat([g.contiguous().view([-1]) for g in grad_outputs])
        grad_input = grad_output.new_empty([ctx.a2ai.B_global * sum(ctx.a2ai.D_local_list)])
        myreq.req = dist.all_to_all_single(grad_input, grad_output, group=ctx.pg, async_op=True)
        myreq.tensor = grad_input
        return (None, None, myreq.dummy_tensor)
"""


def test_a_shared_request_whose_tensor_fields_the_pair_clears_is_released() -> None:
    # ctx.tensor is the one real leak; myreq's fields are cleared by the Req's backward
    assert warned(code("comm_ops.py", TORCHREC)) == ["All2Allv_Req.tensor"]


def test_an_object_with_tensor_fields_nobody_clears_is_reported_with_its_fields() -> None:
    kept = TORCHREC.replace("        myreq.tensor = None\n        myreq.dummy_tensor = None\n", "")
    found = {f.symbol: f for f in check(code("comm_ops.py", kept)) if f.level == "warning"}
    assert sorted(found) == ["All2Allv_Req.myreq", "All2Allv_Req.tensor", "All2Allv_Wait.myreq"]
    # the field that holds real tensors is named; the one-element dummy is not
    assert "myreq.tensor" in found["All2Allv_Wait.myreq"].message
    assert "dummy_tensor" not in found["All2Allv_Wait.myreq"].message


# torchrec's info dataclasses: fields annotated as tensors, handed in and parked on ctx
TORCHREC_INFO = """
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor


@dataclass
class All2AllSequenceInfo:
    embedding_dim: int
    lengths_after_sparse_data_all2all: Tensor
    forward_recat_tensor: Optional[Tensor]
    input_splits: List[int]


class All2All_Seq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pg, a2ai: All2AllSequenceInfo, embeddings: Tensor):
        ctx.a2ai = a2ai
        ctx.pg = pg
        return embeddings.view(-1, a2ai.embedding_dim)

    @staticmethod
    def backward(ctx, grad):
        return None, None, grad.view(-1)
"""


def test_a_dataclass_with_tensor_fields_parked_on_ctx_names_its_fields() -> None:
    (found,) = [f for f in check(code("info.py", TORCHREC_INFO)) if f.level == "warning"]
    assert found.symbol == "All2All_Seq.a2ai"
    assert "lengths_after_sparse_data_all2all" in found.message
    assert "forward_recat_tensor" in found.message and "input_splits" not in found.message


# Lightning Thunder 0.2.6 executors/torch_autograd.py: a dict shared by two Functions; the
# first parks outputs in it, the second pops them; the second's backward parks gradients
# and saved tensors in it (a store made in backward), the first's backward pops them
THUNDER = """
import torch


class ThunderFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, compiled_backward, side_channel, saved_tensors, saved_other, flat_output,
                *flat_args):
        ctx.compiled_backward = compiled_backward
        ctx.saved_other = saved_other
        ctx.side_channel = side_channel
        if side_channel is not None:
            ctx.side_channel["fw"] = flat_output
            ctx.side_channel["tensors_to_save"] = saved_tensors
            return torch.randn(1, device="meta", requires_grad=True)
        ctx.save_for_backward(*saved_tensors)
        return flat_output

    @staticmethod
    def backward(ctx, *raw_args):
        args = ctx.side_channel.pop("bw")
        saved_tensors_list = ctx.side_channel.pop("saved_tensors")
        grads = ctx.compiled_backward([saved_tensors_list, ctx.saved_other], args)
        return (None, None, None, None, None, *grads)


class ThunderOutputFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dummy, side_channel, *args):
        ctx.side_channel = side_channel
        ctx.num_args = len(args)
        res = ctx.side_channel.pop("fw")
        ctx.save_for_backward(*ctx.side_channel.pop("tensors_to_save"))
        return res

    @staticmethod
    def backward(ctx, *args):
        ctx.side_channel["bw"] = list(args)
        ctx.side_channel["saved_tensors"] = list(ctx.saved_tensors)
        return torch.randn(1, device="meta"), None, *([None] * ctx.num_args)
"""


def test_a_dict_the_pair_pops_is_released_and_backward_stores_are_judged() -> None:
    assert check(code("torch_autograd.py", THUNDER)) == []
    # without the pops in ThunderFunction's backward, what the second backward parked stays
    kept = THUNDER.replace('ctx.side_channel.pop("bw")', 'ctx.side_channel["bw"]').replace(
        'ctx.side_channel.pop("saved_tensors")', 'ctx.side_channel["saved_tensors"]'
    )
    found = {f.symbol: f for f in check(code("torch_autograd.py", kept)) if f.level == "warning"}
    assert sorted(found) == ["ThunderFunction.side_channel", "ThunderOutputFunction.side_channel"]
    assert "backward" in found["ThunderOutputFunction.side_channel"].message


# Liger-Kernel 0.8.2 backends/_ascend/ops/fused_neighborhood_attention.py: backward caches
# its gradients on ctx for a repeated backward, and nothing drops them
LIGER_BACKWARD_CACHE = """
import torch


class LigerFusedNeighborhoodAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, kernel_size=7):
        output, attn_weights = fused_forward(query, key, value, kernel_size)
        ctx.save_for_backward(query, key, value, attn_weights)
        ctx.kernel_size = kernel_size
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, attn_weights = ctx.saved_tensors
        cache_key = (grad_output.untyped_storage().data_ptr(), grad_output._version)
        backward_cache = getattr(ctx, "_backward_cache", None)
        if backward_cache is not None and cache_key in backward_cache:
            return (*backward_cache[cache_key], None)
        grad_query, grad_key, grad_value = fused_backward(
            grad_output.contiguous(), query, key, value, attn_weights, ctx.kernel_size
        )
        if backward_cache is None:
            backward_cache = {}
            ctx._backward_cache = backward_cache
        backward_cache[cache_key] = (grad_query, grad_key, grad_value)
        return grad_query, grad_key, grad_value, None


def fused_backward(grad, q, k, v, attn, kernel_size):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
"""


def test_a_cache_filled_in_backward_and_never_dropped_is_a_leak() -> None:
    found = [f for f in check(code("nat.py", LIGER_BACKWARD_CACHE)) if f.level == "warning"]
    assert [f.symbol for f in found] == ["LigerFusedNeighborhoodAttentionFunction._backward_cache"]
    assert "backward" in found[0].message


# verl 0.7.0 utils/activation_offload.py: the pack hook hands the tensor to another object's
# method (the offload handler's tensor_push), which parks it in its own tag table and
# returns the tag; the hook returns that tag through a local name
VERL = """
import torch


class CpuOffloadHookWithOffloadHandler:
    def __init__(self, offload_handler, handler_extra_kwargs=None):
        self.offload_handler = offload_handler
        self.handler_extra_kwargs = handler_extra_kwargs or {}

    def __enter__(self):
        torch._C._autograd._push_saved_tensors_default_hooks(
            self.on_save_for_backward, self.on_get_saved_tensor
        )

    def __exit__(self, *args):
        torch._C._autograd._pop_saved_tensors_default_hooks()

    def on_save_for_backward(self, tensor: torch.Tensor):
        retrieve_identifier = self.offload_handler.tensor_push(tensor, **self.handler_extra_kwargs)
        return retrieve_identifier

    def on_get_saved_tensor(self, saved_state):
        return self.offload_handler.tensor_pop(saved_state, **self.handler_extra_kwargs)


class SynchronizedGroupOffloadHandler:
    def __init__(self, num_offload_group):
        self.num_offload_group = num_offload_group
        self.current_group, self.tensor_count_current_group = (0, 0)
        self.tensor_tag_to_state = {}

    @staticmethod
    def offload(src_tensor):
        cpu_backup = torch.empty(src_tensor.size(), dtype=src_tensor.dtype, device="cpu")
        cpu_backup.copy_(src_tensor, non_blocking=True)
        return (src_tensor.device, cpu_backup)

    def tensor_push(self, tensor: torch.Tensor, **kwargs):
        tensor_tag = (self.current_group, self.tensor_count_current_group)
        self.tensor_count_current_group += 1
        if self.current_group < self.num_offload_group:
            state = SynchronizedGroupOffloadHandler.offload(tensor)
            self.tensor_tag_to_state[tensor_tag] = state
        else:
            self.tensor_tag_to_state[tensor_tag] = tensor
        return tensor_tag

    def tensor_pop(self, tensor_tag, **kwargs):
        return self.tensor_tag_to_state.pop(tensor_tag)
"""


def test_a_pack_hook_s_table_filled_through_another_object_s_method() -> None:
    found = check(code("activation_offload.py", VERL))
    assert [(f.rule, f.symbol) for f in found] == [
        ("LF004", "SynchronizedGroupOffloadHandler.tensor_tag_to_state")
    ]


# Lightning Thunder 0.2.6 tests/opinfos.py: a test table of op descriptions, one of them
# built around the loss *function* (an attribute of an imported module, not a loss value)
THUNDER_OPINFOS = """
import thunder.torch as ltorch

nn_ops = []

nll_loss_opinfo = OpInfo(
    ltorch.nll_loss,
    sample_input_generator=nll_loss_sample_generator,
)
nn_ops.append(nll_loss_opinfo)
"""


def test_a_loss_function_of_an_imported_module_is_not_a_loss() -> None:
    assert check(code("opinfos.py", THUNDER_OPINFOS)) == []


# DeepSpeed 0.19.8 runtime/domino/async_linear.py: backward parks the all-reduce's handle in
# a dict the caller handed in; a handle is not a tensor
DOMINO = """
import torch
import torch.distributed as dist


class DominoAsyncColumnParallelLinearImpl(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, handle_dic, h_id):
        ctx.save_for_backward(inp, weight, bias)
        ctx.handle_dic = handle_dic
        ctx.h_id = h_id
        return torch.matmul(inp, weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight, bias = ctx.saved_tensors
        grad_input = torch.matmul(grad_output, weight)
        handle = dist.all_reduce(grad_input, async_op=True)
        ctx.handle_dic[ctx.h_id] = handle
        return grad_input, None, None, None, None
"""


def test_a_handle_parked_in_backward_is_not_a_tensor() -> None:
    assert check(code("async_linear.py", DOMINO)) == []
