"""`leakfree scan` on code its rules were not built from.

Each case is the real shape it names (a new user's file, or a stack's code at the version
in benchmarks/scan_real.py), cut to what decides the verdict. The labelled sets those came
from are in benchmarks/labels/; docs/scan.md's table counts them.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from leakfree.__main__ import main
from leakfree.scan import scan
from leakfree.scan._model import ScanFinding, Source
from leakfree.scan.rules import RULES
from tests._scan import project_of, source


def check(*sources: Source) -> list[ScanFinding]:
    """Every rule on the first source, the others in the project (helpers, bases)."""
    project = project_of(*sources)
    return sorted(
        f for rule in RULES if rule.wants(sources[0].text) for f in rule.check(sources[0], project)
    )


def leaks(*sources: Source) -> list[str]:
    """``Class.attr`` (or container) of each leak found, notes left out."""
    return sorted(f.symbol for f in check(*sources) if f.level == "warning")


def cli(
    tmp_path: Path, files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode() if isinstance(text, str) else text)
    rc = main(["scan", *(str(tmp_path / n) for n in files)])
    return rc, capsys.readouterr().out


# --- the four shapes ------------------------------------------------------------------

USER_CLEAN = """
import torch


class ScaledSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        y = torch.softmax(x * scale, dim=-1)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        gx = y * (g - (g * y).sum(-1, keepdim=True))
        return gx * ctx.scale, None
"""

USER_LEAKY = """
import torch


class GeluDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        mask = (torch.rand_like(x) > p).to(x.dtype) / (1 - p)
        ctx.x = x
        ctx.mask = mask
        return torch.nn.functional.gelu(x) * mask

    @staticmethod
    def backward(ctx, g):
        x = ctx.x.detach().requires_grad_()
        with torch.enable_grad():
            y = torch.nn.functional.gelu(x)
        (gx,) = torch.autograd.grad(y, x, g * ctx.mask)
        return gx, None
"""


def test_a_python_float_multiplied_into_a_softmax_is_not_a_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `x * scale` handed to torch.softmax: x is the tensor, so nothing is said of scale
    assert check(source("user.py", USER_CLEAN)) == []
    rc, out = cli(tmp_path, {"user.py": USER_CLEAN}, capsys)
    assert rc == 0 and "0 findings in 1 file" in out


def test_a_dropout_mask_made_by_comparing_a_random_tensor_is_a_tensor() -> None:
    # (torch.rand_like(x) > p) is a boolean tensor: the mask, 128 KiB a call, is found
    found = {f.symbol: f for f in check(source("user.py", USER_LEAKY))}
    assert sorted(found) == ["GeluDropout.mask", "GeluDropout.x"]
    assert (
        "mask = (torch.rand_like(x) > p).to(x.dtype) / (1 - p)" in found["GeluDropout.mask"].message
    )


@pytest.mark.parametrize(
    "binding",
    [
        "BASE = torch.autograd.Function",
        "if os.environ.get('LF'):\n    BASE = leakfree.Function\n"
        "else:\n    BASE = torch.autograd.Function",
        "BASE = leakfree.Function if os.environ.get('LF') else torch.autograd.Function",
        "try:\n    from apex import Function as BASE\nexcept ImportError:\n"
        "    from torch.autograd import Function as BASE",
    ],
    ids=["alias", "under-if", "if-expression", "try-import"],
)
def test_a_function_is_found_however_its_base_is_spelled(binding: str) -> None:
    code = f"import os\nimport torch\nimport leakfree\n\n{binding}\n\n" + textwrap.dedent(
        """
        class GeluDropout(BASE):
            @staticmethod
            def forward(ctx, x, p):
                mask = (torch.rand_like(x) > p).to(x.dtype) / (1 - p)
                ctx.mask = mask
                return x * mask

            @staticmethod
            def backward(ctx, g):
                return g * ctx.mask, None


        class Again(GeluDropout):
            @staticmethod
            def forward(ctx, x, p):
                ctx.again = torch.zeros_like(x)
                return x
        """
    )
    # the subclass of the subclass too; a leakfree branch does not make it release
    assert leaks(source("user.py", code)) == ["Again.again", "GeluDropout.mask"]


def test_a_base_that_is_leakfree_on_every_branch_releases() -> None:
    code = "import leakfree\nimport torch\nBASE = leakfree.Function\n" + textwrap.dedent(
        """
        class Keep(BASE):
            @staticmethod
            def forward(ctx, x):
                ctx.kept = x * 2
                return x

            @staticmethod
            def backward(ctx, g):
                return g
        """
    )
    assert leaks(source("user.py", code)) == []


def _module(path: str, module: str, text: str) -> Source:
    return Source(path, text, ast.parse(text), module)


def test_subclasses_across_a_package_s_files_and_re_exports() -> None:
    base = _module(
        "pkg/base.py",
        "pkg.base",
        "import torch\n\nclass Base(torch.autograd.Function):\n    pass\n",
    )
    init = _module("pkg/__init__.py", "pkg", "from .base import Base\n")
    user = _module(
        "pkg/user.py",
        "pkg.user",
        textwrap.dedent(
            """
            import torch
            from pkg import Base  # re-exported by the package's __init__


            class Gate(Base):
                @staticmethod
                def forward(context, x):
                    context.gate = torch.sigmoid(x)
                    return x * context.gate

                @staticmethod
                def backward(context, g):
                    return g * context.gate
            """
        ),
    )
    assert leaks(user, base, init) == ["Gate.gate"]
    # without the package's files, `Base` and a ctx named `context` say nothing
    assert leaks(user) == []


def test_a_module_subclass_with_a_forward_is_not_a_function() -> None:
    code = textwrap.dedent(
        """
        import torch
        from mylib import Base


        class Block(Base):
            def forward(self, x):
                self.cache = x * 2
                return x

            def backward(self, g):
                return g
        """
    )
    assert check(source("user.py", code)) == []


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("broken.py", "import torch\n\ndef f(:\n    pass\n", "SyntaxError"),
        (
            "latin.py",
            b"# no coding cookie\nname = '\xe9t\xe9'\n",
            "SyntaxError: invalid or missing",
        ),
        ("nul.py", "x = 1\x00\n", "SyntaxError"),
        ("newer.py", "type Alias = list[int]\n", "SyntaxError"),  # 3.12 syntax, no Function
    ],
    ids=["syntax", "encoding", "null-byte", "newer-syntax"],
)
def test_a_file_that_cannot_be_read_or_parsed_is_listed_and_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: str | bytes, reason: str
) -> None:
    import sys

    if name == "newer.py" and sys.version_info >= (3, 12):
        pytest.skip("parses on 3.12 and later")
    files: dict[str, str] = {name: content, "ok.py": "y = 2\n"}  # type: ignore[dict-item]
    rc, out = cli(tmp_path, files, capsys)
    assert rc == 3, out
    assert f"not parsed: {tmp_path.as_posix()}/{name}: {reason}" in out
    result = scan([str(tmp_path)])
    assert result.status == 3 and len(result.unparsed) == 1 and result.files == 2


def test_help_lists_every_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    from leakfree.scan._run import EXIT_STATUSES

    with pytest.raises(SystemExit):
        main(["scan", "--help"])
    out = capsys.readouterr().out
    for status, meaning in EXIT_STATUSES.items():
        assert f"{status}" in out and meaning.split(" (")[0] in " ".join(out.split())
    docs = (Path(__file__).resolve().parents[1] / "docs" / "scan.md").read_text()
    for status in EXIT_STATUSES:
        assert f"**{status}**" in docs  # docs/scan.md lists each, as --help does


# --- transformers 5.x: the reformer and I-BERT shapes -----------------------------------------

REFORMER = """
import torch
from torch.autograd.function import Function


class ReverseSort(Function):
    @staticmethod
    def forward(ctx, out_vectors, logits, sorted_bucket_idx, undo_sorted_bucket_idx):
        with torch.no_grad():
            ctx.sorted_bucket_idx = sorted_bucket_idx
            expanded = undo_sorted_bucket_idx.unsqueeze(-1).expand(out_vectors.shape)
            out_vectors = torch.gather(out_vectors, 2, expanded)
            logits = torch.gather(logits, 2, undo_sorted_bucket_idx)
        return out_vectors, logits

    @staticmethod
    def backward(ctx, grad_out_vectors, grad_logits):
        sorted_bucket_idx = ctx.sorted_bucket_idx
        expanded = sorted_bucket_idx.unsqueeze(-1).expand(grad_out_vectors.shape)
        grad_out_vectors = torch.gather(grad_out_vectors, 2, expanded)
        grad_logits = torch.gather(grad_logits, 2, sorted_bucket_idx)
        return grad_out_vectors, grad_logits, None, None


class _ReversibleFunction(Function):
    @staticmethod
    def forward(ctx, hidden_states, layers, attention_mask, num_hashes, all_hidden_states,
                all_attentions, past_buckets_states, use_cache, orig_sequence_length,
                output_hidden_states, output_attentions):
        all_buckets = ()
        hidden_states, attn_output = torch.chunk(hidden_states, 2, dim=-1)
        for layer in layers:
            layer_outputs = layer(prev_attn_output=attn_output, hidden_states=hidden_states,
                                  attention_mask=attention_mask, num_hashes=num_hashes)
            attn_output = layer_outputs.attn_output
            hidden_states = layer_outputs.hidden_states
            all_buckets = all_buckets + (layer_outputs.buckets,)
        ctx.save_for_backward(attn_output.detach(), hidden_states.detach())
        ctx.layers = layers
        ctx.all_buckets = all_buckets
        ctx.attention_mask = attention_mask
        return torch.cat([attn_output, hidden_states], dim=-1)

    @staticmethod
    def backward(ctx, grad_hidden_states):
        layers = ctx.layers
        all_buckets = ctx.all_buckets
        attention_mask = ctx.attention_mask
        for layer in layers[::-1]:
            buckets = all_buckets[-1]
            all_buckets = all_buckets[:-1]
            layer.backward_pass(attention_mask=attention_mask, buckets=buckets)
        return grad_hidden_states, None, None, None, None, None, None, None, None, None, None
"""

IBERT = """
import torch
from torch.autograd import Function


class SymmetricQuantFunction(Function):
    @staticmethod
    def forward(ctx, x, k, percentile_mode, scale):
        zero_point = torch.tensor(0.0).to(scale.device)
        n = 2 ** (k - 1) - 1
        new_quant_x = linear_quantize(x, scale, zero_point, inplace=False)
        new_quant_x = torch.clamp(new_quant_x, -n, n - 1)
        ctx.scale = scale
        return new_quant_x

    @staticmethod
    def backward(ctx, grad_output):
        scale = ctx.scale
        if len(grad_output.shape) == 4:
            scale = scale.view(-1, 1, 1, 1)
        return grad_output.clone() / scale, None, None, None, None


class FixedPointMul(Function):
    @staticmethod
    def forward(ctx, pre_act, pre_act_scaling_factor, bit_num, z_scaling_factor,
                identity=None, identity_scaling_factor=None):
        ctx.identity = identity
        with torch.no_grad():
            z_int = torch.round(pre_act / pre_act_scaling_factor)
            output = z_int
            if identity is not None:
                wx_int = torch.round(identity / identity_scaling_factor)
                output = wx_int + output
            return torch.clamp(output.type(torch.float), -1, 1)

    @staticmethod
    def backward(ctx, grad_output):
        identity_grad = None
        if ctx.identity is not None:
            identity_grad = grad_output.clone()
        return grad_output.clone(), None, None, None, None, identity_grad, None
"""


def test_reformer_s_three_ctx_attributes_each_by_its_own_evidence() -> None:
    found = {f.symbol: f.message for f in check(source("modeling_reformer.py", REFORMER))}
    assert sorted(found) == [
        "ReverseSort.sorted_bucket_idx",  # what backward does with it: .unsqueeze
        "_ReversibleFunction.all_buckets",  # a tensor-named field of a layer's output
        "_ReversibleFunction.attention_mask",  # a forward parameter named for its tensor
    ]
    assert "sorted_bucket_idx.unsqueeze(-1).expand" in found["ReverseSort.sorted_bucket_idx"]
    assert "layer_outputs.buckets" in found["_ReversibleFunction.all_buckets"]


def test_ibert_identity_and_scale() -> None:
    # identity: one of `identity / identity_scaling_factor` handed to torch.round must be a
    # tensor and nothing else says which; scale: backward calls scale.view(...)
    assert leaks(source("quant_modules.py", IBERT)) == [
        "FixedPointMul.identity",
        "SymmetricQuantFunction.scale",
    ]


# --- the new stacks: false findings removed, misses found ----------------------------------


def test_flash_attn_softmax_scale_from_a_helper_s_tuple_is_a_float() -> None:
    # flash-attn 2.8.3 flash_attn_triton.py: the helper returns `o, lse, softmax_scale`,
    # the last `softmax_scale or 1.0 / math.sqrt(d)`; rotary.py keeps an int offset on ctx
    code = textwrap.dedent(
        """
        import math
        import torch


        def _flash_attn_forward(q, k, v, bias=None, causal=False, softmax_scale=None):
            batch, seqlen_q, nheads, d = q.shape
            softmax_scale = softmax_scale or 1.0 / math.sqrt(d)
            o = torch.empty_like(q)
            lse = torch.empty((batch, nheads, seqlen_q), device=q.device)
            return o, lse, softmax_scale


        class FlashAttnFunc(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, bias=None, causal=False, softmax_scale=None):
                o, lse, ctx.softmax_scale = _flash_attn_forward(
                    q, k, v, bias=bias, causal=causal, softmax_scale=softmax_scale
                )
                ctx.save_for_backward(q, k, v, o, lse, bias)
                return o

            @staticmethod
            def backward(ctx, do):
                return do, None, None, None, None, None


        class ApplyRotaryEmb(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, cos, sin, seqlen_offsets=0):
                out = x * cos
                if isinstance(seqlen_offsets, int):
                    ctx.save_for_backward(cos, sin)
                    ctx.seqlen_offsets = seqlen_offsets
                else:
                    ctx.save_for_backward(cos, sin, seqlen_offsets)
                    ctx.seqlen_offsets = None
                return out

            @staticmethod
            def backward(ctx, do):
                return do, None, None, None
        """
    )
    assert check(source("flash_attn_triton.py", code)) == []


def test_colossalai_fp8_copies_from_a_helper_s_tuple_are_tensors() -> None:
    # ColossalAI 0.5.1 quantization/fp8.py, _LinearFp8: cast_to_fp8 returns the copy and
    # its inverse scale, both tensors; all four stay on ctx
    code = textwrap.dedent(
        """
        import torch


        def cast_to_fp8(inp: torch.Tensor, fp8_format="e4m3"):
            if inp.numel() == 0:
                return inp.to(torch.float8_e4m3fn), torch.tensor([1.0], device=inp.device)
            per_tensor_max = inp.abs().max().float()
            scale = 448.0 / per_tensor_max
            ret = (scale * inp.float()).to(torch.float8_e4m3fn)
            return ret, torch.unsqueeze(1.0 / scale, dim=0)


        class _LinearFp8(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w, bias):
                x_fp8, inv_scale_x = cast_to_fp8(x, fp8_format="e4m3")
                w_fp8, inv_scale_w = cast_to_fp8(w, fp8_format="e4m3")
                ctx.x_fp8 = x_fp8
                ctx.w_fp8_t = w_fp8.t()
                ctx.inv_scale_x = inv_scale_x
                ctx.inv_scale_w = inv_scale_w
                return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=inv_scale_x, scale_b=inv_scale_w)

            @staticmethod
            def backward(ctx, out_grad):
                return out_grad, None, None
        """
    )
    assert leaks(source("fp8.py", code)) == [
        "_LinearFp8.inv_scale_w",
        "_LinearFp8.inv_scale_x",
        "_LinearFp8.w_fp8_t",
        "_LinearFp8.x_fp8",
    ]


def test_xformers_shapes() -> None:
    # xformers 0.0.35: an op class from a helper annotated Type[...] is no tensor; the
    # sparse tensor's mask fields and an attention bias are (not a module's weight)
    code = textwrap.dedent(
        """
        from typing import Optional, Type, Union
        import torch


        def _dispatch_bw(inp) -> Type[AttentionBwOpBase]:
            return _run_priority_list("memory_efficient_attention_backward", PRIORITY, inp)


        def _sparsify24_forward(x: torch.Tensor, *, algo: str, backend: str) -> Sparse24Tensor:
            packed, meta, threads_masks = OPERATOR(x, algorithm=algo, backend=backend)
            return Sparse24Tensor(x.shape, packed=packed, meta=meta, threads_masks=threads_masks)


        class _fMHA(torch.autograd.Function):
            @staticmethod
            def forward(ctx, op, *args):
                inp = Inputs(*args)
                out = torch.empty_like(inp.query)
                ctx.op_bw = _dispatch_bw(inp)
                ctx.scale = inp.scale
                ctx.n_args = len(args)
                return out

            @staticmethod
            def backward(ctx, grad):
                return grad


        class _Sparsify24Func(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x: torch.Tensor, algo: str, gradient: str, backend: str):
                out = _sparsify24_forward(x, algo=algo, backend=backend)
                ctx.threads_masks = out.threads_masks
                ctx.dtype = out.dtype
                ctx.gradient = gradient
                return out

            @staticmethod
            def backward(ctx, grad_out):
                return grad_out, None, None, None


        class _PartialFunc(torch.autograd.Function):
            @staticmethod
            def forward(ctx, query, key, value,
                        attn_bias: Optional[Union[torch.Tensor, AttentionBias]], p: float = 0.0):
                ctx.bias = attn_bias
                ctx.save_for_backward(query, key, value)
                ctx.p = p
                return query

            @staticmethod
            def backward(ctx, grad):
                return grad, None, None, None, None
        """
    )
    assert leaks(source("fmha.py", code)) == ["_PartialFunc.bias", "_Sparsify24Func.threads_masks"]


def test_torch_flex_attention_s_mask_graph_is_judged_by_its_annotation() -> None:
    # torch 2.13 _higher_order_ops/flex_attention.py: `block_mask: tuple[Any, ...]`; its last
    # element is the mask's graph module, whatever the parameter's name says
    code = textwrap.dedent(
        """
        from typing import Any, Callable
        import torch
        from torch import Tensor


        class FlexAttentionAutogradOp(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, query: Tensor, fw_graph: Callable,
                        block_mask: tuple[Any, ...], scale: float):
                ctx._fw_graph = fw_graph
                ctx._mask_graph = block_mask[-1]
                ctx.scale = scale
                return query

            @staticmethod
            def backward(ctx, grad):
                mask_graph = ctx._mask_graph
                return grad, None, None, None
        """
    )
    assert check(source("flex_attention.py", code)) == []


NEMO = """
import torch
from torch import nn


class LabelModel(ModelPT):
    def evaluation_step(self, batch, batch_idx, dataloader_idx=0, tag="val"):
        audio, labels = batch
        logits = self.forward(audio)
        loss = self.eval_loss(logits=logits, labels=labels)
        output = {f"{tag}_loss": loss}
        if tag == "val":
            self.validation_step_outputs.append(output)
        return output

    def inference_step(self, batch, mode):
        loss = self.fwd_bwd_step(batch, forward_only=True)
        self.test_step_outputs.append(loss)

    def setup_decoders(self, cfg):
        for name, dec_cfg in cfg.items():
            new_decoder_loss = {"decoder": build(dec_cfg.decoder), "loss": build(dec_cfg.loss)}
            new_decoder_loss = nn.ModuleDict(new_decoder_loss)
            self.decoder_losses[name] = new_decoder_loss


class GPTQADataset(QADataset):
    def _convert(self, examples):
        for example in examples:
            input_ids = torch.squeeze(self.tokenizer(example)["input_ids"])
            labels = GPTQADataset.update_labels_for_no_pad_loss(input_ids, 0, None)
            feature = {"input_ids": input_ids, "labels": labels}
            self.features.append(feature)
"""


def test_nemo_evaluation_helpers_data_sets_and_module_dicts_keep_no_graph() -> None:
    assert check(source("nemo_models.py", NEMO)) == []


def test_colossalai_moe_manager_keeps_router_losses_with_their_graphs() -> None:
    # ColossalAI 0.5.1 legacy/moe/manager.py: a process-wide manager's lists, emptied only
    # by the next forward's reset_loss()
    code = textwrap.dedent(
        """
        class MoEManager:
            def reset_loss(self):
                self.router_aux_loss, self.router_z_loss = [], []

            def add_loss(self, aux_loss: float = 0.0, z_loss: float = 0.0):
                self.router_aux_loss.append(aux_loss)
                self.router_z_loss.append(z_loss)
        """
    )
    assert leaks(source("manager.py", code)) == ["self.router_aux_loss", "self.router_z_loss"]


# --- what the scanner cannot see (docs/scan.md names each) ------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        # ColossalAI DPGradScalerIn: annotated int, handed a 0-d tensor by every caller
        """
        class DPGradScalerIn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, inputs, moe_dp_size: int, activated_experts: int):
                ctx.moe_dp_size = moe_dp_size
                ctx.activated_experts = activated_experts
                return inputs

            @staticmethod
            def backward(ctx, grad):
                return grad, None, None
        """,
        # xformers _Sparsify24Func: a tensor subclass's field named `meta`
        """
        class _Sparsify24Func(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                out = _sparsify24_forward(x)
                ctx.meta = out.meta
                return out

            @staticmethod
            def backward(ctx, grad):
                return grad
        """,
    ],
    ids=["wrong-annotation", "tensor-subclass-field"],
)
def test_what_the_scanner_cannot_see_stays_unseen(code: str) -> None:
    # pinned so docs/scan.md stays true: when one of these is found, move it there
    assert leaks(source("known.py", "import torch\n" + textwrap.dedent(code))) == []


# --- the second held-out batch: Liger-Kernel, flash-linear-attention, torchao, unsloth -------


def test_fla_token_shift_reads_its_helper_s_helper() -> None:
    # fla 0.5.2 modules/token_shift.py: T comes from prepare_maxlens(...) -> int, read one
    # helper further; cu_seqlens, batch + 1 integers, is a note, not a leak
    code = textwrap.dedent(
        """
        import torch


        def prepare_maxlens(cu_seqlens: torch.LongTensor) -> int:
            return torch.max(cu_seqlens.diff()).item()


        def token_shift_fwd(x: torch.Tensor, cu_seqlens=None):
            B, T, D = x.shape
            y = torch.empty_like(x)
            if cu_seqlens is not None:
                T = prepare_maxlens(cu_seqlens)
                N = len(cu_seqlens) - 1
            else:
                N = B
            use_short_kernel = T <= 4096
            return y, N, T, use_short_kernel


        class TokenShift(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
                output, N, T, use_short_kernel = token_shift_fwd(x, cu_seqlens)
                ctx.cu_seqlens = cu_seqlens
                ctx.N = N
                ctx.T = T
                ctx.use_short_kernel = use_short_kernel
                return output

            @staticmethod
            def backward(ctx, dy):
                return dy, None
        """
    )
    found = check(source("token_shift.py", code))
    assert [(f.symbol, f.level) for f in found] == [("TokenShift.cu_seqlens", "note")]
    assert "sequence boundaries" in found[0].message


def test_torchao_arithmetic_around_a_call_says_nothing_of_its_names() -> None:
    # torchao 0.18 paretoq StretchedElasticQuant: torch.round(torch.clamp(...) * n_levels -
    # shift); `shift` and `n_levels` are numbers, so is the tuple kept on ctx
    code = textwrap.dedent(
        """
        import math
        import torch


        class StretchedElasticQuant(torch.autograd.Function):
            @staticmethod
            def forward(ctx, input, alpha, num_bits, layerwise):
                grad_scale = 1.0 / math.sqrt(input.numel())
                ctx.save_for_backward(input, alpha)
                n_levels = 2 ** (num_bits - 1)
                shift = 0.5
                Qp = (n_levels - shift) / n_levels
                ctx.other = grad_scale, -Qp, Qp, layerwise
                q_w = torch.round(torch.clamp(input / alpha, -1, 1) * n_levels - shift) + shift
                return q_w * alpha

            @staticmethod
            def backward(ctx, grad_output):
                return grad_output, None, None, None
        """
    )
    assert check(source("utils_quant.py", code)) == []


def test_liger_keeps_a_detached_bias_a_note_and_unsloth_registers_functions() -> None:
    # Liger-Kernel 0.8.2 fused_linear_cross_entropy: `bias.detach() if bias is not None
    # else None` is the head's parameter; unsloth: a registry of compute_loss functions
    code = textwrap.dedent(
        """
        import torch

        RL_FUNCTIONS = {"sft_trainer": []}


        def sft_trainer_compute_loss(function_name, function):
            return function


        RL_FUNCTIONS["sft_trainer"].append(sft_trainer_compute_loss)


        class LigerFusedLinearCrossEntropyFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, _input, weight, target, bias=None, ce_weight=None):
                loss = torch.nn.functional.linear(_input, weight).sum()
                ctx.save_for_backward(_input.detach(), weight.detach())
                ctx.bias = bias.detach() if bias is not None else None
                ctx.ce_weight = ce_weight.detach() if ce_weight is not None else None
                return loss

            @staticmethod
            def backward(ctx, grad):
                return grad, None, None, None, None
        """
    )
    found = check(source("fused_linear_cross_entropy.py", code))
    assert [(f.rule, f.symbol, f.level) for f in found] == [
        ("LF001", "LigerFusedLinearCrossEntropyFunction.bias", "note"),
        ("LF001", "LigerFusedLinearCrossEntropyFunction.ce_weight", "note"),
    ]


def test_a_helper_handed_no_tensor_that_makes_one_and_a_local_lambda_of_a_helper_s_name() -> None:
    # fla 0.5.2 log_linear_attn: `llut = level_lut(BT, device)` builds a [BT, BT] table
    # each call; I-BERT's `reshape = lambda x: ...` is a local, not the project's `reshape`
    code = textwrap.dedent(
        """
        import torch


        def level_lut(BT, device):
            lut = torch.zeros((BT, BT), dtype=torch.int32, device=device)
            return lut


        def reshape(x):
            return x.view(-1)


        class ChunkLogLinearAttentionFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, BT: int = 64):
                ctx.llut = level_lut(BT, q.device)
                return q * k

            @staticmethod
            def backward(ctx, do):
                return do, do, None


        class FixedPointMul(torch.autograd.Function):
            @staticmethod
            def forward(ctx, pre_act, identity=None, identity_scaling_factor=None):
                reshape = lambda x: x  # noqa: E731
                ctx.identity = identity
                identity_scaling_factor = reshape(identity_scaling_factor)
                return torch.round(identity / identity_scaling_factor) + pre_act

            @staticmethod
            def backward(ctx, g):
                return g, None, None
        """
    )
    assert leaks(source("chunk.py", code)) == [
        "ChunkLogLinearAttentionFunction.llut",
        "FixedPointMul.identity",
    ]


def test_an_rng_state_from_a_helper_is_a_note() -> None:
    # Megatron-Core 0.16.1 tensor_parallel/random.py: `_get_all_rng_states()` returns the
    # CPU and device generators' state tensors, a few KB, read where it is defined
    code = textwrap.dedent(
        """
        import torch


        def _get_all_rng_states():
            return torch.get_rng_state(), torch.cuda.get_rng_state()


        class CheckpointFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, run_function, *args):
                ctx.run_function = run_function
                ctx.rng_states = _get_all_rng_states()
                ctx.save_for_backward(*args)
                with torch.no_grad():
                    return run_function(*args)

            @staticmethod
            def backward(ctx, *grads):
                return (None, *grads)
        """
    )
    found = check(source("random.py", code))
    assert [(f.symbol, f.level) for f in found] == [("CheckpointFunction.rng_states", "note")]
