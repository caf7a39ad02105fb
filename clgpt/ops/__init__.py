"""Ops: the launchers, one object per engine (its device and model widths), that own kernel choice.

As llm.c splits kernels (`kernels/*.cl`) from launchers (`llmc/*.cuh`), the architectures in clgpt/gpt2.py
and clgpt/llama.py call only these methods; which kernel, tiles, split-K, local sizes and launch style a
device gets comes from its clgpt.tuning row and is decided here, once, for every architecture.

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
    grad_norm / adamw     over flat parameter buffers (clgpt/params.py)
    dropout_*             counter-hash masks (clgpt/dropout.py, kernels/dropout.cl)
"""

from __future__ import annotations

import math
from collections import namedtuple
from contextlib import contextmanager
from operator import itemgetter

import numpy as np
import pyopencl as cl

from clgpt import knobs, sm90a
from clgpt.device import Device
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig
from clgpt.precision import ROUND, matrix_path, mma_bk, mma_groups, mma_launch, mma_threads, resolve
from clgpt.tuning import (MMA_SMALL_GROUPS, MMA_SPLIT_GROUPS, MMA_SPLIT_MIN_K, SMALL_GROUPS, SPLIT_MIN_K,
                          SPLIT_MIN_TOTAL_K, SPLIT_SMALL_GROUPS, WGMMA_MIN_MNK, WGMMA_SPLIT_GROUPS, WGMMA_SPLIT_MIN_K,
                          launch_config)

F32 = 4
# Default tiles of the local-memory matmul: TSM x TSN outputs per work-group, TSK deep, WPTM x WPTN outputs
# per work-item. What a device actually runs comes from clgpt.tuning (per device type and vendor).
MATMUL_TILES = dict(TSM=64, TSN=64, TSK=32, WPTM=8, WPTN=8)

i32, f32 = np.int32, np.float32
FLASH_MIN_GROUPS, FLASH_LONG_T = 4, 1024  # flash attention's size rule (Ops._use_flash)


# a GELU' deferred into a gradient's copy (Ops._matmul_bf16): the fp32 buffer holding dg, gelu's input E, the
# product's rows and columns, whether the copy holding dg * gelu'(E) was made
_Deferred = namedtuple("_Deferred", "buf E rows cols copied")


def ceil_to(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def split_k_chunks(Kp: int, groups: int, target: int, min_k: int, align: int) -> tuple[int, int] | None:
    """Split-K for the tensor-core GEMMs: -> (S, kc), Kp cut into S chunks of kc (a multiple of align) so that
    groups * S comes near 2 * target work-groups with chunks at least min_k deep; None when fewer than 2 fit."""
    S = min(-(-2 * target // groups), Kp // min_k)
    if S < 2:
        return None
    kc = ceil_to(-(-Kp // S), align)
    return -(-Kp // kc), kc


def matmul_launch(mm: dict, M: int, N: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """-> (global size, local size) of the matmul form `mm` (a clgpt.tuning matmul config) for C (M,N)."""
    if mm["kernel"] == "matmul_rb":
        lsize = tuple(mm.get("lsize", (1, 4)))
        return (ceil_to(-(-M // mm["RM"]), lsize[0]), ceil_to(-(-N // (mm.get("VW", 8) * mm["NV"])), lsize[1])), lsize
    lsize = (mm["TSN"] // mm["WPTN"], mm["TSM"] // mm["WPTM"])
    return (-(-N // mm["TSN"]) * lsize[0], -(-M // mm["TSM"]) * lsize[1]), lsize


def matmul_defines(mm: dict) -> dict:
    """The -D tile options of the matmul form `mm`."""
    return {k: v for k, v in mm.items() if k not in ("kernel", "lsize")}


class Ops:
    """Launchers for one device and one model's widths (C, H, D, V, eps are build options of the kernels).

    `seq_len` (the engine's longest T) decides whether attention runs as batched matmuls on GPUs.
    `precision` (clgpt/precision.py): the matmuls' operands, fp32 | tf32 | bf16 | auto.
    """

    def __init__(self, dev: Device, cfg: ModelConfig, seq_len: int, precision: str = "fp32",
                 batch_size: int | None = None):
        self.dev, self.cfg = dev, cfg
        self.ctx, self.queue = dev.ctx, dev.queue
        kn = knobs.read()
        self.launch = launch_config(dev.device)
        self.mm = self.launch["matmul"]
        # matmul precision: ROUND for the portable kernels; the tensor-core kernel where the device has one
        # (the big and small mma tiles), else None
        self.precision = resolve(precision, dev.device)
        self.round = ROUND[self.precision]
        self.mma = None
        if self.round and matrix_path(dev.device) == "nv_mma":
            self.mma = (self.launch["matmul_mma"], self.launch["matmul_mma_small"])
        # bf16: the GEMM on bf16 operand copies (kernels/matmul_bf16.cl: cp.async, ldmatrix), (big, small) tiles
        self.bf16, self._bf16_opts = None, {}
        self._bf16_mn = kn.bf16_mn  # m/n-contiguous copies (ldmatrix.trans)
        # the bf16 copies of op(A), op(B); reuse's; a gradient's copy its product wrote (TILED_OUT 2)
        self._b16, self._b16_size = [None, None, None, None], [0, 0, 0, 0]
        if self.round == 1 and self.mma is not None and self.launch.get("matmul_bf16"):
            self.bf16 = (self.launch["matmul_bf16"], self.launch["matmul_bf16_small"])
        # bf16 on sm_90 (H100, H200): wgmma (kernels/matmul_wgmma.cl) on tiled copies, (wide, narrow) tiles
        self.wgmma = None
        if self.bf16 is not None and self.launch.get("matmul_wgmma") and sm90a.supported(dev.device):
            self.wgmma = (self.launch["matmul_wgmma"], self.launch["matmul_wgmma_narrow"])
        self.wgmma_min = WGMMA_MIN_MNK if kn.wgmma_min_mnk is None else kn.wgmma_min_mnk  # 0: every product
        # wgmma reads one tiled copy of a matrix for a product and for its transposes (M- / N-major operands);
        # CLGPT_WGMMA_MN=0 copies op(A), op(B) transposed to K-major for each product instead (comparisons).
        # Copies of `stable` buffers (the forward's activations, the weights) serve every product until the
        # next forward (forget_copies); one `reuse` buffer's copy serves the products inside its block.
        self._wgmma_mn = kn.wgmma_mn
        # the GELU' product (epi 2): defer (default: wgmma, gelu' in its gradient's copy), wgmma (in the epilogue:
        # slower), mma (mma.sync's epilogue on copies of its own)
        self._epi2 = kn.wgmma_epi2
        self._stable, self._reusing = {}, None  # stable: handle -> buffer (held, so no handle is reused while kept)
        self._colsums = None  # (key, row chunks, buffer): the reuse copy's column sums (bias_backward)
        # products that wrote their output only as its tiled copy (matmul_wgmma.cl TILED_OUT 2): handle ->
        # (copy, Rp, Cp, column sums, row chunks), taken by the reuse block of that buffer
        self._premade = {}
        self._tiled_out = kn.wgmma_tiled_out  # 0: copies made apart (comparisons)
        # a GELU' deferred from the backward's product dg (epi 2) into its gradient's reuse copy: handle ->
        # _Deferred; once copied, the copy holds dg * gelu'(E) and the fp32 buffer dg, which nothing reads
        self._gelu_pending = {}
        self._kept, self._kept_bufs = {}, {}  # (buffer, rows, cols) -> (copy, Rp, Cp) while valid; buffer -> its copy's
        self.align = max(64, dev.device.mem_base_addr_align // 8 // F32)  # sub-buffer alignment, in floats
        self.rows = int(self.launch.get("rows", 0))  # GPUs: one work-group of `rows` work-items per row
        self.attn_gemm = bool(self.launch.get("attn_gemm", 0)) and seq_len >= self.launch.get("attn_gemm_min_t", 0)
        self.preset = bool(self.launch.get("preset", 0))
        self._plans = {}  # preset launches: (kernel, gsize, lsize, buffers) -> [a cl.Kernel, the args it holds]
        self._buffer_args = {}  # kernel -> a function picking its non-scalar arguments (_launch's key)
        self._scratch, self._scratch_size = [None, None], [0, 0]  # transposed B, A for matmul_rb
        # scratch floats grown as asked (_grown): "parts" split-K partial products, "cparts" column-sum partials,
        # "tparts" the column sums a TILED_OUT 2 product wrote (GPUs)
        self._grown_bufs = {}
        self._mm = {}
        self._rb_variants = {}  # matmul_rb tiles with fewer vectors per work-item, by NV (_rb_tiles)
        self._rb_plans = {}  # matmul_rb launches by product shape (_rb_plan)
        self._subs = {}  # sub-buffers by (buffer, offset): the K chunks of split products (_sub)
        # LayerNorm's one-work-item kernels: rows (forward, backward) and channels (dw, db) a work-item
        self.norm_rb, self.norm_cb = self.launch.get("norm_rb", 1), self.launch.get("norm_cb", 1)
        self.k = {}
        self._nv_verbose_on = kn.nv_verbose  # NVIDIA's build log with registers and spills (_nv_verbose)
        self._build_common()
        if self.bf16 is not None:
            self._bf16_setup()
        self.flash = self._use_flash(kn.flash, seq_len, batch_size)  # (after _bf16_setup: it may turn bf16 off)
        if self.flash:
            self._flash_setup()

    def _use_flash(self, mode: str, T: int, B: int | None) -> bool:
        """bf16 attention as fused kernels (kernels/flash.cl: no T x T scores) where the bf16 GEMM runs and the
        head width is 16-64. CLGPT_FLASH: auto (default) | on | off. auto: flash when the forward's grid, B x H x
        ceil(T/64) work-groups of 4 warps, fills the GPU (FLASH_MIN_GROUPS a compute unit), or T >= FLASH_LONG_T
        (the T x T buffers' memory), or B is not known. On a grid that leaves units idle the batched form's
        large products use the GPU better than flash's few work-groups; once the grid fills it, flash's fused
        kernels, which never write the scores, win (bench/RESULTS_GPU.md)."""
        D = self.cfg.head_dim
        if mode == "off" or self.bf16 is None or D % 16 or D > 64:
            return False
        groups = None if B is None else B * self.cfg.n_head * -(-T // 64)
        return (mode == "on" or groups is None or T >= FLASH_LONG_T
                or groups >= FLASH_MIN_GROUPS * self.dev.device.max_compute_units)

    # ---- kernels ----
    def buf(self, nfloats: int) -> cl.Buffer:
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, max(1, int(nfloats)) * F32)

    def _build_common(self):
        """Kernels every architecture launches: matmul helpers, attention, cross-entropy, embedding, AdamW."""
        cfg, dev, k, launch = self.cfg, self.dev, self.k, self.launch
        C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
        scale = float(1.0 / math.sqrt(D))
        k["embedding_forward"] = dev.kernel("embedding", "embedding_forward", C=C)
        if launch.get("cpu_vec"):  # CPUs: a row a work-item, float8
            k["embedding_forward_rows"] = dev.kernel("embedding", "embedding_forward_rows", C=C)
        k["embedding_backward_wte"] = dev.kernel("embedding", "embedding_backward_wte", C=C)
        for kname in ("attention_forward", "attention_backward_query", "attention_backward_key"):
            k[kname] = dev.kernel("attention", kname, C=C, H=H, D=D, SCALE=scale, VEC=launch["vec"])
        if launch.get("cpu_attn"):  # CPUs: same kernels, dot products 4 keys at a time (kernels/cpu.cl)
            for kname in ("attention_forward", "attention_backward_query"):
                k[kname] = dev.kernel("cpu", kname + "_u4", C=C, H=H, D=D, SCALE=scale)
            if D % 16 == 0:  # the products with att / datt as register-blocked ones (6 rows x 16 columns a
                # work-item): key side, and att @ v, datt @ k after the u4 kernels (ROWS_RB=1: softmax only)
                kw = dict(C=C, H=H, D=D, SCALE=scale)
                k["attention_backward_key_rb"] = dev.kernel("cpu", "attention_backward_key_rb", **kw)
                k["attention_rows_rb"] = dev.kernel("cpu", "attention_rows_rb", **kw)
                for kname in ("attention_forward", "attention_backward_query"):
                    k[kname] = dev.kernel("cpu", kname + "_u4", ROWS_RB=1, **kw)
        for kname in ("xent_forward", "xent_backward"):
            k[kname] = dev.kernel("xent", kname, V=cfg.vocab_size)
        if launch.get("xent_fused"):  # CPUs: loss and unscaled gradient in one vectorised pass per row
            k["xent_fused"] = dev.kernel("xent", "xent_fused", V=cfg.vocab_size)
        if launch.get("cpu_bias"):  # CPUs: float8 column sums (kernels/cpu.cl)
            k["bias_backward_v8"] = dev.kernel("cpu", "bias_backward_v8")
        if self.rows:
            LW = self.rows
            k["xent_forward_wg"] = dev.kernel("xent", "xent_forward_wg", V=cfg.vocab_size, LW=LW)
            for kname in ("attention_softmax", "attention_dsoftmax"):
                k[kname] = dev.kernel("attention", kname, C=C, H=H, D=D, SCALE=scale, VEC=0, LW=LW)
            k["bias_partial"] = dev.kernel("matmul", "bias_partial")
            k["bias_final"] = dev.kernel("matmul", "bias_final")
        k["splitk_reduce"] = dev.kernel("matmul", "splitk_reduce")
        for kname in ("grad_norm_partial", "grad_norm_final", "adamw"):
            k[kname] = dev.kernel("adamw", kname, STRIDED=int(launch["norm_parts"] > 256))
        if self.rows:  # GPUs: the norm's sums as work-groups
            for kname in ("grad_norm_partial_wg", "grad_norm_final_wg"):
                k[kname] = dev.kernel("adamw", kname, LW=self.rows)
        k["bias_backward"] = dev.kernel("matmul", "bias_backward")
        k["transpose"] = dev.kernel("matmul", "transpose")
        if launch.get("cpu_vec"):  # CPUs: float8 AdamW (kernels/adamw.cl), register transposes (kernels/cpu.cl)
            k["adamw_v8"] = dev.kernel("adamw", "adamw_v8", STRIDED=int(launch["norm_parts"] > 256))
            k["transpose_v8"] = dev.kernel("cpu", "transpose_v8")
        if launch.get("ld_pad"):
            k["transpose_ld_v8"] = dev.kernel("cpu", "transpose_ld_v8")
            k["copy_ld_v8"] = dev.kernel("cpu", "copy_ld_v8")
            if launch["norm_parts"] <= 256:  # chunked partial sums (not STRIDED): float8 chains
                k["grad_norm_partial"] = dev.kernel("cpu", "grad_norm_partial_v8")
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
            if C % 128 == 0 and C <= 2048 and self.launch.get("ln_rw"):  # 32 work-items a row, RW rows a group
                for kname in ("layernorm_forward_rows", "layernorm_backward_rows", "layernorm_param_final_rows"):
                    k[kname] = dev.kernel("layernorm", kname, C=C, EPS=float(cfg.norm_eps), RW=self.launch["ln_rw"])
                if self.wgmma is not None and self._wgmma_mn and self._tiled_out:  # the output's tiled copy too
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
                                  **({"ROPE_VEC": 1} if self.launch.get("cpu_vec") and D % 8 == 0 else {}))
        for kname in ("swiglu_forward", "swiglu_backward"):  # mixture of experts: gate, up apart
            k[kname] = dev.kernel("swiglu", kname)
        # dense: h = gate | up per row (the backward is the dact product's epilogue 3)
        # CPUs with 16-float vectors (the matmul row's VW 16: AVX-512) take float16 blocks, the same bits
        wide = {"SW": 16} if self.mm.get("kernel") == "matmul_rb" and self.mm.get("VW") == 16 else {}
        k["swiglu_rows_forward"] = dev.kernel("swiglu", "swiglu_rows_forward", F=cfg.n_ff, **wide)
        if self.rows:
            for kname in ("rmsnorm_param_partial", "rmsnorm_param_final"):
                k[kname] = dev.kernel("rmsnorm", kname, C=C, EPS=float(cfg.norm_eps))
            # one work-group per row (as LayerNorm's): one work-item a row left most of a GPU idle
            for kname in ("rmsnorm_forward_wg", "rmsnorm_backward_wg"):
                k[kname] = dev.kernel("rmsnorm", kname, C=C, EPS=float(cfg.norm_eps), LW=self.rows)
            k["swiglu_rows_forward_el"] = dev.kernel("swiglu", "swiglu_rows_forward_el", F=cfg.n_ff)
        if E:
            self._build_moe()
        return k

    def _build_moe(self):
        """kernels/moe.cl: routing, gather, combine and their gradients, rows aligned to grouped_tiles' RM. GPUs
        route in one work-group (its local counts: 2 LW E words) and take dw one work-group a row."""
        cfg, dev, k = self.cfg, self.dev, self.k
        moe = dict(E=cfg.n_expert, K=cfg.n_expert_used, C=cfg.n_embd, RM=self.grouped_tiles()["RM"])
        for kname in ("moe_router_forward", "moe_route_packed", "moe_gather_packed", "moe_combine_forward",
                      "moe_combine_backward", "moe_weight_backward", "moe_router_backward", "moe_scatter_backward"):
            k[kname] = dev.kernel("moe", kname, **moe)
        self.route_lw = 0
        if self.rows:
            lw = min(256, dev.device.max_work_group_size)
            while lw > 1 and lw * moe["E"] > 4096:
                lw //= 2
            if lw >= moe["E"]:
                self.route_lw = lw
                k["moe_route_packed_wg"] = dev.kernel("moe", "moe_route_packed_wg", **moe, LW=lw)
            k["moe_weight_backward_wg"] = dev.kernel("moe", "moe_weight_backward_wg", **moe, LW=64)

    def moe_route(self, N, probs, sel, pos, counts, offs, tiles, pmean):
        """Pack each expert's tokens in increasing order at a tile-aligned offset (kernels/moe.cl)."""
        args = (i32(N), probs, sel, pos, counts, offs, tiles, pmean)
        if self.route_lw:
            self.run("moe_route_packed_wg", (self.route_lw,), *args, lsize=(self.route_lw,))
        else:
            self.run("moe_route_packed", (self.cfg.n_expert,), *args, lsize=(1,))

    def moe_weight_backward(self, N, dy, pos, ye, dwsel):
        """dwsel (N, K): the gradient of each pick's weight, dy . ye of its expert's row."""
        if "moe_weight_backward_wg" in self.k:
            self.run("moe_weight_backward_wg", (N * self.cfg.n_expert_used * 64,), i32(N), dy, pos, ye, dwsel,
                     lsize=(64,))
        else:
            self.runp("moe_weight_backward", (N * self.cfg.n_expert_used,), i32(N), dy, pos, ye, dwsel)

    # ---- launch helpers ----
    def run(self, name, gsize, *args, lsize=None):
        self._launch(self.k[name], gsize, lsize, args)

    def _launch(self, kern, gsize, lsize, args):
        """kern(queue, gsize, lsize, *args); with `preset`, through a cl.Kernel kept per (kernel, sizes, buffers)
        whose arguments were set once: a repeated launch (every step of training) is one enqueue, and one whose
        scalars change every step (a dropout seed, AdamW's bias corrections) sets them again on the same
        cl.Kernel instead of making a new one each step."""
        if not self.preset or not isinstance(kern, cl.Kernel):
            kern(self.queue, gsize, lsize, *args)
            return
        ptr = kern.int_ptr
        buffers = self._buffer_args.get(ptr)  # the kernel's non-scalar arguments (buffers, None), by position
        if buffers is None:
            pos = tuple(i for i, a in enumerate(args) if not isinstance(a, np.generic))
            buffers = self._buffer_args[ptr] = (itemgetter(*pos) if len(pos) > 1 else
                                                 (lambda a, i=pos[0]: a[i]) if pos else (lambda a: ()))
        key = (ptr, tuple(gsize), lsize and tuple(lsize), buffers(args))
        try:
            plan = self._plans.get(key)
        except TypeError:  # an unhashable argument: launch it plainly
            kern(self.queue, gsize, lsize, *args)
            return
        if plan is None:
            if len(self._plans) >= 4096:
                self._plans.clear()
            plan = self._plans[key] = [cl.Kernel(kern.program, kern.function_name), None]
        if plan[1] != args:
            plan[0].set_args(*args)
            plan[1] = args
        cl.enqueue_nd_range_kernel(self.queue, plan[0], gsize, lsize)

    def runp(self, name, gsize, *args):
        """run with the device's fixed local size, the global size padded to it (the kernel bounds-checks).
        A fixed local size matters on PoCL: it compiles a kernel once per local size, and lets it pick one
        that divides the global size when none is given, so a size that changes per call (distinct tokens,
        T') would compile again and again."""
        lsize = (self.launch["local_1d"],) if len(gsize) == 1 else tuple(self.launch["local_2d"])
        self._launch(self.k[name], tuple(ceil_to(g, l) for g, l in zip(gsize, lsize)), lsize, args)

    # ---- matmul ----
    def matmul(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0):
        """Cm (M,N) = alpha * op(A) @ op(B) [+ bias] [+ resid] [+ Cm], row-major, contiguous."""
        self.matmul_epi(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha)

    def _tiles(self, M, N, nz=1):
        """-> (config, work-groups) for an (M,N) output (times nz batches): the big tiles, or the small ones
        where the big give fewer than SMALL_GROUPS work-groups."""
        mm = self.mm
        if mm["kernel"] == "matmul_rb":
            return self._rb_tiles(N), 0
        if mm["kernel"] != "matmul":
            return mm, 0
        groups = -(-M // mm["TSM"]) * -(-N // mm["TSN"]) * nz
        small = self.launch.get("matmul_small")
        if small is not None and groups < SMALL_GROUPS:
            return small, -(-M // small["TSM"]) * -(-N // small["TSN"]) * nz
        narrow = self.launch.get("matmul_narrow")
        if narrow is not None and N <= narrow["TSN"] < mm["TSN"]:
            return narrow, -(-M // narrow["TSM"]) * -(-N // narrow["TSN"]) * nz
        return mm, groups

    def _rb_tiles(self, N):
        """matmul_rb's tiles for an output N columns wide: the table's NV vectors of VW columns, or fewer where
        that leaves a shorter last partial block (the slow scalar path), e.g. N = 96 takes 2 blocks of 3 x 16.
        The sums are the same whatever the tiles (each output sums over k in order), and the tail is always the
        last N mod 16 columns (NV = 1 leaves that much), whose scalar epilogue math is what it was before."""
        mm = self.mm
        width = mm.get("VW", 8)
        nv = min(range(mm["NV"], 0, -1), key=lambda v: (N % (width * v), -v))
        if nv == mm["NV"]:
            return mm
        if nv not in self._rb_variants:  # one dict per NV: kernels are cached by the dict's id
            self._rb_variants[nv] = dict(mm, NV=nv)
        return self._rb_variants[nv]

    def _kernel_mm(self, mm, ta, tb, bias, resid, accum, epi, split=0, batch=0, causal=0, init=0):
        key = (ta, tb, bias, resid, accum, epi, split, batch, causal, id(mm), init)
        kern = self._mm.get(key)
        if kern is None:
            extra = {}
            if split:
                extra["SPLITK"] = 1
            if init:  # matmul_rb continuing the raw sums of an earlier launch (a product split along K)
                extra["INIT"] = 1
            if batch:
                extra.update(BATCH=1, CAUSAL=causal)
            if self.round:  # tf32/bf16 operands (fp32 builds keep their options, so their binaries, unchanged)
                extra["ROUND"] = self.round
            kern = self._mm[key] = self.dev.kernel(
                "matmul", mm["kernel"], TA=ta, TB=tb, BIAS=int(bias), RESID=int(resid), ACCUM=int(accum), EPI=epi,
                **extra, **matmul_defines(mm))
        return kern

    def split_plan(self, M, N, K):
        """-> (config, S, kc): split-K into S chunks of kc (S = 1: no split), GPUs only."""
        mm, groups = self._tiles(M, N)
        if not self.launch.get("split_k") or K < SPLIT_MIN_TOTAL_K:
            return mm, 1, K
        target = SPLIT_SMALL_GROUPS
        if mm is not self.launch.get("matmul_small"):  # big (or narrow) tiles: split only a short last wave
            if groups >= target:
                return mm, 1, K
            s = min(-(-target // groups), K // SPLIT_MIN_K["big"])
        else:
            big = self.mm
            gbig = -(-M // big["TSM"]) * -(-N // big["TSN"])
            s = min(-(-target // gbig), K // SPLIT_MIN_K["big"])
            if s * gbig >= SMALL_GROUPS:
                mm, groups = big, gbig
            elif groups >= SMALL_GROUPS:
                return mm, 1, K
            else:
                s = min(-(-target // groups), K // SPLIT_MIN_K["small"])
        if s < 2:
            return mm, 1, K
        kc = ceil_to(-(-K // s), mm["TSK"])
        return mm, -(-K // kc), kc

    def matmul_epi(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0, epi=0, E=None,
                   ldc=None):
        """matmul with an epilogue: epi 1 also writes E = gelu(Cm); epi 2 multiplies Cm by gelu'(E); epi 3 is
        the SwiGLU backward: E (M, 2N) = gate | up, the product is dact, Cm (M, 2N) receives dgate | dup
        (ldc = 2N: Cm's and E's rows ldc floats apart)."""
        if M <= 0 or N <= 0:
            return
        if self.bf16 is not None:
            self._matmul_bf16(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc or N)
            return
        if self.mma is not None:
            self._matmul_mma(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc or N)
            return
        if self.mm["kernel"] == "matmul_rb":
            self._matmul_rb(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc)
            return
        mm, _ = self._tiles(M, N)
        ldb = K if tb else N
        lda = M if ta else K
        if mm["kernel"] == "matmul" and bias is None and resid is None and epi == 0 and K > 0:
            mm, S, kc = self.split_plan(M, N, K)
            if S > 1:
                P = self._grown("parts", S * M * N)
                kern = self._kernel_mm(mm, ta, tb, False, False, False, 0, split=1)
                (gx, gy), lsize = matmul_launch(mm, M, N)
                self._launch(kern, (gx, gy, S), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), P,
                             i32(N), None, None, f32(1.0), None, i32(kc), i32(1), *(i32(0),) * 9))
                self.runp("splitk_reduce", (M * N,), i32(M * N), i32(S), i32(bool(accum)), f32(alpha), P, Cm)
                return
        kern = self._kernel_mm(mm, ta, tb, bias is not None, resid is not None, bool(accum), epi)
        gsize, lsize = matmul_launch(mm, M, N)
        self._launch(kern, gsize, lsize, (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc or N),
                                          bias, resid, f32(alpha), E))

    def _rb_plan(self, M, N, K, ta, tb, bias, resid, accum, epi, ldc):
        """matmul_rb's launch for one product shape: which operands go through scratch, the kernel, its sizes
        and integer arguments. Worked out once per shape (the same few shapes every step): the host's Python
        runs on the cores that compute.
        The CPU form wants op(B) rows and op(A) rows contiguous: a transposed copy costs far less than the
        strided (and, for wide A, TLB-missing) reads it saves.
        ld_pad: op(B) rows whose stride is a multiple of 64 floats (256 bytes: 1024, 4096 floats here) map a
        work-item's K loads down a column strip onto a few cache sets; rows padded by ld_pad floats spread them
        (M's 2048x4096x256 product and its K = 2048 weight gradients). A transposed B is written padded at no
        extra cost; a plain one is copied (once per product) where it holds at least ld_pad_copy floats.
        A small op(A) (M*K <= ta_direct floats: S's weight gradients) is read in place (matmul_rb's TA=1):
        measured 25-30% under transpose + NN there, and one launch fewer."""
        mm = self._rb_tiles(N)
        pad = self.launch.get("ld_pad", 0)
        if tb:
            b_op, ldb = "transpose", (N + pad if pad and N % 64 == 0 else N)
        elif pad and N % 64 == 0 and K * N >= self.launch.get("ld_pad_copy", 1 << 62):
            b_op, ldb = "pad", N + pad
        else:
            b_op, ldb = None, N
        a_transpose = bool(ta) and M * K > self.launch.get("ta_direct", 0)  # (padding its rows measured no gain)
        ta = 0 if a_transpose else ta
        lda = M if ta else K
        gsize, lsize = matmul_launch(mm, M, N)
        ints = (i32(M), i32(N), i32(K), i32(lda), i32(ldb), i32(ldc or N))
        kmax = self.launch.get("rb_kmax", 0)
        if kmax and K > kmax and not (bias or resid or epi):
            # K-long op(B) strips outgrow the caches (2048x256x4096: 57 GFLOP/s, at K = 2048 110): chunks of K
            n = -(-K // kmax)
            kc = ceil_to(-(-K // n), self.align)  # sub-buffers start at aligned offsets
            chunks = [(k0, min(kc, K - k0)) for k0 in range(0, K, kc)]
            if len(chunks) > 1:
                kerns = (self._kernel_mm(mm, ta, 0, False, False, False, 0),
                         self._kernel_mm(mm, ta, 0, False, False, False, 0, init=1),
                         self._kernel_mm(mm, ta, 0, False, False, accum, 0, init=1))
                return b_op, ldb, a_transpose, (kerns, chunks, ta), gsize, lsize, ints
        kern = self._kernel_mm(mm, ta, 0, bias, resid, accum, epi)
        return b_op, ldb, a_transpose, kern, gsize, lsize, ints

    def _matmul_rb(self, M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc):
        key = (M, N, K, ta, tb, bias is not None, resid is not None, bool(accum), epi, ldc)
        plan = self._rb_plans.get(key)
        if plan is None:
            plan = self._rb_plans[key] = self._rb_plan(*key)
        b_op, ldb, a_transpose, kern, gsize, lsize, (iM, iN, iK, ilda, ildb, ildc) = plan
        if b_op == "transpose":
            B = self._transposed(0, B, N, K, ldb)
        elif b_op == "pad":
            B = self._padded(0, B, K, N, ldb)
        if a_transpose:
            A = self._transposed(1, A, K, M)
        if isinstance(kern, tuple):  # split along K (_rb_plan)
            self._matmul_rb_chunks(kern, gsize, lsize, plan[-1], A, B, Cm, accum, alpha)
            return
        self._launch(kern, gsize, lsize, (iM, iN, iK, A, ilda, B, ildb, Cm, ildc, bias, resid, f32(alpha), E))

    def _matmul_rb_chunks(self, kerns, gsize, lsize, ints, A, B, Cm, accum, alpha):
        """A product split along K into chunks (_rb_plan's rb_kmax): the first launch writes its raw sums (alpha 1,
        no epilogue), each next one starts its accumulators from them (INIT) and goes on with the next k, the last
        applies alpha [+ Cm]. Per output the same chain of sums as one launch, bit for bit. The raw sums go to Cm
        itself, or to a scratch where Cm accumulates."""
        (first, mid, last), chunks, ta = kerns
        iM, iN, _, ilda, ildb, ildc = ints
        P, ldp = (self._grown("parts", int(iM) * int(iN)), iN) if accum else (Cm, ildc)
        end = len(chunks) - 1
        for c, (k0, kc) in enumerate(chunks):
            a = self._sub(A, k0 * (int(ilda) if ta else 1))
            b = self._sub(B, k0 * int(ildb))
            kern = first if c == 0 else last if c == end else mid
            out, ldo, scale = (Cm, ildc, alpha) if c == end else (P, ldp, 1.0)
            self._launch(kern, gsize, lsize, (iM, iN, i32(kc), a, ilda, b, ildb, out, ldo, None, P if c else None,
                                              f32(scale), None))

    def _sub(self, buf, off):
        """The sub-buffer of buf from float `off` on (kept: the same few every step, so preset launches hit)."""
        if off == 0:
            return buf
        key = (buf.int_ptr, off)
        sub = self._subs.get(key)
        if sub is None:
            parent = buf.get_info(cl.mem_info.ASSOCIATED_MEMOBJECT)  # a sub-buffer's: regions of the parent
            base = buf.get_info(cl.mem_info.OFFSET) if parent is not None else 0
            sub = self._subs[key] = (parent or buf).get_sub_region(base + off * F32, buf.size - off * F32)
        return sub

    # ---- tensor cores (kernels/matmul_mma.cl) ----
    def _mma_tiles(self, M, N, nz=1):
        """The big mma tiles, or the small ones where the big give fewer than MMA_SMALL_GROUPS work-groups."""
        big, small = self.mma
        return big if mma_groups(big, M, N) * nz >= MMA_SMALL_GROUPS else small

    def _kernel_mma(self, mm, ta, tb, bias, resid, accum, epi, align4, split=0, batch=0, causal=0):
        key = ("mma", ta, tb, bias, resid, accum, epi, align4, split, batch, causal, id(mm))
        kern = self._mm.get(key)
        if kern is None:
            nth = mma_threads(mm)
            if (mm["BM"] * 4) % nth or (mm["BN"] * 4) % nth or mm["BM"] % (16 * mm["WM"]) or mm["BN"] % (8 * mm["WN"]):
                raise ClgptError(f"mma tiles {mm}: BM, BN times 4 must divide by the work-group's threads, "
                                 "BM by 16 WM, BN by 8 WN")
            extra = dict(SPLITK=1) if split else {}
            if batch:
                extra.update(BATCH=1, CAUSAL=causal)
            if "nvidia" not in self.dev.device.vendor.lower():
                extra["MMA_EMULATE"] = 1  # CLGPT_MMA_EMULATE on a device without tensor cores (tests)
            build = self._nv_verbose(extra)
            kern = self._mm[key] = self.dev.kernel(
                "matmul_mma", "matmul_mma", build_options=build, TA=ta, TB=tb, BIAS=int(bias), RESID=int(resid),
                ACCUM=int(accum), EPI=epi, ROUND=self.round, ALIGN4=int(align4), BM=mm["BM"], BN=mm["BN"],
                WM=mm["WM"], WN=mm["WN"], **extra)
        return kern

    def _matmul_mma(self, M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc=None):
        lda, ldb = (M if ta else K), (K if tb else N)
        align4 = lda % 4 == 0 and ldb % 4 == 0
        mm = self._mma_tiles(M, N)
        groups = mma_groups(mm, M, N)
        if bias is None and resid is None and epi == 0 and K >= SPLIT_MIN_TOTAL_K and groups < MMA_SPLIT_GROUPS:
            # split-K as the fp32 kernel does: S raw partial products, then splitk_reduce adds them in order
            S = min(-(-MMA_SPLIT_GROUPS * 2 // groups), K // MMA_SPLIT_MIN_K)
            if S >= 2:
                kc = ceil_to(-(-K // S), mma_bk(self.round))
                S = -(-K // kc)
                P = self._grown("parts", S * M * N)
                kern = self._kernel_mma(mm, ta, tb, False, False, False, 0, align4, split=1)
                (gx, gy), lsize = mma_launch(mm, M, N)
                self._launch(kern, (gx, gy, S), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), P,
                             i32(N), None, None, f32(1.0), None, i32(kc), i32(1), *(i32(0),) * 9))
                self.runp("splitk_reduce", (M * N,), i32(M * N), i32(S), i32(bool(accum)), f32(alpha), P, Cm)
                return
        kern = self._kernel_mma(mm, ta, tb, bias is not None, resid is not None, bool(accum), epi, align4)
        gsize, lsize = mma_launch(mm, M, N)
        self._launch(kern, gsize, lsize, (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc or N),
                                          bias, resid, f32(alpha), E))

    # ---- bf16 GEMM on bf16 operand copies (kernels/matmul_bf16.cl) ----
    def _bf16_setup(self):
        """Build the copy kernels; on NVIDIA, find how a local pointer becomes a shared-window address for
        cp.async / ldmatrix (its integer value, or cvta.to.shared of it): kernels/matmul_bf16.cl smem_probe.
        Neither works -> self.bf16 = None (bf16 runs on matmul_mma.cl)."""
        if "nvidia" not in self.dev.device.vendor.lower():
            self._bf16_opts = dict(MMA_EMULATE=1)  # CLGPT_MMA_EMULATE (tests on PoCL)
        else:
            out = np.zeros(4, np.uint32)
            d = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=out)
            self.dev.kernel("matmul_bf16", "smem_probe")(self.queue, (64,), (64,), d)
            cl.enqueue_copy(self.queue, out, d, is_blocking=True)
            if out[1] == 0x5EED0003:
                self._bf16_opts = dict(SMEM_CVTA=0)
            elif out[2] == 0x5EED0003:
                self._bf16_opts = dict(SMEM_CVTA=1)
            else:
                self.bf16 = self.wgmma = None
                return
        self.k["to_bf16"] = self.dev.kernel("matmul_bf16", "to_bf16", **self._bf16_opts)
        self.k["to_bf16_t"] = self.dev.kernel("matmul_bf16", "to_bf16_t", **self._bf16_opts)
        if self.wgmma is not None:
            self.k["to_bf16_tiled"] = self.dev.kernel("matmul_bf16", "to_bf16", TILED=1, **self._bf16_opts)
            self.k["to_bf16_t_tiled"] = self.dev.kernel("matmul_bf16", "to_bf16_t", TILED=1, **self._bf16_opts)
            if self.rows and self.launch.get("colsum_rows") == 64:  # reuse copies: bias_partial's sums too
                for name, extra in (("to_bf16_colsum", {}), ("to_bf16_colsum_gelu", dict(GELU_GRAD=1))):
                    self.k[name] = self.dev.kernel("matmul_bf16", "to_bf16", TILED=1, COLSUM=1, **extra,
                                                   **self._bf16_opts)
                self.k["gelu_backward"] = self.dev.kernel("gelu", "gelu_backward")
            self.k["xent_backward_tiled"] = self.dev.kernel("xent", "xent_backward_tiled", V=self.cfg.vocab_size)

    def _nv_verbose(self, opts: dict) -> tuple:
        """Build options: CLGPT_NV_VERBOSE=1 has NVIDIA's compiler report registers and spills in the build log
        (bench/gpu_tc.py), not for kernels built with MMA_EMULATE in `opts`."""
        return ("-cl-nv-verbose",) if self._nv_verbose_on and not opts.get("MMA_EMULATE") else ()

    def _flash_setup(self):
        """kernels/flash.cl's three kernels, with the bf16 GEMM's options (MMA_EMULATE on PoCL, for tests)."""
        cfg = self.cfg
        for kname in ("flash_forward", "flash_backward_dq", "flash_backward_dkv"):
            self.k[kname] = self.dev.kernel("flash", kname, build_options=self._nv_verbose(self._bf16_opts),
                                            C=cfg.n_embd, H=cfg.n_head, D=cfg.head_dim,
                                            SCALE=float(1.0 / math.sqrt(cfg.head_dim)), **self._bf16_opts)
        if self.wgmma is not None and self._wgmma_mn and self._tiled_out and cfg.n_embd % 64 == 0:
            self.k["flash_forward_tiled"] = self.dev.kernel(  # the output's tiled copy on the way (wgmma)
                "flash", "flash_forward", build_options=self._nv_verbose(self._bf16_opts), C=cfg.n_embd,
                H=cfg.n_head, D=cfg.head_dim, SCALE=float(1.0 / math.sqrt(cfg.head_dim)), OUT_TILED=1,
                **self._bf16_opts)

    def _kernel_bf16(self, mm, akc, bkc, bias, resid, accum, epi, split=0):
        key = ("bf16", akc, bkc, bias, resid, accum, epi, split, id(mm))
        kern = self._mm.get(key)
        if kern is None:
            nth = mma_threads(mm)
            if (mm["BM"] % 32 or mm["BN"] % 32 or mm["BM"] % (16 * mm["WM"]) or mm["BN"] % (16 * mm["WN"])
                    or ((mm["BM"] + mm["BN"]) * 4) % nth):
                raise ClgptError(f"bf16 tiles {mm}: BM, BN multiples of 32, BM of 16 WM, BN of 16 WN, "
                                 "(BM + BN) * 4 of the work-group's threads")
            extra = dict(SPLITK=1) if split else {}
            build = self._nv_verbose(self._bf16_opts)
            kern = self._mm[key] = self.dev.kernel(
                "matmul_bf16", "matmul_bf16", build_options=build, AKC=int(akc), BKC=int(bkc), BIAS=int(bias),
                RESID=int(resid), ACCUM=int(accum), EPI=epi, BM=mm["BM"], BN=mm["BN"], WM=mm["WM"], WN=mm["WN"],
                STAGES=mm.get("STAGES", 2), **extra, **self._bf16_opts)
        return kern

    def to_bf16(self, slot, X, rows, cols, Rp, Cp, trans=False, tiled=False, out=None):
        """-> the bf16 copy (Rp x Cp, zero-padded) of X (rows x cols, row-major), or with trans of X.T (X stored
        (cols, rows)); into `out`, else scratch `slot` (0: A, 1: B, 2: Ops.reuse's). Rp and Cp multiples of 32.
        tiled: in matmul_wgmma.cl's layout (matmul_bf16.cl TILED; Rp a multiple of 8, Cp of 64)."""
        if out is None:
            out = self._b16_slot(slot, Rp * Cp * 2)
        suffix = "_tiled" if tiled else ""
        if trans:
            self._launch(self.k["to_bf16_t" + suffix], (Cp, Rp // 4), (32, 8),
                         (i32(rows), i32(cols), X, i32(rows), out, i32(Cp)))
        else:
            self._launch(self.k["to_bf16" + suffix], (Cp // 8, Rp), (4, 32),
                         (i32(rows), i32(cols), X, i32(cols), out, i32(Cp)))
        return out

    def bf16_operands(self, mm, M, N, K, A, B, ta, tb):
        """-> (A16, akc, lda, B16, bkc, ldb, Kp): bf16 copies of op(A), op(B) in the layout the fp32 buffers
        have (akc/bkc = 1: k-contiguous rows), padded to mm's tiles and Kp = K rounded up to 32. With
        CLGPT_BF16_MN=0 both are transposed to k-contiguous rows instead."""
        Kp, Mp, Np = ceil_to(max(K, 1), 32), ceil_to(M, mm["BM"]), ceil_to(N, mm["BN"])
        if self._bf16_mn:
            A16 = self.to_bf16(0, A, K, M, Kp, Mp) if ta else self.to_bf16(0, A, M, K, Mp, Kp)
            B16 = self.to_bf16(1, B, N, K, Np, Kp) if tb else self.to_bf16(1, B, K, N, Kp, Np)
            return A16, not ta, (Mp if ta else Kp), B16, bool(tb), (Kp if tb else Np), Kp
        A16 = self.to_bf16(0, A, M, K, Mp, Kp, trans=bool(ta))
        B16 = self.to_bf16(1, B, N, K, Np, Kp, trans=not tb)
        return A16, True, Kp, B16, True, Kp, Kp

    def _matmul_bf16(self, M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc=None):
        for X in (A, B):  # a deferred GELU' is read from the reuse copy only
            if X.int_ptr in self._gelu_pending and not (X.int_ptr == self._reusing and self._wgmma_mn
                                                        and self.on_wgmma(M, N, K, epi)):
                self._settle(X)
        if (epi == 2 and self._epi2 == "defer" and "to_bf16_colsum_gelu" in self.k and self._wgmma_mn
                and self.on_wgmma(M, N, K)
                and bias is None and resid is None and not accum):
            if self._tiled_out and M % 64 == 0 and N % 64 == 0:
                # dh = dg * gelu'(E) written only as dh's tiled copy and its column sums, for dh's reuse block
                copy, part = self._b16_slot(3, M * N * 2), self._grown("tparts", M // 64 * N)
                self._matmul_wgmma(M, N, K, A, B, Cm, ta, tb, None, None, False, alpha, 2, E, tiled_out=(copy, part))
                self._premade[Cm.int_ptr] = (copy, M, N, part, M // 64)
                return
            # dh = dg * gelu'(E): the product on wgmma now, gelu' when dh's reuse copy is made (or _settle)
            self._matmul_wgmma(M, N, K, A, B, Cm, ta, tb, None, None, False, alpha, 0, None)
            self._gelu_pending[Cm.int_ptr] = _Deferred(Cm, E, M, N, False)
            return
        if self.on_wgmma(M, N, K, epi):
            if (epi == 1 and self._tiled_out and self._wgmma_mn and E.int_ptr in self._stable and M % 64 == 0
                    and N % 64 == 0):
                # g = gelu(h) written only as g's kept tiled copy (the products read g through it alone)
                self._matmul_wgmma(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E,
                                   tiled_out=(self._kept_copy(E, M, N), None))
                return
            self._matmul_wgmma(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc=ldc)
            return
        big, small = self.bf16
        mm = big if mma_groups(big, M, N) >= MMA_SMALL_GROUPS else small
        ops = self.bf16_operands(mm, M, N, K, A, B, ta, tb)
        self.matmul_bf16(mm, M, N, *ops, Cm, bias, resid, accum, alpha, epi, E, split_k=K >= SPLIT_MIN_TOTAL_K,
                         ldc=ldc)

    def matmul_bf16(self, mm, M, N, A16, akc, lda, B16, bkc, ldb, Kp, Cm, bias=None, resid=None, accum=False,
                    alpha=1.0, epi=0, E=None, split_k=True, ldc=None):
        """Cm (M,N) = alpha op(A16) @ op(B16) [+ ...] on bf16 copies (bf16_operands) padded to mm's tiles and Kp."""
        groups = mma_groups(mm, M, N)
        if split_k and bias is None and resid is None and epi == 0 and groups < MMA_SPLIT_GROUPS:
            # split-K as the fp32 kernel does: S raw partial products, then splitk_reduce adds them in order
            plan = split_k_chunks(Kp, groups, MMA_SPLIT_GROUPS, MMA_SPLIT_MIN_K, 32)
            if plan:
                S, kc = plan
                P = self._grown("parts", S * M * N)
                kern = self._kernel_bf16(mm, akc, bkc, False, False, False, 0, split=1)
                (gx, gy), lsize = mma_launch(mm, M, N)
                self._launch(kern, (gx, gy, S), lsize + (1,), (i32(M), i32(N), i32(Kp), A16, i32(lda), B16, i32(ldb),
                                                              P, i32(N), None, None, f32(1.0), None, i32(kc)))
                self.runp("splitk_reduce", (M * N,), i32(M * N), i32(S), i32(bool(accum)), f32(alpha), P, Cm)
                return
        kern = self._kernel_bf16(mm, akc, bkc, bias is not None, resid is not None, bool(accum), epi)
        gsize, lsize = mma_launch(mm, M, N)
        self._launch(kern, gsize, lsize, (i32(M), i32(N), i32(Kp), A16, i32(lda), B16, i32(ldb), Cm, i32(ldc or N),
                                          bias, resid, f32(alpha), E))

    # ---- bf16 GEMM on Hopper's wgmma (kernels/matmul_wgmma.cl) ----
    def _kernel_wgmma(self, mm, trans, bias, resid, accum, epi, split=0, tiled_out=0):
        key = ("wgmma", trans, bias, resid, accum, epi, split, tiled_out, id(mm))
        kern = self._mm.get(key)
        if kern is None:
            kern = self._mm[key] = self.dev.kernel(
                "matmul_wgmma", "matmul_wgmma", BM=mm["BM"], BN=mm["BN"], TA=int(trans[0]), TB=int(trans[1]),
                STAGES=mm["STAGES"], PIPE=mm["PIPE"],
                BIAS=int(bias), RESID=int(resid), ACCUM=int(accum), EPI=epi, SPLITK=int(bool(split)),
                **({"TILED_OUT": tiled_out} if tiled_out else {}),
                SMEM_BYTES=mm["STAGES"] * (mm["BM"] + mm["BN"]) * 128 + 64)
        return kern

    def _matmul_wgmma(self, M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, tiled_out=None, ldc=None):
        """Cm (M,N) = alpha op(A) @ op(B) [+ ...] on tiled bf16 copies: wgmma, split along K when the output
        gives too few work-groups (raw parts, then splitk_reduce adds them in order, as the fp32 path does).
        tiled_out = (copy, column sums): epi 1's E, or with epi 2 Cm itself (and its sums), written only as its
        tiled bf16 copy (M, N multiples of 64: matmul_wgmma.cl TILED_OUT)."""
        wide, narrow = self.wgmma
        mm = wide if ceil_to(N, wide["BN"]) * 8 <= ceil_to(N, narrow["BN"]) * 9 else narrow
        BM, BN = mm["BM"], mm["BN"]
        Kp = ceil_to(max(K, 1), 64)
        if self._wgmma_mn:  # the copies as the fp32 buffers lie: A (K x M) with ta, B (K x N) without tb
            A16, ra, ca = self.tiled_copy(0, A, *((K, M) if ta else (M, K)))
            B16, rb, cb = self.tiled_copy(1, B, *((N, K) if tb else (K, N)))
            trans, ext = (bool(ta), not tb), (ca if ta else ra, rb if tb else cb)
        else:
            ra, rb = ceil_to(M, 64), ceil_to(N, 64)
            A16 = self.to_bf16(0, A, M, K, ra, Kp, trans=bool(ta), tiled=True)
            B16 = self.to_bf16(1, B, N, K, rb, Kp, trans=not tb, tiled=True)
            trans, ext = (False, False), (ra, rb)
        gn, gm = -(-N // BN), -(-M // BM)  # work-groups along n and m
        groups, gsize, lsize = gn * gm, (gn * 2 * BM, gm), (2 * BM, 1)
        operands = (i32(Kp), A16, i32(ra), i32(ext[0]), B16, i32(rb), i32(ext[1]))
        if (K >= SPLIT_MIN_TOTAL_K and bias is None and resid is None and epi == 0 and tiled_out is None
                and groups < WGMMA_SPLIT_GROUPS):
            plan = split_k_chunks(Kp, groups, WGMMA_SPLIT_GROUPS, WGMMA_SPLIT_MIN_K, 64)
            if plan:
                S, kc = plan
                P = self._grown("parts", S * M * N)
                self._launch(self._kernel_wgmma(mm, trans, False, False, False, 0, split=1), gsize + (S,),
                             lsize + (1,), (i32(M), i32(N), *operands, P, i32(N), None, None, f32(1.0), None, i32(kc)))
                self.runp("splitk_reduce", (M * N,), i32(M * N), i32(S), i32(bool(accum)), f32(alpha), P, Cm)
                return
        kern = self._kernel_wgmma(mm, trans, bias is not None, resid is not None, bool(accum), epi,
                                  tiled_out=epi if tiled_out else 0)
        self._launch(kern, gsize, lsize, (i32(M), i32(N), *operands, Cm, i32(ldc or N), bias, resid, f32(alpha), E,
                                          *(tiled_out or ())))

    def tiled_copy(self, slot, X, rows, cols):
        """-> (copy, Rp, Cp): the bf16 copy of X (rows x cols, row-major) in matmul_wgmma.cl's tiled layout, padded
        to Rp, Cp (multiples of 64). A stable buffer's copy is made once per forward and kept (its own device
        buffer), the reuse block's buffer's once per block (scratch slot 2); others go to scratch `slot`."""
        key = (X.int_ptr, rows, cols)
        hit = self._kept.get(key)
        if hit is not None:
            return hit
        Rp, Cp = ceil_to(rows, 64), ceil_to(cols, 64)
        if key[0] in self._stable:
            out = self._kept_buf(X, Rp * Cp * 2)
            out = self._kept[key] = (self.to_bf16(None, X, rows, cols, Rp, Cp, tiled=True, out=out), Rp, Cp)
            return out
        pre = self._premade.pop(key[0], None)
        if pre is not None:  # written by the product that made X (TILED_OUT 2), with its column sums
            if key[0] != self._reusing or pre[1:3] != (rows, cols):
                raise ClgptError("internal: a gradient written only as its tiled copy was read otherwise")
            self._colsums = (key, pre[4], pre[3])
            out = self._kept[key] = pre[:3]
            return out
        if key[0] == self._reusing:  # slot 2, with the column sums for bias_backward where the GPU has them
            if "to_bf16_colsum" not in self.k:
                out = self._kept[key] = (self.to_bf16(2, X, rows, cols, Rp, Cp, tiled=True), Rp, Cp)
                return out
            out, part = self._b16_slot(2, Rp * Cp * 2), self._grown("cparts", Rp // 64 * cols)
            args = (i32(rows), i32(cols), X, i32(cols), out, i32(Cp), part)
            gelu = self._gelu_pending.get(key[0])
            if gelu is not None and (gelu.rows, gelu.cols, gelu.copied) == (rows, cols, False):  # GELU' on the way
                self._launch(self.k["to_bf16_colsum_gelu"], (Cp // 8, Rp), (4, 64), args + (gelu.E,))
                self._gelu_pending[key[0]] = gelu._replace(copied=True)
            else:
                self._settle(X)
                self._launch(self.k["to_bf16_colsum"], (Cp // 8, Rp), (4, 64), args)
            self._colsums = (key, Rp // 64, part)
            out = self._kept[key] = (out, Rp, Cp)
            return out
        return self.to_bf16(slot, X, rows, cols, Rp, Cp, tiled=True), Rp, Cp

    def _kept_buf(self, X, nbytes):
        """The device buffer that holds stable buffer X's tiled copy, grown to nbytes."""
        out = self._kept_bufs.get(X.int_ptr)
        if out is None or out.size < nbytes:
            out = self._kept_bufs[X.int_ptr] = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, nbytes)
        return out

    def _kept_copy(self, X, rows, cols):
        """Stable X's kept tiled copy (rows, cols multiples of 64) for X's producer to write: kept from now on."""
        copy = self._kept_buf(X, rows * cols * 2)
        self._kept[(X.int_ptr, rows, cols)] = (copy, rows, cols)
        return copy

    def _with_copy(self, kname, X, rows, cols):
        """-> (kernel, extra arguments): kname's _tiled form, writing stable X's kept tiled copy as it writes X
        (LayerNorm's LN_TILED, flash's OUT_TILED), where that form was built and rows, cols are multiples of 64;
        else kname itself."""
        if kname + "_tiled" not in self.k or X.int_ptr not in self._stable or rows % 64 or cols % 64:
            return kname, ()
        return kname + "_tiled", (self._kept_copy(X, rows, cols),)

    def _settle(self, X):
        """X's fp32 values made what its readers expect: a deferred GELU' (_matmul_bf16) applied in place."""
        if X.int_ptr in self._premade:
            raise ClgptError("internal: a gradient written only as its tiled copy was read as fp32")
        gelu = self._gelu_pending.pop(X.int_ptr, None)
        if gelu is not None:
            n = gelu.rows * gelu.cols
            self.runp("gelu_backward", (n,), i32(n), X, gelu.E, X)

    def _b16_slot(self, slot, nbytes):
        """Scratch slot `slot`'s bf16 buffer, grown to at least nbytes."""
        if self._b16_size[slot] < nbytes:
            self._b16[slot], self._b16_size[slot] = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, nbytes), nbytes
        return self._b16[slot]

    def on_wgmma(self, M, N, K, epi=0) -> bool:
        """Whether the bf16 product of this size (and epilogue) runs on wgmma."""
        return self.wgmma is not None and (epi != 2 or self._epi2 == "wgmma") and M * N * K >= self.wgmma_min

    def stable(self, *bufs):
        """Declare fp32 buffers that hold still from a forward to the end of its backward (activations the
        forward writes once, the weights): on wgmma the tiled copy one product makes serves the later ones, until
        forget_copies, which the engine calls as each forward begins."""
        self._stable.update((b.int_ptr, b) for b in bufs)

    def forget_copies(self):
        self._kept.clear()
        self._premade.clear()
        for gelu in list(self._gelu_pending.values()):
            if not gelu.copied:
                self._settle(gelu.buf)
        self._gelu_pending.clear()

    @contextmanager
    def reuse(self, buf):
        """Inside the block, which does not write `buf`, the tiled copy of it made for one product serves the next
        ones (a gradient that feeds both the weight's and the input's product)."""
        if self._reusing is not None:
            raise ClgptError("Ops.reuse blocks do not nest")
        self._reusing = buf.int_ptr
        try:
            yield
        finally:
            self._reusing, self._colsums = None, None
            if self._premade.pop(buf.int_ptr, None) is not None:
                raise ClgptError("internal: a gradient written only as its tiled copy was never read")
            for key in [k for k in self._kept if k[0] == buf.int_ptr]:
                del self._kept[key]
            gelu = self._gelu_pending.get(buf.int_ptr)
            if gelu is not None and not gelu.copied:  # never copied: finish the fp32 gradient
                self._settle(buf)
            self._gelu_pending.pop(buf.int_ptr, None)

    def linear_backward(self, N, n_out, n_in, dy, x, W, dW, dx, db=None, epi=0, E=None, ldc=None):
        """Both gradients of y (N, n_out) = x (N, n_in) @ W.T [+ b]: dW += dy.T @ x, db += dy's column sums,
        dx = dy @ W through matmul_epi's epilogue `epi` (E, ldc as there). dy feeds both products, so the
        operand copy made of it for the first serves the second (reuse)."""
        with self.reuse(dy):
            self.matmul(n_out, n_in, N, dy, x, dW, ta=1, accum=True)
            if db is not None:
                self.bias_backward(N, n_out, dy, db)
            self.matmul_epi(N, n_in, n_out, dy, W, dx, epi=epi, E=E, ldc=ldc)

    def _grown(self, key, n):
        """Scratch floats `key` (see _grown_bufs), grown to at least n."""
        buf = self._grown_bufs.get(key)
        if buf is None or buf.size < n * F32:
            buf = self._grown_bufs[key] = self.buf(n)
        return buf

    def bmm(self, M, N, K, nz, hb, A, lda, a_off, B, ldb, b_off, Cm, ldc, c_off, ta=0, tb=0, alpha=1.0, causal=0,
            mm=None):
        """Batched matmul (the local-memory form): for z < nz, (zb, zh) = divmod(z, hb), Cm_z (M,N) =
        alpha op(A_z) @ op(B_z) where X_z = X + o + zb * s_b + zh * s_h and x_off = (o, s_b, s_h); causal: see
        kernels/matmul.cl. `mm` overrides the tiles (CPUs, whose table row has none of this form).
        With tensor cores (self.mma) the batched mma kernel runs instead."""
        if self.mma is not None:
            mm = self._mma_tiles(M, N, nz)
            align4 = all(v % 4 == 0 for v in (lda, ldb, *a_off, *b_off))
            kern = self._kernel_mma(mm, ta, tb, False, False, False, 0, align4, batch=1, causal=causal)
            (gx, gy), lsize = mma_launch(mm, M, N)
            self._launch(kern, (gx, gy, nz), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm,
                         i32(ldc), None, None, f32(alpha), None, i32(0), i32(hb),
                         *(i32(v) for v in (*a_off, *b_off, *c_off))))
            return
        if mm is None:
            mm, _ = self._tiles(M, N, nz)
        kern = self._kernel_mm(mm, ta, tb, False, False, False, 0, batch=1, causal=causal)
        (gx, gy), lsize = matmul_launch(mm, M, N)
        self._launch(kern, (gx, gy, nz), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc),
                     None, None, f32(alpha), None, i32(0), i32(hb), *(i32(v) for v in (*a_off, *b_off, *c_off))))

    # ---- grouped products (mixture of experts): all experts in one launch, kernels/matmul.cl GROUP ----
    # CPUs run the register-blocked matmul_rb_grouped (the CPU row's RM x NV), GPUs (the local-memory `matmul`
    # form in their table row) the `matmul` kernel built with GROUP, its tiles chosen as _tiles chooses them for
    # a plain product of the same size, weight gradients split along K as split_plan splits them.
    def grouped_local(self) -> bool:
        """Whether the grouped products run the local-memory tiled form (GPU rows of the tuning table)."""
        return self.mm["kernel"] == "matmul"

    def grouped_tiles(self) -> dict:
        """RM: the rows every expert's packed rows are aligned to (kernels/moe.cl): the register-blocked form's
        rows per work-item (the CPU row's, else 6 x 16 columns), or the tiled form's largest TSM (so every
        tile size the products pick divides it)."""
        if self.grouped_local():
            tiles = [self.launch.get(k) for k in ("matmul", "matmul_small", "matmul_narrow")]
            return dict(RM=max(t["TSM"] for t in tiles if t is not None and t["kernel"] == "matmul"))
        if self.mm["kernel"] == "matmul_rb":
            return dict(RM=self.mm["RM"], NV=self.mm["NV"], VW=self.mm.get("VW", 8), lsize=tuple(self.mm.get("lsize", (1, 4))))
        return dict(RM=6, NV=2, VW=8, lsize=(1, 16))

    def _grouped_kernel(self, group, E, ta, accum):
        g = self.grouped_tiles()
        return self.dev.kernel("matmul", "matmul_rb_grouped", GROUP=group, NGROUPS=E, TA=ta, TB=0,
                               ACCUM=int(accum), RM=g["RM"], NV=g["NV"], VW=g["VW"]), g

    def _grouped_kernel_local(self, mm, group, E, ta, tb, accum, split=0):
        key = ("grouped", group, E, ta, tb, accum, split, id(mm))
        kern = self._mm.get(key)
        if kern is None:
            kern = self._mm[key] = self.dev.kernel("matmul", "matmul", GROUP=group, NGROUPS=E, TA=ta, TB=tb,
                                                   ACCUM=int(accum), SPLITK=split, **matmul_defines(mm))
        return kern

    def matmul_grouped_rows(self, E, max_tiles, N, K, A, lda, B, ldb, bstride, Cm, ldc, counts, offs, tiles,
                            accum=False, alpha=1.0, tb=0):
        """For each group e: Cm[rows of e] (,N) = alpha A[rows of e] (,K) @ op(B_e) [+ Cm], B_e = B + e*bstride
        with rows ldb apart (tb: B_e is (N,K), e.g. a slice of a stacked (E, N, K) weight, used transposed);
        group e's rows are offs[e] .. offs[e]+counts[e]-1 (device buffers), max_tiles * RM rows in all."""
        if self.grouped_local():
            rows = max_tiles * self.grouped_tiles()["RM"]
            mm, _ = self._tiles(rows, N)
            kern = self._grouped_kernel_local(mm, 1, E, 0, tb, accum)
            gsize, lsize = matmul_launch(mm, rows, N)
            self._launch(kern, gsize, lsize, (i32(rows), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc),
                                              None, None, f32(alpha), None, i32(0), i32(1), i32(bstride), i32(0),
                                              counts, offs))
            return
        if tb:  # the register-blocked form reads op(B) rows: stacked (E*N, K) -> (K, E*N), B_e at column e*N
            if ldb != K or bstride != N * K:
                raise ClgptError(f"matmul_grouped_rows: tb needs a contiguous stacked (E, N, K) B "
                                 f"(ldb {ldb}, bstride {bstride}, N {N}, K {K})")
            B, ldb = self.transposed_b(B, E * N, K)
            bstride = N
        kern, g = self._grouped_kernel(1, E, 0, accum)
        ls = g["lsize"]
        gsize = (ceil_to(max_tiles, ls[0]), ceil_to(-(-N // (g["VW"] * g["NV"])), ls[1]))
        self._launch(kern, gsize, ls, (i32(0), i32(N), i32(K), A, i32(lda), B, i32(ldb), i32(bstride), Cm, i32(ldc),
                                       i32(0), f32(alpha), counts, offs, tiles))

    def matmul_grouped_k(self, E, M, N, A, lda, B, ldb, Cm, ldc, cstride, counts, offs, ta=1, accum=True,
                         alpha=1.0, max_rows=None, total_rows=None):
        """For each group e: C_e (M,N) = alpha op(A_e) @ B_e [+ C_e], C_e = Cm + e*cstride, the K = counts[e]
        rows of A_e, B_e from offs[e] (weight gradients: op(A) = dY.T, TA=1). The tiled form splits K where
        split_plan would split a product of total_rows / E rows; chunks cover max_rows (the most one group
        can hold), and those past a group's count do nothing."""
        if self.grouped_local():
            if max_rows is None:
                raise ClgptError("matmul_grouped_k: the tiled form needs max_rows (the most rows one group holds)")
            kavg = -(-(total_rows or max_rows * E) // E)
            mm, S, kc = self.split_plan(M * E, N, kavg)  # the E outputs' tiles as one (E*M, N) output's
            GS = -(-max_rows // kc) if S > 1 else 1
            if GS > 1 and (cstride != M * N or ldc != N):
                GS = 1  # splitk_reduce_grouped wants the E outputs back to back
            if GS == 1:
                kc = 1 << 30  # one chunk: all of a group's rows
            (gx, gy), lsize = matmul_launch(mm, M, N)
            out = self._grown("parts", GS * E * M * N) if GS > 1 else Cm
            kern = self._grouped_kernel_local(mm, 2, E, ta, 0, accum and GS == 1, split=int(GS > 1))
            self._launch(kern, (gx, gy, E * GS), lsize + (1,),
                         (i32(M), i32(N), i32(0), A, i32(lda), B, i32(ldb), out, i32(ldc), None, None,
                          f32(1.0 if GS > 1 else alpha), None, i32(kc), i32(GS), i32(0), i32(cstride), counts, offs))
            if GS > 1:
                red = self._mm.get(("grouped_reduce", E))
                if red is None:
                    red = self._mm[("grouped_reduce", E)] = self.dev.kernel("matmul", "splitk_reduce_grouped",
                                                                           GROUP=2, NGROUPS=E)
                lsz = tuple(self.launch["local_2d"])
                self._launch(red, (ceil_to(M * N, lsz[0]), ceil_to(E, lsz[1])), lsz,
                             (i32(M * N), i32(kc), i32(bool(accum)), f32(alpha), counts, out, Cm))
            return
        kern, g = self._grouped_kernel(2, E, ta, accum)
        ls = g["lsize"]
        gsize = (ceil_to(-(-M // g["RM"]), ls[0]), ceil_to(-(-N // (g["VW"] * g["NV"])), ls[1]), E)
        self._launch(kern, gsize, ls + (1,), (i32(M), i32(N), i32(0), A, i32(lda), B, i32(ldb), i32(0), Cm, i32(ldc),
                                              i32(cstride), f32(alpha), counts, offs, counts))

    def transposed_b(self, x, rows, cols):
        """(x (rows, cols) transposed into scratch, its row stride): a B operand for the grouped products,
        rows padded off multiples of 64 floats where the table pads (ld_pad)."""
        pad = self.launch.get("ld_pad", 0)
        ld = rows + pad if pad and rows % 64 == 0 else rows
        return self._transposed(0, x, rows, cols, ld), ld

    def bias_backward(self, M, N, dy, db):
        """db (N) += column sums of dy (M,N), in a fixed order."""
        if self._colsums is not None and self._colsums[0] == (dy.int_ptr, M, N):  # made with dy's tiled copy
            self._bias_final(self._colsums[1], N, self._colsums[2], db)
            return
        self._settle(dy)
        if self.launch.get("cpu_bias"):
            self.run("bias_backward_v8", (-(-N // 8),), i32(M), i32(N), dy, db, lsize=(1,))
            return
        if not self.rows:
            self.runp("bias_backward", (N,), i32(M), i32(N), dy, db)
            return
        rc = self.launch["colsum_rows"]
        R = -(-M // rc)
        if R < self.launch["colsum_min_parts"]:
            self.runp("bias_backward", (N,), i32(M), i32(N), dy, db)
            return
        part = self._grown("cparts", R * N)
        self.runp("bias_partial", (N, R), i32(M), i32(N), i32(rc), dy, part)
        self._bias_final(R, N, part, db)

    def _bias_final(self, R, N, part, db):
        """db (N) += the sums of R rows of parts (bias_partial's, or to_bf16 COLSUM's): kernels/matmul.cl."""
        self.run("bias_final", (ceil_to(N, 16), 16), i32(R), i32(N), part, db, lsize=(16, 16))

    # ---- transposes (CPU matmul operands) ----
    def _transpose_into(self, x, out, rows, cols, ldo=None):
        """out (cols, rows) = x (rows, cols).T; out's rows ldo (default rows) floats apart (transpose_ld_v8)."""
        if ldo is not None and ldo != rows:
            self.run("transpose_ld_v8", (ceil_to(-(-cols // 8), 4), -(-rows // 16)), i32(rows), i32(cols), x, out,
                     i32(ldo), lsize=(4, 1))
            return
        if "transpose_v8" in self.k:  # 16 x 8 blocks
            self.run("transpose_v8", (ceil_to(-(-cols // 8), 4), -(-rows // 16)), i32(rows), i32(cols), x, out,
                     lsize=(4, 1))
            return
        self.run("transpose", (ceil_to(-(-cols // 8), 4), -(-rows // 8)), i32(rows), i32(cols), x, out, lsize=(4, 1))

    def _scratch_buf(self, slot, n):
        if self._scratch_size[slot] < n:
            self._scratch[slot], self._scratch_size[slot] = self.buf(n), n
        return self._scratch[slot]

    def _transposed(self, slot, x, rows, cols, ldo=None):
        """x (rows, cols) transposed into scratch buffer `slot` (grown as needed) -> the scratch (cols, rows),
        its rows ldo (default rows) floats apart."""
        ldo = rows if ldo is None else ldo
        out = self._scratch_buf(slot, cols * ldo)
        self._transpose_into(x, out, rows, cols, ldo)
        return out

    def _padded(self, slot, x, rows, cols, ldo):
        """x (rows, cols) copied into scratch buffer `slot`, its rows ldo floats apart (the padding unwritten)."""
        out = self._scratch_buf(slot, rows * ldo)
        self.run("copy_ld_v8", (-(-cols // 64), rows), i32(rows), i32(cols), x, out, i32(ldo), lsize=(1, 1))
        return out

    # ---- normalisation ----
    def layernorm(self, N, x, w, b, out, mean, rstd):
        if "layernorm_forward_rows" in self.k:  # GPUs, C % 128 == 0: a row a 32-work-item slice, RW a group
            rw = self.launch["ln_rw"]
            kname, copy = self._with_copy("layernorm_forward_rows", out, N, self.cfg.n_embd)
            self.run(kname, (32, ceil_to(N, rw)), i32(N), x, w, b, out, mean, rstd, *copy, lsize=(32, rw))
            return
        if self.rows:
            self.run("layernorm_forward_wg", (N * self.rows,), i32(N), x, w, b, out, mean, rstd, lsize=(self.rows,))
            return
        self._rows("layernorm_forward", -(-N // self.norm_rb), (i32(N), x, w, b, out, mean, rstd))

    def layernorm_backward(self, N, dout, x, mean, rstd, w, dw, db, dx, accum):
        C = self.cfg.n_embd
        if "layernorm_backward_rows" in self.k:  # dx and each work-group's dw, db part in one pass, then their sum
            rw = self.launch["ln_rw"]
            rpi = max(1, N // (rw * self.launch["ln_parts"]))  # rows a row-slot
            P = -(-N // (rw * rpi))
            part = self._grown("cparts", 2 * P * C)
            self.run("layernorm_backward_rows", (32, P * rw), i32(N), i32(rpi), i32(accum), dout, x, w, mean, rstd,
                     dx, part, lsize=(32, rw))
            self.run("layernorm_param_final_rows", (C // 2, 32), i32(P), part, dw, db, lsize=(8, 32))
            return
        if self.rows:
            self.run("layernorm_backward_wg", (N * self.rows,), i32(N), i32(accum), dout, x, w, mean, rstd, dx,
                     lsize=(self.rows,))
            rc = self.launch["colsum_rows"]
            R = -(-N // rc)
            if R < self.launch["colsum_min_parts"]:
                self.runp("layernorm_param_backward", (-(-C // self.norm_cb),), i32(N), dout, x, mean, rstd, dw, db)
                return
            part = self._grown("cparts", 2 * R * C)
            self.runp("layernorm_param_partial", (C, R), i32(N), i32(rc), dout, x, mean, rstd, part)
            self.runp("layernorm_param_final", (C,), i32(R), part, dw, db)
            return
        self._rows("layernorm_backward", -(-N // self.norm_rb), (i32(N), i32(accum), dout, x, w, mean, rstd, dx))
        self._rows("layernorm_param_backward", -(-C // self.norm_cb), (i32(N), dout, x, mean, rstd, dw, db))


    def rmsnorm(self, N, x, w, out, rstd):
        if self.rows:
            self.run("rmsnorm_forward_wg", (N * self.rows,), i32(N), x, w, out, rstd, lsize=(self.rows,))
            return
        self._rows("rmsnorm_forward", -(-N // self.norm_rb), (i32(N), x, w, out, rstd))

    def rmsnorm_backward(self, N, dout, x, rstd, w, dw, dx, accum):
        if self.rows:
            self.run("rmsnorm_backward_wg", (N * self.rows,), i32(N), i32(accum), dout, x, w, rstd, dx,
                     lsize=(self.rows,))
        else:
            self._rows("rmsnorm_backward", -(-N // self.norm_rb), (i32(N), i32(accum), dout, x, w, rstd, dx))
        if self.rows:  # GPUs: column sums in two stages over row chunks, as LayerNorm's
            rc = self.launch["colsum_rows"]
            R = -(-N // rc)
            if R >= self.launch["colsum_min_parts"]:
                part = self._grown("cparts", R * self.cfg.n_embd)
                self.runp("rmsnorm_param_partial", (self.cfg.n_embd, R), i32(N), i32(rc), dout, x, rstd, part)
                self.runp("rmsnorm_param_final", (self.cfg.n_embd,), i32(R), part, dw)
                return
        self._rows("rmsnorm_param_backward", -(-self.cfg.n_embd // self.norm_cb), (i32(N), dout, x, rstd, dw))

    # ---- attention ----
    def att_floats(self, B: int, T: int) -> int:
        """Floats of a layer's attention state (att, datt): the probabilities (B,H,T,T), or with flash
        attention each row's softmax statistic (B,H,T)."""
        return B * self.cfg.n_head * T * (1 if self.flash else T)

    def _flash_grid(self, Bp, Tp, drop):
        """kernels/flash.cl's global size (a 64-row block of one (batch, head) a work-group of 128) and its last
        arguments: dropout's seed, site and p (p 0: none)."""
        seed, site, p = drop[:3] if drop is not None else (0, 0, 0.0)
        return (-(-Tp // 64) * 128, Bp * self.cfg.n_head), (np.uint32(seed), np.uint32(site), f32(p))

    def attention_forward(self, Bp, Tp, qkv, out, att, drop=None):
        """out (B',T',C), att (B',H,T',T') from qkv (B',T',3C). drop = (seed, site, p, att_d): dropout on the
        probabilities, att_d (B',H,T',T') receives the dropped ones (att keeps the softmax for the backward).
        Flash attention: att holds (B',H,T') row statistics, att_d is unused (the kernels redraw the mask)."""
        cfg = self.cfg
        C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
        if self.flash:
            g, tail = self._flash_grid(Bp, Tp, drop)
            kname, copy = self._with_copy("flash_forward", out, Bp * Tp, C)
            self.run(kname, g, i32(Tp), qkv, out, att, *tail, *copy, lsize=(128, 1))
            return
        if drop is not None:
            self._attention_forward_batched(Bp, Tp, qkv, out, att, drop)
            return
        if not self.attn_gemm:
            self.runp("attention_forward", (Tp, Bp * H), i32(Bp), i32(Tp), qkv, out, att)
            if "attention_rows_rb" in self.k:  # out = att @ v
                self._rows_rb(Bp, Tp, att, qkv, 2 * C, 3 * C, out, 0, C, 1.0)
            return
        self._attention_forward_batched(Bp, Tp, qkv, out, att, None)

    def _batched_tiles(self):
        """Tiles and row kernels for batched attention: the table's on GPUs, the generic ones elsewhere
        (CPUs take this form only for attention dropout)."""
        if self.mm["kernel"] == "matmul":
            return None, self.rows, ""
        if "attention_softmax_cpu" not in self.k:
            cfg, LW = self.cfg, 16
            kw = dict(C=cfg.n_embd, H=cfg.n_head, D=cfg.head_dim, SCALE=float(1.0 / math.sqrt(cfg.head_dim)), VEC=0)
            self.k["attention_softmax_cpu"] = self.dev.kernel("attention", "attention_softmax", LW=LW, **kw)
            self.k["attention_dsoftmax_cpu"] = self.dev.kernel("attention", "attention_dsoftmax", LW=LW, **kw)
        return dict(kernel="matmul", **MATMUL_TILES, LDSV=0), 16, "_cpu"

    def _attention_forward_batched(self, Bp, Tp, qkv, out, att, drop):
        C, H, D = self.cfg.n_embd, self.cfg.n_head, self.cfg.head_dim
        mm, LW, sfx = self._batched_tiles()
        T3, TT = Tp * 3 * C, Tp * Tp
        nz, scale = Bp * H, 1.0 / math.sqrt(D)
        # att = SCALE q k^T (causal tiles only), softmax rows, [dropout], out = att v
        self.bmm(Tp, Tp, D, nz, H, qkv, 3 * C, (0, T3, D), qkv, 3 * C, (C, T3, D), att, Tp, (0, H * TT, TT),
                 tb=1, alpha=scale, causal=1, mm=mm)
        self.run("attention_softmax" + sfx, (nz * Tp * LW,), i32(Tp), att, lsize=(LW,))
        probs = att
        if drop is not None:
            seed, site, p, probs = drop
            self.dropout_forward(nz * TT, seed, site, p, att, probs)
        self.bmm(Tp, D, Tp, nz, H, probs, Tp, (0, H * TT, TT), qkv, 3 * C, (2 * C, T3, D), out, C, (0, Tp * C, D),
                 causal=2, mm=mm)

    def attention_backward(self, Bp, Tp, dout, qkv, att, datt, dqkv, drop=None, out=None):
        """dqkv (B',T',3C) from dout (B',T',C); datt is scratch. drop as in attention_forward. out: the forward's
        output (B',T',C), which flash attention's backward reads."""
        cfg = self.cfg
        C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
        if self.flash:
            g, tail = self._flash_grid(Bp, Tp, drop)
            self.run("flash_backward_dq", g, i32(Tp), dout, qkv, out, att, datt, dqkv, *tail, lsize=(128, 1))
            self.run("flash_backward_dkv", g, i32(Tp), dout, qkv, att, datt, dqkv, *tail, lsize=(128, 1))
            return
        if drop is None and not self.attn_gemm:
            self.runp("attention_backward_query", (Tp, Bp * H), i32(Bp), i32(Tp), dout, qkv, att, datt, dqkv)
            if "attention_backward_key_rb" in self.k:
                self._rows_rb(Bp, Tp, datt, qkv, C, 3 * C, dqkv, 0, 3 * C, 1.0 / math.sqrt(D))  # dq = SCALE ds @ k
                self.run("attention_backward_key_rb", (-(-Tp // 6), Bp * H * (D // 8)), i32(Bp), i32(Tp), dout, qkv,
                         att, datt, dqkv, lsize=(1, D // 8))
                return
            self.runp("attention_backward_key", (Tp, Bp * H), i32(Bp), i32(Tp), dout, qkv, att, datt, dqkv)
            return
        mm, LW, sfx = self._batched_tiles()
        T3, TT, TC = Tp * 3 * C, Tp * Tp, Tp * C
        nz, scale = Bp * H, 1.0 / math.sqrt(D)
        ATT = (0, H * TT, TT)
        probs = att if drop is None else drop[3]
        # dp = dout v^T [* mask / (1-p)]; ds = att (dp - sum att dp); dq = SCALE ds k; dk = SCALE ds^T q;
        # dv = probs^T dout (probs: the dropped probabilities the forward multiplied v by)
        self.bmm(Tp, Tp, D, nz, H, dout, C, (0, TC, D), qkv, 3 * C, (2 * C, T3, D), datt, Tp, ATT, tb=1, causal=1,
                 mm=mm)
        if drop is not None:
            seed, site, p, _ = drop
            self.dropout_backward(nz * TT, seed, site, p, datt)
        self.run("attention_dsoftmax" + sfx, (nz * Tp * LW,), i32(Tp), att, datt, lsize=(LW,))
        self.bmm(Tp, D, Tp, nz, H, datt, Tp, ATT, qkv, 3 * C, (C, T3, D), dqkv, 3 * C, (0, T3, D), alpha=scale,
                 causal=2, mm=mm)
        self.bmm(Tp, D, Tp, nz, H, datt, Tp, ATT, qkv, 3 * C, (0, T3, D), dqkv, 3 * C, (C, T3, D), ta=1,
                 alpha=scale, causal=3, mm=mm)
        self.bmm(Tp, D, Tp, nz, H, probs, Tp, ATT, dout, C, (0, TC, D), dqkv, 3 * C, (2 * C, T3, D), ta=1, causal=3,
                 mm=mm)

    def _rows_rb(self, Bp, Tp, A, Bm, boff, ldb, O, ooff, ldo, sc):
        """CPUs: O[b, t, head h] = sc * sum_{t2 <= t} A[b, h, t, t2] Bm[b, t2, head h] (kernels/cpu.cl)."""
        D = self.cfg.head_dim
        self.run("attention_rows_rb", (-(-Tp // 6), Bp * self.cfg.n_head * (D // 16)), i32(Bp), i32(Tp), A, Bm,
                 i32(boff), i32(ldb), O, i32(ooff), i32(ldo), f32(sc), lsize=(1, D // 16))

    # ---- cross-entropy ----
    def xent_forward(self, N, logits, targets, mask, losses, lse, dlogits):
        """losses (N), lse (N); on CPUs (xent_fused) also mask * (softmax - onehot) into dlogits."""
        if self.launch.get("xent_fused"):
            self.runp("xent_fused", (N,), i32(N), logits, targets, mask, losses, lse, dlogits)
            return
        if self.rows:
            self.run("xent_forward_wg", (N * self.rows,), i32(N), logits, targets, mask, losses, lse,
                     lsize=(self.rows,))
            return
        self.runp("xent_forward", (N,), i32(N), logits, targets, mask, losses, lse)

    def xent_backward(self, N, s, logits, targets, mask, lse, dlogits) -> float:
        """dlogits = s * mask * (softmax - onehot), or, after the fused forward, leaves dlogits unscaled;
        -> the factor the caller's matmuls on dlogits take as alpha (s, or 1)."""
        if self.launch.get("xent_fused"):  # the forward left the unscaled gradient in dlogits
            return s
        V = self.cfg.vocab_size
        if (dlogits.int_ptr == self._reusing and self._wgmma_mn and self.on_wgmma(N, self.cfg.n_embd, V)
                and self.on_wgmma(V, self.cfg.n_embd, N)):
            # both products on dlogits read its tiled bf16 copy: write that instead of the fp32 gradient
            Rp, Cp = ceil_to(N, 64), ceil_to(V, 64)
            out = self._b16_slot(2, Rp * Cp * 2)
            self._launch(self.k["xent_backward_tiled"], (Cp // 8, Rp), (4, 32),
                         (i32(N), f32(s), logits, targets, mask, lse, out))
            self._kept[(dlogits.int_ptr, N, V)] = (out, Rp, Cp)
            return 1.0
        self.run("xent_backward", (ceil_to(V, 64), N), i32(N), f32(s), logits, targets, mask, lse, dlogits,
                 lsize=(64, 1))
        return 1.0

    # ---- embedding ----
    def embedding_forward(self, N, Tp, tokens, wte, wpe, out):
        """out (N,C) = wte[tokens] + wpe[n % T'] (llama passes a zero position table)."""
        if "embedding_forward_rows" in self.k:
            self.runp("embedding_forward_rows", (N,), i32(N), i32(Tp), tokens, wte, wpe, out)
            return
        self.runp("embedding_forward", (self.cfg.n_embd, N), i32(N), i32(Tp), tokens, wte, wpe, out)

    def token_embd_backward(self, n_rows, rows, starts, order, dx, dwte):
        """dwte[rows[r]] += sum of dx rows order[starts[r]..starts[r+1]) (host-sorted: deterministic)."""
        self.runp("embedding_backward_wte", (self.cfg.n_embd, n_rows), i32(n_rows), rows, starts, order, dx, dwte)

    def position_embd_backward(self, Bp, Tp, dx, dwpe):
        self.runp("embedding_backward_wpe", (self.cfg.n_embd, Tp), i32(Bp), i32(Tp), dx, dwpe)

    # ---- llama pieces ----
    def _rope_launch(self, name, slots, N, args):
        """(slots, N) work-items, one per (head slot, row); work-groups of about 64 (PoCL pays per group)."""
        r = max(1, 64 // slots)
        self.run(name, (slots, ceil_to(N, r)), *args, lsize=(slots, r))

    def rope_forward(self, N, Tp, src, cos, sin, qkv):
        """qkv (N,3C) = RoPE'd q, k and v (kv heads repeated) from the q | k | v product src (N, C+2Ckv);
        with n_head_kv == n_head in place (src is qkv)."""
        H, G = self.cfg.n_head, self.cfg.n_head // self.cfg.kv_heads
        self._rope_launch("rope_forward", 2 * H if G == 1 else 3 * H, N, (i32(N), i32(Tp), src, cos, sin, qkv))

    def rope_backward(self, N, Tp, dqkv, cos, sin, dsrc):
        """dsrc (N, C+2Ckv), the q | k | v product's gradient, from dqkv (N,3C); in place when G == 1."""
        H, Hkv = self.cfg.n_head, self.cfg.kv_heads
        self._rope_launch("rope_backward", 2 * H if H == Hkv else H + 2 * Hkv, N,
                          (i32(N), i32(Tp), dqkv, cos, sin, dsrc))

    def swiglu_rows_forward(self, N, h, out):
        """out (N,F) = silu(h[:, :F]) * h[:, F:], h (N,2F) = gate | up."""
        if "swiglu_rows_forward_el" in self.k:  # GPUs: one work-item per output
            F = self.cfg.n_ff
            self.run("swiglu_rows_forward_el", (ceil_to(F, 64), N), i32(N), h, out, lsize=(64, 1))
            return
        self._rows("swiglu_rows_forward", N, (i32(N), h, out))

    def _rows(self, name, N, args):
        """A one-work-item-per-row kernel over N work-items: CPUs one work-item a work-group (explicit vector loops,
        as kernels/cpu.cl's kernels are launched; so that a few, LayerNorm's dw, db at C / norm_cb, still spread
        over the cores), other devices the fixed 1-D local size."""
        if self.launch.get("cpu_vec"):
            self.run(name, (N,), *args, lsize=(1,))
        else:
            self.runp(name, (N,), *args)

    def swiglu_forward(self, n, gate, up, out):
        self.run("swiglu_forward", (ceil_to(n, 256),), i32(n), gate, up, out, lsize=(256,))

    def swiglu_backward(self, n, dy, gate, up, dgate, dup):
        self.run("swiglu_backward", (ceil_to(n, 256),), i32(n), dy, gate, up, dgate, dup, lsize=(256,))

    # ---- dropout (kernels/dropout.cl; masks from clgpt.dropout's hash of seed, site, element) ----
    def dropout_forward(self, n, seed, site, p, x, out):
        """out = x * keep / (1 - p) over n elements (out may be x)."""
        self.runp("dropout_forward", (n,), i32(n), np.uint32(seed), np.uint32(site), f32(p), x, out)

    def dropout_residual(self, n, seed, site, p, resid, y, out):
        """out = resid + y * keep / (1 - p) (a residual branch; out may be resid)."""
        self.runp("dropout_residual", (n,), i32(n), np.uint32(seed), np.uint32(site), f32(p), resid, y, out)

    def dropout_backward(self, n, seed, site, p, dx, out=None):
        """out = dx * keep / (1 - p) (out defaults to dx: in place)."""
        self.runp("dropout_backward", (n,), i32(n), np.uint32(seed), np.uint32(site), f32(p), dx,
                  dx if out is None else out)

    # ---- optimizer ----
    def grad_norm(self, n, chunk, n_parts, flat_g, partials, clip, norm_buf):
        """norm_buf[0] = ||flat_g||, norm_buf[1] = the clip factor (clip <= 0: 1)."""
        if "grad_norm_partial_wg" in self.k:  # GPUs: n_parts work-groups
            LW = self.rows
            self.run("grad_norm_partial_wg", (n_parts * LW,), i32(n), flat_g, partials, lsize=(LW,))
            self.run("grad_norm_final_wg", (LW,), i32(n_parts), f32(clip), partials, norm_buf, lsize=(LW,))
            return
        self.run("grad_norm_partial", (n_parts,), i32(n), i32(chunk), flat_g, partials)
        self.run("grad_norm_final", (1,), i32(n_parts), f32(clip), partials, norm_buf)

    def adamw(self, n, n_decay, p, g, m, v, norm_buf, lr, beta1, beta2, bc1, bc2, eps, weight_decay):
        lsize = (self.launch["local_1d"],)  # lr and the bias corrections change every step: no preset
        name, per = ("adamw_v8", 8) if "adamw_v8" in self.k else ("adamw", 1)  # adamw_v8: 8 parameters a work-item
        self.k[name](self.queue, (ceil_to(-(-n // per), lsize[0]),), lsize, i32(n), i32(n_decay), p, g, m, v,
                     norm_buf, f32(lr), f32(beta1), f32(beta2), f32(bc1), f32(bc2), f32(eps), f32(weight_decay))
