"""The Ops base: what one device and one model's widths decide once, the kernels an architecture builds (into the
launcher's table, clgpt/ops/launcher.py, through which every clgpt/ops module launches), and split-K's reduce.

Builds, and launches none itself: kernels/embedding.cl, attention.cl, xent.cl, bias.cl, transpose.cl, matmul.cl, adamw.cl and
dropout.cl for every architecture (_build_common), layernorm.cl for GPT-2 (build_gpt2), rmsnorm.cl, rope.cl,
swiglu.cl and moe.cl for Llama (build_llama). The path a device takes comes from its clgpt.device.tuning row,
clgpt.device.precision's matrix path and clgpt.device.knobs, read once into clgpt/device/capabilities.py's record: the portable GEMM (self.mm), tensor cores (self.mma), the bf16
GEMM (self.bf16) and wgmma (self.wgmma); clgpt/ops/gemm.py dispatches between them.
"""

from __future__ import annotations

import math

import numpy as np
import pyopencl as cl

from clgpt.device.opencl import Device
from clgpt.errors import ClgptError
from clgpt.device.capabilities import capabilities
from clgpt.device.knobs import Knobs
from clgpt.device.knobs import read as read_knobs
from clgpt.model import ModelConfig
from clgpt.ops.copybook import CopyBook
from clgpt.ops.launcher import F32, Launcher, ceil_to
from clgpt.device.precision import ROUND
from clgpt.device.tuning import WGMMA_MIN_MNK

ATTENTION = ("auto", "flash", "batched")  # the stages' `attention` setting (AttentionOps._use_flash)

i32, f32 = np.int32, np.float32


class BaseOps:
    """State and kernels of one Ops (see clgpt.ops.Ops); run / runp for the models, through the launcher."""

    def __init__(self, dev: Device, cfg: ModelConfig, seq_len: int, precision: str = "fp32",
                 batch_size: int | None = None, knobs: Knobs | None = None, attention: str = "auto"):
        if attention not in ATTENTION:
            raise ClgptError(f"attention {attention!r}: use {', '.join(ATTENTION)}")
        self.dev, self.cfg = dev, cfg
        self.ctx, self.queue = dev.ctx, dev.queue
        kn = read_knobs() if knobs is None else knobs
        self.knobs = kn
        self.caps = caps = capabilities(dev.device, kn)
        self.launch = dict(caps.launch)
        # the one place a kernel is enqueued (clgpt/ops/launcher.py): kernels by name, buffers, scratch
        self.launcher = Launcher(dev, self.launch, caps.preset, caps.row_groups_of_one, kn.nv_verbose)
        self.mm = self.launch["matmul"]
        # matmul precision: ROUND for the portable kernels; the GEMM backend the record gives for it, with its
        # (big, small) tiles: mma on fp32 operands, the bf16 GEMM on bf16 operand copies (kernels/matmul_bf16.cl:
        # cp.async, ldmatrix), and on sm_90 (H100, H200) wgmma (kernels/matmul_wgmma.cl) on tiled copies
        if precision not in ROUND:  # resolved where the device is made (EngineBase: clgpt.device.precision.resolve)
            raise ClgptError(f"Ops: precision {precision!r} is not resolved; use one of {', '.join(ROUND)}")
        self.precision = precision
        self.round = ROUND[self.precision]
        self.gemm = caps.gemm_backend(self.round)
        self.mma = self.bf16 = self.wgmma = None
        if self.gemm != "portable":
            self.mma = (self.launch["matmul_mma"], self.launch["matmul_mma_small"])
        if self.gemm in ("bf16", "wgmma"):
            self.bf16 = (self.launch["matmul_bf16"], self.launch["matmul_bf16_small"])
        if self.gemm == "wgmma":
            self.wgmma = (self.launch["matmul_wgmma"], self.launch["matmul_wgmma_narrow"])
        self.bf16_options = {}
        # the launcher's byte slots hold the bf16 copies: 0, 1 op(A), op(B); 2 reuse's; 3 a gradient's copy its
        # product wrote (TILED_OUT 2)
        self.wgmma_min = WGMMA_MIN_MNK if kn.wgmma_min_mnk is None else kn.wgmma_min_mnk  # 0: every product
        # wgmma reads one tiled copy of a matrix for a product and for its transposes (M- / N-major operands):
        # the book of which copies serve which products (clgpt/ops/copybook.py)
        self.copies = CopyBook()
        self.align = self.launcher.align  # sub-buffer alignment, in floats
        # the record's op forms where this model's widths allow them (see clgpt/device/capabilities.py)
        C, D = cfg.n_embd, cfg.head_dim
        self.rows = caps.group_rows  # GPUs: one work-group of `rows` work-items per row
        self.ln_rows = caps.layernorm_rows and C % 128 == 0 and C <= 2048  # LayerNorm's and RMSNorm's
        self.attn_rb = caps.attention_rb and D % 16 == 0
        self.rope_vec = caps.rope_vec and D % 8 == 0
        self.attn_gemm = caps.attention_gemm_min_t is not None and seq_len >= caps.attention_gemm_min_t
        self.preset = caps.preset
        # on wgmma: outputs whose producers also write their tiled copies (LayerNorm's, flash's, the GELU
        # products'), reuse copies that also give the bias gradient's column sums
        self.tiled_outputs = self.wgmma is not None
        self.colsum_copies = self.wgmma is not None and caps.colsum_copies
        # the launcher's scratch: slots 0, 1 the transposed B, A for matmul_rb; grown floats "parts" split-K
        # partial products, "cparts" column-sum partials, "tparts" the column sums a TILED_OUT 2 product wrote
        self.product_kernels = {}  # the GEMM kernels built, by their build options (the backends' _kernel_*)
        self._rb_variants = {}  # matmul_rb tiles with fewer vectors per work-item, by NV (rb_tiles)
        self.rb_plans = {}  # matmul_rb launches by product shape (_rb_plan)
        # LayerNorm's one-work-item kernels: rows (forward, backward) and channels (dw, db) a work-item
        self.norm_rb, self.norm_cb = self.launch.get("norm_rb", 1), self.launch.get("norm_cb", 1)
        self.k = self.launcher.k
        self._build_common()
        if self.bf16 is not None:
            self._bf16_setup()
        self.flash = self._use_flash(attention, seq_len, batch_size)
        # llama's RoPE inside flash attention's copy and stores where no kv head serves several query heads
        self.rope_fused = self.flash and cfg.arch == "llama" and cfg.kv_heads == cfg.n_head
        if self.flash:
            self.flash_setup()

    # ---- kernels ----
    def buf(self, nfloats: int) -> cl.Buffer:
        return self.launcher.buf(nfloats)

    def _build_common(self):
        """Kernels every architecture launches: matmul helpers, attention, cross-entropy, embedding, AdamW."""
        cfg, dev, k, launch, caps = self.cfg, self.dev, self.k, self.launch, self.caps
        C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
        scale = float(1.0 / math.sqrt(D))
        k["embedding_forward"] = dev.kernel("embedding", "embedding_forward", C=C)
        if caps.embedding_rows:  # CPUs: a row a work-item, float8
            k["embedding_forward_rows"] = dev.kernel("embedding", "embedding_forward_rows", C=C)
        k["embedding_backward_wte"] = dev.kernel("embedding", "embedding_backward_wte", C=C)
        for kname in ("attention_forward", "attention_backward_query", "attention_backward_key"):
            k[kname] = dev.kernel("attention", kname, C=C, H=H, D=D, SCALE=scale, VEC=launch["vec"])
        if caps.attention_u4:  # CPUs: same kernels, dot products 4 keys at a time (kernels/attention.cl)
            for kname in ("attention_forward", "attention_backward_query"):
                k[kname] = dev.kernel("attention", kname + "_u4", C=C, H=H, D=D, SCALE=scale, VEC=1)
            if self.attn_rb:  # the products with att / datt as register-blocked ones (6 rows x 16 columns a
                # work-item): key side, and att @ v, datt @ k after the u4 kernels (ROWS_RB=1: softmax only)
                kw = dict(C=C, H=H, D=D, SCALE=scale, VEC=1)
                k["attention_backward_key_rb"] = dev.kernel("attention", "attention_backward_key_rb", **kw)
                k["attention_rows_rb"] = dev.kernel("attention", "attention_rows_rb", **kw)
                for kname in ("attention_forward", "attention_backward_query"):
                    k[kname] = dev.kernel("attention", kname + "_u4", ROWS_RB=1, **kw)
        for kname in ("xent_forward", "xent_backward"):
            k[kname] = dev.kernel("xent", kname, V=cfg.vocab_size)
        if caps.xent_fused:  # CPUs: loss and unscaled gradient in one vectorised pass per row
            k["xent_fused"] = dev.kernel("xent", "xent_fused", V=cfg.vocab_size)
        if caps.bias_v8:  # CPUs: float8 column sums (kernels/bias.cl)
            k["bias_backward_v8"] = dev.kernel("bias", "bias_backward_v8")
        if self.rows:
            LW = self.rows
            k["xent_forward_wg"] = dev.kernel("xent", "xent_forward_wg", V=cfg.vocab_size, LW=LW)
            for kname in ("attention_softmax", "attention_dsoftmax"):
                k[kname] = dev.kernel("attention", kname, C=C, H=H, D=D, SCALE=scale, VEC=0, LW=LW)
            k["bias_partial"] = dev.kernel("bias", "bias_partial")
            k["bias_final"] = dev.kernel("bias", "bias_final")
        k["splitk_reduce"] = dev.kernel("matmul", "splitk_reduce")
        for kname in ("grad_norm_partial", "grad_norm_final", "adamw"):
            k[kname] = dev.kernel("adamw", kname, STRIDED=int(launch["norm_parts"] > 256))
        if caps.grad_norm_groups:  # GPUs: the norm's sums as work-groups
            for kname in ("grad_norm_partial_wg", "grad_norm_final_wg"):
                k[kname] = dev.kernel("adamw", kname, LW=self.rows)
        k["bias_backward"] = dev.kernel("bias", "bias_backward")
        k["transpose"] = dev.kernel("transpose", "transpose")
        if caps.adamw_v8:  # CPUs: float8 AdamW (kernels/adamw.cl)
            k["adamw_v8"] = dev.kernel("adamw", "adamw_v8", STRIDED=int(launch["norm_parts"] > 256))
        if caps.transpose_v8:  # register transposes (kernels/transpose.cl)
            k["transpose_v8"] = dev.kernel("transpose", "transpose_v8")
        if caps.pad_ld:
            k["transpose_ld_v8"] = dev.kernel("transpose", "transpose_ld_v8")
            k["copy_ld_v8"] = dev.kernel("transpose", "copy_ld_v8")
        if caps.grad_norm_v8:  # chunked partial sums (not STRIDED): float8 chains
            k["grad_norm_partial"] = dev.kernel("adamw", "grad_norm_partial_v8", STRIDED=int(launch["norm_parts"] > 256))
        for kname in ("dropout_forward", "dropout_residual", "dropout_backward"):
            k[kname] = dev.kernel("dropout", kname)

    def build_gpt2(self):
        """GPT-2's own kernels: LayerNorm (with its GPU row forms), the position embedding, GELU."""
        cfg, dev, k = self.cfg, self.dev, self.k
        C = cfg.n_embd
        k["embedding_backward_wpe"] = dev.kernel("embedding", "embedding_backward_wpe", C=C)
        rb, cb = self.norm_rb, self.norm_cb
        for kname in ("layernorm_forward", "layernorm_backward", "layernorm_param_backward"):
            # RB rows / CB channels a work-item only where the table asks (CPUs): other builds keep their bytes
            k[kname] = dev.kernel("layernorm", kname, C=C, EPS=float(cfg.norm_eps),
                                  **({"RB": rb} if rb > 1 else {}), **({"CB": cb} if cb > 1 else {}))
        if self.rows:
            for kname in ("layernorm_forward_wg", "layernorm_backward_wg", "layernorm_param_partial",
                          "layernorm_param_final"):
                k[kname] = dev.kernel("layernorm", kname, C=C, EPS=float(cfg.norm_eps), LW=self.rows)
            if self.ln_rows:  # 32 work-items a row, RW rows a group
                for kname in ("layernorm_forward_rows", "layernorm_backward_rows", "layernorm_param_final_rows"):
                    k[kname] = dev.kernel("layernorm", kname, C=C, EPS=float(cfg.norm_eps), RW=self.launch["ln_rw"])
                if self.tiled_outputs:  # the output's tiled copy too
                    k["layernorm_forward_rows_tiled"] = dev.kernel("layernorm", "layernorm_forward_rows", C=C,
                                                                   EPS=float(cfg.norm_eps), RW=self.launch["ln_rw"],
                                                                   LN_TILED=1)

    def build_llama(self):
        """Llama's own kernels: RMSNorm, RoPE with the q | k | v packing, SwiGLU, the MoE routing."""
        cfg, dev, k = self.cfg, self.dev, self.k
        C, D, E = cfg.n_embd, cfg.head_dim, cfg.n_expert
        rb, cb = self.norm_rb, self.norm_cb
        for kname in ("rmsnorm_forward", "rmsnorm_backward", "rmsnorm_param_backward"):
            # as LayerNorm's: RB rows / CB channels a work-item only where the table asks (CPUs)
            k[kname] = dev.kernel("rmsnorm", kname, C=C, EPS=float(cfg.norm_eps),
                                  **({"RB": rb} if rb > 1 else {}), **({"CB": cb} if cb > 1 else {}))
        for kname in ("rope_forward", "rope_backward"):  # CPUs: 4 pairs a step (ROPE_VEC), the same bits
            k[kname] = dev.kernel("rope", kname, C=C, D=D, G=cfg.n_head // cfg.kv_heads, CKV=cfg.kv_heads * D,
                                  **({"ROPE_VEC": 1} if self.rope_vec else {}))
        for kname in ("swiglu_forward", "swiglu_backward"):  # mixture of experts: gate, up apart
            k[kname] = dev.kernel("swiglu", kname)
        # dense: h = gate | up per row (the backward is the dact product's epilogue 3)
        # CPUs with 16-float vectors (the matmul row's VW 16: AVX-512) take float16 blocks, the same bits
        wide = {"SW": 16} if self.mm.get("kernel") == "matmul_rb" and self.mm.get("VW") == 16 else {}
        k["swiglu_rows_forward"] = dev.kernel("swiglu", "swiglu_rows_forward", F=cfg.n_ff, **wide)
        if self.ln_rows:  # GPUs, C % 128 == 0: 32 work-items a row, RW rows a group (as LayerNorm's)
            for kname in ("rmsnorm_forward_rows", "rmsnorm_backward_rows", "rmsnorm_param_final_rows"):
                k[kname] = dev.kernel("rmsnorm", kname, C=C, EPS=float(cfg.norm_eps), RW=self.launch["ln_rw"])
            if self.tiled_outputs:  # the output's tiled copy too
                k["rmsnorm_forward_rows_tiled"] = dev.kernel("rmsnorm", "rmsnorm_forward_rows", C=C,
                                                             EPS=float(cfg.norm_eps), RW=self.launch["ln_rw"],
                                                             RMS_TILED=1)
        elif self.rows:
            for kname in ("rmsnorm_param_partial", "rmsnorm_param_final"):
                k[kname] = dev.kernel("rmsnorm", kname, C=C, EPS=float(cfg.norm_eps))
            # one work-group per row (as LayerNorm's): one work-item a row left most of a GPU idle
            for kname in ("rmsnorm_forward_wg", "rmsnorm_backward_wg"):
                k[kname] = dev.kernel("rmsnorm", kname, C=C, EPS=float(cfg.norm_eps), LW=self.rows)
        if self.caps.swiglu_per_element:
            self._build_swiglu_gpu()
        if self.caps.rope_per_pair:
            for kname in ("rope_forward_el", "rope_backward_el"):  # one work-item a pair
                k[kname] = dev.kernel("rope", kname, C=C, D=D, G=cfg.n_head // cfg.kv_heads, CKV=cfg.kv_heads * D)
        if E:
            self._build_moe()
        return k

    def _build_swiglu_gpu(self):
        """The dense SwiGLU forward spread over a GPU: 4 outputs a work-item (F % 4 == 0; with the output's tiled
        copy where the products read one and F % 64 == 0), else one."""
        F, dev = self.cfg.n_ff, self.dev
        if F % 4:
            self.k["swiglu_rows_forward_el"] = dev.kernel("swiglu", "swiglu_rows_forward_el", F=F)
            return
        self.k["swiglu_rows_forward_v4"] = dev.kernel("swiglu", "swiglu_rows_forward_v4", F=F)
        if self.tiled_outputs and F % 64 == 0:
            self.k["swiglu_rows_forward_v4_tiled"] = dev.kernel("swiglu", "swiglu_rows_forward_v4", F=F, SWIGLU_TILED=1)
            self.k["swiglu_rows_forward_v4_tiled_only"] = dev.kernel("swiglu", "swiglu_rows_forward_v4", F=F,
                                                                     SWIGLU_TILED=2)

    def _build_moe(self):
        """kernels/moe.cl: routing, gather, combine and their gradients, rows aligned to grouped_tiles' RM. GPUs
        route in one work-group (its local counts: 2 LW E words) and take dw one work-group a row."""
        cfg, dev, k = self.cfg, self.dev, self.k
        moe = dict(E=cfg.n_expert, K=cfg.n_expert_used, C=cfg.n_embd, RM=self.grouped_tiles()["RM"])
        for kname in ("moe_router_forward", "moe_route_packed", "moe_gather_packed", "moe_combine_forward",
                      "moe_combine_backward", "moe_weight_backward", "moe_router_backward", "moe_scatter_backward"):
            k[kname] = dev.kernel("moe", kname, **moe)
        self.route_lw = 0
        if self.caps.moe_route_group:
            lw = min(256, dev.device.max_work_group_size)
            while lw > 1 and lw * moe["E"] > 4096:
                lw //= 2
            if lw >= moe["E"]:
                self.route_lw = lw
                k["moe_route_packed_wg"] = dev.kernel("moe", "moe_route_packed_wg", **moe, LW=lw)
        if self.tiled_outputs:  # the operands of the grouped products straight to their tiled copies
            for kname in ("moe_gather_packed_tiled", "moe_combine_backward_tiled"):
                k[kname] = dev.kernel("moe", kname, **moe, MOE_TILED=1)
            k["swiglu_rows_forward_tiled"] = dev.kernel("swiglu", "swiglu_rows_forward_tiled", EXPERTS_TILED=1)
            k["to_bf16_pair"] = dev.kernel("matmul_bf16", "to_bf16_pair", TILED=1, **self.bf16_options)
        self.router_rw = 4  # tokens a work-group of moe_router_forward_rows
        if self.rows:  # the router's products inside its kernels, in fp32 (grouped.py moe_router_forward)
            for kname in ("moe_router_forward_rows", "moe_router_dw_partial", "moe_scatter_router_backward"):
                k[kname] = dev.kernel("moe", kname, **moe, RW=self.router_rw)
        if self.caps.moe_weight_backward_groups:
            k["moe_weight_backward_wg"] = dev.kernel("moe", "moe_weight_backward_wg", **moe, LW=64)

    def _nv_verbose(self, opts: dict) -> tuple:
        return self.launcher.verbose_options(opts)

    # ---- what the models launch by name (the launcher's) ----
    def run(self, name, gsize, *args, lsize=None):
        self.launcher.run(name, gsize, *args, lsize=lsize)

    def runp(self, name, gsize, *args):
        self.launcher.runp(name, gsize, *args)

    # ---- scratch ----
    def _split_k(self, kern, gsize, lsize, M, N, S, operands, tail, accum, alpha, Cm):
        """Split-K as every GEMM backend runs it: `kern` (built with split=1) writes S raw M x N partial products,
        one per slice of K along grid dimension 2, into the "parts" scratch; splitk_reduce then adds them in
        order into Cm (alpha, accum). operands: the kernel's arguments between M, N and its output; tail: those
        after its epilogue's (the slice depth kc and what follows)."""
        P = self.launcher.grown("parts", S * M * N)
        self.launcher.launch(kern, (*gsize, S), (*lsize, 1),
                             (i32(M), i32(N), *operands, P, i32(N), None, None, f32(1.0), None, *tail))
        self.launcher.runp("splitk_reduce", (M * N,), i32(M * N), i32(S), i32(bool(accum)), f32(alpha), P, Cm)
