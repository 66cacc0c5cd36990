# ruff: noqa
# Stand-in for the LF001 scan rule (data file: never imported).
# Imitates Transformer Engine 2.15 `transformer_engine/pytorch/attention/dot_product_attention/
# backends.py` (`FusedAttnFunc`, read at v2.15): the same forward as 2.14, and backward
# restores through `restore_from_func_ctx(ctx)`, a helper in another module
# (te_quantized_tensor.py here, `transformer_engine/pytorch/quantized_tensor.py` upstream)
# that sets `ctx.tensor_objects = None` after restoring.
import torch

from transformer_engine.pytorch.cpp_extensions.fused_attn import (
    FusedAttnBackend,
    fused_attn_bwd,
    fused_attn_fwd,
)
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from transformer_engine.pytorch.quantized_tensor import prepare_for_saving, restore_from_func_ctx
from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer


class FusedAttnFunc(torch.autograd.Function):
    """Fused attention forward and backward."""

    @staticmethod
    def forward(
        ctx,
        is_training,
        max_seqlen_q,
        max_seqlen_kv,
        cu_seqlens_q,
        cu_seqlens_kv,
        q,
        k,
        v,
        attn_scale,
        dropout_p,
        qkv_layout,
        attn_mask_type,
        window_size,
        rng_gen,
        fused_attention_backend,
        fp8,
        fp8_meta,
        quantizers,
        deterministic,
        layer_number,
    ):
        fp8_recipe = FP8GlobalStateManager.get_fp8_recipe()
        if fp8_meta is not None and fp8_meta.get("local_recipes", None) is not None:
            fp8_recipe = fp8_meta["local_recipes"][0]
        QKV_quantizer, O_quantizer, S_quantizer, dQKV_quantizer, dO_quantizer = quantizers
        out_nominal_dtype = q.dtype

        out, aux_ctx_tensors, *max_logit = fused_attn_fwd(
            is_training,
            max_seqlen_q,
            max_seqlen_kv,
            cu_seqlens_q,
            cu_seqlens_kv,
            q,
            k,
            v,
            out_nominal_dtype,
            fused_attention_backend,
            attn_scale,
            dropout_p,
            qkv_layout,
            attn_mask_type,
            window_size,
            rng_gen,
        )
        fp8_tensors = (None, None, None, None)
        qkvo_tensors = (q, k, v, out)

        ctx.fp8_recipe = fp8_recipe
        ctx.fp8 = fp8 and is_training
        ctx.nominal_dtype = out_nominal_dtype

        tensors_to_save, tensor_objects = prepare_for_saving(
            *fp8_tensors, *qkvo_tensors, cu_seqlens_q, cu_seqlens_kv, *aux_ctx_tensors
        )
        ctx.save_for_backward(*tensors_to_save)
        ctx.tensor_objects = tensor_objects
        ctx.fp8_meta = fp8_meta

        ctx.layer_number = layer_number
        ctx.QKV_quantizer = QKV_quantizer
        ctx.O_quantizer = O_quantizer
        ctx.dQKV_quantizer = dQKV_quantizer
        ctx.dO_quantizer = dO_quantizer
        ctx.S_quantizer = S_quantizer
        if ctx.fp8 and isinstance(ctx.S_quantizer, Float8Quantizer):
            ctx.S_quantizer = S_quantizer.copy()
            ctx.S_quantizer.scale = S_quantizer.scale.clone()

        ctx.max_seqlen_q = max_seqlen_q
        ctx.max_seqlen_kv = max_seqlen_kv
        ctx.attn_scale = attn_scale
        ctx.dropout_p = dropout_p
        ctx.qkv_layout = qkv_layout
        ctx.attn_mask_type = attn_mask_type
        ctx.window_size = window_size
        ctx.fused_attention_backend = (
            fused_attention_backend if ctx.fp8 else FusedAttnBackend["F16_arbitrary_seqlen"]
        )
        ctx.deterministic = deterministic
        return out

    @staticmethod
    def backward(ctx, d_out, *_args):
        d_out = d_out.contiguous()
        (
            q_fp8,
            k_fp8,
            v_fp8,
            out_fp8,
            q,
            k,
            v,
            out,
            cu_seqlens_q,
            cu_seqlens_kv,
            *aux_ctx_tensors,
        ) = restore_from_func_ctx(ctx)
        dq, dk, dv, *rest = fused_attn_bwd(
            ctx.max_seqlen_q,
            ctx.max_seqlen_kv,
            cu_seqlens_q,
            cu_seqlens_kv,
            q,
            k,
            v,
            out,
            d_out,
            ctx.nominal_dtype,
            aux_ctx_tensors,
            ctx.fused_attention_backend,
            ctx.attn_scale,
            ctx.dropout_p,
            ctx.qkv_layout,
            ctx.attn_mask_type,
            ctx.window_size,
            ctx.deterministic,
        )
        return (None,) * 5 + (dq, dk, dv) + (None,) * 12
