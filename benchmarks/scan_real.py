"""`leakfree scan` on real training stacks: findings per rule, each labelled by reading it,
and the scan's CPU time against one plain `ast.parse` pass over the same files.

Targets are the installed packages (torch, transformers, TRL, torchtune, peft, accelerate,
lightning, bitsandbytes) and unpacked sources in a corpora folder (``--corpora``, default
``$LEAKFREE_CORPORA`` or ``benchmarks/corpora``), which ``--fetch`` fills from the package
index (DeepSpeed, Megatron-Core, torchtitan, Composer: source distributions, unpacked, never
built or installed); Transformer Engine and Fast-LLM come from their repositories::

    git -C TransformerEngine archive v2.13 transformer_engine | tar -x -C corpora/te-2.13
    git -C TransformerEngine archive v2.15 transformer_engine | tar -x -C corpora/te-2.15
    git -C Fast-LLM archive 7d61a1b fast_llm | tar -x -C corpora/fast-llm-7d61a1b
    git -C trl archive v1.3.0 trl/models/activation_offloading.py | tar -x -C corpora/trl-1.3.0

Seven more stacks, none of which the rules were built from, come from their repositories
at a tag (the held-out set: every autograd Function's ctx attributes in them were labelled
by reading, in ``benchmarks/labels/<stack>.tsv``)::

    git -C xformers archive v0.0.35 xformers | tar -x -C corpora/xformers-0.0.35
    git -C flash-attention archive v2.8.3 flash_attn | tar -x -C corpora/flash-attn-2.8.3
    git -C apex archive 25.09 apex | tar -x -C corpora/apex-25.09
    git -C fairscale archive v0.4.13 fairscale | tar -x -C corpora/fairscale-0.4.13
    git -C ColossalAI archive v0.5.1 colossalai | tar -x -C corpora/colossalai-0.5.1
    git -C mamba archive v2.3.2 mamba_ssm | tar -x -C corpora/mamba-2.3.2
    git -C NeMo archive v2.4.0 nemo | tar -x -C corpora/nemo-2.4.0

and four more, labelled the same way after the rules had been changed for the first seven::

    git -C Liger-Kernel archive v0.8.2 src/liger_kernel | tar -x -C corpora/liger-0.8.2
    git -C flash-linear-attention archive v0.5.2 fla | tar -x -C corpora/fla-0.5.2
    git -C ao archive v0.18.0 torchao | tar -x -C corpora/torchao-0.18.0
    git -C unsloth archive 015bdef unsloth | tar -x -C corpora/unsloth-head

and eight more, none of them read before, whose every ctx store (in forward,
setup_context and backward; verl's pack-hook tables too) was labelled by reading before
the scanner was run on them (``benchmarks/labels/``, the ``where`` and ``size`` columns)::

    git -C gsplat archive 90d7b4b gsplat | tar -x -C corpora/gsplat-90d7b4b
    git -C torchrec archive v2025.09.29.00 torchrec | tar -x -C corpora/torchrec-2025.09.29
    git -C dgl archive v2.4.0 python/dgl | tar -x -C corpora/dgl-2.4.0
    git -C mmcv archive v2.2.0 mmcv | tar -x -C corpora/mmcv-2.2.0
    git -C pytorch3d archive v0.7.9 pytorch3d | tar -x -C corpora/pytorch3d-0.7.9
    git -C verl archive v0.7.0 verl | tar -x -C corpora/verl-0.7.0
    git -C MinkowskiEngine archive v0.5.4 MinkowskiEngine | tar -x -C corpora/minkowskiengine-0.5.4
    git -C lightning-thunder archive 0.2.6 thunder | tar -x -C corpora/thunder-0.2.6

(nerfstudio-project/gsplat, pytorch/torchrec, dmlc/dgl, open-mmlab/mmcv,
facebookresearch/pytorch3d, volcengine/verl, NVIDIA/MinkowskiEngine,
Lightning-AI/lightning-thunder).

Every finding is looked up in :data:`LABELS` (TRUE: memory really held past its use;
BENIGN: true by the rule but harmless, a weight or a state that lives anyway; FALSE: the
rule is wrong); one that is not there is counted ``unread`` and printed. Files a rule needs
that do not parse with this interpreter (Fast-LLM's Python 3.12 syntax) are scanned again
with a newer interpreter when one is found (``--newer-python``).

    python benchmarks/scan_real.py                 # table, JSON, and the speed ratio
    python benchmarks/scan_real.py --write-docs    # regenerate docs/scan.md's table
    python benchmarks/scan_real.py torch --findings
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import gc
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from leakfree._text import format_table
from leakfree.scan import ScanFinding, ScanResult, scan
from leakfree.scan._locate import python_files, resolve
from leakfree.scan.rules import RULES

#: installed packages, by import name
INSTALLED = (
    "torch",
    "transformers",
    "trl",
    "torchtune",
    "peft",
    "accelerate",
    "lightning",
    "bitsandbytes",
)
#: unpacked sources: label -> folder inside the corpora folder
CORPORA = {
    "transformer_engine 2.13": "te-2.13/transformer_engine",
    "transformer_engine 2.15": "te-2.15/transformer_engine",
    "trl 1.3.0 (offloader)": "trl-1.3.0/trl",
    "deepspeed 0.19.8": "deepspeed-0.19.8/deepspeed",
    "megatron-core 0.16.1": "megatron_core-0.16.1/megatron",
    "torchtitan 0.3.0": "torchtitan-0.3.0/torchtitan",
    "composer 0.32.1": "mosaicml-0.32.1/composer",
    "fast-llm 7d61a1b": "fast-llm-7d61a1b/fast_llm",
    "xformers 0.0.35": "xformers-0.0.35/xformers",
    "flash-attn 2.8.3": "flash-attn-2.8.3/flash_attn",
    "apex 25.09": "apex-25.09/apex",
    "fairscale 0.4.13": "fairscale-0.4.13/fairscale",
    "colossalai 0.5.1": "colossalai-0.5.1/colossalai",
    "mamba-ssm 2.3.2": "mamba-2.3.2/mamba_ssm",
    "nemo 2.4.0": "nemo-2.4.0/nemo",
    "liger-kernel 0.8.2": "liger-0.8.2/src/liger_kernel",
    "fla 0.5.2": "fla-0.5.2/fla",
    "torchao 0.18.0": "torchao-0.18.0/torchao",
    "unsloth 015bdef": "unsloth-head/unsloth",
    "gsplat 90d7b4b": "gsplat-90d7b4b/gsplat",
    "torchrec 2025.09.29": "torchrec-2025.09.29/torchrec",
    "dgl 2.4.0": "dgl-2.4.0/python/dgl",
    "mmcv 2.2.0": "mmcv-2.2.0/mmcv",
    "pytorch3d 0.7.9": "pytorch3d-0.7.9/pytorch3d",
    "verl 0.7.0": "verl-0.7.0/verl",
    "minkowskiengine 0.5.4": "minkowskiengine-0.5.4/MinkowskiEngine",
    "thunder 0.2.6": "thunder-0.2.6/thunder",
}
#: the stacks labelled store by store before the rules were run on or changed for them
NEW_STACKS = tuple(CORPORA)[-8:]
#: the speed measurement's targets: the two largest trees people scan
SPEED_TARGETS = ("torch", "transformers")
#: what --fetch downloads: distribution==version, unpacked as <name>-<version>/
SDISTS = ("deepspeed==0.19.8", "megatron-core==0.16.1", "torchtitan==0.3.0", "mosaicml==0.32.1")

TRUE, BENIGN, FALSE = "TRUE", "BENIGN", "FALSE"

#: (rule, path inside its package, symbol) -> (label, why), read finding by finding
LABELS: dict[tuple[str, str, str], tuple[str, str]] = {
    # torch 2.13.0
    ("LF001", "torch/_higher_order_ops/base_hop.py", "BaseHOPFunction.operands"): (
        TRUE, "the forward's input tensors, on ctx and never dropped by backward"),
    ("LF003", "torch/distributed/pipelining/schedules.py", "self._internal_losses"): (
        TRUE, "each microbatch's loss and graph until the step ends (docs/pipeline.md)"),
    ("LF001", "torch/nn/modules/_functions.py", "CrossMapLRN2d.scale"): (
        TRUE, "a tensor the size of the input, kept after backward"),
    ("LF001", "torch/nn/utils/_expanded_weights/group_norm_expanded_weights.py",
     "GroupNormPerSampleGrad.input"): (TRUE, "the input activation"),
    ("LF001", "torch/nn/utils/_expanded_weights/linear_expanded_weights.py",
     "LinearPerSampleGrad.args"): (TRUE, "(input, weight): the input activation"),
    ("LF001", "torch/nn/utils/_expanded_weights/linear_expanded_weights.py",
     "LinearPerSampleGrad.kwargs"): (BENIGN, "{'bias': bias}: a parameter"),
    ("LF001", "torch/utils/checkpoint.py", "CheckpointFunction.fwd_cpu_state"): (
        BENIGN, "the CPU RNG state, 5 KB per call (a note)"),
    # transformers
    ("LF001", "transformers/models/ibert/quant_modules.py", "FixedPointMul.identity"): (
        TRUE, "an activation-sized tensor"),
    # TRL 1.16 and torchtune 0.6.1: the tables patch_all() replaces
    ("LF004", "trl/models/activation_offloading.py", "OffloadActivations.tracker"): (
        TRUE, "payloads of a graph freed without backward stay until the next __enter__ "
        "(1.16), for the manager's life (1.3)"),
    ("LF004", "trl/models/activation_offloading.py", "OffloadActivations.fwd_stash"): (
        TRUE, "as tracker"),
    ("LF004", "torchtune/training/_activation_offloading.py", "OffloadActivations.tracker"): (
        TRUE, "as TRL's"),
    ("LF004", "torchtune/training/_activation_offloading.py",
     "OffloadActivations.fwd_stash"): (TRUE, "as TRL's"),
    # bitsandbytes 0.50.2
    ("LF001", "bitsandbytes/autograd/_functions.py", "MatMul8bitLt.A"): (
        TRUE, "the input activation"),
    ("LF001", "bitsandbytes/autograd/_functions.py", "MatMul8bitLt.B"): (
        BENIGN, "the quantized weight, which lives anyway"),
    ("LF001", "bitsandbytes/autograd/_functions.py", "MatMul8bitLt.bias"): (
        BENIGN, "a parameter (a note)"),
    ("LF001", "bitsandbytes/autograd/_functions.py", "MatMul8bitLt.tensors"): (
        TRUE, "holds the input activation beside int8 buffers"),
    ("LF001", "bitsandbytes/autograd/_functions.py", "MatMul8bitFp.A"): (
        TRUE, "the input activation"),
    ("LF001", "bitsandbytes/autograd/_functions.py", "MatMul4Bit.A"): (
        TRUE, "the input activation"),
    ("LF001", "bitsandbytes/autograd/_functions.py", "MatMul4Bit.B"): (
        BENIGN, "the 4-bit weight, which lives anyway"),
    ("LF001", "bitsandbytes/autograd/_functions.py", "MatMul4Bit.tensors"): (
        TRUE, "(A, B): holds the input activation"),
    # Transformer Engine v2.13: the five tensor_objects holders REFERENCE.md lists, and
    # the MoE permutation's maps and probabilities (gone from 2.15)
    ("LF001", "transformer_engine/pytorch/attention/dot_product_attention/backends.py",
     "FusedAttnFunc.tensor_objects"): (TRUE, "quantized storage objects (FP8 buffers)"),
    ("LF001", "transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py",
     "AttnFuncWithCPAndKVP2P.tensor_objects"): (TRUE, "as FusedAttnFunc"),
    ("LF001", "transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py",
     "AttnFuncWithCPAndQKVOA2A.tensor_objects"): (TRUE, "as FusedAttnFunc"),
    ("LF001", "transformer_engine/pytorch/module/grouped_linear.py",
     "_GroupedLinear.tensor_objects"): (TRUE, "as FusedAttnFunc"),
    ("LF001", "transformer_engine/pytorch/ops/fuser.py",
     "_OperationFuserAutogradFunction.tensor_objects"): (TRUE, "the 2.6-2.13 fuser leak"),
    ("LF001", "transformer_engine/pytorch/distributed.py",
     "_CheckpointFunction.fwd_cpu_rng_state"): (BENIGN, "the CPU RNG state (a note)"),
    ("LF001", "transformer_engine/pytorch/module/grouped_linear.py",
     "_GroupedLinear.weight_objects"): (BENIGN, "weights (a note)"),
    ("LF001", "transformer_engine/pytorch/module/layernorm_linear.py",
     "_LayerNormLinear.weight_object"): (BENIGN, "the weight (a note)"),
    ("LF001", "transformer_engine/pytorch/module/layernorm_linear.py",
     "_LayerNormLinear.weight"): (BENIGN, "the weight (a note)"),
    ("LF001", "transformer_engine/pytorch/module/linear.py", "_Linear.weight_object"): (
        BENIGN, "the weight (a note)"),
    ("LF001", "transformer_engine/pytorch/permutation.py",
     "_moe_permute_index_map.row_id_map"): (TRUE, "an int32 map, tokens x top-k"),
    ("LF001", "transformer_engine/pytorch/permutation.py", "_moe_unpermute_index_map.probs"): (
        TRUE, "the router probabilities, tokens x top-k"),
    ("LF001", "transformer_engine/pytorch/permutation.py", "_moe_permute_mask_map.probs"): (
        TRUE, "as above"),
    ("LF001", "transformer_engine/pytorch/permutation.py",
     "_moe_unpermute_mask_map.merging_probs"): (TRUE, "as above"),
    # DeepSpeed 0.19.8
    ("LF001", "deepspeed/runtime/activation_checkpointing/checkpointing.py",
     "CheckpointFunction.fwd_cpu_rng_state"): (BENIGN, "RNG state (a note)"),
    ("LF001", "deepspeed/runtime/activation_checkpointing/checkpointing.py",
     "CheckpointFunction.fwd_cuda_rng_state"): (BENIGN, "RNG state (a note)"),
    ("LF001", "deepspeed/runtime/sequence_parallel/ulysses_sp.py",
     "SequenceTiledCompute.compute_params"): (BENIGN, "parameters (a note)"),
    ("LF001", "deepspeed/runtime/sequence_parallel/ulysses_sp.py", "TiledMLP.compute_params"): (
        BENIGN, "parameters (a note)"),
    ("LF001", "deepspeed/runtime/sequence_parallel/ulysses_sp.py",
     "SequenceTiledCompute.kwargs_to_shard"): (TRUE, "the forward's input activations"),
    ("LF001", "deepspeed/runtime/sequence_parallel/ulysses_sp.py",
     "SequenceTiledCompute.kwargs_to_pass"): (TRUE, "forward inputs passed through"),
    **{
        ("LF001", "deepspeed/sequence/fpdt_layer.py", f"{cls}.{attr}"): (
            TRUE, "per-chunk q/k/v/output/lse activations (host copies when offloading)")
        for cls, attrs in (
            ("_FPDTGPUAttentionImpl_", ("global_q", "global_k", "global_v")),
            ("_FPDTGPUOffloadingAttentionImpl_",
             ("layernorm_output", "global_q", "global_k", "global_v", "attn_output", "attn_lse")),
        )
        for attr in attrs
    },
    # Megatron-Core 0.16.1
    ("LF005", "megatron/core/pipeline_parallel/schedules.py", "input_tensor.grad"): (
        TRUE, "leaf receive buffers with .grad in the 1F1B loops"),
    ("LF001", "megatron/core/transformer/custom_layers/batch_invariant_kernels.py",
     "BatchInvariantRMSNormFn.rsigma"): (TRUE, "saved and also parked on ctx: outlives backward"),
    # torchtitan 0.3.0
    ("LF003", "torchtitan/experiments/graph_trainer/graph_pp/runner.py",
     "schedule._internal_losses"): (TRUE, "torch's schedule list, filled by hand"),
    # Fast-LLM 7d61a1b (scanned with Python 3.12)
    ("LF001", "fast_llm/functional/triton/mlp.py", "ChunkWeight.weight"): (BENIGN, "a note"),
    ("LF001", "fast_llm/functional/triton/mlp.py", "ChunkWeight.weight_chunked"): (
        BENIGN, "views of the weight (a note)"),
    ("LF001", "fast_llm/functional/triton/mlp.py", "ChunkWeightPost.weight"): (
        BENIGN, "a note"),
    ("LF001", "fast_llm/functional/triton/mlp.py", "ChunkWeightPost.weight_chunked"): (
        BENIGN, "a note"),
    ("LF001", "fast_llm/functional/utils.py", "Function.context"): (
        TRUE, "wrap_forward_backward's context (tensors for backward), never dropped"),
    ("LF001", "fast_llm/functional/utils.py", "AuxiliaryLoss.grad"): (
        TRUE, "a tensor the size of the auxiliary loss (small)"),
    # --- found on code the rules were not built from (the held-out stacks below, and the
    # shapes found missing in torch, transformers and DeepSpeed) --------------------------
    ("LF001", "torch/nn/utils/_expanded_weights/embedding_expanded_weights.py",
     "EmbeddingPerSampleGrad.input"): (TRUE, "the input activation"),
    ("LF001", "torch/nn/utils/_expanded_weights/layer_norm_expanded_weights.py",
     "LayerNormPerSampleGrad.args"): (TRUE, "(input, normalized_shape): the input activation"),
    ("LF001", "transformers/models/ibert/quant_modules.py", "SymmetricQuantFunction.scale"): (
        TRUE, "the per-channel scaling factor tensor"),
    ("LF001", "transformers/models/reformer/modeling_reformer.py",
     "ReverseSort.sorted_bucket_idx"): (TRUE, "an index tensor, batch x heads x sequence"),
    ("LF001", "transformers/models/reformer/modeling_reformer.py",
     "_ReversibleFunction.all_buckets"): (TRUE, "every layer's LSH buckets (kept, run)"),
    ("LF001", "transformers/models/reformer/modeling_reformer.py",
     "_ReversibleFunction.attention_mask"): (TRUE, "the attention mask (kept, run)"),
    ("LF001", "deepspeed/sequence/fpdt_layer.py", "_FPDTGPUAttentionImpl_.attn_output"): (
        TRUE, "per-chunk outputs, filled by index from a helper's tuple"),
    ("LF001", "deepspeed/sequence/fpdt_layer.py", "_FPDTGPUAttentionImpl_.attn_lse"): (
        TRUE, "per-chunk log-sum-exp, as attn_output"),
    # xformers 0.0.35
    ("LF001", "xformers/ops/fmha/__init__.py", "_fMHA.attn_bias_tensor"): (
        TRUE, "a tensor attention bias, up to B x H x Mq x Mk"),
    ("LF001", "xformers/ops/fmha/__init__.py", "_fMHA.attn_bias_ctx"): (
        TRUE, "an AttentionBias object holding tensors (a full bias or sequence starts)"),
    ("LF001", "xformers/ops/fmha/merge_training.py", "_PartialFunc.bias"): (
        TRUE, "the attention bias, a tensor or a mask object"),
    ("LF001", "xformers/ops/sp24.py", "_Sparsify24Func.threads_masks"): (
        TRUE, "the 2:4 selection mask computed from the activation"),
    ("LF001", "xformers/ops/sp24.py", "_Sparsify24STEFunc.threads_masks"): (
        TRUE, "as _Sparsify24Func"),
    ("LF001", "xformers/ops/sp24.py", "_Sparsify24LikeFunc.threads_masks"): (
        TRUE, "the pattern's mask"),
    # apex 25.09
    ("LF001", "apex/contrib/fmha/fmha.py", "FMHAFun.cu_seqlens"): (
        BENIGN, "sequence boundaries, batch + 1 int32 values (a note)"),
    ("LF001", "apex/contrib/index_mul_2d/index_mul_2d.py", "IndexMul2d_.for_backwards"): (
        TRUE, "(in1, in2, idx1): activations"),
    ("LF001", "apex/contrib/index_mul_2d/index_mul_2d.py", "IndexMul2dBackward_.for_backwards"): (
        TRUE, "(in1, in2, idx1, grad_out): activations"),
    ("LF001", "apex/contrib/openfold_triton/mha.py", "FusedAttenionCoreFunc.mask"): (
        TRUE, "the attention mask (a view keeps its storage)"),
    ("LF001", "apex/transformer/tensor_parallel/random.py",
     "CheckpointFunction.fwd_cpu_rng_state"): (BENIGN, "RNG state (a note)"),
    ("LF001", "apex/transformer/tensor_parallel/random.py",
     "CheckpointFunction.fwd_cuda_rng_state"): (BENIGN, "RNG state (a note)"),
    # fairscale 0.4.13
    ("LF001", "fairscale/experimental/nn/offload.py", "OffloadFunction.inputs"): (
        TRUE, "the model's input tensors"),
    ("LF001", "fairscale/experimental/nn/offload.py", "OffloadFunction.fwd_rng_state"): (
        BENIGN, "RNG state (a note)"),
    ("LF001", "fairscale/nn/checkpoint/checkpoint_activations.py",
     "CheckpointFunction.packed_non_tensor_inputs"): (
        TRUE, "the module and non-Tensor arguments: a list or dict of tensors passed in stays"),
    ("LF001", "fairscale/nn/model_parallel/random.py", "CheckpointFunction.fwd_cpu_rng_state"): (
        BENIGN, "RNG state (a note)"),
    ("LF001", "fairscale/nn/model_parallel/random.py", "CheckpointFunction.fwd_cuda_rng_state"): (
        BENIGN, "RNG state (a note)"),
    ("LF001", "fairscale/nn/pipe/checkpoint.py", "Checkpoint.rng_states"): (
        BENIGN, "RNG states (a note)"),
    ("LF001", "fairscale/nn/pipe/checkpoint.py", "Recompute.rng_states"): (
        BENIGN, "RNG states (a note)"),
    # ColossalAI 0.5.1
    ("LF003", "colossalai/legacy/moe/manager.py", "self.router_aux_loss"): (
        TRUE, "router losses with graphs on a process-wide manager until the next forward"),
    ("LF003", "colossalai/legacy/moe/manager.py", "self.router_z_loss"): (TRUE, "as above"),
    ("LF001", "colossalai/legacy/utils/activation_checkpoint.py",
     "CheckpointFunction.fwd_cpu_rng_state"): (BENIGN, "RNG state (a note)"),
    ("LF001", "colossalai/legacy/utils/activation_checkpoint.py",
     "CheckpointFunction.tensor_inputs"): (TRUE, "CPU copies of the inputs (activation offload)"),
    ("LF001", "colossalai/quantization/fp8.py", "_LinearFp8.x_fp8"): (
        TRUE, "an fp8 copy of the input activation"),
    ("LF001", "colossalai/quantization/fp8.py", "_LinearFp8.w_fp8_t"): (
        TRUE, "an fp8 copy of the weight, made per call"),
    ("LF001", "colossalai/quantization/fp8.py", "_LinearFp8.inv_scale_x"): (
        TRUE, "a per-call scale tensor (tiny)"),
    ("LF001", "colossalai/quantization/fp8.py", "_LinearFp8.inv_scale_w"): (
        TRUE, "a per-call scale tensor (tiny)"),
    ("LF001", "colossalai/shardformer/layer/_operation.py",
     "_LinearWithGatherForwardReduceScatterBackward.gathered_input"): (
        TRUE, "the all-gathered input, activation x world size"),
    ("LF001", "colossalai/shardformer/layer/_operation.py",
     "_MatmulWithGatherForwardReduceScatterBackward.gathered_input"): (TRUE, "as above"),
    ("LF001", "colossalai/shardformer/layer/loss.py", "DistCrossEntropy.inv_num_non_zero"): (
        TRUE, "a 0-d tensor from the data (tiny)"),
    # mamba-ssm 2.3.2
    ("LF001", "mamba_ssm/ops/selective_scan_interface.py", "MambaInnerFn.b_rms_weight"): (
        BENIGN, "a norm weight (a note)"),
    ("LF001", "mamba_ssm/ops/selective_scan_interface.py", "MambaInnerFn.c_rms_weight"): (
        BENIGN, "a norm weight (a note)"),
    ("LF001", "mamba_ssm/ops/selective_scan_interface.py", "MambaInnerFn.dt_rms_weight"): (
        BENIGN, "a norm weight (a note)"),
    # NeMo 2.4.0
    ("LF001", "nemo/collections/asr/parts/numba/rnnt_loss/rnnt_numpy.py", "_RNNT.grads"): (
        TRUE, "the joint gradient, B x T x U+1 x V (the NumPy reference loss)"),
    ("LF003", "nemo/collections/asr/parts/mixins/interctc_mixin.py", "metrics"): (
        BENIGN, "validation epoch end: losses computed with grad off"),
    ("LF003", "nemo/collections/nlp/models/language_modeling/megatron_retrieval_model.py",
     "self._reduced_loss_buffer"): (
        BENIGN, "its helper returns loss.clone().detach(): no graph, which the rule cannot see"),
    ("LF001", "megatron/core/tensor_parallel/random.py", "CheckpointFunction.rng_states"): (
        BENIGN, "RNG states (a note)"),
    ("LF001", "fairscale/nn/checkpoint/checkpoint_activations.py",
     "CheckpointFunction.fwd_rng_state"): (BENIGN, "RNG state (a note)"),
    ("LF001", "fla/ops/log_linear_attn/chunk.py", "ChunkLogLinearAttentionFunction.llut"): (
        TRUE, "a [BT, BT] int32 table rebuilt each call (small)"),
    # the second held-out batch: Liger-Kernel 0.8.2, fla 0.5.2, torchao 0.18.0, unsloth
    (
        "LF001",
        "liger_kernel/ops/backends/_ascend/ops/cross_entropy.py",
        "LigerCrossEntropyFunction.ce_stats",
    ): (TRUE, "a float32 [3] stats tensor built per call (tiny)"),
    (
        "LF001",
        "liger_kernel/ops/backends/_ascend/ops/fused_linear_cross_entropy.py",
        "LigerFusedLinearCrossEntropyFunction.bias",
    ): (BENIGN, "a weight or its scale (a note)"),
    (
        "LF001",
        "liger_kernel/ops/backends/_ascend/ops/fused_linear_cross_entropy.py",
        "LigerFusedLinearCrossEntropyFunction.ce_weight",
    ): (BENIGN, "a weight or its scale (a note)"),
    (
        "LF001",
        "fla/modules/backends/triton_ascend/grpo.py",
        "GrpoLossNPU.ref_logp",
    ): (TRUE, "reference log-probs, batch x length"),
    (
        "LF001",
        "fla/modules/conv/cp/ops.py",
        "CausalConv1dFunctionCP.chunk_indices",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/modules/conv/triton/ops.py",
        "CausalConv1dFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/modules/conv/triton/ops.py",
        "CausalConv1dFunction.cu_seqlens_cpu",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/modules/conv/triton/ops.py",
        "CausalConv1dFunction.chunk_indices",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/modules/grpo.py",
        "GrpoLoss.ref_logp",
    ): (TRUE, "reference log-probs, batch x length"),
    (
        "LF001",
        "fla/modules/rotary.py",
        "RotaryEmbeddingFunction.chunk_indices",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/modules/token_shift.py",
        "TokenShift.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/modules/token_shift.py",
        "TokenShift.chunk_indices",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/modules/token_shift_cp.py",
        "TokenShiftCPFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/modules/token_shift_cp.py",
        "TokenShiftCPFunction.chunk_indices",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/attn/parallel.py",
        "ParallelAttentionFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/attnres/backends/gluon.py",
        "FusedAttnresGluonFunction.res",
    ): (TRUE, "a tuple of the residual activations, beyond what is saved"),
    (
        "LF001",
        "fla/ops/attnres/fused.py",
        "FusedAttnresFunction.res",
    ): (TRUE, "a tuple of the residual activations, beyond what is saved"),
    (
        "LF001",
        "fla/ops/common/fused_chunk.py",
        "FusedChunkFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/common/fused_recurrent.py",
        "FusedRecurrentFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/delta_rule/fused_recurrent.py",
        "FusedRecurrentFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/deltaformer/parallel.py",
        "ParallelDeltaformerFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/generalized_delta_rule/dplr/chunk.py",
        "ChunkDPLRDeltaRuleFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/generalized_delta_rule/dplr/chunk.py",
        "ChunkDPLRDeltaRuleFunction.chunk_indices",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/generalized_delta_rule/iplr/fused_recurrent.py",
        "FusedRecurrentIPLRDeltaRuleFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/gla/chunk.py",
        "ChunkGLAFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/gsa/chunk.py",
        "ChunkGSAFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/gsa/fused_recurrent.py",
        "FusedRecurrentGSAFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/hgrn/fused_recurrent.py",
        "FusedRecurrentHGRNFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/linear_attn/utils.py",
        "StatefulNormalizeFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/mesa_net/chunk.py",
        "ChunkMesaNetFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/nsa/compression.py",
        "ParallelNSACompressionFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/nsa/compression.py",
        "ParallelNSACompressionFunction.token_indices",
    ): (TRUE, "a [T, 2] index tensor, per token"),
    (
        "LF001",
        "fla/ops/nsa/parallel.py",
        "ParallelNSAFunction.block_indices",
    ): (TRUE, "a LongTensor [B, T, H, S], per token"),
    (
        "LF001",
        "fla/ops/nsa/parallel.py",
        "ParallelNSAFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/nsa/parallel.py",
        "ParallelNSAFunction.token_indices",
    ): (TRUE, "a [T, 2] index tensor, per token"),
    (
        "LF001",
        "fla/ops/parallax/parallel.py",
        "ParallaxFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/parallax/parallel.py",
        "ParallaxFunction.chunk_indices",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/path_attn/parallel.py",
        "ParallelPATHAttentionFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/rwkv6/chunk.py",
        "ChunkRWKV6Function.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/rwkv6/fused_recurrent.py",
        "FusedRecurrentRWKV6Function.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/rwkv7/fused_k_update.py",
        "KUpdateFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/simple_gla/chunk.py",
        "ChunkSimpleGLAFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/ttt/chunk.py",
        "ChunkTTTLinearFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/ttt/fused_chunk.py",
        "FusedChunkTTTLinearFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/utils/pack.py",
        "PackSequenceFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/utils/pack.py",
        "UnpackSequenceFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/utils/pooling.py",
        "MeanPoolingFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "fla/ops/wall_attn/parallel.py",
        "WallParallelAttentionFunction.cu_seqlens",
    ): (BENIGN, "sequence boundaries, a few bytes per sequence (a note)"),
    (
        "LF001",
        "torchao/prototype/moe_training/blockwise_fp8/grouped_mm.py",
        "_Float8BlockwiseGroupedMM.backend",
    ): (TRUE, "on the DeepGEMM path, per-call offset tensors (small)"),
    (
        "LF001",
        "torchao/sparsity/training/autograd.py",
        "_SparsifyLikeFunc.bitmask",
    ): (TRUE, "the 2:4 pattern's packed bitmask, scales with the activation"),
    (
        "LF001",
        "unsloth/kernels/fp8.py",
        "FP8BlockQuantLinear.weight",
    ): (BENIGN, "a weight or its scale (a note)"),
    (
        "LF001",
        "unsloth/kernels/fp8.py",
        "FP8BlockQuantLinear.weight_scale",
    ): (BENIGN, "a weight or its scale (a note)"),
    (
        "LF001",
        "unsloth/kernels/fp8.py",
        "FbgemmFp8Linear_matmul.weight",
    ): (BENIGN, "a weight or its scale (a note)"),
    (
        "LF001",
        "unsloth/kernels/fp8.py",
        "FbgemmFp8Linear_matmul.weight_scale",
    ): (BENIGN, "a weight or its scale (a note)"),
    (
        "LF001",
        "unsloth/kernels/fp8.py",
        "FP8_fbgemm_block_linear.weight",
    ): (BENIGN, "a weight or its scale (a note)"),
    (
        "LF001",
        "unsloth/kernels/fp8.py",
        "FP8_fbgemm_block_linear.weight_scale",
    ): (BENIGN, "a weight or its scale (a note)"),
    (
        "LF001",
        "unsloth/kernels/rope_embedding.py",
        "Fast_RoPE_Embedding.cos",
    ): (BENIGN, "the rotary module's cached table (a note)"),
    (
        "LF001",
        "unsloth/kernels/rope_embedding.py",
        "Fast_RoPE_Embedding.sin",
    ): (BENIGN, "the rotary module's cached table (a note)"),
    (
        "LF001",
        "unsloth/kernels/rope_embedding.py",
        "Fast_RoPE_Embedding_QK.cos",
    ): (BENIGN, "the rotary module's cached table (a note)"),
    (
        "LF001",
        "unsloth/kernels/rope_embedding.py",
        "Fast_RoPE_Embedding_QK.sin",
    ): (BENIGN, "the rotary module's cached table (a note)"),
    (
        "LF001",
        "unsloth/kernels/rope_embedding.py",
        "Fast_RoPE_Embedding_QK.rope_indices",
    ): (TRUE, "position ids as int32, one per token (tiny)"),
    # --- found by the rules of the round that labelled eight more stacks store by store
    # (the evidence from use, objects that carry tensors, notes for a few numbers) ---------
    ("LF001", "bitsandbytes/autograd/_functions.py", "MatMul8bitLt.state"): (
        BENIGN, "the layer's MatmulLtState (int8 weight, its scales): lives with the module"),
    ("LF001", "bitsandbytes/autograd/_functions.py", "MatMul8bitLt.tensor_states"): (
        BENIGN, "(SCAt, state.idx): SCAt is None in this version; idx the outlier columns, "
        "at most hidden-size ints, also held by the layer's state"),
    ("LF001", "bitsandbytes/autograd/_functions.py", "MatMul4Bit.bias"): (
        BENIGN, "a parameter (a note)"),
    ("LF001", "transformer_engine/pytorch/distributed.py",
     "_CheckpointFunction.fwd_cuda_rng_state"): (BENIGN, "the CUDA RNG state (a note)"),
    ("LF001", "deepspeed/sequence/fpdt_layer.py", "_FPDTGPUAttentionImpl_.qkv_linear_weight"): (
        BENIGN, "a weight (a note)"),
    ("LF001", "deepspeed/sequence/fpdt_layer.py", "_FPDTGPUAttentionImpl_.qkv_linear_bias"): (
        BENIGN, "a parameter (a note)"),
    ("LF001", "deepspeed/sequence/fpdt_layer.py",
     "_FPDTGPUOffloadingAttentionImpl_.qkv_linear_weight"): (BENIGN, "a weight (a note)"),
    ("LF001", "deepspeed/sequence/fpdt_layer.py",
     "_FPDTGPUOffloadingAttentionImpl_.qkv_linear_bias"): (BENIGN, "a parameter (a note)"),
    ("LF001", "deepspeed/sequence/fpdt_layer.py", "FPDT_LogitsLoss.logit_weights"): (
        BENIGN, "the output projection's weight (a note)"),
    ("LF001", "fast_llm/functional/triton/sparse_linear.py", "OutputSparseLinear.sparse_map"): (
        TRUE, "the batch's MoE SparseMap: sparse_rows is tokens x experts-per-token ints"),
    ("LF001", "fast_llm/functional/triton/sparse_linear.py", "InputSparseLinear.sparse_map"): (
        TRUE, "as OutputSparseLinear"),
}  # fmt: skip


def _package_path(name: str) -> Path | None:
    if importlib.util.find_spec(name) is None:
        return None
    (target,) = resolve([name])
    return target.path


def _relative(finding: ScanFinding, target: Path) -> str:
    """The finding's path inside its package (``torch/utils/checkpoint.py``)."""
    path = Path(finding.path)
    if path.is_absolute():
        return path.relative_to(target.parent).as_posix()
    return path.as_posix()


def _newer_python(wanted: str | None) -> str | None:
    """An interpreter of Python 3.12 or later that runs (pyenv's shims may not)."""
    pyenv = sorted(Path.home().glob(".pyenv/versions/3.1[2-9]*/bin/python"), reverse=True)
    candidates = [wanted] if wanted else ["python3.13", "python3.12", *map(str, pyenv)]
    for candidate in candidates:
        found = shutil.which(candidate) if candidate else None
        if found:
            probe = subprocess.run([found, "-c", "import ast"], capture_output=True)
            if probe.returncode == 0:
                return found
    return None


def _version(python: str) -> str:
    """``Python 3.12`` for an interpreter's path."""
    out = subprocess.run(
        [python, "-c", "import sys; print('Python %d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True,
    )  # fmt: skip
    return out.stdout.strip() or Path(python).name


def _rescan(python: str, path: Path) -> ScanResult:
    """``path`` scanned by another interpreter (JSON), as a ScanResult of Findings."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [python, "-m", "leakfree", "scan", str(path), "--format", "json"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    data = json.loads(out.stdout)
    result = ScanResult(files=data["files"], unparsed=data["unparsed"], seconds=data["seconds"])
    result.findings = [
        ScanFinding(
            f["path"], f["line"], f["column"], f["rule"], f["symbol"], f["message"], f["level"]
        )
        for f in data["findings"]
    ]
    return result


def _parse_all(files: list[Path]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        for path in files:
            with contextlib.suppress(SyntaxError, ValueError, UnicodeDecodeError):
                ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def speed(paths: list[Path], rounds: int) -> dict[str, object]:
    """CPU seconds of ``scan(paths, jobs=1)`` and of one ``ast.parse`` pass over the same
    files, interleaved, ``rounds`` times: the median and range of each ratio. The pass is
    timed twice: as a plain loop runs it (the cyclic collector on, walking the trees it
    has made so far) and with the collector off (the parse itself, as the scanner runs
    it); the second is the stricter ratio."""
    files = [p for path in paths for target in resolve([str(path)]) for p in python_files(target)]
    scans, parses, bare = [], [], []
    for _ in range(rounds):
        gc.collect()
        started = time.process_time()
        scan([str(p) for p in paths], jobs=1)
        scans.append(time.process_time() - started)
        gc.collect()
        started = time.process_time()
        _parse_all(files)
        parses.append(time.process_time() - started)
        gc.collect()
        gc.disable()
        try:
            started = time.process_time()
            _parse_all(files)
            bare.append(time.process_time() - started)
        finally:
            gc.enable()
    return {
        "targets": [p.name for p in paths],
        "files": len(files),
        "rounds": rounds,
        "scan_cpu_s": sorted(scans),
        "parse_cpu_s": sorted(parses),
        "parse_no_collector_cpu_s": sorted(bare),
        "ratio": _spread([s / p for s, p in zip(scans, parses)]),
        "ratio_no_collector": _spread([s / p for s, p in zip(scans, bare)]),
    }


#: what a labelled holder is, from its rows (one row per store)
LEAK, SMALL, HARMLESS, UNSURE = "leak", "small", "harmless", "unsure"
#: the rules whose warnings the label files judge: ctx stores, and pack-hook tables
LABELLED_RULES = ("LF001", "LF002", "LF004")


def holders(table: Path) -> tuple[dict[tuple[str, str], str], int, int]:
    """``labels/<stack>.tsv`` read as holders: (path, ``Class.attr``) -> LEAK (a tensor
    that grows with the data, never released), SMALL (never released, a few numbers),
    HARMLESS (no tensor, released, or what lives anyway) or UNSURE; with the number of
    Functions and of stores (rows) labelled. Files written before the ``where`` and
    ``size`` columns read as stores in forward whose tensors are of real size."""
    with table.open() as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    functions = len({(r["path"], r["class"]) for r in rows if r.get("where") != "pack hook"})
    stores = [r for r in rows if r["attr"] != "-"]
    verdicts: dict[tuple[str, str], list[str]] = {}
    for r in stores:
        if r["kind"] == "TENSOR" and r["released"].strip().startswith("no"):
            verdict = SMALL if (r.get("size") or "real") == "small" else LEAK
        else:
            verdict = UNSURE if r["kind"] == "UNSURE" else HARMLESS
        verdicts.setdefault((r["path"], f"{r['class']}.{r['attr']}"), []).append(verdict)
    order = (LEAK, SMALL, UNSURE, HARMLESS)  # a holder is what its worst store makes it
    held = {k: min(v, key=order.index) for k, v in verdicts.items()}
    return held, functions, len(stores)


@dataclass
class Measured:
    """One labelled stack (or all of them) against the scan: counts, and the holders
    behind each count (``path Class.attr``)."""

    functions: int = 0
    stores: int = 0
    holders: int = 0
    leaks: int = 0  #: real leaks: a tensor that grows with the data, never released
    small: int = 0  #: never released, a few numbers
    found: int = 0  #: real leaks with a warning (each is a true warning)
    false_warnings: list[str] = field(default_factory=list)
    small_warned: list[str] = field(default_factory=list)
    unsure_warned: list[str] = field(default_factory=list)
    as_notes: list[str] = field(default_factory=list)  #: real leaks reported as notes only
    missed: list[str] = field(default_factory=list)  #: real leaks without a warning

    def precision(self) -> str:
        return _ratio(self.found, self.found + len(self.false_warnings))

    def recall(self) -> str:
        return _ratio(self.found, self.leaks)

    def row(self, name: str) -> tuple[str, ...]:
        """The stack's line of the labelled table (:data:`HELD_HEAD`)."""
        return (
            name, str(self.functions), str(self.stores), str(self.holders),
            f"{self.leaks} (+{self.small} small)", str(self.found),
            str(len(self.false_warnings)), str(len(self.as_notes)), self.precision(),
            self.recall(),
        )  # fmt: skip

    def add(self, name: str, other: Measured) -> None:
        """Count ``other`` (the stack ``name``) in this total."""
        for key in ("functions", "stores", "holders", "leaks", "small", "found"):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        for key in ("false_warnings", "small_warned", "unsure_warned", "as_notes", "missed"):
            getattr(self, key).extend(f"{name}: {x}" for x in getattr(other, key))


HELD_HEAD = (
    "labelled stack", "Functions", "ctx stores", "holders", "real leaks", "true warnings",
    "false warnings", "leaks as notes", "precision", "recall",
)  # fmt: skip


def _ratio(hit: int, total: int) -> str:
    return f"{100 * hit / total:.1f}% ({hit}/{total})" if total else "- (0/0)"


def held_out(folder: str, path: Path, result: ScanResult) -> Measured | None:
    """The scan against ``labels/<folder>.tsv`` (every ctx store of every autograd
    Function of a stack, labelled by reading), by holder (``Class.attr``, or a pack
    hook's table).

    Counted: a *warning* is an LF001 / LF002 / LF004 finding at level warning; notes are
    not warnings. Precision is the warnings on real leaks over every warning, small and
    unsure holders left out (a note or a warning on a few numbers is right either way; an
    unsure label says nothing), a warning on a holder no row names counting as false.
    Recall is the real leaks with a warning over every real leak (one reported only as a
    note is missed)."""
    table = HERE / "labels" / f"{folder}.tsv"
    if not table.exists():
        return None
    held, functions, stores = holders(table)
    warned = {
        (_relative(f, path), f.symbol)
        for f in result.findings
        if f.level == "warning" and f.rule in LABELLED_RULES
    }
    noted = {(_relative(f, path), f.symbol) for f in result.findings if f.level == "note"}

    def listed(keys: Iterable[tuple[str, str]]) -> list[str]:
        return sorted(f"{p} {s}" for p, s in keys)

    leaks = [k for k, v in held.items() if v == LEAK]
    return Measured(
        functions=functions,
        stores=stores,
        holders=len(held),
        leaks=len(leaks),
        small=sum(v == SMALL for v in held.values()),
        found=sum(k in warned for k in leaks),
        false_warnings=listed(k for k in warned if held.get(k) == HARMLESS)
        + [f"{u} (no label)" for u in listed(k for k in warned if k not in held)],
        small_warned=listed(k for k in warned if held.get(k) == SMALL),
        unsure_warned=listed(k for k in warned if held.get(k) == UNSURE),
        as_notes=listed(k for k in leaks if k in noted),
        missed=listed(k for k in leaks if k not in warned),
    )


def fetch(corpora: Path) -> None:
    """Download and unpack :data:`SDISTS` (source distributions only, no dependencies,
    nothing built or installed)."""
    corpora.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--dest", tmp, *SDISTS],
            check=True,
        )  # fmt: skip
        for archive in Path(tmp).glob("*.tar.gz"):
            with tarfile.open(archive) as tar:
                tar.extractall(corpora, filter="data")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help="installed packages or corpora labels")
    parser.add_argument(
        "--corpora",
        default=os.environ.get("LEAKFREE_CORPORA", str(HERE / "corpora")),
        help="folder holding the unpacked sources",
    )
    parser.add_argument("--fetch", action="store_true", help="download the sdists first")
    parser.add_argument("--rounds", type=int, default=3, help="speed rounds (interleaved)")
    parser.add_argument("--no-speed", action="store_true", help="skip the speed measurement")
    parser.add_argument("--newer-python", default=None, help="interpreter for newer syntax")
    parser.add_argument("--findings", action="store_true", help="print every finding")
    parser.add_argument("--write-docs", action="store_true", help="update docs/scan.md")
    parser.add_argument("--json", default=str(HERE / "results" / "scan_real.json"))
    return parser.parse_args(argv)


def _targets(wanted: set[str], corpora: Path) -> list[tuple[str, Path]]:
    """(label, path) of each installed package and unpacked source to scan."""
    targets: list[tuple[str, Path]] = []
    for name in INSTALLED:
        path = _package_path(name)
        if (not wanted or name in wanted) and path is not None:
            targets.append((name, path))
    for label, folder in CORPORA.items():
        path = corpora / folder
        if (not wanted or label in wanted or label.split()[0] in wanted) and path.exists():
            targets.append((label, path))
    return targets


def _file_label(folder: str, rule: str, rel: str, symbol: str) -> tuple[str, str] | None:
    """A finding's label from ``labels/<folder>.tsv`` (a stack labelled store by store):
    TRUE on a real leak, BENIGN on a small one or on what lives anyway (PARAM), FALSE on
    a store that holds no tensor or is released; None where no row names it or the row is
    unsure (then it must be read)."""
    table = HERE / "labels" / f"{folder}.tsv"
    if rule not in LABELLED_RULES or not table.exists():
        return None
    with table.open() as f:
        rows = [
            r
            for r in csv.DictReader(f, delimiter="\t")
            if (r["path"], f"{r['class']}.{r['attr']}") == (rel, symbol)
        ]
    held, _, _ = holders(table)
    verdict = held.get((rel, symbol))
    if verdict is None or verdict == UNSURE:
        return None
    why = rows[0]["why"]
    if verdict == LEAK:
        return TRUE, why
    if verdict == SMALL or any(r["kind"] == "PARAM" for r in rows):
        return BENIGN, why
    return FALSE, why


def _scan_one(
    name: str, path: Path, newer: str | None, findings: bool
) -> tuple[ScanResult, str, dict[str, int], list[dict[str, str]], list[str]]:
    """One target scanned (again with a newer interpreter when files did not parse), each
    finding labelled: the result, the interpreter, counts per label, the listing, and the
    findings not yet read."""
    result, how = scan([str(path)]), HERE_PYTHON
    if result.unparsed and newer is not None:
        result, how = _rescan(newer, path), _version(newer)
    folder = CORPORA[name].split("/")[0] if name in CORPORA else ""
    counts = {TRUE: 0, BENIGN: 0, FALSE: 0, "unread": 0}
    listed, unread = [], []
    for f in result.findings:
        rel = _relative(f, path)
        label, why = (
            LABELS.get((f.rule, rel, f.symbol))
            or _file_label(folder, f.rule, rel, f.symbol)
            or ("unread", "not labelled yet: read it")
        )
        counts[label] += 1
        entry = f"{f.rule}{' (note)' if f.level == 'note' else ''} {rel}:{f.line} {f.symbol}"
        listed.append({"finding": entry, "label": label, "why": why})
        if label == "unread":
            unread.append(f"{name}: {entry}: {f.message}")
        if findings:
            print(f"{label:7} {entry}: {why}")
    return result, how, counts, listed, unread


HERE_PYTHON = f"Python {sys.version_info.major}.{sys.version_info.minor}"  # as _version words it


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    corpora = Path(args.corpora)
    if args.fetch:
        fetch(corpora)
    targets = _targets(set(args.targets), corpora)
    newer = _newer_python(args.newer_python)
    codes = [r.code for r in RULES]
    rows, out, unread = [], [], []
    totals = {group: {TRUE: 0, BENIGN: 0, FALSE: 0, "unread": 0} for group in GROUPS}
    measured: dict[str, Measured] = {}
    for name, path in targets:
        result, how, counts, listed, new_unread = _scan_one(name, path, newer, args.findings)
        unread += new_unread
        for label, n in counts.items():
            totals[_group(name)][label] += n
        if name in CORPORA:
            found = held_out(CORPORA[name].split("/")[0], path, result)
            if found is not None:
                measured[name] = found
        per_rule = {c: sum(f.rule == c for f in result.findings) for c in codes}
        notes = sum(f.level == "note" for f in result.findings)
        rows.append(
            (
                name if how == HERE_PYTHON else f"{name} (read with {how})",
                str(result.files),
                *(str(per_rule[c]) for c in codes),
                str(notes),
                *(str(counts[k]) for k in (TRUE, BENIGN, FALSE)),
                str(len(result.unparsed)) + ("" if not result.unparsed else " (!)"),
            )
        )
        out.append({"target": name, "scanned_with": how, "files": result.files,
                    "unparsed": result.unparsed, "findings": per_rule, "notes": notes,
                    "labels": counts, "listed": listed})  # fmt: skip
    header = ("package", "files", *codes, "of them notes", TRUE, BENIGN, FALSE, "not parsed")
    table = format_table(header, rows, markdown=True)
    print(table)
    for group, count in totals.items():
        print(f"\n{group}: {_read_line(count)}")
    for line in unread:
        print(f"unread: {line}")
    held_table = _print_held(measured)
    timing = {} if args.no_speed else _speeds(corpora, args.rounds)
    for line in map(_speed_line, timing.values()):
        print("\n" + line)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    sums = {name: asdict(m) for name, m in _subtotals(measured).items()}
    report = {"rules": codes, "python": sys.version.split()[0], "results": out,
              "totals": totals, "held_out": {n: asdict(m) for n, m in measured.items()},
              "held_out_sums": sums, "speed": timing}  # fmt: skip
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    if args.write_docs:
        _write_docs(table, totals, timing, held_table)
    return 0


#: the findings table's two groups: the targets of earlier rounds, and the stacks
#: labelled store by store before the rules were changed for them in this one
GROUPS = ("the 27 targets", "the 8 stacks labelled in this round")


def _group(name: str) -> str:
    return GROUPS[1] if name in NEW_STACKS else GROUPS[0]


def _read_line(count: dict[str, int]) -> str:
    return (
        f"**{count[TRUE]} TRUE, {count[BENIGN]} BENIGN, {count[FALSE]} FALSE** "
        f"({count['unread']} not yet read)"
    )


def _print_held(measured: dict[str, Measured]) -> str:
    """Print the labelled stacks' table and every miss, note and false warning; returns
    the table (markdown)."""
    if not measured:
        return ""
    lines = [m.row(name) for name, m in measured.items()]
    for name, m in _subtotals(measured).items():
        lines.append(m.row(f"**{name}**"))
    table = format_table(HELD_HEAD, lines, markdown=True)
    print("\nlabelled ctx stores (benchmarks/labels/):\n" + table)
    for name, m in measured.items():
        for what, key in (("missed", "missed"), ("as a note", "as_notes"),
                          ("FALSE warning", "false_warnings"), ("small, warned", "small_warned"),
                          ("unsure, warned", "unsure_warned")):  # fmt: skip
            for item in getattr(m, key):
                print(f"{what}: {name}: {item}")
    return table


def _subtotals(measured: dict[str, Measured]) -> dict[str, Measured]:
    """The stacks labelled in earlier rounds, those labelled in this one, and all."""
    parts = {"labelled earlier": Measured(), "labelled in this round": Measured()}
    together = Measured()
    for name, m in measured.items():
        parts["labelled in this round" if name in NEW_STACKS else "labelled earlier"].add(name, m)
        together.add(name, m)
    return {**{k: v for k, v in parts.items() if v.holders}, "together": together}


def _speeds(corpora: Path, rounds: int) -> dict[str, dict[str, object]]:
    """The speed ratio on torch + transformers, and on the stacks labelled this round."""
    sets = {
        "torch and transformers": [p for p in map(_package_path, SPEED_TARGETS) if p],
        "the 8 stacks labelled in this round": [
            corpora / CORPORA[n] for n in NEW_STACKS if (corpora / CORPORA[n]).exists()
        ],
    }
    return {name: speed(paths, rounds) for name, paths in sets.items() if paths}


BEGIN, END = "<!-- scan_real:begin -->", "<!-- scan_real:end -->"


def _speed_line(timing: dict[str, object]) -> str:
    plain, bare = timing["ratio"], timing["ratio_no_collector"]
    assert isinstance(plain, dict) and isinstance(bare, dict)
    targets = ", ".join(timing["targets"])  # type: ignore[arg-type]
    return (
        f"Speed on {targets} ({timing['files']} files), one process, CPU time "
        f"(median of {timing['rounds']}, min-max): **{plain['median']:.2f}x** one plain "
        f"`ast.parse` pass over the same files ({plain['min']:.2f}-{plain['max']:.2f}); "
        f"**{bare['median']:.2f}x** the same pass with the cyclic collector off "
        f"({bare['min']:.2f}-{bare['max']:.2f}), which is the parse alone. Scan "
        f"{_seconds(timing['scan_cpu_s'])} s, parse {_seconds(timing['parse_cpu_s'])} s, "
        f"parse without the collector {_seconds(timing['parse_no_collector_cpu_s'])} s."
    )


def _seconds(values: object) -> str:
    assert isinstance(values, list)
    return "/".join(f"{v:.1f}" for v in values)


def _write_docs(
    table: str,
    totals: dict[str, dict[str, int]],
    timing: dict[str, dict[str, object]],
    held_table: str,
) -> None:
    docs = ROOT / "docs" / "scan.md"
    text = docs.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    body = [table, ""]
    body += [f"Findings read, {group}: {_read_line(count)}." for group, count in totals.items()]
    if held_table:
        body += [
            "",
            "Every ctx store of every autograd Function in the labelled stacks (and verl's",
            "pack-hook tables), labelled by reading (`benchmarks/labels/`), against the",
            "warnings at the defaults (precision and recall as defined above):",
            "",
            held_table,
        ]
    body += [f"\n{_speed_line(t)}" for t in timing.values()]
    docs.write_text(f"{head}{BEGIN}\n{chr(10).join(body)}\n{END}{tail}")
    print(f"updated {docs}")


if __name__ == "__main__":
    sys.exit(main())
