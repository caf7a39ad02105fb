"""The bf16 GEMM on Hopper's wgmma (sm_90a: H100, H200), on tiled bf16 copies of the operands (clgpt/ops/
copies.py, which its bf16 GEMM owns), built through clgpt/device/sm90a.py. Products under the wgmma size
(Knobs.wgmma_min_mnk, WGMMA_MIN_MNK) and those with GELU' in the epilogue fall back to the bf16 GEMM on
mma.sync it holds; on wgmma a GELU' product defers GELU' into its gradient's copy, and the products whose only
readers are products write only their output's tiled copy (TILED_OUT).

Launches kernels/matmul_wgmma.cl (and kernels/matmul.cl's splitk_reduce for split-K).
"""

from __future__ import annotations

import numpy as np

from clgpt.ops.core import Facts, Part, ceil_to, f32, i32, run_split_k
from clgpt.ops.gemm.bf16 import Bf16Gemm
from clgpt.ops.gemm.portable import split_k_chunks
from clgpt.device.tuning import (SPLIT_MIN_TOTAL_K, WGMMA_BAND, WGMMA_BAND_MIN_BYTES, WGMMA_MID_MIN_K,
                                 WGMMA_MID_RATE, WGMMA_NARROW_ALONE_RATE, WGMMA_SPLIT_GROUPS, WGMMA_SPLIT_MIN_K,
                                 WGMMA_WIDE_MIN_K)


class WgmmaGemm(Part):
    """matmul on kernels/matmul_wgmma.cl (the GEMM interface of clgpt/ops/gemm/portable.py's PortableGemm);
    `bf16`, the bf16 GEMM on mma.sync, runs the products wgmma leaves and makes the tiled copies (`copies`)."""

    def __init__(self, f: Facts, bf16: Bf16Gemm):
        super().__init__(f)
        self.bf16 = bf16
        self.copies = bf16.copies  # the tiled copies, made by the bf16 GEMM's to_bf16

    def matmul(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0):
        """Cm (M,N) = alpha * op(A) @ op(B) [+ bias] [+ resid] [+ Cm], row-major, contiguous."""
        self.matmul_epi(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha)

    def matmul_epi(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0, epi=0, E=None,
                   ldc=None):
        """matmul with an epilogue (as clgpt/ops/gemm/portable.py's): on wgmma where on_wgmma says, a deferred
        GELU' settled first where the product reads its fp32 values, else the bf16 GEMM."""
        if M <= 0 or N <= 0:
            return
        ldc = ldc or N
        for X in (A, B):  # a deferred GELU' is read from the reuse copy only
            book = self.copies.book
            if book.deferred(X) is not None and not (book.is_reusing(X) and self.on_wgmma(M, N, K, epi)):
                self.copies.settle(X)
        if (epi == 2 and self.f.colsum_copies and self.on_wgmma(M, N, K)
                and bias is None and resid is None and not accum):
            if M % 64 == 0 and N % 64 == 0:
                # dh = dg * gelu'(E) written only as dh's tiled copy and its column sums, for dh's reuse block
                copy, part = self.launcher.slot(3, M * N * 2), self.launcher.grown("tparts", M // 64 * N)
                self.matmul_wgmma(M, N, K, A, B, Cm, ta, tb, None, None, False, alpha, 2, E, tiled_out=(copy, part))
                self.copies.book.premake(Cm, (copy, M, N, part, M // 64))
                return
            # dh = dg * gelu'(E): the product on wgmma now, gelu' when dh's reuse copy is made (or settle)
            self.matmul_wgmma(M, N, K, A, B, Cm, ta, tb, None, None, False, alpha, 0, None)
            self.copies.book.defer_gelu(Cm, E, M, N)
            return
        if self.on_wgmma(M, N, K, epi):
            if epi == 3 and self.f.tiled_outputs and M % 64 == 0 and N % 64 == 0 and ldc == 2 * N and not accum:
                # dgate | dup (M, 2N) written only as its tiled copy, for its reuse block (the products after it
                # are larger: on wgmma too)
                copy = self.launcher.slot(3, M * 2 * N * 2)
                self.matmul_wgmma(M, N, K, A, B, Cm, ta, tb, bias, resid, False, alpha, 3, E, tiled_out=(copy, None),
                                   ldc=ldc)
                self.copies.book.premake(Cm, (copy, M, 2 * N, None, M // 64))
                return
            if (epi == 1 and self.f.tiled_outputs and self.copies.book.is_stable(E) and M % 64 == 0
                    and N % 64 == 0):
                # g = gelu(h) written only as g's kept tiled copy (the products read g through it alone)
                self.matmul_wgmma(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E,
                                   tiled_out=(self.copies.kept_copy(E, M, N), None))
                return
            self.matmul_wgmma(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc=ldc)
            return
        self.bf16.matmul_epi(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc)

    def matmul_half(self, M, N, K, A, B, Cm, tb=0, bias=None, copy=None, fp32=True) -> bool:
        """For a reader that takes bf16, where the product runs on wgmma unsplit and N % 4 == 0 (matmul_wgmma.cl
        OUT_BF16): Cm (M,N) = A @ op(B) [+ bias] as bf16, row-major in the first half of Cm's bytes; or with copy
        = (buffer, at) its bf16 copy, row-major, in buffer from ushort at (a multiple of 4), and fp32 in Cm unless
        fp32 is False (Cm then unwritten). -> whether it did (False: nothing written)."""
        if M <= 0 or N % 4 or not self.on_wgmma(M, N, K):
            return False
        out16 = (copy[0], np.uint64(copy[1])) if copy is not None else None
        half = 1 if copy is None else 2 if fp32 else 3
        self.matmul_wgmma(M, N, K, A, B, Cm, 0, tb, bias, None, False, 1.0, 0, None, half=half, out16=out16)
        return True

    def bmm(self, *args, **kw):
        """Batched products: the bf16 GEMM's (on the batched mma kernel)."""
        self.bf16.bmm(*args, **kw)

    def on_wgmma(self, M, N, K, epi=0) -> bool:
        """Whether the bf16 product of this size (and epilogue) runs on wgmma. Never with GELU' in the epilogue
        (epi 2): on wgmma that product defers GELU' to its gradient's copy (matmul_epi), else mma.sync's
        epilogue applies it."""
        return epi != 2 and M * N * K >= self.f.wgmma_min

    def tiles(self, N, M=0, K=0, tb=1):
        """The wide tiles for a deep product: K at least WGMMA_WIDE_MIN_K, at least WGMMA_SPLIT_GROUPS work-groups
        on them (fewer would be split along K) and padding N to their BN wasting at most an eighth more than the
        narrow ones'; else, at least WGMMA_MID_MIN_K and under WGMMA_WIDE_MIN_K deep, the mid ones where their
        busiest SM ends sooner (mid_ends_sooner); else the narrow (clgpt.device.tuning says why). M and K left
        out: the narrow. tb as matmul's (0: B stored K x N)."""
        wide, narrow = self.f.wgmma
        if K < WGMMA_WIDE_MIN_K or -(-M // wide["BM"]) * -(-N // wide["BN"]) < WGMMA_SPLIT_GROUPS:
            mid = self.f.wgmma_mid if M and WGMMA_MID_MIN_K <= K < WGMMA_WIDE_MIN_K else None
            return mid if mid and self.mid_ends_sooner(M, N, tb) else narrow
        return wide if ceil_to(N, wide["BN"]) * 8 <= ceil_to(N, narrow["BN"]) * 9 else narrow

    def mid_ends_sooner(self, M, N, tb=1) -> bool:
        """Whether C (M, N) ends sooner on the mid tiles than on the narrow, by the busiest SM's outputs over its
        throughput: tiles go round the SMs, two narrow ones share an SM at the narrow pair's throughput, a narrow
        one alone runs at WGMMA_NARROW_ALONE_RATE of that, a mid one (always alone) at WGMMA_MID_RATE. Not for
        tiles whose BN leaves part of a 64-column block where B's copy lies K x N (tb 0: TB 1 in the kernel)."""
        mid, narrow = self.f.wgmma_mid, self.f.wgmma[1]
        if mid["BN"] % 64 and not tb:
            return False
        sms = self.dev.device.max_compute_units

        def busiest(mm):  # tiles the busiest SM holds, and the outputs of one
            return -(-(-(-M // mm["BM"]) * -(-N // mm["BN"])) // sms), mm["BM"] * mm["BN"]

        h, area = busiest(narrow)
        narrow_span = (h // 2) * 2 * area + (h % 2) * area / WGMMA_NARROW_ALONE_RATE
        h, area = busiest(mid)
        return h * area / WGMMA_MID_RATE < narrow_span

    @staticmethod
    def band(a_bytes, b_bytes):
        """Rows of tiles a band for a product whose copies take these bytes: WGMMA_BAND where B's copy outgrows
        the cache and A's fits (clgpt.device.tuning says why), else 0 (launch order)."""
        return WGMMA_BAND if b_bytes > WGMMA_BAND_MIN_BYTES >= a_bytes else 0

    def kernel(self, mm, trans, bias, resid, accum, epi, split=0, tiled_out=0, group=0, ngroups=0, band=0, half=0):
        key = ("wgmma", trans, bias, resid, accum, epi, split, tiled_out, group, ngroups, band, half, id(mm))
        kern = self.product_kernels.get(key)
        if kern is None:
            kern = self.product_kernels[key] = self.dev.kernel(
                "matmul_wgmma", "matmul_wgmma", BM=mm["BM"], BN=mm["BN"], TA=int(trans[0]), TB=int(trans[1]),
                STAGES=mm["STAGES"], PIPE=mm["PIPE"], **({"TILE_BAND": band} if band else {}),
                BIAS=int(bias), RESID=int(resid), ACCUM=int(accum), EPI=epi, SPLITK=int(bool(split)),
                **({"TILED_OUT": tiled_out} if tiled_out else {}), **({"OUT_BF16": half} if half else {}),
                **({"GROUP": group, "NGROUPS": ngroups} if group else {}),
                **({"BF16_CVT": 1} if self.f.bf16_options.get("BF16_CVT") else {}),
                **({"WGMMA_EMULATE": 1} if self.caps.mma_emulated else {}),
                SMEM_BYTES=mm["STAGES"] * (mm["BM"] + mm["BN"]) * 128 + 64)
        return kern

    def matmul_wgmma(self, M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, tiled_out=None, ldc=None,
                     half=0, out16=None):
        """Cm (M,N) = alpha op(A) @ op(B) [+ ...] on tiled bf16 copies: wgmma, split along K when the output
        gives too few work-groups (raw parts, then splitk_reduce adds them in order, as the fp32 path does).
        tiled_out = (copy, column sums): epi 1's E, or with epi 2 Cm itself (and its sums), written only as its
        tiled bf16 copy (M, N multiples of 64: matmul_wgmma.cl TILED_OUT). half: OUT_BF16 (1: Cm as bf16; 2: Cm and
        its bf16 copy, out16 = (buffer, ushort offset); 3: that copy alone), unsplit."""
        mm = self.tiles(N, M, K, tb)
        BM, BN = mm["BM"], mm["BN"]
        Kp = ceil_to(max(K, 1), 64)
        # the copies as the fp32 buffers lie: A (K x M) with ta, B (K x N) without tb
        A16, ra, ca = self.copies.tiled_copy(0, A, *((K, M) if ta else (M, K)))
        B16, rb, cb = self.copies.tiled_copy(1, B, *((N, K) if tb else (K, N)))
        trans, ext = (bool(ta), not tb), (ca if ta else ra, rb if tb else cb)
        gn, gm = -(-N // BN), -(-M // BM)  # work-groups along n and m
        groups, gsize, lsize = gn * gm, (gn * 2 * BM, gm), (2 * BM, 1)
        operands = (i32(Kp), A16, i32(ra), i32(ext[0]), B16, i32(rb), i32(ext[1]))
        if (K >= SPLIT_MIN_TOTAL_K and bias is None and resid is None and epi == 0 and tiled_out is None
                and not half and groups < WGMMA_SPLIT_GROUPS):
            plan = split_k_chunks(Kp, groups, WGMMA_SPLIT_GROUPS, WGMMA_SPLIT_MIN_K, 64)
            if plan:
                S, kc = plan
                run_split_k(self.launcher, self.kernel(mm, trans, False, False, False, 0, split=1), gsize, lsize,
                            M, N, S, operands, (i32(kc),), accum, alpha, Cm)
                return
        kern = self.kernel(mm, trans, bias is not None, resid is not None, bool(accum), epi,
                           tiled_out=epi if tiled_out else 0, band=self.band(ra * ca * 2, rb * cb * 2), half=half)
        self.launcher.launch(kern, gsize, lsize, (i32(M), i32(N), *operands, Cm, i32(ldc or N), bias, resid, f32(alpha), E,
                                          *(tiled_out or out16 or ())))
