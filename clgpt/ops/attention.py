"""Causal attention over qkv (N, 3C): one launch per pass (CPUs, short sequences), batched matmuls with softmax
row kernels (GPUs, dropout), flash attention's fused kernels on NVIDIA's tensor cores (bf16), or portable flash
attention (fp32, plain OpenCL C: GPUs without NVIDIA's, long sequences). Llama hands its RoPE over with the call
(rope=): rope.cl's launches around attention, or, on NVIDIA's flash without grouped kv heads, inside its kernels.

Launches kernels/attention.cl (its CPU forms too: attention_*_u4, attention_rows_rb, attention_backward_key_rb),
kernels/flash.cl and kernels/flash_portable.cl (tiles: clgpt/device/tuner_flash.py); the batched form's products
go through the GEMM backend's bmm (kernels/matmul.cl, matmul_mma.cl).
"""

from __future__ import annotations

import math

import numpy as np

from clgpt.device import tuner_flash
from clgpt.errors import ClgptError
from clgpt.ops.core import Facts, Part, f32, i32
from clgpt.ops.gemm import MATMUL_TILES
from clgpt.ops.layers import Layers

FLASH_MIN_GROUPS, FLASH_LONG_T = 4, 1024  # flash attention's size rule (Attention._use_flash)
# kernels/flash.cl's tiles: the forward's and dq's 16-row m tiles a warp (MT: 128 query rows as 8 / MT warps), the
# keys (forward KS, dq KQ) or queries (dk/dv QK) a step and each kernel's register cap (NREG, clgpt/device/sm90a.py
# cap_registers; 0: none). The forward and dq run capped at 128: two 256-item work-groups an SM; dk/dv, uncapped,
# ran the attention faster than capped at 128 (bench/RESULTS_GPU.md). The flash knob
# (clgpt.device.knobs FLASH_KEYS) overrides them.
FLASH_TILES = dict(FWD_MT=1, KS=64, DQ_MT=1, KQ=16, QK=16, FWD_NREG=128, DQ_NREG=128, DKV_NREG=0)
_FLASH_DEFAULTS = dict(MT=1, KS=64, KQ=16, QK=16)  # kernels/flash.cl's own: left out of its options


class Attention(Part):
    """attention_forward / attention_backward and flash attention's choice; `gemm` runs the batched form's products
    and keeps the tiled copies, `layers` gives RoPE and dropout. mode: the stage's `attention` setting; seq_len,
    batch_size: the engine's longest T and its B (None: not known)."""

    def __init__(self, f: Facts, gemm, layers: Layers, mode: str, seq_len: int, batch_size: int | None):
        super().__init__(f)
        self.gemm, self.copies, self.layers = gemm, gemm.copies, layers
        cfg, dev, k, launch, caps = self.cfg, self.dev, self.k, self.launch, self.caps
        C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
        scale = float(1.0 / math.sqrt(D))
        for kname in ("attention_forward", "attention_backward_query", "attention_backward_key"):
            k[kname] = dev.kernel("attention", kname, C=C, H=H, D=D, SCALE=scale, VEC=launch["vec"])
        if caps.attention_u4:  # CPUs: same kernels, dot products 4 keys at a time (kernels/attention.cl)
            for kname in ("attention_forward", "attention_backward_query"):
                k[kname] = dev.kernel("attention", kname + "_u4", C=C, H=H, D=D, SCALE=scale, VEC=1)
            if f.attn_rb:  # the products with att / datt as register-blocked ones (6 rows x 16 columns a
                # work-item): key side, and att @ v, datt @ k after the u4 kernels (ROWS_RB=1: softmax only)
                kw = dict(C=C, H=H, D=D, SCALE=scale, VEC=1)
                k["attention_backward_key_rb"] = dev.kernel("attention", "attention_backward_key_rb", **kw)
                k["attention_rows_rb"] = dev.kernel("attention", "attention_rows_rb", **kw)
                for kname in ("attention_forward", "attention_backward_query"):
                    k[kname] = dev.kernel("attention", kname + "_u4", ROWS_RB=1, **kw)
        if f.rows:
            for kname in ("attention_softmax", "attention_dsoftmax"):
                k[kname] = dev.kernel("attention", kname, C=C, H=H, D=D, SCALE=scale, VEC=0, LW=f.rows, **f.sg)
        self.flash = self._use_flash(mode, seq_len, batch_size)
        self.flash_portable = not self.flash and self._use_flash_portable(mode, seq_len)
        if self.flash_portable:
            self._flash_portable_setup()
        # llama's RoPE inside flash attention's copy and stores where no kv head serves several query heads
        self.rope_fused = self.flash and cfg.arch == "llama" and cfg.kv_heads == cfg.n_head
        if self.flash:
            self.flash_setup()

    def _use_flash(self, mode: str, T: int, B: int | None) -> bool:
        """bf16 attention as fused kernels (kernels/flash.cl: no T x T scores) where the bf16 GEMM runs and the
        head width is 16-64. mode, the stage's `attention` setting: auto | flash | batched. auto: flash when the forward's grid, B x H x
        ceil(T/64) warp quartets (64 rows), fills the GPU (FLASH_MIN_GROUPS a compute unit), or T >= FLASH_LONG_T
        (the T x T buffers' memory), or B is not known. On a grid that leaves units idle the batched form's
        large products use the GPU better than flash's few work-groups; once the grid fills it, flash's fused
        kernels, which never write the scores, win (bench/RESULTS_GPU.md)."""
        D = self.cfg.head_dim
        if mode == "batched" or self.f.bf16 is None or D % 16 or D > 64:
            return False
        groups = None if B is None else B * self.cfg.n_head * -(-T // 64)
        return (mode == "flash" or groups is None or T >= FLASH_LONG_T
                or groups >= FLASH_MIN_GROUPS * self.dev.device.max_compute_units)

    def _use_flash_portable(self, mode: str, T: int) -> bool:
        """Portable flash attention (kernels/flash_portable.cl: no T x T scores, fp32) where NVIDIA's does not run,
        on a GPU row (the CPU row keeps its one-launch forms). auto: on the generic row (the portable GEMM: no
        tensor cores to make the batched products cheap) from T tuner_flash.MIN_T, unless the tuner's record
        (knobs.flash_tuning) found the batched form faster at this shape; flash: on any GPU row."""
        if mode == "batched" or not self.f.rows or self.caps.attention_gemm_min_t is None:
            return False
        tuned = self.f.knobs.flash_tuning or {}
        return mode == "flash" or (self.f.gemm == "portable" and T >= tuner_flash.MIN_T
                                   and tuned.get("form", "flash") == "flash")

    def _flash_portable_setup(self):
        """kernels/flash_portable.cl's three kernels with the tuner's tiles (knobs.flash_tuning), else (or where
        those do not build here) each kernel's first candidate that fits the device and builds; the precision's
        ROUND on the products' operands, as the batched form's GEMM rounds them."""
        cfg, tuned = self.cfg, self.f.knobs.flash_tuning or {}
        self.portable_tiles = {}
        for kname in tuner_flash.KERNELS:
            short = tuner_flash.SHORT[kname]
            t, self.k[kname] = tuner_flash.build_first(self.dev, short, cfg.n_embd, cfg.n_head, cfg.head_dim,
                                                       tuned.get(short), self.f.round)
            self.portable_tiles[short] = t

    def _portable_run(self, kernel, Tp, Bp, *args, drop=None):
        """One of kernels/flash_portable.cl's launches over B' x H heads of T' rows; drop: (seed, site, p, ..)."""
        seed, site, p = drop[:3] if drop is not None else (0, 0, 0.0)
        g, lsize = tuner_flash.grid(Tp, Bp * self.cfg.n_head, self.portable_tiles[kernel])
        self.launcher.run(tuner_flash.NAME[kernel], g, i32(Tp), *args, np.uint32(seed), np.uint32(site), f32(p), lsize=lsize)

    def flash_setup(self):
        """kernels/flash.cl's kernels, with the bf16 GEMM's options (MMA_EMULATE on PoCL, for tests); where RoPE
        is fused (rope_fused) built with ROPE (the dq, dk stores rotate back), and the rotating copy too."""
        cfg = self.cfg
        ft = self.flash_tiles = {**FLASH_TILES, **(self.f.knobs.flash or {})}
        capped = not self.f.bf16_options.get("MMA_EMULATE")  # NVIDIA only: the cap rebuilds the program's PTX
        rope = {"ROPE": 1} if self.rope_fused else {}
        own = {"flash_forward": dict(MT=ft["FWD_MT"], KS=ft["KS"], MAXNREG=ft["FWD_NREG"]),
               "flash_backward_dq": dict(MT=ft["DQ_MT"], KQ=ft["KQ"], MAXNREG=ft["DQ_NREG"]),
               "flash_backward_dkv": dict(QK=ft["QK"], MAXNREG=ft["DKV_NREG"])}

        def build(kname, **extra):
            opts = {**self.f.bf16_options, **rope, **own.get(kname, {}), **extra}
            opts = {k: v for k, v in opts.items()  # the kernel's defaults left out: one program where all agree
                    if _FLASH_DEFAULTS.get(k, -1) != v and not (k == "MAXNREG" and not (capped and v))}
            return self.dev.kernel("flash", kname, build_options=self.launcher.verbose_options(self.f.bf16_options), C=cfg.n_embd,
                                   H=cfg.n_head, D=cfg.head_dim, SCALE=float(1.0 / math.sqrt(cfg.head_dim)), **opts)

        for kname in ("flash_bf16", "flash_forward", "flash_backward_dq", "flash_backward_dkv",
                      *(("flash_bf16_rope",) if rope else ())):
            self.k[kname] = build(kname)
        if self.f.tiled_outputs and cfg.n_embd % 64 == 0:
            self.k["flash_forward_tiled"] = build("flash_forward", OUT_TILED=1)  # the output's tiled copy (wgmma)
            if rope:  # dqkv as its tiled copy alone (attention_backward's products_only)
                for kname in ("flash_backward_dq", "flash_backward_dkv"):
                    self.k[kname + "_tiled_only"] = build(kname, DQKV_TILED=1)

    def att_floats(self, B: int, T: int) -> int:
        """Floats of a layer's attention state (att, datt): the probabilities (B,H,T,T), or with flash
        attention each row's softmax statistic (B,H,T) and, from float COPY_AT (kernels/flash.cl: the
        statistics' floats rounded up to 64), the bf16 copy of qkv (B,T,3C) the kernels read (datt: of dout)."""
        BHT = B * self.cfg.n_head * T
        if self.flash_portable:  # att: the forward's lse rows, datt: the backward's delta rows (B,H,T)
            return BHT
        if not self.flash:
            return BHT * T
        return self._copy_at(B, T) + B * T * 3 * self.cfg.n_embd // 2

    def _copy_at(self, B: int, T: int) -> int:
        """kernels/flash.cl's COPY_AT(B H, T): the float of att (datt) where the bf16 copy of qkv (dout) begins."""
        return -(-B * self.cfg.n_head * T // 64) * 64

    def _flash_grid(self, Bp, Tp, drop):
        """kernels/flash.cl's global sizes, of the forward and of dq (128 query rows a work-group of 256 / MT) and
        of dk/dv (64 keys a work-group of 128), and the kernels' last arguments: dropout's seed, site and p (p 0:
        none)."""
        seed, site, p = drop[:3] if drop is not None else (0, 0, 0.0)
        H, nq = self.cfg.n_head, -(-Tp // 128)
        return ((nq * self._flash_items("FWD_MT"), Bp * H), (nq * self._flash_items("DQ_MT"), Bp * H),
                (-(-Tp // 64) * 128, Bp * H), (np.uint32(seed), np.uint32(site), f32(p)))

    def _flash_items(self, mt):
        """Work-items of a forward or dq work-group: 128 rows as warps of 16 MT rows."""
        return 128 // (16 * self.flash_tiles[mt]) * 32

    def _flash_copy(self, Bp, Tp, X, cols, dst, tables=()):
        """X (B',T',cols) as its bf16 copy into dst (att or datt) at float COPY_AT (kernels/flash.cl); tables
        (cos, sin): qkv's copy with q and k rotated (flash_bf16_rope)."""
        n8 = Bp * Tp * cols // 8
        self.launcher.run("flash_bf16_rope" if tables else "flash_bf16", (-(-n8 // 256) * 256,), i32(n8), i32(Tp),
                 i32(Bp * self.cfg.n_head), X, *tables, dst, lsize=(256,))

    def _fused_tables(self, rope, x):
        """(cos, sin) where flash's kernels do the RoPE (rope_fused), else (); rope's buffer must be x there (in
        place: no grouped kv heads)."""
        if not self.rope_fused:
            return ()
        if rope is None or rope[0].int_ptr != x.int_ptr:
            raise ClgptError("flash attention with RoPE fused (llama, n_head_kv == n_head) takes "
                             "rope=(qkv, cos, sin) on the buffer it works on")
        return tuple(rope[1:])

    def attention_forward(self, Bp, Tp, qkv, out, att, drop=None, rope=None, product=None, qkv_read=True):
        """out (B',T',C), att (B',H,T',T') from qkv (B',T',3C). drop = (seed, site, p, att_d): dropout on the
        probabilities, att_d (B',H,T',T') receives the dropped ones (att keeps the softmax for the backward).
        Flash attention: att holds (B',H,T') row statistics, att_d is unused (the kernels redraw the mask).
        rope = (src, cos, sin), llama's: attention over qkv = RoPE(src), src the q | k | v product (B'T', C + 2Ckv;
        qkv itself without grouped kv heads), cos, sin (T_max, D/2) its tables. rope_forward makes qkv first, except
        where rope_fused: flash_bf16_rope rotates q and k into the bf16 copy the kernels read, and qkv keeps the
        product's q and k unrotated (what reads it later asks rotated_qkv).
        product = (x, W, bias), without rope: qkv = x @ W^T + bias made here first; where flash reads its bf16 copy
        and the GEMM writes one beside its output (matmul_half), the product writes it, not a pass of its own, and
        with qkv_read False (nothing reads qkv's fp32 values after this forward: flash's backward reads the copy)
        the copy alone."""
        cfg = self.cfg
        C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
        copied = product is not None and self._qkv_product(Bp, Tp, qkv, att, *product, copy=self.flash and rope is None,
                                                           fp32=qkv_read)
        tables = self._fused_tables(rope, qkv)
        if rope is not None and not tables:
            self.layers.rope_forward(Bp * Tp, Tp, *rope, qkv)
        if self.flash:
            g, _, _, tail = self._flash_grid(Bp, Tp, drop)
            if not copied:
                self._flash_copy(Bp, Tp, qkv, 3 * C, att, tables)
            kname, copy = self.copies.with_copy("flash_forward", out, Bp * Tp, C)
            self.launcher.run(kname, g, i32(Tp), out, att, *tail, *copy, lsize=(self._flash_items("FWD_MT"), 1))
            return
        if self.flash_portable:  # att: lse (B',H,T'); dropout redrawn from (seed, site), att_d unused
            self._portable_run("forward", Tp, Bp, qkv, out, att, drop=drop)
            return
        if drop is not None:
            self._attention_forward_batched(Bp, Tp, qkv, out, att, drop)
            return
        if not self.f.attn_gemm:
            self.launcher.runp("attention_forward", (Tp, Bp * H), i32(Bp), i32(Tp), qkv, out, att)
            if self.f.attn_rb:  # out = att @ v
                self._rows_rb(Bp, Tp, att, qkv, 2 * C, 3 * C, out, 0, C, 1.0)
            return
        self._attention_forward_batched(Bp, Tp, qkv, out, att, None)

    def _qkv_product(self, Bp, Tp, qkv, att, x, W, bias, copy: bool, fp32: bool = True) -> bool:
        """qkv (B'T', 3C) = x @ W^T + bias; with copy also flash's bf16 copy of it into att from float COPY_AT
        (kernels/flash.cl) where the GEMM writes one (fp32 False: the copy alone); -> whether it did."""
        N, C = Bp * Tp, self.cfg.n_embd
        at = 2 * self._copy_at(Bp, Tp)  # in halves
        if copy and self.gemm.matmul_half(N, 3 * C, C, x, W, qkv, tb=1, bias=bias, copy=(att, at), fp32=fp32):
            return True
        self.gemm.matmul(N, 3 * C, C, x, W, qkv, tb=1, bias=bias)
        return False

    def _batched_tiles(self):
        """Tiles and row kernels for batched attention: the table's on GPUs, the generic ones elsewhere
        (CPUs take this form only for attention dropout)."""
        if self.f.mm["kernel"] == "matmul":
            return None, self.f.rows, ""
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
        self.gemm.bmm(Tp, Tp, D, nz, H, qkv, 3 * C, (0, T3, D), qkv, 3 * C, (C, T3, D), att, Tp, (0, H * TT, TT),
                 tb=1, alpha=scale, causal=1, mm=mm)
        self.launcher.run("attention_softmax" + sfx, (nz * Tp * LW,), i32(Tp), att, lsize=(LW,))
        probs = att
        if drop is not None:
            seed, site, p, probs = drop
            self.layers.dropout_forward(nz * TT, seed, site, p, att, probs)
        self.gemm.bmm(Tp, D, Tp, nz, H, probs, Tp, (0, H * TT, TT), qkv, 3 * C, (2 * C, T3, D), out, C, (0, Tp * C, D),
                 causal=2, mm=mm)

    def rotated_qkv(self, N, Tp, qkv, cos, sin):
        """Leaves qkv (N,3C), after attention_forward(rope=(qkv, cos, sin)), holding the rotated q and k attention
        used: where flash rotated only its copy (rope_fused), rope_forward rotates them in place now; elsewhere
        qkv holds them already. For what reads qkv after a forward (KVCache.prefill's keys)."""
        if self.rope_fused:
            self.layers.rope_forward(N, Tp, qkv, cos, sin, qkv)

    def attention_backward(self, Bp, Tp, dout, qkv, att, datt, dqkv, drop=None, out=None, rope=None,
                           products_only=False):
        """dqkv (B',T',3C) from dout (B',T',C); datt is scratch. drop as in attention_forward. out: the forward's
        output (B',T',C), which flash attention's backward reads (with att's copy of qkv). rope = (dsrc, cos, sin)
        as the forward's: the gradient then goes on through RoPE's transpose into dsrc (B'T', C + 2Ckv; dqkv
        itself without grouped kv heads), by rope_backward after attention, or, where rope_fused, in flash's dq
        and dk stores. products_only: dqkv's only readers are the q | k | v product's two gradient products
        (linear_backward's, next); where flash does the RoPE and both run on wgmma, dqkv is written only as the
        tiled copy they read (flash.cl DQKV_TILED), which the GEMM's copies keep for that reuse block."""
        tables = self._fused_tables(rope, dqkv)
        N, C3 = Bp * Tp, 3 * self.cfg.n_embd
        copy = None
        if (products_only and tables and self.f.tiled_outputs and N % 64 == 0 and C3 % 64 == 0
                and self.gemm.on_wgmma(C3, self.cfg.n_embd, N) and self.gemm.on_wgmma(N, self.cfg.n_embd, C3)):
            copy = self.launcher.slot(3, N * C3 * 2)
        self._attention_backward(Bp, Tp, dout, qkv, att, datt, dqkv, drop, out, tables, copy)
        if copy is not None:
            self.copies.book.premake(dqkv, (copy, N, C3, None, N // 64))
        if rope is not None and not tables:
            self.layers.rope_backward(Bp * Tp, Tp, dqkv, rope[1], rope[2], rope[0])

    def _attention_backward(self, Bp, Tp, dout, qkv, att, datt, dqkv, drop, out, tables, copy=None):
        cfg = self.cfg
        C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
        if self.flash:
            _, gq, gk, tail = self._flash_grid(Bp, Tp, drop)
            self._flash_copy(Bp, Tp, dout, C, datt)
            only, extra = ("_tiled_only", (copy,)) if copy is not None else ("", ())
            self.launcher.run("flash_backward_dq" + only, gq, i32(Tp), dout, out, att, datt, dqkv, *tail, *tables, *extra,
                     lsize=(self._flash_items("DQ_MT"), 1))
            self.launcher.run("flash_backward_dkv" + only, gk, i32(Tp), att, datt, dqkv, *tail, *tables, *extra,
                     lsize=(128, 1))
            return
        if self.flash_portable:  # datt: delta (B',H,T'), written by dq, read by dk/dv
            self._portable_run("dq", Tp, Bp, qkv, dout, out, att, datt, dqkv, drop=drop)
            self._portable_run("dkv", Tp, Bp, qkv, dout, att, datt, dqkv, drop=drop)
            return
        if drop is None and not self.f.attn_gemm:
            self.launcher.runp("attention_backward_query", (Tp, Bp * H), i32(Bp), i32(Tp), dout, qkv, att, datt, dqkv)
            if self.f.attn_rb:
                self._rows_rb(Bp, Tp, datt, qkv, C, 3 * C, dqkv, 0, 3 * C, 1.0 / math.sqrt(D))  # dq = SCALE ds @ k
                self.launcher.run("attention_backward_key_rb", (-(-Tp // 6), Bp * H * (D // 8)), i32(Bp), i32(Tp), dout, qkv,
                         att, datt, dqkv, lsize=(1, D // 8))
                return
            self.launcher.runp("attention_backward_key", (Tp, Bp * H), i32(Bp), i32(Tp), dout, qkv, att, datt, dqkv)
            return
        mm, LW, sfx = self._batched_tiles()
        T3, TT, TC = Tp * 3 * C, Tp * Tp, Tp * C
        nz, scale = Bp * H, 1.0 / math.sqrt(D)
        ATT = (0, H * TT, TT)
        probs = att if drop is None else drop[3]
        # dp = dout v^T [* mask / (1-p)]; ds = att (dp - sum att dp); dq = SCALE ds k; dk = SCALE ds^T q;
        # dv = probs^T dout (probs: the dropped probabilities the forward multiplied v by)
        self.gemm.bmm(Tp, Tp, D, nz, H, dout, C, (0, TC, D), qkv, 3 * C, (2 * C, T3, D), datt, Tp, ATT, tb=1, causal=1,
                 mm=mm)
        if drop is not None:
            seed, site, p, _ = drop
            self.layers.dropout_backward(nz * TT, seed, site, p, datt)
        self.launcher.run("attention_dsoftmax" + sfx, (nz * Tp * LW,), i32(Tp), att, datt, lsize=(LW,))
        self.gemm.bmm(Tp, D, Tp, nz, H, datt, Tp, ATT, qkv, 3 * C, (C, T3, D), dqkv, 3 * C, (0, T3, D), alpha=scale,
                 causal=2, mm=mm)
        self.gemm.bmm(Tp, D, Tp, nz, H, datt, Tp, ATT, qkv, 3 * C, (0, T3, D), dqkv, 3 * C, (C, T3, D), ta=1,
                 alpha=scale, causal=3, mm=mm)
        self.gemm.bmm(Tp, D, Tp, nz, H, probs, Tp, ATT, dout, C, (0, TC, D), dqkv, 3 * C, (2 * C, T3, D), ta=1, causal=3,
                 mm=mm)

    def _rows_rb(self, Bp, Tp, A, Bm, boff, ldb, O, ooff, ldo, sc):
        """CPUs: O[b, t, head h] = sc * sum_{t2 <= t} A[b, h, t, t2] Bm[b, t2, head h] (kernels/attention.cl)."""
        D = self.cfg.head_dim
        self.launcher.run("attention_rows_rb", (-(-Tp // 6), Bp * self.cfg.n_head * (D // 16)), i32(Bp), i32(Tp), A, Bm,
                 i32(boff), i32(ldb), O, i32(ooff), i32(ldo), f32(sc), lsize=(1, D // 16))
