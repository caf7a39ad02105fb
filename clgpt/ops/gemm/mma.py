"""The GEMM on tensor cores with fp32 buffers as operands (mma.sync, NVIDIA sm_80+; emulated on other devices
for tests): tf32, and bf16 where the bf16 GEMM is off; the batched form attention's products take with tensor
cores, and the tiles and kernels the grouped products build (clgpt/ops/grouped.py).

Launches kernels/matmul_mma.cl (and kernels/matmul.cl's splitk_reduce for split-K).
"""

from __future__ import annotations

from clgpt.errors import ClgptError
from clgpt.ops.copies import TiledCopies
from clgpt.ops.core import Facts, Part, ceil_to, f32, i32, run_split_k
from clgpt.device.precision import mma_bk, mma_groups, mma_launch, mma_threads
from clgpt.device.tuning import MMA_SMALL_GROUPS, MMA_SPLIT_GROUPS, MMA_SPLIT_MIN_K, SPLIT_MIN_TOTAL_K


class MmaGemm(Part):
    """matmul on kernels/matmul_mma.cl (the GEMM interface of clgpt/ops/gemm/portable.py's PortableGemm)."""

    def __init__(self, f: Facts):
        super().__init__(f)
        self.copies = TiledCopies(f, None)

    def matmul_half(self, M, N, K, A, B, Cm, tb=0, bias=None, copy=None, fp32=True) -> bool:
        """No bf16 outputs here (clgpt/ops/gemm/wgmma.py's writes them): nothing written, -> False."""
        return False

    def on_wgmma(self, M, N, K, epi=0) -> bool:
        """Whether a product of this size runs on wgmma: never here."""
        return False

    def matmul(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0):
        """Cm (M,N) = alpha * op(A) @ op(B) [+ bias] [+ resid] [+ Cm], row-major, contiguous."""
        self.matmul_epi(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha)

    def tiles(self, M, N, nz=1):
        """The big mma tiles, or the small ones where the big give fewer than MMA_SMALL_GROUPS work-groups."""
        big, small = self.f.mma
        return big if mma_groups(big, M, N) * nz >= MMA_SMALL_GROUPS else small

    def kernel(self, mm, ta, tb, bias, resid, accum, epi, align4, split=0, batch=0, causal=0, group=0,
                    ngroups=0):
        """matmul_mma built for tiles mm; group 1 / 2 with ngroups: the grouped forms (clgpt/ops/grouped.py)."""
        key = ("mma", ta, tb, bias, resid, accum, epi, align4, split, batch, causal, id(mm), group, ngroups)
        kern = self.product_kernels.get(key)
        if kern is None:
            nth = mma_threads(mm)
            if (mm["BM"] * 4) % nth or (mm["BN"] * 4) % nth or mm["BM"] % (16 * mm["WM"]) or mm["BN"] % (8 * mm["WN"]):
                raise ClgptError(f"mma tiles {mm}: BM, BN times 4 must divide by the work-group's threads, "
                                 "BM by 16 WM, BN by 8 WN")
            extra = dict(SPLITK=1) if split else {}
            if batch:
                extra.update(BATCH=1, CAUSAL=causal)
            if group:
                extra.update(GROUP=group, NGROUPS=ngroups)
            if self.caps.mma_emulated:
                extra["MMA_EMULATE"] = 1  # CLGPT_MMA_EMULATE on a device without tensor cores (tests)
            build = self.launcher.verbose_options(extra)
            kern = self.product_kernels[key] = self.dev.kernel(
                "matmul_mma", "matmul_mma", build_options=build, TA=ta, TB=tb, BIAS=int(bias), RESID=int(resid),
                ACCUM=int(accum), EPI=epi, ROUND=self.f.round, ALIGN4=int(align4), BM=mm["BM"], BN=mm["BN"],
                WM=mm["WM"], WN=mm["WN"], **extra)
        return kern

    def matmul_epi(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0, epi=0, E=None,
                   ldc=None):
        """matmul with an epilogue (as clgpt/ops/gemm/portable.py's)."""
        if M <= 0 or N <= 0:
            return
        lda, ldb = (M if ta else K), (K if tb else N)
        align4 = lda % 4 == 0 and ldb % 4 == 0
        mm = self.tiles(M, N)
        groups = mma_groups(mm, M, N)
        if bias is None and resid is None and epi == 0 and K >= SPLIT_MIN_TOTAL_K and groups < MMA_SPLIT_GROUPS:
            # split-K as the fp32 kernel does: S raw partial products, then splitk_reduce adds them in order
            S = min(-(-MMA_SPLIT_GROUPS * 2 // groups), K // MMA_SPLIT_MIN_K)
            if S >= 2:
                kc = ceil_to(-(-K // S), mma_bk(self.f.round))
                S = -(-K // kc)
                run_split_k(self.launcher, self.kernel(mm, ta, tb, False, False, False, 0, align4, split=1),
                            *mma_launch(mm, M, N), M, N, S, (i32(K), A, i32(lda), B, i32(ldb)),
                            (i32(kc), i32(1), *(i32(0),) * 9), accum, alpha, Cm)
                return
        kern = self.kernel(mm, ta, tb, bias is not None, resid is not None, bool(accum), epi, align4)
        gsize, lsize = mma_launch(mm, M, N)
        self.launcher.launch(kern, gsize, lsize, (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc or N),
                                          bias, resid, f32(alpha), E))

    def bmm(self, M, N, K, nz, hb, A, lda, a_off, B, ldb, b_off, Cm, ldc, c_off, ta=0, tb=0, alpha=1.0, causal=0,
            mm=None, accum=False, small=False):
        """Batched matmul (as PortableGemm.bmm) on the batched mma kernel; `mm` is the portable form's (unused).
        small: the small tiles whatever the size (Muon's Newton-Schulz products, clgpt/ops/muon.py)."""
        mm = self.f.mma[1] if small else self.tiles(M, N, nz)
        align4 = all(v % 4 == 0 for v in (lda, ldb, *a_off, *b_off))
        kern = self.kernel(mm, ta, tb, False, False, bool(accum), 0, align4, batch=1, causal=causal)
        (gx, gy), lsize = mma_launch(mm, M, N)
        self.launcher.launch(kern, (gx, gy, nz), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm,
                     i32(ldc), None, None, f32(alpha), None, i32(0), i32(hb),
                     *(i32(v) for v in (*a_off, *b_off, *c_off))))
