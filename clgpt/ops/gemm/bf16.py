"""The bf16 GEMM on bf16 operand copies (cp.async, ldmatrix, mma.sync; NVIDIA sm_80+, emulated on other devices
for tests): the plain (not tiled) operand copies and the product on them; the tiled copies wgmma reads, which
its copies (clgpt/ops/copies.py, owned here and lent to the wgmma backend) make through to_bf16. Batched
products run on the mma backend it holds.

Launches kernels/matmul_bf16.cl (to_bf16, matmul_bf16; kernels/matmul.cl's splitk_reduce for split-K).
"""

from __future__ import annotations

from clgpt.errors import ClgptError
from clgpt.ops.copies import TiledCopies
from clgpt.ops.core import Facts, Part, ceil_to, f32, i32, run_split_k
from clgpt.ops.gemm.mma import MmaGemm
from clgpt.ops.gemm.portable import split_k_chunks
from clgpt.device.precision import mma_groups, mma_launch, mma_threads
from clgpt.device.tuning import MMA_SMALL_GROUPS, MMA_SPLIT_GROUPS, MMA_SPLIT_MIN_K, SPLIT_MIN_TOTAL_K


class Bf16Gemm(Part):
    """matmul on kernels/matmul_bf16.cl (the GEMM interface of clgpt/ops/gemm/portable.py's PortableGemm); `mma`,
    the tensor-core backend on fp32 operands, runs its batched products."""

    def __init__(self, f: Facts, mma: MmaGemm):
        """Builds the copy kernels, with the record's bf16 build options (clgpt/device/capabilities.py:
        MMA_EMULATE on PoCL for tests, else how smem_probe found a local pointer becomes a shared-window
        address)."""
        super().__init__(f)
        self.mma = mma
        self.copies = TiledCopies(f, self)  # the tiled copies wgmma reads, made by to_bf16
        self.k["to_bf16"] = self.dev.kernel("matmul_bf16", "to_bf16", **f.bf16_options)
        if f.wgmma is not None:
            self.k["to_bf16_tiled"] = self.dev.kernel("matmul_bf16", "to_bf16", TILED=1, **f.bf16_options)

    def matmul_half(self, M, N, K, A, B, Cm, tb=0, bias=None, copy=None, fp32=True) -> bool:
        """No bf16 outputs here (clgpt/ops/gemm/wgmma.py's writes them): nothing written, -> False."""
        return False

    def on_wgmma(self, M, N, K, epi=0) -> bool:
        """Whether a product of this size runs on wgmma: never here."""
        return False

    def matmul(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0):
        """Cm (M,N) = alpha * op(A) @ op(B) [+ bias] [+ resid] [+ Cm], row-major, contiguous."""
        self.matmul_epi(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha)

    def matmul_epi(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0, epi=0, E=None,
                   ldc=None):
        """matmul with an epilogue (as clgpt/ops/gemm/portable.py's) on bf16 copies of the operands."""
        if M <= 0 or N <= 0:
            return
        big, small = self.f.bf16
        mm = big if mma_groups(big, M, N) >= MMA_SMALL_GROUPS else small
        ops = self.bf16_operands(mm, M, N, K, A, B, ta, tb)
        self.matmul_bf16(mm, M, N, *ops, Cm, bias, resid, accum, alpha, epi, E, split_k=K >= SPLIT_MIN_TOTAL_K,
                         ldc=ldc or N)

    def bmm(self, *args, **kw):
        """Batched products: the batched mma kernel (MmaGemm.bmm)."""
        self.mma.bmm(*args, **kw)

    def stacks_fit(self, M, N, K) -> bool:
        """Whether bmm_bf16 takes an M x N x K product: M, N multiples of the small tiles, K of 32 (its stacks are
        not padded)."""
        mm = self.f.bf16[1]
        return M % mm["BM"] == 0 and N % mm["BN"] == 0 and K % 32 == 0

    def bmm_bf16(self, M, N, K, nz, hb, A16, lda, a_off, B16, ldb, b_off, Cm, ldc, c_off, ta=0, tb=0, alpha=1.0,
                 causal=0, resid=None, out16=False):
        """Batched products on bf16 operand stacks (as MmaGemm.bmm's arguments: product z of nz at offsets o +
        (z / hb) sb + (z % hb) sh, in elements) on the small tiles, Cm = alpha op(A) op(B) [+ resid, at Cm's
        offsets], in bf16 where out16. Muon's Newton-Schulz (clgpt/ops/muon.py): sizes that stacks_fit, operand
        rows and offsets multiples of 8 (16-byte copies)."""
        mm = self.f.bf16[1]
        if not self.stacks_fit(M, N, K) or any(v % 8 for v in (lda, ldb, *a_off, *b_off)):
            raise ClgptError(f"bmm_bf16 {M} x {N} x {K}: M, N multiples of {mm['BM']} x {mm['BN']}, K of 32, "
                             "operand rows and offsets of 8")
        kern = self.kernel(mm, not ta, bool(tb), False, resid is not None, False, 0, batch=1, causal=causal,
                           out16=out16)
        (gx, gy), lsize = mma_launch(mm, M, N)
        self.launcher.launch(kern, (gx, gy, nz), lsize + (1,),
                             (i32(M), i32(N), i32(K), A16, i32(lda), B16, i32(ldb), Cm, i32(ldc), None, resid,
                              f32(alpha), None, i32(hb), *(i32(v) for v in (*a_off, *b_off, *c_off))))

    def kernel(self, mm, akc, bkc, bias, resid, accum, epi, split=0, batch=0, causal=0, out16=False):
        key = ("bf16", akc, bkc, bias, resid, accum, epi, split, id(mm), batch, causal, out16)
        kern = self.product_kernels.get(key)
        if kern is None:
            nth = mma_threads(mm)
            if (mm["BM"] % 32 or mm["BN"] % 32 or mm["BM"] % (16 * mm["WM"]) or mm["BN"] % (16 * mm["WN"])
                    or ((mm["BM"] + mm["BN"]) * 4) % nth):
                raise ClgptError(f"bf16 tiles {mm}: BM, BN multiples of 32, BM of 16 WM, BN of 16 WN, "
                                 "(BM + BN) * 4 of the work-group's threads")
            extra = dict(SPLITK=1) if split else {}
            if batch:
                extra.update(BATCH=1, CAUSAL=causal, OUT16=int(out16))
            build = self.launcher.verbose_options(self.f.bf16_options)
            kern = self.product_kernels[key] = self.dev.kernel(
                "matmul_bf16", "matmul_bf16", build_options=build, AKC=int(akc), BKC=int(bkc), BIAS=int(bias),
                RESID=int(resid), ACCUM=int(accum), EPI=epi, BM=mm["BM"], BN=mm["BN"], WM=mm["WM"], WN=mm["WN"],
                STAGES=mm.get("STAGES", 2), **({"TILE_BAND": mm["TILE_BAND"]} if mm.get("TILE_BAND") else {}),
                **extra, **self.f.bf16_options)
        return kern

    def to_bf16(self, slot, X, rows, cols, Rp, Cp, tiled=False, out=None):
        """-> the bf16 copy (Rp x Cp, zero-padded) of X (rows x cols, row-major); into `out`, else scratch `slot`
        (0: A, 1: B, 2: a reuse block's). Rp and Cp multiples of 32.
        tiled: in matmul_wgmma.cl's layout (matmul_bf16.cl TILED; Rp a multiple of 8, Cp of 64)."""
        if out is None:
            out = self.launcher.slot(slot, Rp * Cp * 2)
        self.launcher.launch(self.k["to_bf16_tiled" if tiled else "to_bf16"], (Cp // 8, Rp), (4, 32),
                     (i32(rows), i32(cols), X, i32(cols), out, i32(Cp)))
        return out

    def bf16_operands(self, mm, M, N, K, A, B, ta, tb):
        """-> (A16, akc, lda, B16, bkc, ldb, Kp): bf16 copies of op(A), op(B) in the layout the fp32 buffers
        have (akc/bkc = 1: k-contiguous rows; the kernel reads m/n-contiguous ones with ldmatrix.trans), padded
        to mm's tiles and Kp = K rounded up to 32."""
        Kp, Mp, Np = ceil_to(max(K, 1), 32), ceil_to(M, mm["BM"]), ceil_to(N, mm["BN"])
        A16 = self.to_bf16(0, A, K, M, Kp, Mp) if ta else self.to_bf16(0, A, M, K, Mp, Kp)
        B16 = self.to_bf16(1, B, N, K, Np, Kp) if tb else self.to_bf16(1, B, K, N, Kp, Np)
        return A16, not ta, (Mp if ta else Kp), B16, bool(tb), (Kp if tb else Np), Kp

    def matmul_bf16(self, mm, M, N, A16, akc, lda, B16, bkc, ldb, Kp, Cm, bias=None, resid=None, accum=False,
                    alpha=1.0, epi=0, E=None, split_k=True, ldc=None):
        """Cm (M,N) = alpha op(A16) @ op(B16) [+ ...] on bf16 copies (bf16_operands) padded to mm's tiles and Kp."""
        groups = mma_groups(mm, M, N)
        if split_k and bias is None and resid is None and epi == 0 and groups < MMA_SPLIT_GROUPS:
            # split-K as the fp32 kernel does: S raw partial products, then splitk_reduce adds them in order
            plan = split_k_chunks(Kp, groups, MMA_SPLIT_GROUPS, MMA_SPLIT_MIN_K, 32)
            if plan:
                S, kc = plan
                run_split_k(self.launcher, self.kernel(mm, akc, bkc, False, False, False, 0, split=1),
                            *mma_launch(mm, M, N), M, N, S, (i32(Kp), A16, i32(lda), B16, i32(ldb)), (i32(kc),),
                            accum, alpha, Cm)
                return
        kern = self.kernel(mm, akc, bkc, bias is not None, resid is not None, bool(accum), epi)
        gsize, lsize = mma_launch(mm, M, N)
        self.launcher.launch(kern, gsize, lsize, (i32(M), i32(N), i32(Kp), A16, i32(lda), B16, i32(ldb), Cm, i32(ldc or N),
                                          bias, resid, f32(alpha), E))
