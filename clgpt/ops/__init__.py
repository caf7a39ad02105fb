"""Ops: the launchers, one object per engine (its device and model widths), that own kernel choice.

As llm.c splits kernels (`kernels/*.cl`) from launchers (`llmc/*.cuh`), the architectures in clgpt/models/gpt2.py
and clgpt/models/llama.py call only these methods; which kernel, tiles, split-K, local sizes and launch style a
device gets comes from its clgpt.device.tuning row and is decided here, once, for every architecture.

Shapes: B batch, T time, N = B*T rows, C n_embd, V vocab, H heads, D = C // H, F n_ff.
Buffers are pyopencl Buffers (or sub-buffers) of float32 (int32 for token ids), row-major.

    matmul / matmul_epi   Cm (M,N) = alpha op(A) op(B) [+ bias] [+ resid] [+ Cm], GELU epilogues
    bias_backward         db += column sums of dy
    matmul_grouped_rows / matmul_grouped_k     mixture of experts: all experts' products in one launch
    layernorm[_backward], rmsnorm[_backward]
    attention_forward / attention_backward     causal attention over qkv (N, 3C), att (B,H,T,T)
    xent_forward / xent_backward               fused softmax + cross-entropy (masked)
    embedding_forward / token_embd_backward / position_embd_backward
    rope_forward / rope_backward, swiglu_forward / swiglu_backward, gelu via the matmul epilogue
    grad_norm / adamw     over flat parameter buffers (clgpt/models/params.py)
    dropout_*             counter-hash masks (clgpt/models/dropout.py, kernels/dropout.cl)

One class, Ops, composed of a mixin a file; each file names the kernels/*.cl files it launches:

    launcher.py    Launcher (self.launcher): the one place a kernel is enqueued; kernels by name, buffers, scratch
    core.py        BaseOps: __init__ (path choice from clgpt/device/capabilities.py's record), kernel builds
    gemm.py        matmul / matmul_epi dispatch, the portable tiled and register-blocked forms, split-K, bmm,
                   bias_backward, linear_backward
    gemm_mma.py    tensor cores on fp32 operands (kernels/matmul_mma.cl)
    gemm_bf16.py   the bf16 GEMM on bf16 operand copies (kernels/matmul_bf16.cl)
    gemm_wgmma.py  Hopper's wgmma (kernels/matmul_wgmma.cl)
    copybook.py    CopyBook (self.copies): how long each tiled bf16 copy wgmma reads serves, bookkeeping alone
    copies.py      the tiled bf16 copies wgmma reads, made as the book says: stable, reuse, forget_copies
    grouped.py     mixture of experts: grouped products, moe_route, moe_weight_backward
    norms.py       layernorm, rmsnorm
    attention.py   attention, flash attention
    layers.py      cross-entropy, embedding, rope, swiglu, dropout, grad_norm, adamw
"""

from __future__ import annotations

from clgpt.ops.attention import FLASH_LONG_T, FLASH_MIN_GROUPS, AttentionOps
from clgpt.ops.copies import CopyOps
from clgpt.ops.core import F32, BaseOps, ceil_to
from clgpt.ops.gemm import MATMUL_TILES, GemmOps, matmul_defines, matmul_launch, split_k_chunks
from clgpt.ops.gemm_bf16 import Bf16Ops
from clgpt.ops.gemm_mma import MmaOps
from clgpt.ops.gemm_wgmma import WgmmaOps
from clgpt.ops.grouped import GroupedOps
from clgpt.ops.layers import LayerOps
from clgpt.ops.norms import NormOps

__all__ = ["F32", "FLASH_LONG_T", "FLASH_MIN_GROUPS", "MATMUL_TILES", "Ops", "ceil_to", "matmul_defines",
           "matmul_launch", "split_k_chunks"]


class Ops(GemmOps, MmaOps, Bf16Ops, WgmmaOps, CopyOps, GroupedOps, NormOps, AttentionOps, LayerOps, BaseOps):
    """Launchers for one device and one model's widths (C, H, D, V, eps are build options of the kernels).

    `seq_len` (the engine's longest T) decides whether attention runs as batched matmuls on GPUs.
    `precision` (clgpt/device/precision.py): the matmuls' operands, fp32 | tf32 | bf16, resolved by the caller.
    """
