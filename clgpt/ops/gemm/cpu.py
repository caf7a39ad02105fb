"""The register-blocked GEMM for CPUs: kernels/matmul.cl's matmul_rb (RM rows x NV vectors of VW columns a
work-item), its tiles per output width (rb_tiles), a plan per product shape, products split along K, and the
operand transposes and row padding it reads through (kernels/transpose.cl).

Launches kernels/matmul.cl (matmul_rb) and kernels/transpose.cl (transpose, transpose_v8, transpose_ld_v8,
copy_ld_v8); batched products (attention dropout on CPUs) run the portable tiled form it holds.
"""

from __future__ import annotations

from clgpt.ops.copies import TiledCopies
from clgpt.ops.core import Facts, Part, ceil_to, f32, i32
from clgpt.ops.gemm.portable import PortableGemm, matmul_launch


class RegisterBlockedGemm(Part):
    """matmul on kernels/matmul.cl's matmul_rb (the CPU rows of clgpt.device.tuning); `tiled`, the portable
    backend, builds its kernels and runs its batched products."""

    def __init__(self, f: Facts, tiled: PortableGemm):
        super().__init__(f)
        self.tiled = tiled
        tiled.rb = self
        self.copies = TiledCopies(f, None)
        self._rb_variants = {}  # matmul_rb tiles with fewer vectors per work-item, by NV (rb_tiles)
        self.rb_plans = {}  # matmul_rb launches by product shape (_rb_plan)
        dev, k, caps = self.dev, self.k, self.caps
        k["transpose"] = dev.kernel("transpose", "transpose")
        if caps.transpose_v8:  # register transposes (kernels/transpose.cl)
            k["transpose_v8"] = dev.kernel("transpose", "transpose_v8")
        if caps.pad_ld:
            k["transpose_ld_v8"] = dev.kernel("transpose", "transpose_ld_v8")
            k["copy_ld_v8"] = dev.kernel("transpose", "copy_ld_v8")

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
        """matmul with an epilogue (as clgpt/ops/gemm/portable.py's)."""
        if M <= 0 or N <= 0:
            return
        self._matmul_rb(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc)

    def bmm(self, *args, **kw):
        """Batched products: the portable tiled form (PortableGemm.bmm)."""
        self.tiled.bmm(*args, **kw)

    def rb_tiles(self, N):
        """matmul_rb's tiles for an output N columns wide: the table's NV vectors of VW columns, or fewer where
        that leaves a shorter last partial block (the slow scalar path), e.g. N = 96 takes 2 blocks of 3 x 16.
        The sums are the same whatever the tiles (each output sums over k in order), and the tail is always the
        last N mod 16 columns (NV = 1 leaves that much), whose scalar epilogue math is what it was before."""
        mm = self.f.mm
        width = mm.get("VW", 8)
        nv = min(range(mm["NV"], 0, -1), key=lambda v: (N % (width * v), -v))
        if nv == mm["NV"]:
            return mm
        if nv not in self._rb_variants:  # one dict per NV: kernels are cached by the dict's id
            self._rb_variants[nv] = dict(mm, NV=nv)
        return self._rb_variants[nv]

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
        mm = self.rb_tiles(N)
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
            kc = ceil_to(-(-K // n), self.f.align)  # sub-buffers start at aligned offsets
            chunks = [(k0, min(kc, K - k0)) for k0 in range(0, K, kc)]
            if len(chunks) > 1:
                kerns = (self.tiled.kernel(mm, ta, 0, False, False, False, 0),
                         self.tiled.kernel(mm, ta, 0, False, False, False, 0, init=1),
                         self.tiled.kernel(mm, ta, 0, False, False, accum, 0, init=1))
                return b_op, ldb, a_transpose, (kerns, chunks, ta), gsize, lsize, ints
        kern = self.tiled.kernel(mm, ta, 0, bias, resid, accum, epi)
        return b_op, ldb, a_transpose, kern, gsize, lsize, ints

    def _matmul_rb(self, M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha, epi, E, ldc):
        key = (M, N, K, ta, tb, bias is not None, resid is not None, bool(accum), epi, ldc)
        plan = self.rb_plans.get(key)
        if plan is None:
            plan = self.rb_plans[key] = self._rb_plan(*key)
        b_op, ldb, a_transpose, kern, gsize, lsize, (iM, iN, iK, ilda, ildb, ildc) = plan
        if b_op == "transpose":
            B = self.transposed(0, B, N, K, ldb)
        elif b_op == "pad":
            B = self._padded(0, B, K, N, ldb)
        if a_transpose:
            A = self.transposed(1, A, K, M)
        if isinstance(kern, tuple):  # split along K (_rb_plan)
            self._matmul_rb_chunks(kern, gsize, lsize, plan[-1], A, B, Cm, accum, alpha)
            return
        self.launcher.launch(kern, gsize, lsize, (iM, iN, iK, A, ilda, B, ildb, Cm, ildc, bias, resid, f32(alpha), E))

    def _matmul_rb_chunks(self, kerns, gsize, lsize, ints, A, B, Cm, accum, alpha):
        """A product split along K into chunks (_rb_plan's rb_kmax): the first launch writes its raw sums (alpha 1,
        no epilogue), each next one starts its accumulators from them (INIT) and goes on with the next k, the last
        applies alpha [+ Cm]. Per output the same chain of sums as one launch, bit for bit. The raw sums go to Cm
        itself, or to a scratch where Cm accumulates."""
        (first, mid, last), chunks, ta = kerns
        iM, iN, _, ilda, ildb, ildc = ints
        P, ldp = (self.launcher.grown("parts", int(iM) * int(iN)), iN) if accum else (Cm, ildc)
        end = len(chunks) - 1
        for c, (k0, kc) in enumerate(chunks):
            a = self.launcher.sub(A, k0 * (int(ilda) if ta else 1))
            b = self.launcher.sub(B, k0 * int(ildb))
            kern = first if c == 0 else last if c == end else mid
            out, ldo, scale = (Cm, ildc, alpha) if c == end else (P, ldp, 1.0)
            self.launcher.launch(kern, gsize, lsize, (iM, iN, i32(kc), a, ilda, b, ildb, out, ldo, None, P if c else None,
                                              f32(scale), None))

    # ---- transposes (the operands it reads) ----
    def _transpose_into(self, x, out, rows, cols, ldo=None):
        """out (cols, rows) = x (rows, cols).T; out's rows ldo (default rows) floats apart (transpose_ld_v8)."""
        if ldo is not None and ldo != rows:
            self.launcher.run("transpose_ld_v8", (ceil_to(-(-cols // 8), 4), -(-rows // 16)), i32(rows), i32(cols), x, out,
                     i32(ldo), lsize=(4, 1))
            return
        if self.caps.transpose_v8:  # 16 x 8 blocks
            self.launcher.run("transpose_v8", (ceil_to(-(-cols // 8), 4), -(-rows // 16)), i32(rows), i32(cols), x, out,
                     lsize=(4, 1))
            return
        self.launcher.run("transpose", (ceil_to(-(-cols // 8), 4), -(-rows // 8)), i32(rows), i32(cols), x, out, lsize=(4, 1))

    def transposed(self, slot, x, rows, cols, ldo=None):
        """x (rows, cols) transposed into scratch buffer `slot` (grown as needed) -> the scratch (cols, rows),
        its rows ldo (default rows) floats apart."""
        ldo = rows if ldo is None else ldo
        out = self.launcher.scratch(slot, cols * ldo)
        self._transpose_into(x, out, rows, cols, ldo)
        return out

    def _padded(self, slot, x, rows, cols, ldo):
        """x (rows, cols) copied into scratch buffer `slot`, its rows ldo floats apart (the padding unwritten)."""
        out = self.launcher.scratch(slot, rows * ldo)
        self.launcher.run("copy_ld_v8", (-(-cols // 64), rows), i32(rows), i32(cols), x, out, i32(ldo), lsize=(1, 1))
        return out
