"""Engine: the GPT-2 forward pass, backward pass and AdamW step on an OpenCL device.

Shapes: B batch, T time, N = B*T rows, C n_embd, V vocab, H heads, D = C // H, F n_ff, L layers.
All parameters live in one flat device buffer (grads, AdamW m and v likewise), each tensor a sub-buffer,
tensors that decay first; so zero_grad is one fill, the grad norm is one two-stage reduction and AdamW
is one launch. Activations are allocated once for (batch_size, seq_len); a call with B' <= B, T' <= T
uses the first B'*T' rows. Within a step only the loss (and the norm in step) comes back to the host.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pyopencl as cl

from clgpt.device import Device, get_device
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig, decays, param_shapes
from clgpt.precision import ROUND, matrix_path, mma_bk, mma_groups, mma_launch, mma_threads, resolve
from clgpt.tuning import (MMA_SMALL_GROUPS, MMA_SPLIT_GROUPS, MMA_SPLIT_MIN_K, SMALL_GROUPS, SPLIT_MIN_K,
                          SPLIT_MIN_TOTAL_K, SPLIT_SMALL_GROUPS, launch_config)

F32 = 4
# Default tiles of the local-memory matmul: TSM x TSN outputs per work-group, TSK deep, WPTM x WPTN outputs
# per work-item. What a device actually runs comes from clgpt.tuning (per device type and vendor).
MATMUL_TILES = dict(TSM=64, TSN=64, TSK=32, WPTM=8, WPTN=8)

i32, f32 = np.int32, np.float32


def _ceil(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def matmul_launch(mm: dict, M: int, N: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """-> (global size, local size) of the matmul form `mm` (a clgpt.tuning matmul config) for C (M,N)."""
    if mm["kernel"] == "matmul_rb":
        lsize = tuple(mm.get("lsize", (1, 4)))
        return (_ceil(-(-M // mm["RM"]), lsize[0]), _ceil(-(-N // (8 * mm["NV"])), lsize[1])), lsize
    lsize = (mm["TSN"] // mm["WPTN"], mm["TSM"] // mm["WPTM"])
    return (-(-N // mm["TSN"]) * lsize[0], -(-M // mm["TSM"]) * lsize[1]), lsize


def matmul_defines(mm: dict) -> dict:
    """The -D tile options of the matmul form `mm`."""
    return {k: v for k, v in mm.items() if k not in ("kernel", "lsize")}


class Engine:
    def __init__(self, cfg: ModelConfig, params: dict, batch_size: int, seq_len: int, device: Device | None = None,
                 precision: str = "fp32"):
        cfg.validate()
        if seq_len > cfg.n_ctx:
            raise ClgptError(f"seq_len {seq_len} exceeds the model's n_ctx {cfg.n_ctx}")
        self.cfg, self.B, self.T = cfg, int(batch_size), int(seq_len)
        self.dev = device or get_device()
        self.ctx, self.queue = self.dev.ctx, self.dev.queue
        self.launch = launch_config(self.dev.device)
        self.mm = self.launch["matmul"]
        # matmul precision (clgpt/precision.py): ROUND for the portable kernels; the tensor-core kernel where
        # the device has one (the mma tiles), else None
        self.precision = resolve(precision, self.dev.device)
        self.round = ROUND[self.precision]
        self.mma = None
        if self.round and matrix_path(self.dev.device) == "nv_mma":
            self.mma = (self.launch["matmul_mma"], self.launch["matmul_mma_small"])
        self._scratch, self._scratch_size = [None, None], [0, 0]  # transposed B, A for matmul_rb
        self._parts, self._parts_size = None, 0  # split-K partial products, column-sum partials (GPUs)
        self._cparts, self._cparts_size = None, 0
        self.rows = int(self.launch.get("rows", 0))  # GPUs: one work-group of `rows` work-items per row
        self.attn_gemm = bool(self.launch.get("attn_gemm", 0)) and self.T >= self.launch.get("attn_gemm_min_t", 0)
        self.preset = bool(self.launch.get("preset", 0))
        self._plans = {}  # preset launches: (kernel, gsize, lsize, args) -> a cl.Kernel with those args set
        self.shapes = param_shapes(cfg)
        self._layout()
        self._build_kernels()
        self._alloc()
        self.t = 0
        self._fwd = None  # (B', T', sum(mask)) of the last forward with targets
        self.set_params(params)
        self.set_optimizer_state(None)
        self.zero_grad()

    # ---- layout and allocation ----
    def _layout(self):
        align = max(64, self.dev.device.mem_base_addr_align // 8 // F32)  # in floats
        names = [n for n in self.shapes if decays(n)] + [n for n in self.shapes if not decays(n)]
        self.offsets, off = {}, 0
        self.n_decay = 0
        for name in names:
            self.offsets[name] = off
            off = _ceil(off + int(np.prod(self.shapes[name])), align)
            if decays(name):
                self.n_decay = off
        self.n_flat = off
        self.order = names

    def _buf(self, nfloats: int) -> cl.Buffer:
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, max(1, int(nfloats)) * F32)

    def _views(self, flat: cl.Buffer) -> dict[str, cl.Buffer]:
        return {n: flat.get_sub_region(self.offsets[n] * F32, int(np.prod(self.shapes[n])) * F32) for n in self.order}

    def _alloc(self):
        cfg, B, T = self.cfg, self.B, self.T
        N, C, V, F, H, L = B * T, cfg.n_embd, cfg.vocab_size, cfg.n_ff, cfg.n_head, cfg.n_layer
        mf = cl.mem_flags
        self.flat_p, self.flat_g = self._buf(self.n_flat), self._buf(self.n_flat)
        self.flat_m, self.flat_v = self._buf(self.n_flat), self._buf(self.n_flat)
        self.p, self.g = self._views(self.flat_p), self._views(self.flat_g)
        self.n_parts = min(self.launch["norm_parts"], max(1, self.n_flat // 1024))
        self.chunk = -(-self.n_flat // self.n_parts)
        self.partials, self.norm_buf = self._buf(self.n_parts), self._buf(2)
        ib = lambda n: cl.Buffer(self.ctx, mf.READ_ONLY, max(1, n) * 4)  # noqa: E731
        self.tokens, self.targets, self.mask = ib(N), ib(N), self._buf(N)
        self.emb_order, self.emb_rows, self.emb_starts = ib(N), ib(N), ib(N + 1)
        self.acts = []
        for _ in range(L):
            self.acts.append(dict(
                x=self._buf(N * C), ln1=self._buf(N * C), ln1_mean=self._buf(N), ln1_rstd=self._buf(N),
                qkv=self._buf(N * 3 * C), att=self._buf(B * H * T * T), atty=self._buf(N * C),
                x_mid=self._buf(N * C), ln2=self._buf(N * C), ln2_mean=self._buf(N), ln2_rstd=self._buf(N),
                h=self._buf(N * F), g=self._buf(N * F),
            ))
        self.x_out = self._buf(N * C)  # residual stream after the last block
        self.lnf, self.lnf_mean, self.lnf_rstd = self._buf(N * C), self._buf(N), self._buf(N)
        self.logits, self.losses, self.lse = self._buf(N * V), self._buf(N), self._buf(N)
        # backward scratch, reused by every layer
        self.dlogits, self.dx, self.dln = self._buf(N * V), self._buf(N * C), self._buf(N * C)
        self.datty, self.dqkv = self._buf(N * C), self._buf(N * 3 * C)
        self.dg, self.dh, self.datt = self._buf(N * F), self._buf(N * F), self._buf(B * H * T * T)
        self.losses_host = np.empty(N, np.float32)

    def _build_kernels(self):
        cfg, dev = self.cfg, self.dev
        C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
        k = {}
        for kname in ("embedding_forward", "embedding_backward_wte", "embedding_backward_wpe"):
            k[kname] = dev.kernel("embedding", kname, C=C)
        for kname in ("layernorm_forward", "layernorm_backward", "layernorm_param_backward"):
            k[kname] = dev.kernel("layernorm", kname, C=C, EPS=float(cfg.norm_eps))
        for kname in ("attention_forward", "attention_backward_query", "attention_backward_key"):
            k[kname] = dev.kernel("attention", kname, C=C, H=H, D=D, SCALE=float(1.0 / math.sqrt(D)),
                                  VEC=self.launch["vec"])
        if self.launch.get("cpu_attn"):  # CPUs: same kernels, dot products 4 keys at a time (kernels/cpu.cl)
            for kname in ("attention_forward", "attention_backward_query"):
                k[kname] = dev.kernel("cpu", kname + "_u4", C=C, H=H, D=D, SCALE=float(1.0 / math.sqrt(D)))
            if D % 16 == 0:  # the products with att / datt as register-blocked ones (6 rows x 16 columns a
                # work-item): key side, and att @ v, datt @ k after the u4 kernels (ROWS_RB=1: softmax only)
                kw = dict(C=C, H=H, D=D, SCALE=float(1.0 / math.sqrt(D)))
                k["attention_backward_key_rb"] = dev.kernel("cpu", "attention_backward_key_rb", **kw)
                k["attention_rows_rb"] = dev.kernel("cpu", "attention_rows_rb", **kw)
                for kname in ("attention_forward", "attention_backward_query"):
                    k[kname] = dev.kernel("cpu", kname + "_u4", ROWS_RB=1, **kw)
        for kname in ("xent_forward", "xent_backward"):
            k[kname] = dev.kernel("xent", kname, V=cfg.vocab_size)
        if self.launch.get("xent_fused"):  # CPUs: loss and unscaled gradient in one vectorised pass per row
            k["xent_fused"] = dev.kernel("xent", "xent_fused", V=cfg.vocab_size)
        if self.launch.get("cpu_bias"):  # CPUs: float8 column sums (kernels/cpu.cl)
            k["bias_backward_v8"] = dev.kernel("cpu", "bias_backward_v8")
        if self.rows:
            LW = self.rows
            for kname in ("layernorm_forward_wg", "layernorm_backward_wg", "layernorm_param_partial",
                          "layernorm_param_final"):
                k[kname] = dev.kernel("layernorm", kname, C=C, EPS=float(cfg.norm_eps), LW=LW)
            k["xent_forward_wg"] = dev.kernel("xent", "xent_forward_wg", V=cfg.vocab_size, LW=LW)
            for kname in ("attention_softmax", "attention_dsoftmax"):
                k[kname] = dev.kernel("attention", kname, C=C, H=H, D=D, SCALE=float(1.0 / math.sqrt(D)), VEC=0, LW=LW)
            k["bias_partial"] = dev.kernel("matmul", "bias_partial")
            k["bias_final"] = dev.kernel("matmul", "bias_final")
        k["splitk_reduce"] = dev.kernel("matmul", "splitk_reduce")
        for kname in ("gelu_forward", "gelu_backward"):
            k[kname] = dev.kernel("gelu", kname)
        for kname in ("grad_norm_partial", "grad_norm_final", "adamw"):
            k[kname] = dev.kernel("adamw", kname, STRIDED=int(self.launch["norm_parts"] > 256))
        k["bias_backward"] = dev.kernel("matmul", "bias_backward")
        k["transpose"] = dev.kernel("matmul", "transpose")
        if self.launch.get("cpu_vec"):  # CPUs: float8 AdamW (kernels/adamw.cl), register transposes (kernels/cpu.cl)
            k["adamw_v8"] = dev.kernel("adamw", "adamw_v8", STRIDED=int(self.launch["norm_parts"] > 256))
            k["transpose_v8"] = dev.kernel("cpu", "transpose_v8")
        if self.launch.get("ld_pad"):
            k["transpose_ld_v8"] = dev.kernel("cpu", "transpose_ld_v8")
            k["copy_ld_v8"] = dev.kernel("cpu", "copy_ld_v8")
            if self.launch["norm_parts"] <= 256:  # chunked partial sums (not STRIDED): float8 chains
                k["grad_norm_partial"] = dev.kernel("cpu", "grad_norm_partial_v8")
        self.k = k
        self._mm = {}

    # ---- launch helpers ----
    def _run(self, name, gsize, *args, lsize=None):
        self._launch(self.k[name], gsize, lsize, args)

    def _launch(self, kern, gsize, lsize, args):
        """kern(queue, gsize, lsize, *args); with `preset`, through a cl.Kernel kept per (kernel, sizes, args)
        whose arguments were set once: a repeated launch (every step of training) is one enqueue."""
        if not self.preset or not isinstance(kern, cl.Kernel):
            kern(self.queue, gsize, lsize, *args)
            return
        key = (kern.int_ptr, tuple(gsize), lsize and tuple(lsize), args)
        try:
            k = self._plans.get(key)
        except TypeError:  # an unhashable argument: launch it plainly
            kern(self.queue, gsize, lsize, *args)
            return
        if k is None:
            if len(self._plans) >= 4096:
                self._plans.clear()
            k = cl.Kernel(kern.program, kern.function_name)
            k.set_args(*args)
            self._plans[key] = k
        cl.enqueue_nd_range_kernel(self.queue, k, gsize, lsize)

    def _runp(self, name, gsize, *args):
        """_run with the device's fixed local size, the global size padded to it (the kernel bounds-checks).
        A fixed local size matters on PoCL: it compiles a kernel once per local size, and lets it pick one
        that divides the global size when none is given, so a size that changes per call (distinct tokens,
        T') would compile again and again."""
        lsize = (self.launch["local_1d"],) if len(gsize) == 1 else tuple(self.launch["local_2d"])
        self._launch(self.k[name], tuple(_ceil(g, l) for g, l in zip(gsize, lsize)), lsize, args)

    def matmul(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0):
        """Cm (M,N) = alpha * op(A) @ op(B) [+ bias] [+ resid] [+ Cm], row-major, contiguous."""
        self._matmul(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha)

    def _tiles(self, M, N, nz=1, narrow_ok=False):
        """-> (config, work-groups) for an (M,N) output (times nz batches): the big tiles, or the small ones
        where the big give fewer than SMALL_GROUPS work-groups."""
        mm = self.mm
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

    def _kernel_mm(self, mm, ta, tb, bias, resid, accum, epi, split=0, batch=0, causal=0):
        key = (ta, tb, bias, resid, accum, epi, split, batch, causal, id(mm))
        kern = self._mm.get(key)
        if kern is None:
            extra = {}
            if split:
                extra["SPLITK"] = 1
            if batch:
                extra.update(BATCH=1, CAUSAL=causal)
            if self.round:  # tf32/bf16 operands (fp32 builds keep their options, so their binaries, unchanged)
                extra["ROUND"] = self.round
            kern = self._mm[key] = self.dev.kernel(
                "matmul", mm["kernel"], TA=ta, TB=tb, BIAS=int(bias), RESID=int(resid), ACCUM=int(accum), EPI=epi,
                **extra, **matmul_defines(mm))
        return kern

    def _split_plan(self, M, N, K):
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
        kc = _ceil(-(-K // s), mm["TSK"])
        return mm, -(-K // kc), kc

    def _matmul(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0, epi=0, E=None):
        """matmul with an epilogue: epi 1 also writes E = gelu(Cm); epi 2 multiplies Cm by gelu'(E)."""
        if M <= 0 or N <= 0:
            return
        if self.mma is not None:
            self._matmul_mma(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E)
            return
        mm, _ = self._tiles(M, N)
        if mm["kernel"] == "matmul_rb":
            # The CPU form wants op(B) rows and op(A) rows contiguous: a transposed copy costs far less than
            # the strided (and, for wide A, TLB-missing) reads it saves.
            # ld_pad: op(B) rows whose stride is a multiple of 64 floats (256 bytes: 1024, 4096 floats here) map
            # a work-item's K loads down a column strip onto a few cache sets; rows padded by ld_pad floats
            # spread them (1.2-1.4x on M's 2048x4096x256 and K = 2048 weight gradients). A transposed B is
            # written padded at no extra cost; a plain one is copied (once per product) where it holds at
            # least ld_pad_copy floats.
            pad = self.launch.get("ld_pad", 0)
            if tb:
                ldb = N + pad if pad and N % 64 == 0 else N
                B, tb = self._transposed(0, B, N, K, ldb), 0
            else:
                ldb = N
                if pad and N % 64 == 0 and K * N >= self.launch.get("ld_pad_copy", 1 << 62):
                    ldb = N + pad
                    B = self._padded(0, B, K, N, ldb)
            # A small op(A) (M*K <= ta_direct floats: S's weight gradients) is read in place (matmul_rb's TA=1):
            # measured 25-30% under transpose + NN there, and one launch fewer.
            lda = M if ta else K
            if ta and M * K > self.launch.get("ta_direct", 0):
                A, ta, lda = self._transposed(1, A, K, M), 0, K  # (padding its rows measured no gain)
        else:
            ldb = K if tb else N
            lda = M if ta else K
        if mm["kernel"] == "matmul" and bias is None and resid is None and epi == 0 and K > 0:
            mm, S, kc = self._split_plan(M, N, K)
            if S > 1:
                P = self._grow_parts(S * M * N)
                kern = self._kernel_mm(mm, ta, tb, False, False, False, 0, split=1)
                (gx, gy), lsize = matmul_launch(mm, M, N)
                self._launch(kern, (gx, gy, S), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), P,
                             i32(N), None, None, f32(1.0), None, i32(kc), i32(1), *(i32(0),) * 9))
                self._runp("splitk_reduce", (M * N,), i32(M * N), i32(S), i32(bool(accum)), f32(alpha), P, Cm)
                return
        kern = self._kernel_mm(mm, ta, tb, bias is not None, resid is not None, bool(accum), epi)
        gsize, lsize = matmul_launch(mm, M, N)
        self._launch(kern, gsize, lsize, (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(N),
                                          bias, resid, f32(alpha), E))

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
            if matrix_path(self.dev.device) == "nv_mma" and "nvidia" not in self.dev.device.vendor.lower():
                extra["MMA_EMULATE"] = 1  # CLGPT_MMA_EMULATE on a device without tensor cores (tests)
            # CLGPT_NV_VERBOSE=1: NVIDIA's compiler reports registers and spills in the build log (bench/gpu_tc.py)
            build = ("-cl-nv-verbose",) if os.environ.get("CLGPT_NV_VERBOSE") and not extra.get("MMA_EMULATE") else ()
            kern = self._mm[key] = self.dev.kernel(
                "matmul_mma", "matmul_mma", build_options=build, TA=ta, TB=tb, BIAS=int(bias), RESID=int(resid), ACCUM=int(accum),
                EPI=epi, ROUND=self.round, ALIGN4=int(align4), BM=mm["BM"], BN=mm["BN"], WM=mm["WM"], WN=mm["WN"],
                **extra)
        return kern

    def _matmul_mma(self, M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E):
        lda, ldb = (M if ta else K), (K if tb else N)
        align4 = lda % 4 == 0 and ldb % 4 == 0
        mm = self._mma_tiles(M, N)
        groups = mma_groups(mm, M, N)
        if bias is None and resid is None and epi == 0 and K >= SPLIT_MIN_TOTAL_K and groups < MMA_SPLIT_GROUPS:
            # split-K as the fp32 kernel does: S raw partial products, then splitk_reduce adds them in order
            S = min(-(-MMA_SPLIT_GROUPS * 2 // groups), K // MMA_SPLIT_MIN_K)
            if S >= 2:
                kc = _ceil(-(-K // S), mma_bk(self.round))
                S = -(-K // kc)
                P = self._grow_parts(S * M * N)
                kern = self._kernel_mma(mm, ta, tb, False, False, False, 0, align4, split=1)
                (gx, gy), lsize = mma_launch(mm, M, N)
                self._launch(kern, (gx, gy, S), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), P,
                             i32(N), None, None, f32(1.0), None, i32(kc), i32(1), *(i32(0),) * 9))
                self._runp("splitk_reduce", (M * N,), i32(M * N), i32(S), i32(bool(accum)), f32(alpha), P, Cm)
                return
        kern = self._kernel_mma(mm, ta, tb, bias is not None, resid is not None, bool(accum), epi, align4)
        gsize, lsize = mma_launch(mm, M, N)
        self._launch(kern, gsize, lsize, (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(N),
                                          bias, resid, f32(alpha), E))

    def _grow_parts(self, n):
        if self._parts_size < n:
            self._parts, self._parts_size = self._buf(n), n
        return self._parts

    def _grow_cparts(self, n):
        if self._cparts_size < n:
            self._cparts, self._cparts_size = self._buf(n), n
        return self._cparts

    def _bmm(self, M, N, K, nz, hb, A, lda, a_off, B, ldb, b_off, Cm, ldc, c_off, ta=0, tb=0, alpha=1.0, causal=0):
        """Batched matmul (GPUs): for z < nz, (zb, zh) = divmod(z, hb), Cm_z (M,N) = alpha op(A_z) @ op(B_z)
        where X_z = X + o + zb * s_b + zh * s_h and x_off = (o, s_b, s_h); causal: see kernels/matmul.cl."""
        if self.mma is not None:
            mm = self._mma_tiles(M, N, nz)
            align4 = all(v % 4 == 0 for v in (lda, ldb, *a_off, *b_off))
            kern = self._kernel_mma(mm, ta, tb, False, False, False, 0, align4, batch=1, causal=causal)
            (gx, gy), lsize = mma_launch(mm, M, N)
            self._launch(kern, (gx, gy, nz), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm,
                         i32(ldc), None, None, f32(alpha), None, i32(0), i32(hb),
                         *(i32(v) for v in (*a_off, *b_off, *c_off))))
            return
        mm, _ = self._tiles(M, N, nz)
        kern = self._kernel_mm(mm, ta, tb, False, False, False, 0, batch=1, causal=causal)
        (gx, gy), lsize = matmul_launch(mm, M, N)
        self._launch(kern, (gx, gy, nz), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc),
                     None, None, f32(alpha), None, i32(0), i32(hb), *(i32(v) for v in (*a_off, *b_off, *c_off))))

    def _bias_backward(self, M, N, dy, db):
        """db (N) += column sums of dy (M,N), in a fixed order."""
        if self.launch.get("cpu_bias"):
            self._run("bias_backward_v8", (-(-N // 8),), i32(M), i32(N), dy, db, lsize=(1,))
            return
        if not self.rows:
            self._runp("bias_backward", (N,), i32(M), i32(N), dy, db)
            return
        rc = self.launch["colsum_rows"]
        R = -(-M // rc)
        if R < self.launch["colsum_min_parts"]:
            self._runp("bias_backward", (N,), i32(M), i32(N), dy, db)
            return
        part = self._grow_cparts(R * N)
        self._runp("bias_partial", (N, R), i32(M), i32(N), i32(rc), dy, part)
        self._runp("bias_final", (N,), i32(R), i32(N), part, db)

    def _attention_forward(self, Bp, Tp, qkv, out, att):
        cfg = self.cfg
        C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
        if not self.attn_gemm:
            self._runp("attention_forward", (Tp, Bp * H), i32(Bp), i32(Tp), qkv, out, att)
            if "attention_rows_rb" in self.k:  # out = att @ v
                self._rows_rb(Bp, Tp, att, qkv, 2 * C, 3 * C, out, 0, C, 1.0)
            return
        T3, TT = Tp * 3 * C, Tp * Tp
        nz, scale = Bp * H, 1.0 / math.sqrt(D)
        # att = SCALE q k^T (causal tiles only), softmax rows, out = att v
        self._bmm(Tp, Tp, D, nz, H, qkv, 3 * C, (0, T3, D), qkv, 3 * C, (C, T3, D), att, Tp, (0, H * TT, TT),
                  tb=1, alpha=scale, causal=1)
        self._run("attention_softmax", (nz * Tp * self.rows,), i32(Tp), att, lsize=(self.rows,))
        self._bmm(Tp, D, Tp, nz, H, att, Tp, (0, H * TT, TT), qkv, 3 * C, (2 * C, T3, D), out, C, (0, Tp * C, D),
                  causal=2)

    def _attention_backward(self, Bp, Tp, dout, qkv, att, datt, dqkv):
        cfg = self.cfg
        C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
        if not self.attn_gemm:
            self._runp("attention_backward_query", (Tp, Bp * H), i32(Bp), i32(Tp), dout, qkv, att, datt, dqkv)
            if "attention_backward_key_rb" in self.k:
                self._rows_rb(Bp, Tp, datt, qkv, C, 3 * C, dqkv, 0, 3 * C, 1.0 / math.sqrt(D))  # dq = SCALE ds @ k
                self._run("attention_backward_key_rb", (-(-Tp // 6), Bp * H * (D // 8)), i32(Bp), i32(Tp), dout, qkv,
                          att, datt, dqkv, lsize=(1, D // 8))
                return
            self._runp("attention_backward_key", (Tp, Bp * H), i32(Bp), i32(Tp), dout, qkv, att, datt, dqkv)
            return
        T3, TT, TC = Tp * 3 * C, Tp * Tp, Tp * C
        nz, scale = Bp * H, 1.0 / math.sqrt(D)
        ATT = (0, H * TT, TT)
        # dp = dout v^T; ds = att (dp - sum att dp); dq = SCALE ds k; dk = SCALE ds^T q; dv = att^T dout
        self._bmm(Tp, Tp, D, nz, H, dout, C, (0, TC, D), qkv, 3 * C, (2 * C, T3, D), datt, Tp, ATT, tb=1, causal=1)
        self._run("attention_dsoftmax", (nz * Tp * self.rows,), i32(Tp), att, datt, lsize=(self.rows,))
        self._bmm(Tp, D, Tp, nz, H, datt, Tp, ATT, qkv, 3 * C, (C, T3, D), dqkv, 3 * C, (0, T3, D), alpha=scale,
                  causal=2)
        self._bmm(Tp, D, Tp, nz, H, datt, Tp, ATT, qkv, 3 * C, (0, T3, D), dqkv, 3 * C, (C, T3, D), ta=1,
                  alpha=scale, causal=3)
        self._bmm(Tp, D, Tp, nz, H, att, Tp, ATT, dout, C, (0, TC, D), dqkv, 3 * C, (2 * C, T3, D), ta=1, causal=3)

    def _rows_rb(self, Bp, Tp, A, Bm, boff, ldb, O, ooff, ldo, sc):
        """CPUs: O[b, t, head h] = sc * sum_{t2 <= t} A[b, h, t, t2] Bm[b, t2, head h] (kernels/cpu.cl)."""
        D = self.cfg.head_dim
        self._run("attention_rows_rb", (-(-Tp // 6), Bp * self.cfg.n_head * (D // 16)), i32(Bp), i32(Tp), A, Bm,
                  i32(boff), i32(ldb), O, i32(ooff), i32(ldo), f32(sc), lsize=(1, D // 16))

    def _transpose_into(self, x, out, rows, cols, ldo=None):
        """out (cols, rows) = x (rows, cols).T; out's rows ldo (default rows) floats apart (transpose_ld_v8)."""
        if ldo is not None and ldo != rows:
            self._run("transpose_ld_v8", (_ceil(-(-cols // 8), 4), -(-rows // 16)), i32(rows), i32(cols), x, out,
                      i32(ldo), lsize=(4, 1))
            return
        if "transpose_v8" in self.k:  # 16 x 8 blocks
            self._run("transpose_v8", (_ceil(-(-cols // 8), 4), -(-rows // 16)), i32(rows), i32(cols), x, out,
                      lsize=(4, 1))
            return
        self._run("transpose", (_ceil(-(-cols // 8), 4), -(-rows // 8)), i32(rows), i32(cols), x, out, lsize=(4, 1))

    def _scratch_buf(self, slot, n):
        if self._scratch_size[slot] < n:
            self._scratch[slot], self._scratch_size[slot] = self._buf(n), n
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
        self._run("copy_ld_v8", (-(-cols // 64), rows), i32(rows), i32(cols), x, out, i32(ldo), lsize=(1, 1))
        return out

    def _layernorm(self, N, x, w, b, out, mean, rstd):
        if self.rows:
            self._run("layernorm_forward_wg", (N * self.rows,), i32(N), x, w, b, out, mean, rstd, lsize=(self.rows,))
            return
        self._runp("layernorm_forward", (N,), i32(N), x, w, b, out, mean, rstd)

    def _layernorm_backward(self, N, dout, x, mean, rstd, w, dw, db, dx, accum):
        C = self.cfg.n_embd
        if self.rows:
            self._run("layernorm_backward_wg", (N * self.rows,), i32(N), i32(accum), dout, x, w, mean, rstd, dx,
                      lsize=(self.rows,))
            rc = self.launch["colsum_rows"]
            R = -(-N // rc)
            if R < self.launch["colsum_min_parts"]:
                self._runp("layernorm_param_backward", (C,), i32(N), dout, x, mean, rstd, dw, db)
                return
            part = self._grow_cparts(2 * R * C)
            self._runp("layernorm_param_partial", (C, R), i32(N), i32(rc), dout, x, mean, rstd, part)
            self._runp("layernorm_param_final", (C,), i32(R), part, dw, db)
            return
        self._runp("layernorm_backward", (N,), i32(N), i32(accum), dout, x, w, mean, rstd, dx)
        self._runp("layernorm_param_backward", (C,), i32(N), dout, x, mean, rstd, dw, db)

    # ---- forward / backward ----
    def _check(self, a, name, Bp, Tp, dtype):
        a = np.ascontiguousarray(a, dtype=dtype)
        if a.shape != (Bp, Tp):
            raise ClgptError(f"{name} has shape {a.shape}; expected ({Bp}, {Tp}) like tokens")
        return a

    def _check_tokens(self, tokens) -> np.ndarray:
        """tokens as contiguous int32 (B', T'), B' <= B, T' <= T, ids inside the vocabulary."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if tokens.ndim != 2 or tokens.shape[0] > self.B or tokens.shape[1] > self.T or tokens.size == 0:
            raise ClgptError(f"tokens shape {tokens.shape} must be (B', T') with B' <= {self.B}, T' <= {self.T}")
        Bp, Tp = tokens.shape
        V = self.cfg.vocab_size
        if tokens.min() < 0 or tokens.max() >= V:
            raise ClgptError(f"token ids must lie in [0, {V}); got {tokens.min()}..{tokens.max()}")
        return tokens

    def forward(self, tokens, targets=None, mask=None):
        """Mean masked NLL (float) when targets are given, else logits (B', T', V) float32."""
        cfg, q = self.cfg, self.queue
        tokens = self._check_tokens(tokens)
        Bp, Tp = tokens.shape
        N, C, V, F = Bp * Tp, cfg.n_embd, cfg.vocab_size, cfg.n_ff
        cl.enqueue_copy(q, self.tokens, tokens, is_blocking=False)
        self._tokens_host = tokens  # keeps the host array alive during the non-blocking copy
        self._runp("embedding_forward", (C, N), i32(N), i32(Tp), self.tokens, self.p["token_embd.weight"],
                  self.p["position_embd.weight"], self.acts[0]["x"] if cfg.n_layer else self.x_out)
        for i, a in enumerate(self.acts):
            pre = f"blk.{i}."
            x_next = self.acts[i + 1]["x"] if i + 1 < cfg.n_layer else self.x_out
            self._layernorm(N, a["x"], self.p[pre + "attn_norm.weight"], self.p[pre + "attn_norm.bias"],
                            a["ln1"], a["ln1_mean"], a["ln1_rstd"])
            self.matmul(N, 3 * C, C, a["ln1"], self.p[pre + "attn_qkv.weight"], a["qkv"], tb=1,
                        bias=self.p[pre + "attn_qkv.bias"])
            self._attention_forward(Bp, Tp, a["qkv"], a["atty"], a["att"])
            self.matmul(N, C, C, a["atty"], self.p[pre + "attn_output.weight"], a["x_mid"], tb=1,
                        bias=self.p[pre + "attn_output.bias"], resid=a["x"])
            self._layernorm(N, a["x_mid"], self.p[pre + "ffn_norm.weight"], self.p[pre + "ffn_norm.bias"],
                            a["ln2"], a["ln2_mean"], a["ln2_rstd"])
            self._matmul(N, F, C, a["ln2"], self.p[pre + "ffn_up.weight"], a["h"], tb=1,
                         bias=self.p[pre + "ffn_up.bias"], epi=1, E=a["g"])  # h, and g = gelu(h)
            self.matmul(N, C, F, a["g"], self.p[pre + "ffn_down.weight"], x_next, tb=1,
                        bias=self.p[pre + "ffn_down.bias"], resid=a["x_mid"])
        self._layernorm(N, self.x_out, self.p["output_norm.weight"], self.p["output_norm.bias"],
                        self.lnf, self.lnf_mean, self.lnf_rstd)
        self.matmul(N, V, C, self.lnf, self._w_out(), self.logits, tb=1)
        return self._loss(Bp, Tp, targets, mask, self._xent_forward)

    def _loss(self, Bp, Tp, targets, mask, xent_forward):
        """The forward's ending, shared by every engine: logits back to the host when there are no targets,
        else the masked mean loss (per-token losses summed on the host in float64, in a fixed order)."""
        q, V, N = self.queue, self.cfg.vocab_size, Bp * Tp
        if targets is None:
            self._fwd = None
            out = np.empty((Bp, Tp, V), np.float32)
            cl.enqueue_copy(q, out, self.logits, is_blocking=True)
            return out
        targets = self._check(targets, "targets", Bp, Tp, np.int32)
        mask = np.ones((Bp, Tp), np.float32) if mask is None else self._check(mask, "mask", Bp, Tp, np.float32)
        msum = float(mask.sum(dtype=np.float64))
        if msum <= 0:
            raise ClgptError("mask has no nonzero entry; the loss would be 0/0")
        live = mask != 0
        if live.any() and (targets[live].min() < 0 or targets[live].max() >= V):
            raise ClgptError(f"target ids where mask != 0 must lie in [0, {V})")
        self._targets_host, self._mask_host = targets, mask
        cl.enqueue_copy(q, self.targets, targets, is_blocking=False)
        cl.enqueue_copy(q, self.mask, mask, is_blocking=False)
        xent_forward(N)
        losses = self.losses_host[:N]
        cl.enqueue_copy(q, losses, self.losses, is_blocking=True)
        self._fwd = (Bp, Tp, msum)
        return float(losses.sum(dtype=np.float64) / msum)

    def _xent_forward(self, N):
        if self.launch.get("xent_fused"):  # also leaves mask * (softmax - onehot) in dlogits for backward
            self._runp("xent_fused", (N,), i32(N), self.logits, self.targets, self.mask, self.losses, self.lse,
                       self.dlogits)
            return
        if self.rows:
            self._run("xent_forward_wg", (N * self.rows,), i32(N), self.logits, self.targets, self.mask, self.losses,
                      self.lse, lsize=(self.rows,))
            return
        self._runp("xent_forward", (N,), i32(N), self.logits, self.targets, self.mask, self.losses, self.lse)

    def _w_out(self):
        return self.p["token_embd.weight"] if self.cfg.tied else self.p["output.weight"]

    def _g_out(self):
        return self.g["token_embd.weight"] if self.cfg.tied else self.g["output.weight"]

    def zero_grad(self):
        cl.enqueue_fill_buffer(self.queue, self.flat_g, np.float32(0), 0, self.n_flat * F32)

    def backward(self, scale: float = 1.0):
        """Accumulate scale * dloss/dparams of the last forward (with targets) into the grads."""
        if self._fwd is None:
            raise ClgptError("backward() needs a forward() with targets first")
        cfg = self.cfg
        Bp, Tp, msum = self._fwd
        N, C, V, F = Bp * Tp, cfg.n_embd, cfg.vocab_size, cfg.n_ff
        if self.launch.get("xent_fused"):  # the forward left the unscaled gradient in dlogits
            alpha = scale / msum
        else:
            self._run("xent_backward", (_ceil(V, 64), N), i32(N), f32(scale / msum), self.logits, self.targets,
                      self.mask, self.lse, self.dlogits, lsize=(64, 1))
            alpha = 1.0
        self.matmul(V, C, N, self.dlogits, self.lnf, self._g_out(), ta=1, accum=True, alpha=alpha)
        self.matmul(N, C, V, self.dlogits, self._w_out(), self.dln, alpha=alpha)
        self._layernorm_backward(N, self.dln, self.x_out, self.lnf_mean, self.lnf_rstd, self.p["output_norm.weight"],
                                 self.g["output_norm.weight"], self.g["output_norm.bias"], self.dx, accum=0)
        for i in reversed(range(cfg.n_layer)):
            pre, a, p, g = f"blk.{i}.", self.acts[i], self.p, self.g
            # ffn: x_out = x_mid + g @ Wdown.T + b
            self.matmul(C, F, N, self.dx, a["g"], g[pre + "ffn_down.weight"], ta=1, accum=True)
            self._bias_backward(N, C, self.dx, g[pre + "ffn_down.bias"])
            self._matmul(N, F, C, self.dx, p[pre + "ffn_down.weight"], self.dh, epi=2, E=a["h"])  # dh = dg * gelu'(h)
            self.matmul(F, C, N, self.dh, a["ln2"], g[pre + "ffn_up.weight"], ta=1, accum=True)
            self._bias_backward(N, F, self.dh, g[pre + "ffn_up.bias"])
            self.matmul(N, C, F, self.dh, p[pre + "ffn_up.weight"], self.dln)
            self._layernorm_backward(N, self.dln, a["x_mid"], a["ln2_mean"], a["ln2_rstd"], p[pre + "ffn_norm.weight"],
                                     g[pre + "ffn_norm.weight"], g[pre + "ffn_norm.bias"], self.dx, accum=1)
            # attention: x_mid = x + atty @ Wo.T + b
            self.matmul(C, C, N, self.dx, a["atty"], g[pre + "attn_output.weight"], ta=1, accum=True)
            self._bias_backward(N, C, self.dx, g[pre + "attn_output.bias"])
            self.matmul(N, C, C, self.dx, p[pre + "attn_output.weight"], self.datty)
            self._attention_backward(Bp, Tp, self.datty, a["qkv"], a["att"], self.datt, self.dqkv)
            self.matmul(3 * C, C, N, self.dqkv, a["ln1"], g[pre + "attn_qkv.weight"], ta=1, accum=True)
            self._bias_backward(N, 3 * C, self.dqkv, g[pre + "attn_qkv.bias"])
            self.matmul(N, C, 3 * C, self.dqkv, p[pre + "attn_qkv.weight"], self.dln)
            self._layernorm_backward(N, self.dln, a["x"], a["ln1_mean"], a["ln1_rstd"], p[pre + "attn_norm.weight"],
                                     g[pre + "attn_norm.weight"], g[pre + "attn_norm.bias"], self.dx, accum=1)
        self._token_embd_backward(N, self.dx)
        self._runp("embedding_backward_wpe", (C, Tp), i32(Bp), i32(Tp), self.dx, self.g["position_embd.weight"])

    def _token_embd_backward(self, N, dx):
        """dwte += dx rows by token: distinct tokens and their rows, sorted on the host (which holds the
        tokens), so each dwte row sums in a fixed order: deterministic, no float atomics."""
        tok = self._tokens_host.reshape(-1)
        order = np.argsort(tok, kind="stable").astype(np.int32)
        rows, starts = np.unique(tok[order], return_index=True)
        starts = np.append(starts, N).astype(np.int32)
        self._emb_host = (order, rows.astype(np.int32), starts)  # alive during the non-blocking copies
        for buf, arr in zip((self.emb_order, self.emb_rows, self.emb_starts), self._emb_host):
            cl.enqueue_copy(self.queue, buf, arr, is_blocking=False)
        self._runp("embedding_backward_wte", (self.cfg.n_embd, len(rows)), i32(len(rows)), self.emb_rows,
                   self.emb_starts, self.emb_order, dx, self.g["token_embd.weight"])

    # ---- optimizer ----
    def _norm(self, clip: float):
        self._run("grad_norm_partial", (self.n_parts,), i32(self.n_flat), i32(self.chunk), self.flat_g, self.partials)
        self._run("grad_norm_final", (1,), i32(self.n_parts), f32(clip), self.partials, self.norm_buf)

    def grad_norm(self) -> float:
        self._norm(0.0)
        out = np.empty(2, np.float32)
        cl.enqueue_copy(self.queue, out, self.norm_buf, is_blocking=True)
        return float(out[0])

    def step(self, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0) -> float:
        """Clip grads to global norm `clip` (clip <= 0: no clipping), one AdamW step; -> pre-clip norm."""
        self._norm(float(clip))
        self.t += 1
        bc1, bc2 = 1.0 - beta1**self.t, 1.0 - beta2**self.t
        lsize = (self.launch["local_1d"],)  # lr and the bias corrections change every step: no preset
        name, per = ("adamw_v8", 8) if "adamw_v8" in self.k else ("adamw", 1)  # adamw_v8: 8 parameters a work-item
        self.k[name](self.queue, (_ceil(-(-self.n_flat // per), lsize[0]),), lsize, i32(self.n_flat), i32(self.n_decay), self.flat_p, self.flat_g,
                  self.flat_m, self.flat_v, self.norm_buf, f32(lr), f32(beta1), f32(beta2), f32(bc1), f32(bc2),
                  f32(eps), f32(weight_decay))
        out = np.empty(2, np.float32)
        cl.enqueue_copy(self.queue, out, self.norm_buf, is_blocking=True)
        return float(out[0])

    # ---- host access ----
    def _read_flat(self, buf) -> dict[str, np.ndarray]:
        flat = np.empty(self.n_flat, np.float32)
        cl.enqueue_copy(self.queue, flat, buf, is_blocking=True)
        return {n: flat[self.offsets[n]: self.offsets[n] + int(np.prod(s))].reshape(s).copy()
                for n, s in self.shapes.items()}

    def _write_flat(self, buf, d: dict, what: str):
        flat = np.zeros(self.n_flat, np.float32)
        missing = set(self.shapes) - set(d)
        extra = set(d) - set(self.shapes)
        if missing or extra:
            raise ClgptError(f"{what}: missing tensors {sorted(missing)}, unexpected tensors {sorted(extra)}")
        for n, s in self.shapes.items():
            a = np.asarray(d[n], dtype=np.float32)
            if a.shape != s:
                raise ClgptError(f"{what}: tensor {n} has shape {a.shape}; the model expects {s}")
            flat[self.offsets[n]: self.offsets[n] + a.size] = a.reshape(-1)
        cl.enqueue_copy(self.queue, buf, flat, is_blocking=True)

    def get_params(self) -> dict[str, np.ndarray]:
        return self._read_flat(self.flat_p)

    def set_params(self, d: dict):
        self._write_flat(self.flat_p, d, "params")

    def get_grads(self) -> dict[str, np.ndarray]:
        return self._read_flat(self.flat_g)

    def get_optimizer_state(self) -> dict:
        return {"m": self._read_flat(self.flat_m), "v": self._read_flat(self.flat_v), "t": self.t}

    def set_optimizer_state(self, s: dict | None):
        """None resets m, v to zero and t to 0."""
        if s is None:
            for buf in (self.flat_m, self.flat_v):
                cl.enqueue_fill_buffer(self.queue, buf, np.float32(0), 0, self.n_flat * F32)
            self.t = 0
            return
        self._write_flat(self.flat_m, s["m"], "optimizer state m")
        self._write_flat(self.flat_v, s["v"], "optimizer state v")
        self.t = int(s["t"])
