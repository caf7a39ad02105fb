"""The bf16 GEMM on bf16 operand copies (cp.async, ldmatrix, mma.sync; NVIDIA sm_80+, emulated on other devices
for tests): the bf16 path's dispatch (_matmul_bf16: wgmma where it runs, a deferred GELU', else this kernel) and
the plain (not tiled) operand copies.

Launches kernels/matmul_bf16.cl (to_bf16, matmul_bf16; kernels/matmul.cl's splitk_reduce
for split-K). _bf16_setup also builds the tiled copies' kernels (to_bf16 TILED, COLSUM, GELU_GRAD), kernels/
gelu.cl's gelu_backward and kernels/xent.cl's xent_backward_tiled, which clgpt/ops/copies.py and layers.py launch.
"""

from __future__ import annotations

from clgpt.errors import ClgptError
from clgpt.ops.core import ceil_to, f32, i32
from clgpt.ops.gemm import split_k_chunks
from clgpt.device.precision import mma_groups, mma_launch, mma_threads
from clgpt.device.tuning import MMA_SMALL_GROUPS, MMA_SPLIT_GROUPS, MMA_SPLIT_MIN_K, SPLIT_MIN_TOTAL_K


class Bf16Ops:
    """matmul on kernels/matmul_bf16.cl (mixed into clgpt.ops.Ops)."""

    def _bf16_setup(self):
        """Build the copy kernels, with the record's bf16 build options (clgpt/device/capabilities.py: MMA_EMULATE
        on PoCL for tests, else how smem_probe found a local pointer becomes a shared-window address)."""
        self.bf16_options = dict(self.caps.bf16_options)
        self.k["to_bf16"] = self.dev.kernel("matmul_bf16", "to_bf16", **self.bf16_options)
        if self.wgmma is not None:
            self.k["to_bf16_tiled"] = self.dev.kernel("matmul_bf16", "to_bf16", TILED=1, **self.bf16_options)
            if self.colsum_copies:  # reuse copies: bias_partial's sums too
                for name, extra in (("to_bf16_colsum", {}), ("to_bf16_colsum_gelu", dict(GELU_GRAD=1))):
                    self.k[name] = self.dev.kernel("matmul_bf16", "to_bf16", TILED=1, COLSUM=1, **extra,
                                                   **self.bf16_options)
                self.k["gelu_backward"] = self.dev.kernel("gelu", "gelu_backward")
            self.k["xent_backward_tiled"] = self.dev.kernel("xent", "xent_backward_tiled", V=self.cfg.vocab_size)

    def _kernel_bf16(self, mm, akc, bkc, bias, resid, accum, epi, split=0):
        key = ("bf16", akc, bkc, bias, resid, accum, epi, split, id(mm))
        kern = self.product_kernels.get(key)
        if kern is None:
            nth = mma_threads(mm)
            if (mm["BM"] % 32 or mm["BN"] % 32 or mm["BM"] % (16 * mm["WM"]) or mm["BN"] % (16 * mm["WN"])
                    or ((mm["BM"] + mm["BN"]) * 4) % nth):
                raise ClgptError(f"bf16 tiles {mm}: BM, BN multiples of 32, BM of 16 WM, BN of 16 WN, "
                                 "(BM + BN) * 4 of the work-group's threads")
            extra = dict(SPLITK=1) if split else {}
            build = self._nv_verbose(self.bf16_options)
            kern = self.product_kernels[key] = self.dev.kernel(
                "matmul_bf16", "matmul_bf16", build_options=build, AKC=int(akc), BKC=int(bkc), BIAS=int(bias),
                RESID=int(resid), ACCUM=int(accum), EPI=epi, BM=mm["BM"], BN=mm["BN"], WM=mm["WM"], WN=mm["WN"],
                STAGES=mm.get("STAGES", 2), **extra, **self.bf16_options)
        return kern

    def to_bf16(self, slot, X, rows, cols, Rp, Cp, tiled=False, out=None):
        """-> the bf16 copy (Rp x Cp, zero-padded) of X (rows x cols, row-major); into `out`, else scratch `slot` (0: A, 1: B, 2: Ops.reuse's). Rp and Cp multiples of 32.
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

    def _matmul_bf16(self, M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc=None):
        for X in (A, B):  # a deferred GELU' is read from the reuse copy only
            if self.copies.deferred(X) is not None and not (self.copies.is_reusing(X) and self.on_wgmma(M, N, K, epi)):
                self.settle(X)
        if (epi == 2 and self.colsum_copies and self.on_wgmma(M, N, K)
                and bias is None and resid is None and not accum):
            if M % 64 == 0 and N % 64 == 0:
                # dh = dg * gelu'(E) written only as dh's tiled copy and its column sums, for dh's reuse block
                copy, part = self.launcher.slot(3, M * N * 2), self.launcher.grown("tparts", M // 64 * N)
                self.matmul_wgmma(M, N, K, A, B, Cm, ta, tb, None, None, False, alpha, 2, E, tiled_out=(copy, part))
                self.copies.premake(Cm, (copy, M, N, part, M // 64))
                return
            # dh = dg * gelu'(E): the product on wgmma now, gelu' when dh's reuse copy is made (or settle)
            self.matmul_wgmma(M, N, K, A, B, Cm, ta, tb, None, None, False, alpha, 0, None)
            self.copies.defer_gelu(Cm, E, M, N)
            return
        if self.on_wgmma(M, N, K, epi):
            if epi == 3 and self.tiled_outputs and M % 64 == 0 and N % 64 == 0 and ldc == 2 * N and not accum:
                # dgate | dup (M, 2N) written only as its tiled copy, for its reuse block (the products after it
                # are larger: on wgmma too)
                copy = self.launcher.slot(3, M * 2 * N * 2)
                self.matmul_wgmma(M, N, K, A, B, Cm, ta, tb, bias, resid, False, alpha, 3, E, tiled_out=(copy, None),
                                   ldc=ldc)
                self.copies.premake(Cm, (copy, M, 2 * N, None, M // 64))
                return
            if (epi == 1 and self.tiled_outputs and self.copies.is_stable(E) and M % 64 == 0
                    and N % 64 == 0):
                # g = gelu(h) written only as g's kept tiled copy (the products read g through it alone)
                self.matmul_wgmma(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E,
                                   tiled_out=(self._kept_copy(E, M, N), None))
                return
            self.matmul_wgmma(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc=ldc)
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
                self._split_k(self._kernel_bf16(mm, akc, bkc, False, False, False, 0, split=1), *mma_launch(mm, M, N),
                              M, N, S, (i32(Kp), A16, i32(lda), B16, i32(ldb)), (i32(kc),), accum, alpha, Cm)
                return
        kern = self._kernel_bf16(mm, akc, bkc, bias is not None, resid is not None, bool(accum), epi)
        gsize, lsize = mma_launch(mm, M, N)
        self.launcher.launch(kern, gsize, lsize, (i32(M), i32(N), i32(Kp), A16, i32(lda), B16, i32(ldb), Cm, i32(ldc or N),
                                          bias, resid, f32(alpha), E))
