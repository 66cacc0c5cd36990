"""LF001 (ctx state that outlives backward) and LF002 (an output stored on ctx).

The stand-ins in tests/scan_cases/ imitate the real Transformer Engine code (their headers
say which file and version); the inline cases pin each heuristic of the rules.
"""

from __future__ import annotations

import re
import textwrap

import pytest

from leakfree.scan._model import ScanFinding, Source
from leakfree.scan.rules.ctx import RULES
from tests._scan import CASES, project_of, source

LF001, LF002 = RULES


def scan(*sources: Source) -> list[ScanFinding]:
    """Both rules on the first source, with every source in the project (for helpers)."""
    project = project_of(*sources)
    return [f for rule in RULES for f in rule.check(sources[0], project)]


def case(name: str) -> Source:
    return source(f"{name}.py", (CASES / f"{name}.py").read_text())


def inline(code: str, path: str = "mod.py") -> Source:
    return source(path, textwrap.dedent(code))


def line_of(source: Source, needle: str) -> int:
    (hit,) = [i for i, line in enumerate(source.lines, 1) if needle in line]
    return hit


def brief(findings: list[ScanFinding]) -> list[tuple[str, str]]:
    return [(f.rule, f.symbol) for f in findings]


# --- the stand-ins ------------------------------------------------------------------------


def test_te_fuser_leaky_is_flagged_at_the_store() -> None:
    src = case("te_fuser_leaky")
    (f,) = scan(src)
    assert (f.rule, f.symbol) == ("LF001", "_OperationFuserAutogradFunction.tensor_objects")
    assert f.line == line_of(src, "func_ctx.tensor_objects = tensor_objects")
    assert "set it to None in backward" in f.message and "leakfree.Function" in f.message


def test_te_fuser_fixed_is_silent() -> None:
    # 2.14 adds only `func_ctx.tensor_objects = None`: every other ctx attribute (ops,
    # op contexts, counts, flags) is metadata the rule must leave alone.
    assert scan(case("te_fuser_fixed")) == []


def test_te_fused_attention_leaky_is_flagged() -> None:
    src = case("te_fused_attention_leaky")
    (f,) = scan(src, case("te_quantized_tensor"))
    assert (f.rule, f.symbol) == ("LF001", "FusedAttnFunc.tensor_objects")
    assert f.line == line_of(src, "ctx.tensor_objects = tensor_objects")


def test_te_fused_attention_fixed_is_silent_by_following_the_helper_across_files() -> None:
    fixed = case("te_fused_attention_fixed")
    assert scan(fixed, case("te_quantized_tensor")) == []
    # Without the module defining restore_from_func_ctx the release cannot be seen: the
    # silence above comes from following the call into the other file.
    assert brief(scan(fixed)) == [("LF001", "FusedAttnFunc.tensor_objects")]


# --- LF001 edge cases ---------------------------------------------------------------------

_HEAD = "import torch\nfrom torch.autograd import Function\n"


def _one_class(forward: str, backward: str = "return g", base: str = "Function") -> Source:
    fwd = textwrap.indent(textwrap.dedent(forward), " " * 8)
    bwd = textwrap.indent(textwrap.dedent(backward), " " * 8)
    return source(
        "mod.py",
        f"{_HEAD}\nclass Op({base}):\n    @staticmethod\n"
        f"    def forward(ctx, x, scale, quantizer):\n{fwd}\n"
        f"    @staticmethod\n    def backward(ctx, g):\n{bwd}\n",
    )


def test_alias_of_ctx_and_any_spelling() -> None:
    src = inline(
        """
        import torch
        class Op(torch.autograd.Function):
            @staticmethod
            def forward(context, x):
                c = context
                c.buf = torch.exp(x)
                return x * 2
            @staticmethod
            def backward(context, g):
                return g * context.buf
        """
    )
    assert brief(scan(src)) == [("LF001", "Op.buf")]


@pytest.mark.parametrize(
    "store",
    [
        "ctx.y = torch.exp(x)",
        "ctx.y = x.view(-1)",
        "ctx.parts = [x.detach(), x * 2]",
        "ctx.y = x.T",
        "ctx.state = torch.get_rng_state()",
        "ctx.cache = {}\nctx.cache['k'] = x.clone()",
        "ctx.items = []\nctx.items.append(torch.sin(x))",
        "setattr(ctx, 'y', torch.sin(x))",
        "y = torch.relu(x)\nobjs = [y]\nctx.objs = objs",
        "t, objs = split(x)\nctx.save_for_backward(*t)\nctx.objs = objs",
    ],
)
def test_tensor_holding_store_is_flagged(store: str) -> None:
    src = _one_class(f"{store}\nreturn x.clone()")
    assert [f.rule for f in scan(src)] == ["LF001"]


@pytest.mark.parametrize(
    "store",
    [
        "ctx.shape = x.shape",
        "ctx.dtype = x.dtype",
        "ctx.n = x.size(0)",
        "ctx.numel = len(x)",
        "ctx.is_t = isinstance(x, torch.Tensor)",
        "ctx.scale = scale",
        "ctx.quantizer = quantizer",
        "ctx.quantizer = quantizer.copy()",
        "ctx.mode = 'fast'",
        "ctx.flag = x.requires_grad and scale > 0",
        "ctx.grad_shape = compute(x)",
        "ctx.dtypes = x_dtype, w_dtype",
        "a, b = layout_of(x)\nctx.strides = a, b",
        "mask, p = get_mask(x)\nctx.p = p",
        "mask, p = get_mask(x)\nctx.save_for_backward(mask)\nctx.p = 1.0 / (1 - p)",
        "ctx.cfg = Config()",
        "ctx.module = self_module",
        "ctx.save_for_backward(x)\nctx.mark_non_differentiable(x)",
        # TE's checkpoint: the non-tensor arguments, tensors replaced by None
        "ctx.inputs = [a if not torch.is_tensor(a) else None for a in (x, scale)]",
        # a split list handed to torch after the tensor is not a tensor (TE's m_splits)
        "parts = torch.split(x, scale)\nctx.scale = scale",
    ],
)
def test_metadata_store_is_quiet(store: str) -> None:
    assert scan(_one_class(f"{store}\nreturn x.clone()")) == []


@pytest.mark.parametrize(
    "release",
    [
        "ctx.y = None",
        "del ctx.y",
        "delattr(ctx, 'y')",
        "ctx.__dict__.clear()",
        "for name in ('y',):\n    delattr(ctx, name)",
        "ctx.y.clear()",
        "ctx.y, ctx.z = None, None",
        "setattr(ctx, 'y', None)",
        "drop_state(ctx)",
        "drop_list(ctx.y)",
        "Helper().drop_state(ctx)",
    ],
)
def test_release_on_backward_path_is_quiet(release: str) -> None:
    src = _one_class(
        "ctx.y = [torch.exp(x)]\nreturn x.clone()", f"out = g * ctx.y[0]\n{release}\nreturn out"
    )
    helpers = inline(
        """
        def drop_state(c):
            c.y = None
        def drop_list(items):
            items.clear()
        class Helper:
            def drop_state(self, func_ctx):
                del func_ctx.y
        """,
        "helpers.py",
    )
    assert scan(src, helpers) == []


def test_release_of_another_attribute_or_read_only_helper_still_flags() -> None:
    src = _one_class(
        "ctx.y = torch.exp(x)\nctx.z = torch.sin(x)\nreturn x.clone()",
        "ctx.z = None\nuse(ctx)\nreturn g * ctx.y",
    )
    helpers = inline("def use(c):\n    return c.y + 1\n", "helpers.py")
    assert brief(scan(src, helpers)) == [("LF001", "Op.y")]


def test_setup_context_ctx_is_the_first_parameter_and_forward_has_none() -> None:
    src = inline(
        """
        import torch
        class Op(torch.autograd.Function):
            @staticmethod
            def forward(x, w):
                ctx = make_helper()          # not a ctx: forward has none here
                ctx.junk = torch.exp(x)
                return x @ w
            @staticmethod
            def setup_context(func_ctx, inputs, output):
                x, w = inputs
                func_ctx.tmp = torch.exp(x)
                func_ctx.n = len(inputs)
            @staticmethod
            def backward(func_ctx, g):
                return g * func_ctx.tmp, None
        """
    )
    (f,) = scan(src)
    assert (f.rule, f.symbol) == ("LF001", "Op.tmp")
    assert f.line == line_of(src, "func_ctx.tmp =")


def test_leakfree_function_and_release_after_backward_are_quiet_for_lf001() -> None:
    src = inline(
        """
        import torch
        import leakfree
        from leakfree import release_after_backward

        class Mine(leakfree.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.meta = torch.exp(x)
                return x * 2
            @staticmethod
            def backward(ctx, g):
                return g * ctx.meta

        class Theirs(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.meta = torch.exp(x)
                return x * 2
            @staticmethod
            def backward(ctx, g):
                return g * ctx.meta

        class Child(Mine):
            @staticmethod
            def forward(ctx, x):
                ctx.more = torch.sin(x)
                return x * 3

        release_after_backward(Theirs)
        """
    )
    assert scan(src) == []


def test_which_bases_count() -> None:
    src = inline(
        """
        import sympy
        import torch
        from torch import autograd
        from mylib import FusedFunction

        class A(autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.t = torch.exp(x)
                return x * 2
            @staticmethod
            def backward(ctx, g):
                return g

        class B(A):                          # a same-file Function base
            @staticmethod
            def forward(ctx, x):
                ctx.u = torch.exp(x)
                return x * 2

        class C(FusedFunction):              # unknown base ending in Function, Function shape
            @staticmethod
            def forward(ctx, x):
                ctx.v = torch.exp(x)
                return x * 2
            @staticmethod
            def backward(ctx, g):
                return g

        class D(sympy.Function):             # not an autograd Function: no ctx, no backward
            @classmethod
            def eval(cls, x):
                cls.w = torch.exp(x)

        class E(FusedFunction):              # unknown base without a backward: not judged
            @staticmethod
            def forward(ctx, x):
                ctx.z = torch.exp(x)
                return x
        """
    )
    assert sorted(brief(scan(src))) == [("LF001", "A.t"), ("LF001", "B.u"), ("LF001", "C.v")]


# --- LF002 --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("store", "ret"),
    [
        ("ctx.out = out", "out"),
        ("ctx.out = out.view(-1)", "out"),
        ("ctx.out = out[0]", "out"),
        ("ctx.out = out.t()", "out"),
        ("ctx.pair = (out, 3)", "out"),
        ("v = out.reshape(2, -1)\nctx.v = v", "out"),
        ("ctx.out = out", "out, lse"),
        ("ctx.out = out", "ctx.out"),
    ],
)
def test_output_on_ctx_is_flagged(store: str, ret: str) -> None:
    src = _one_class(f"out = torch.exp(x)\nlse = x.sum()\n{store}\nreturn {ret}")
    (f,) = scan(src)
    assert (f.rule, f.symbol) == ("LF002", f"Op.{store.split('=')[0].strip().split('.')[-1]}")
    assert "save_for_backward" in f.message


@pytest.mark.parametrize(
    "body",
    [
        # a non-differentiable output has no grad_fn: no cycle
        "idx = x.argmax()\nctx.mark_non_differentiable(idx)\nctx.idx = idx\nreturn x * 2, idx",
        # an input handed back is wrapped by autograd in a new view: ctx holds the input
        "ctx.keep_x = x\nreturn x",
        # saved the right way
        "out = torch.exp(x)\nctx.save_for_backward(out)\nreturn out",
        # a copy of the output, not the output
        "out = torch.exp(x)\nctx.c = out.clone()\nctx.c = None\nreturn out",
        # an integer output (TE's permutation row_id_map) gets no grad_fn
        "out, row_id_map = permute(x)\nctx.row_id_map = row_id_map\nreturn out, row_id_map",
    ],
)
def test_no_cycle_is_quiet_for_lf002(body: str) -> None:
    assert [f for f in scan(_one_class(body)) if f.rule == "LF002"] == []


def test_detached_output_is_lf001_not_lf002() -> None:
    src = _one_class("out = torch.exp(x)\nctx.d = out.detach()\nreturn out")
    assert brief(scan(src)) == [("LF001", "Op.d")]


def test_setup_context_output_and_leakfree_function_still_get_lf002() -> None:
    src = inline(
        """
        import leakfree
        class Op(leakfree.Function):
            @staticmethod
            def forward(x):
                return x.exp(), x.sum()
            @staticmethod
            def setup_context(ctx, inputs, output):
                y, s = output
                ctx.y_flat = y.flatten()
            @staticmethod
            def backward(ctx, g, gs):
                return g * ctx.y_flat.view_as(g)
        """
    )
    assert brief(scan(src)) == [("LF002", "Op.y_flat")]


def test_lf002_owns_an_attribute_it_reports() -> None:
    src = _one_class("out = torch.exp(x)\nctx.out = out\nreturn out")
    assert brief(scan(src)) == [("LF002", "Op.out")]


# --- the rules' table entries ---------------------------------------------------------------


def test_rule_entries() -> None:
    assert (LF001.code, LF002.code) == ("LF001", "LF002")
    assert "find_retained" in LF001.confirm and "assert_no_leak" in LF001.confirm
    assert "ReferenceCycleError" in LF002.confirm
    # the runner's text filter: files without a Function base are never parsed for these
    assert not LF001.wants("import torch\nx = torch.ones(3)\n")
    assert LF001.wants("class F(torch.autograd.Function):\n    pass\n")


def test_file_without_functions_and_syntax_of_new_python() -> None:
    src = inline(
        """
        match 1:
            case 1:
                pass
        class NotAFunction:
            def forward(self, ctx):
                ctx.x = 1
        """
    )
    assert scan(src) == []


# --- evidence before a finding: the false findings of an earlier version, from their shapes --


def test_annotated_numbers_are_not_tensors_megatron_rmsnorm() -> None:
    # Megatron-Core 0.16 transformer/custom_layers/batch_invariant_kernels.py,
    # BatchInvariantRMSNormFn: `eps: float` goes through torch.rsqrt(ms + eps); only the
    # tensor parked beside save_for_backward is a finding
    src = inline(
        """
        import torch

        class BatchInvariantRMSNormFn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        zero_centered_gamma: bool, num_heads: int):
                ms = x.float().pow(2).mean(-1, keepdim=True)
                rsigma = torch.rsqrt(ms + eps)
                ctx.eps = eps
                ctx.zero_centered_gamma = zero_centered_gamma
                ctx.num_heads = num_heads
                ctx.rsigma = rsigma
                ctx.save_for_backward(x, weight, rsigma)
                return x * rsigma * weight

            @staticmethod
            def backward(ctx, dy):
                x, weight, rsigma = ctx.saved_tensors
                return dy * rsigma * weight, None, None, None, None
        """
    )
    (f,) = scan(src)
    assert (f.rule, f.symbol) == ("LF001", "BatchInvariantRMSNormFn.rsigma")
    assert "because rsigma is passed to ctx.save_for_backward" in f.message


def test_a_helper_that_returns_a_count_is_read_deepspeed_kv_heads() -> None:
    # DeepSpeed 0.19 sequence/layer.py, _SeqAllToAll: the head count comes from a helper
    # handed the input tensor; its body returns ints
    src = inline(
        """
        import torch
        from torch import Tensor

        def _resolve_kv_heads(input, scatter_idx, seq_world_size, num_kv_heads):
            if num_kv_heads is None and not scatter_idx < 2:
                return input.shape[2] // seq_world_size
            return num_kv_heads

        class _SeqAllToAll(torch.autograd.Function):
            @staticmethod
            def forward(ctx, group, input: Tensor, scatter_idx, gather_idx, num_kv_heads=None):
                num_kv_heads = _resolve_kv_heads(input, scatter_idx, 4, num_kv_heads)
                ctx.num_kv_heads = num_kv_heads
                ctx.group = group
                return input.contiguous()

            @staticmethod
            def backward(ctx, *grad_output):
                return (None, grad_output[0], None, None, None)
        """
    )
    assert scan(src) == []
    # the same call into a helper that hands the tensor back is still a finding
    keeps = src.text.replace("return input.shape[2] // seq_world_size", "return input")
    assert brief(scan(inline(keeps))) == [("LF001", "_SeqAllToAll.num_kv_heads")]


def test_communication_handles_are_not_outputs_megatron_fused_dispatch() -> None:
    # Megatron-Core 0.16 transformer/moe/fused_a2a.py, FusedDispatch: the DeepEP handle is
    # stored on ctx and returned beside the tensors; it gets no grad_fn: no cycle
    src = inline(
        """
        import torch

        class FusedDispatch(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, token_indices, token_probs, num_experts, group):
                buffer = get_buffer(group)
                recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle, event = (
                    buffer.dispatch(x, topk_idx=token_indices, topk_weights=token_probs)
                )
                ctx.group = group
                ctx.handle = handle
                ctx.event = event
                return (recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle)

            @staticmethod
            def backward(
                ctx, grad_output, grad_token_indices, grad_token_probs, grad_tpe, grad_handle
            ):
                grad_x = combine(grad_output, ctx.handle)
                ctx.handle = None
                return grad_x, None, None, None, None
        """
    )
    assert scan(src) == []


def test_numpy_output_in_setup_context_is_not_a_cycle_torch_function_db() -> None:
    # torch 2.13 testing/_internal/autograd_function_db.py, NumpyCubeNotComposable
    src = inline(
        """
        import torch

        class NumpyCubeNotComposable(torch.autograd.Function):
            @staticmethod
            def forward(input, np_module):
                input_np = to_numpy(input)
                return torch.tensor(input_np ** 3, device=input.device), input_np

            @staticmethod
            def setup_context(ctx, inputs, output):
                ctx.input_np = output[1]
                ctx.device = inputs[0].device

            @staticmethod
            def backward(ctx, grad_output, grad_saved):
                result_np = 3 * (ctx.input_np ** 2)
                return torch.tensor(result_np, device=ctx.device), None
        """
    )
    assert [f for f in scan(src) if f.rule == "LF002"] == []
    # the tensor element of the same output is one
    tensor = src.text.replace("ctx.input_np = output[1]", "ctx.input_np = output[0]")
    assert ("LF002", "NumpyCubeNotComposable.input_np") in brief(scan(inline(tensor)))


def test_a_chunk_tuple_returned_beside_a_tensor_is_not_an_output_fast_llm() -> None:
    # Fast-LLM functional/triton/mlp.py, ChunkWeight: `weight.chunk(n)` is returned as a
    # tuple beside the input: autograd gives it no grad_fn. It holds the weight: a note
    src = inline(
        """
        import torch

        class ChunkWeight(torch.autograd.Function):
            @staticmethod
            def forward(ctx, input_: torch.Tensor, weight: torch.Tensor, num_chunks: int):
                with torch.no_grad():
                    weight_chunked = weight.chunk(num_chunks)
                ctx.weight = weight
                ctx.weight_chunked = weight_chunked
                return input_, weight_chunked

            @staticmethod
            def backward(ctx, grad_input, dummy):
                for weight_chunk in ctx.weight_chunked:
                    check(weight_chunk)
                return grad_input, None, None
        """
    )
    found = scan(src)
    assert [f.rule for f in found] == ["LF001", "LF001"]
    assert all(f.level == "note" and "lives as long as its module" in f.message for f in found)


# --- notes: memory that lives anyway ---------------------------------------------------


def test_rng_state_and_parameters_are_notes_not_leaks() -> None:
    # torch/utils/checkpoint.py CheckpointFunction keeps the CPU RNG state (5 KB); DeepSpeed
    # ulysses_sp.py TiledMLP keeps the parameters that need grad
    src = inline(
        """
        import torch

        class Tiled(torch.autograd.Function):
            @staticmethod
            def forward(ctx, fn, x, compute_params):
                ctx.fwd_cpu_state = torch.get_rng_state()
                ctx.compute_params = [p for p in compute_params if p.requires_grad]
                ctx.save_for_backward(x)
                return fn(x)

            @staticmethod
            def backward(ctx, g):
                return None, g, None
        """
    )
    found = scan(src)
    assert [(f.symbol, f.level) for f in found] == [
        ("Tiled.fwd_cpu_state", "note"),
        ("Tiled.compute_params", "note"),
    ]
    assert "RNG state" in found[0].message and "parameter or weight" in found[1].message


# --- recall: the misses of an earlier version, from their real shapes ----------------------


def test_a_dict_built_from_forward_args_deepspeed_tiled_compute() -> None:
    # DeepSpeed 0.19 runtime/sequence_parallel/ulysses_sp.py, SequenceTiledCompute
    src = inline(
        """
        import torch

        class SequenceTiledCompute(torch.autograd.Function):
            @staticmethod
            def forward(
                ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass,
                grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                output_reduction, *args
            ):
                args = list(args)
                ctx.fn = fn
                ctx.shards = shards
                kwargs_to_shard = {k: args.pop(0) for k in keys_to_shard}
                kwargs_to_pass = {k: args.pop(0) for k in keys_to_pass}
                ctx.kwargs_to_shard = kwargs_to_shard
                ctx.kwargs_to_pass = kwargs_to_pass
                with torch.no_grad():
                    return fn(**kwargs_to_shard, **kwargs_to_pass)

            @staticmethod
            def backward(ctx, *grads):
                kwargs_to_shard = ctx.kwargs_to_shard
                return (None,) * 9 + tuple(grads)
        """
    )
    found = scan(src)
    assert brief(found) == [
        ("LF001", "SequenceTiledCompute.kwargs_to_shard"),
        ("LF001", "SequenceTiledCompute.kwargs_to_pass"),
    ]
    assert "*args are forward's inputs" in found[0].message


def test_a_list_of_chunk_objects_deepspeed_fpdt() -> None:
    # DeepSpeed 0.19 sequence/fpdt_layer.py, _FPDTGPUOffloadingAttentionImpl_: the
    # attention output is kept as SequenceChunk objects appended in a loop
    src = inline(
        """
        import torch

        class SequenceChunk:
            def __init__(self, chunk, is_in_use=False):
                self.chunk = chunk

        class _FPDTGPUOffloadingAttentionImpl_(torch.autograd.Function):
            @staticmethod
            def forward(
                ctx, layernorm_output, attention_mask, inference_params, rotary_pos_emb,
                spg, scatter_idx, gather_idx, hidden_size, projection_size,
                hidden_size_per_attention_head, kv_projection_size, qkv_linear_weight,
                qkv_linear_bias, dropout, num_chunks=8, cpu_offloading=True
            ):
                global_o = []
                final_output = []
                for i in range(num_chunks):
                    cur_attn_output, cur_attn_lse = update_out_and_lse(None, None, i)
                    all2all_output = single_all_to_all(
                        cur_attn_output.to(ctx.dtype).contiguous(), gather_idx, scatter_idx, 0, spg
                    )
                    final_output.append(all2all_output)
                    global_o.append(SequenceChunk(cur_attn_output.to(ctx.dtype)))
                final_output = torch.cat(final_output, dim=1)
                ctx.attn_output = global_o
                return final_output

            @staticmethod
            def backward(ctx, grad_output):
                attn_output = ctx.attn_output
                return (grad_output,) + (None,) * 15
        """
    )
    (f,) = scan(src)
    assert f.symbol == "_FPDTGPUOffloadingAttentionImpl_.attn_output"
    assert "because global_o gets SequenceChunk(cur_attn_output.to(ctx.dtype)) appended at L" in (
        f.message
    )


def test_the_textbook_input_arithmetic_read_back_in_backward() -> None:
    src = inline(
        """
        import torch

        class Double(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.x = x * 2
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                return grad * ctx.x
        """
    )
    (f,) = scan(src)
    assert (f.symbol, f.level) == ("Double.x", "warning")
    assert "x is forward's input" in f.message


def test_an_is_tensor_guard_on_a_statement_torch_checkpoint() -> None:
    # torch/utils/checkpoint.py, CheckpointFunction: only non-tensor arguments go on
    # ctx.inputs (tensors are saved); the else branch of `if torch.is_tensor(arg)` is not one
    src = inline(
        """
        import torch

        class CheckpointFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, run_function, preserve_rng_state, *args):
                ctx.run_function = run_function
                ctx.inputs = []
                ctx.tensor_indices = []
                tensor_inputs = []
                for i, arg in enumerate(args):
                    if torch.is_tensor(arg):
                        tensor_inputs.append(arg)
                        ctx.tensor_indices.append(i)
                        ctx.inputs.append(None)
                    else:
                        ctx.inputs.append(arg)
                ctx.save_for_backward(*tensor_inputs)
                with torch.no_grad():
                    outputs = run_function(*args)
                return outputs

            @staticmethod
            def backward(ctx, *args):
                inputs = list(ctx.inputs)
                return (None, None) + tuple(inputs)
        """
    )
    assert scan(src) == []
    # the same append in the tensor branch is a finding (the guard is what decides)
    unguarded = re.sub(r"\n *else:\n", "\n", src.text)
    assert brief(scan(inline(unguarded))) == [("LF001", "CheckpointFunction.inputs")]


def test_a_returned_object_without_tensor_evidence_is_not_an_output() -> None:
    # a dict of settings returned beside the result (as TE's _Linear returns its weight
    # workspace beside `out`): no evidence it is a tensor, so no cycle to report
    src = inline(
        """
        import torch

        class WithInfo(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                info = {"scale": 2}
                ctx.info = info
                return x * 2, info

            @staticmethod
            def backward(ctx, g, g_info):
                return g * ctx.info["scale"]
        """
    )
    assert scan(src) == []
    tensor = src.text.replace('info = {"scale": 2}', "info = torch.ones(1)")
    assert brief(scan(inline(tensor))) == [("LF002", "WithInfo.info")]
