"""Ops: the launchers, one object per engine (its device and model widths), that own kernel choice.

As llm.c splits kernels (`kernels/*.cl`) from launchers (`llmc/*.cuh`), the architectures in clgpt/models/gpt2.py
and clgpt/models/llama.py call only these methods; which kernel, tiles, split-K, local sizes and launch style a
device gets comes from its clgpt.device.tuning row and is decided here, once, for every architecture.

Shapes: B batch, T time, N = B*T rows, C n_embd, V vocab, H heads, D = C // H, F n_ff.
Buffers are pyopencl Buffers (or sub-buffers) of float32 (int32 for token ids), row-major.

Ops is a front: it makes the parts and forwards the methods the models call to them. Each part takes the Facts
(core.py), the launcher and the parts it uses in its constructor, builds the kernels it launches and names their
kernels/*.cl files:

    launcher.py    Launcher: the one place a kernel is enqueued; kernels by name, buffers, scratch
    core.py        Facts: the decisions made once (capabilities record, precision, op forms); Part; split-K
    gemm/          the GEMM backends behind one interface, the factory that picks one (gemm/__init__.py):
                   kernels/matmul.cl, kernels/matmul_mma.cl, kernels/matmul_bf16.cl, kernels/matmul_wgmma.cl
    copies.py      TiledCopies: the tiled bf16 copies wgmma reads, their lifetime kept in copybook.py's CopyBook
                   (kernels/gelu.cl)
    linear.py      Linear: linear_backward, bias_backward (kernels/bias.cl)
    norms.py       Norms: layernorm, rmsnorm (kernels/layernorm.cl, kernels/rmsnorm.cl, kernels/norm_rows.cl)
    layers.py      Layers: cross-entropy, embedding, rope, swiglu, dropout, grad_norm, adamw (kernels/xent.cl,
                   kernels/embedding.cl, kernels/rope.cl, kernels/swiglu.cl, kernels/dropout.cl, kernels/adamw.cl)
    attention.py   Attention: attention, flash attention (kernels/attention.cl, kernels/flash.cl,
                   kernels/flash_portable.cl)
    grouped.py     Grouped: mixture of experts' grouped products and routing (kernels/moe.cl)
    muon.py        Muon: the optimizer's launchers (clgpt/models/params.py makes it on an Ops; kernels/muon.cl)
"""

from __future__ import annotations

from clgpt.device.knobs import Knobs
from clgpt.device.opencl import Device
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig
from clgpt.ops.attention import FLASH_LONG_T, FLASH_MIN_GROUPS, Attention
from clgpt.ops.core import ATTENTION, F32, Facts, ceil_to
from clgpt.ops.gemm import MATMUL_TILES, make_gemms, matmul_defines, matmul_launch, split_k_chunks
from clgpt.ops.grouped import Grouped
from clgpt.ops.layers import Layers
from clgpt.ops.linear import Linear
from clgpt.ops.norms import Norms

__all__ = ["F32", "FLASH_LONG_T", "FLASH_MIN_GROUPS", "MATMUL_TILES", "Ops", "ceil_to", "matmul_defines",
           "matmul_launch", "split_k_chunks"]


class Ops:
    """Launchers for one device and one model's widths (C, H, D, V, eps are build options of the kernels).

    `seq_len` (the engine's longest T) decides whether attention runs as batched matmuls on GPUs.
    `precision` (clgpt/device/precision.py): the matmuls' operands, fp32 | tf32 | bf16, resolved by the caller.
    `knobs`: the Knobs the caller read at its edge (clgpt.device.knobs.read). `label_smoothing`: the smoothed
    cross-entropy's eps (checked by the engine; 0: none built). The parts: facts, gemms (backend: the chosen GEMM),
    copies' lifetime (the backend's), linear, norms, layers, attention, grouped.
    """

    def __init__(self, dev: Device, cfg: ModelConfig, seq_len: int, precision: str = "fp32",
                 batch_size: int | None = None, *, knobs: Knobs, attention: str = "auto", label_smoothing: float = 0.0):
        if attention not in ATTENTION:
            raise ClgptError(f"attention {attention!r}: use {', '.join(ATTENTION)}")
        f = self.facts = Facts(dev, cfg, seq_len, precision, knobs)
        self.dev, self.cfg, self.ctx, self.queue, self.knobs, self.caps = dev, cfg, f.ctx, f.queue, knobs, f.caps
        self.launcher, self.k, self.launch = f.launcher, f.launcher.k, f.launch
        self.align, self.preset = f.align, f.preset
        self.precision, self.round, self.gemm, self.mm = f.precision, f.round, f.gemm, f.mm
        self.mma, self.bf16, self.wgmma, self.bf16_options = f.mma, f.bf16, f.wgmma, f.bf16_options
        self.rows, self.attn_gemm, self.tiled_outputs = f.rows, f.attn_gemm, f.tiled_outputs
        self.product_kernels = f.product_kernels
        self.gemms = g = make_gemms(f)
        self.backend = b = g.chosen
        self.linear = Linear(f, b)
        self.norms = Norms(f, b.copies)
        self.layers = ly = Layers(f, b, label_smoothing)
        self.attention = at = Attention(f, b, ly, attention, seq_len, batch_size)
        self.grouped = gr = Grouped(f, g, self.linear, ly)
        self.flash, self.flash_portable, self.rope_fused = at.flash, at.flash_portable, at.rope_fused
        self.run, self.runp, self.buf = f.launcher.run, f.launcher.runp, f.launcher.buf

        # the GEMM and its copies' lifetime (the chosen backend's)
        self.matmul, self.matmul_epi, self.bmm, self.on_wgmma = b.matmul, b.matmul_epi, b.bmm, b.on_wgmma
        self.linear_backward, self.bias_backward = self.linear.linear_backward, self.linear.bias_backward
        c = b.copies
        self.copies = c.book
        self.stable, self.forget_copies, self.reuse, self.settle = c.stable, c.forget_copies, c.reuse, c.settle
        self.tiled_copy = c.tiled_copy
        self.split_plan = g.tiled.split_plan
        self.rb_plans = g.rb.rb_plans if g.rb is not None else {}
        if g.rb is not None:
            self.rb_tiles = g.rb.rb_tiles
        if g.bf16 is not None:
            bf = g.bf16
            self.to_bf16, self.bf16_operands, self.matmul_bf16 = bf.to_bf16, bf.bf16_operands, bf.matmul_bf16

        # norms, the other layers, attention
        n = self.norms
        self.layernorm, self.layernorm_backward = n.layernorm, n.layernorm_backward
        self.rmsnorm, self.rmsnorm_backward = n.rmsnorm, n.rmsnorm_backward
        self.head_logits, self.xent_forward, self.xent_backward = ly.head_logits, ly.xent_forward, ly.xent_backward
        self.embedding_forward, self.token_embd_backward = ly.embedding_forward, ly.token_embd_backward
        self.position_embd_backward = ly.position_embd_backward
        self.rope_forward, self.rope_backward = ly.rope_forward, ly.rope_backward
        self.swiglu_rows_forward, self.swiglu_forward, self.swiglu_backward = (
            ly.swiglu_rows_forward, ly.swiglu_forward, ly.swiglu_backward)
        self.dropout_forward, self.dropout_residual, self.dropout_backward = (
            ly.dropout_forward, ly.dropout_residual, ly.dropout_backward)
        self.grad_norm, self.adamw = ly.grad_norm, ly.adamw
        self.attention_forward, self.attention_backward = at.attention_forward, at.attention_backward
        self.att_floats, self.rotated_qkv, self.flash_setup = at.att_floats, at.rotated_qkv, at.flash_setup

        # mixture of experts
        self.grouped_tiles, self.grouped_local, self.grouped_mma = (gr.grouped_tiles, gr.grouped_local,
                                                                    gr.grouped_mma)
        self.grouped_on_wgmma, self.moe_tiled = gr.grouped_on_wgmma, gr.moe_tiled
        self.matmul_grouped_rows, self.matmul_grouped_k = gr.matmul_grouped_rows, gr.matmul_grouped_k
        self.grouped_linear_backward = gr.grouped_linear_backward
        self.moe_experts_forward, self.moe_experts_backward = gr.moe_experts_forward, gr.moe_experts_backward
        self.moe_gather, self.moe_route = gr.moe_gather, gr.moe_route
        self.moe_combine_backward = gr.moe_combine_backward
        self.moe_router_forward, self.moe_router_backward = gr.moe_router_forward, gr.moe_router_backward
        self.moe_weight_backward = gr.moe_weight_backward

    def weight_copies(self, M, flat, mats):
        """The weights' tiled copies made together (TiledCopies.batch): mats [(X, offset, rows, cols)], X at float
        offset of `flat`, read by products of M rows; only those whose products run on wgmma."""
        self.backend.copies.batch(flat, [m for m in mats if self.backend.on_wgmma(M, m[2], m[3])])

    def build_gpt2(self):
        """GPT-2's own kernels: LayerNorm (with its GPU row forms), the position embedding's gradient."""
        self.layers.build_gpt2()
        self.norms.build_gpt2()

    def build_llama(self):
        """Llama's own kernels: RMSNorm, RoPE with the q | k | v packing, SwiGLU, the MoE routing."""
        self.norms.build_llama()
        self.layers.build_llama()
        if self.cfg.n_expert:
            self.grouped.build()
        return self.k


def attention_ops(dev: Device, cfg: ModelConfig, B: int, T: int, knobs: Knobs, form: str = "batched") -> "Ops":
    """The Ops attention_seconds times with: one GPT-2 layer (q | k | v rows, as the tuner's own runs of the flash
    kernels, clgpt.device.tuner_flash.Run) of cfg's width and heads. Made alone, it builds the programs that
    timing will ask for first (the device's cache keeps them)."""
    one = ModelConfig(vocab_size=64, n_ctx=T, n_embd=cfg.n_embd, n_head=cfg.n_head, n_layer=1, n_ff=4 * cfg.n_embd)
    return Ops(dev, one, T, "fp32", batch_size=B, knobs=knobs, attention=form)


def attention_seconds(dev: Device, cfg: ModelConfig, B: int, T: int, knobs: Knobs, form: str = "batched",
                      reps: int = 3) -> float:
    """Seconds of one layer's attention, forward and backward, in `form` at (B, T) with cfg's heads (all of them
    keys and values) on the knobs' row, fp32: the median of `reps` calls after an untimed one. Portable flash
    attention's tuner weighs its kernels against the batched form's products and row kernels with it
    (clgpt.device.tuner_flash.resolve)."""
    import statistics
    import time

    import numpy as np
    import pyopencl as cl

    ops = attention_ops(dev, cfg, B, T, knobs, form)
    C, rng = cfg.n_embd, np.random.default_rng(0)
    qkv_floats = B * T * 3 * C
    qkv = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                    hostbuf=rng.standard_normal(qkv_floats).astype(np.float32))
    dout = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                     hostbuf=rng.standard_normal(B * T * C).astype(np.float32))
    out, dqkv = ops.buf(B * T * C), ops.buf(qkv_floats)
    att, datt = ops.buf(ops.att_floats(B, T)), ops.buf(ops.att_floats(B, T))

    def call() -> float:
        t0 = time.perf_counter()
        ops.attention_forward(B, T, qkv, out, att, None)
        ops.attention_backward(B, T, dout, qkv, att, datt, dqkv, None, out=out)
        dev.queue.finish()
        return time.perf_counter() - t0

    call()
    return statistics.median(call() for _ in range(reps))
