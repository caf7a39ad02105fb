"""The bf16 GEMM on Hopper's wgmma (sm_90a: H100, H200), on tiled bf16 copies of the operands (clgpt/ops/
copies.py), built through clgpt/device/sm90a.py.

Launches kernels/matmul_wgmma.cl (and kernels/matmul.cl's splitk_reduce for split-K).
"""

from __future__ import annotations

from clgpt.ops.core import ceil_to, f32, i32
from clgpt.ops.gemm import split_k_chunks
from clgpt.device.tuning import SPLIT_MIN_TOTAL_K, WGMMA_SPLIT_GROUPS, WGMMA_SPLIT_MIN_K


class WgmmaOps:
    """matmul on kernels/matmul_wgmma.cl (mixed into clgpt.ops.Ops)."""

    def on_wgmma(self, M, N, K, epi=0) -> bool:
        """Whether the bf16 product of this size (and epilogue) runs on wgmma. Never with GELU' in the epilogue
        (epi 2): on wgmma that product defers GELU' to its gradient's copy (Ops._matmul_bf16), else mma.sync's
        epilogue applies it."""
        return self.wgmma is not None and epi != 2 and M * N * K >= self.wgmma_min

    def _wgmma_tiles(self, N):
        """The wide tiles, unless padding N to their BN wastes over an eighth more than the narrow ones'."""
        wide, narrow = self.wgmma
        return wide if ceil_to(N, wide["BN"]) * 8 <= ceil_to(N, narrow["BN"]) * 9 else narrow

    def _kernel_wgmma(self, mm, trans, bias, resid, accum, epi, split=0, tiled_out=0, group=0, ngroups=0):
        key = ("wgmma", trans, bias, resid, accum, epi, split, tiled_out, group, ngroups, id(mm))
        kern = self.product_kernels.get(key)
        if kern is None:
            kern = self.product_kernels[key] = self.dev.kernel(
                "matmul_wgmma", "matmul_wgmma", BM=mm["BM"], BN=mm["BN"], TA=int(trans[0]), TB=int(trans[1]),
                STAGES=mm["STAGES"], PIPE=mm["PIPE"],
                BIAS=int(bias), RESID=int(resid), ACCUM=int(accum), EPI=epi, SPLITK=int(bool(split)),
                **({"TILED_OUT": tiled_out} if tiled_out else {}),
                **({"GROUP": group, "NGROUPS": ngroups} if group else {}),
                SMEM_BYTES=mm["STAGES"] * (mm["BM"] + mm["BN"]) * 128 + 64)
        return kern

    def matmul_wgmma(self, M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, tiled_out=None, ldc=None):
        """Cm (M,N) = alpha op(A) @ op(B) [+ ...] on tiled bf16 copies: wgmma, split along K when the output
        gives too few work-groups (raw parts, then splitk_reduce adds them in order, as the fp32 path does).
        tiled_out = (copy, column sums): epi 1's E, or with epi 2 Cm itself (and its sums), written only as its
        tiled bf16 copy (M, N multiples of 64: matmul_wgmma.cl TILED_OUT)."""
        mm = self._wgmma_tiles(N)
        BM, BN = mm["BM"], mm["BN"]
        Kp = ceil_to(max(K, 1), 64)
        # the copies as the fp32 buffers lie: A (K x M) with ta, B (K x N) without tb
        A16, ra, ca = self.tiled_copy(0, A, *((K, M) if ta else (M, K)))
        B16, rb, cb = self.tiled_copy(1, B, *((N, K) if tb else (K, N)))
        trans, ext = (bool(ta), not tb), (ca if ta else ra, rb if tb else cb)
        gn, gm = -(-N // BN), -(-M // BM)  # work-groups along n and m
        groups, gsize, lsize = gn * gm, (gn * 2 * BM, gm), (2 * BM, 1)
        operands = (i32(Kp), A16, i32(ra), i32(ext[0]), B16, i32(rb), i32(ext[1]))
        if (K >= SPLIT_MIN_TOTAL_K and bias is None and resid is None and epi == 0 and tiled_out is None
                and groups < WGMMA_SPLIT_GROUPS):
            plan = split_k_chunks(Kp, groups, WGMMA_SPLIT_GROUPS, WGMMA_SPLIT_MIN_K, 64)
            if plan:
                S, kc = plan
                self._split_k(self._kernel_wgmma(mm, trans, False, False, False, 0, split=1), gsize, lsize, M, N, S,
                              operands, (i32(kc),), accum, alpha, Cm)
                return
        kern = self._kernel_wgmma(mm, trans, bias is not None, resid is not None, bool(accum), epi,
                                  tiled_out=epi if tiled_out else 0)
        self.launcher.launch(kern, gsize, lsize, (i32(M), i32(N), *operands, Cm, i32(ldc or N), bias, resid, f32(alpha), E,
                                          *(tiled_out or ())))
