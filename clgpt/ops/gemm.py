"""The GEMM's front door and its portable forms: matmul / matmul_epi dispatch to the tensor-core backends
(gemm_bf16.py, gemm_mma.py) where the device has them, else run here; batched products (bmm), linear_backward,
bias gradients and the CPU form's operand transposes.

Launches kernels/matmul.cl (matmul: local-memory tiles, split-K with splitk_reduce; matmul_rb: register-blocked,
CPUs), kernels/bias.cl (bias_backward, bias_partial, bias_final, bias_backward_v8), kernels/transpose.cl
(transpose, transpose_v8, transpose_ld_v8, copy_ld_v8) and, for bmm with tensor cores, kernels/matmul_mma.cl.
"""

from __future__ import annotations

from clgpt.ops.core import F32, ceil_to, f32, i32
from clgpt.device.precision import mma_launch
from clgpt.device.tuning import SMALL_GROUPS, SPLIT_MIN_K, SPLIT_MIN_TOTAL_K, SPLIT_SMALL_GROUPS

# Default tiles of the local-memory matmul: TSM x TSN outputs per work-group, TSK deep, WPTM x WPTN outputs
# per work-item. What a device actually runs comes from clgpt.device.tuning (per device type and vendor).
MATMUL_TILES = dict(TSM=64, TSN=64, TSK=32, WPTM=8, WPTN=8)


SPLIT_OVERHEAD_K = 256  # a split work-group's fixed cost, in k (prologue, pipeline fill, epilogue): split_k_chunks


def split_k_chunks(Kp: int, groups: int, target: int, min_k: int, align: int) -> tuple[int, int] | None:
    """Split-K for the tensor-core GEMMs: -> (S, kc), Kp cut into S chunks of kc (a multiple of align, at least
    min_k deep), S chosen so that the groups * S work-groups, spread over `target` slots (the multiprocessors),
    finish soonest: the fewest ceil(groups S / target) * (kc + SPLIT_OVERHEAD_K), the smaller S on a tie (a
    third of a wave more work-groups costs a whole wave). None when no split does better than one chunk."""
    def cost(S):
        return -(-groups * S // target) * (ceil_to(-(-Kp // S), align) + SPLIT_OVERHEAD_K)
    S = min(range(1, min(Kp // min_k, 4 * -(-target // groups)) + 1), key=lambda s: (cost(s), s), default=1)
    if S < 2:
        return None
    kc = ceil_to(-(-Kp // S), align)
    return -(-Kp // kc), kc


def matmul_launch(mm: dict, M: int, N: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """-> (global size, local size) of the matmul form `mm` (a clgpt.device.tuning matmul config) for C (M,N)."""
    if mm["kernel"] == "matmul_rb":
        lsize = tuple(mm.get("lsize", (1, 4)))
        return (ceil_to(-(-M // mm["RM"]), lsize[0]), ceil_to(-(-N // (mm.get("VW", 8) * mm["NV"])), lsize[1])), lsize
    lsize = (mm["TSN"] // mm["WPTN"], mm["TSM"] // mm["WPTM"])
    return (-(-N // mm["TSN"]) * lsize[0], -(-M // mm["TSM"]) * lsize[1]), lsize


def matmul_defines(mm: dict) -> dict:
    """The -D tile options of the matmul form `mm`."""
    return {k: v for k, v in mm.items() if k not in ("kernel", "lsize")}


class GemmOps:
    """matmul and its portable kernels (mixed into clgpt.ops.Ops)."""

    def matmul(self, M, N, K, A, B, Cm, ta=0, tb=0, bias=None, resid=None, accum=False, alpha=1.0):
        """Cm (M,N) = alpha * op(A) @ op(B) [+ bias] [+ resid] [+ Cm], row-major, contiguous."""
        self.matmul_epi(M, N, K, A, B, Cm, ta, tb, bias, resid, accum, alpha)

    def _tiles(self, M, N, nz=1):
        """-> (config, work-groups) for an (M,N) output (times nz batches): the big tiles, or the small ones
        where the big give fewer than SMALL_GROUPS work-groups."""
        mm = self.mm
        if mm["kernel"] == "matmul_rb":
            return self.rb_tiles(N), 0
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

    def rb_tiles(self, N):
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
        kern = self.product_kernels.get(key)
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
            kern = self.product_kernels[key] = self.dev.kernel(
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

    def tuned_split(self, mm, K, S):
        """-> (mm, S, kc) of the tuner's split count S for a product K deep (the same chunks as it timed)."""
        if S < 2 or not self.launch.get("split_k"):
            return mm, 1, K
        kc = ceil_to(-(-K // S), mm["TSK"])
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
        # the device tuner's tiles (and split) for this product where it measured it (clgpt/device/tuner.py)
        tuned = self.launch.get("matmul_shapes", {}).get((M, N, K, ta, tb))
        mm = tuned[0] if tuned else self._tiles(M, N)[0]
        ldb = K if tb else N
        lda = M if ta else K
        if mm["kernel"] == "matmul" and bias is None and resid is None and epi == 0 and K > 0:
            mm, S, kc = self.split_plan(M, N, K) if tuned is None else self.tuned_split(mm, K, tuned[1])
            if S > 1:
                self._split_k(self._kernel_mm(mm, ta, tb, False, False, False, 0, split=1), *matmul_launch(mm, M, N),
                              M, N, S, (i32(K), A, i32(lda), B, i32(ldb)), (i32(kc), i32(1), *(i32(0),) * 9),
                              accum, alpha, Cm)
                return
        kern = self._kernel_mm(mm, ta, tb, bias is not None, resid is not None, bool(accum), epi)
        gsize, lsize = matmul_launch(mm, M, N)
        self.launcher.launch(kern, gsize, lsize, (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc or N),
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
        plan = self.rb_plans.get(key)
        if plan is None:
            plan = self.rb_plans[key] = self._rb_plan(*key)
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

    # ---- batched products (attention) ----
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
            self.launcher.launch(kern, (gx, gy, nz), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm,
                         i32(ldc), None, None, f32(alpha), None, i32(0), i32(hb),
                         *(i32(v) for v in (*a_off, *b_off, *c_off))))
            return
        if mm is None:
            mm, _ = self._tiles(M, N, nz)
        kern = self._kernel_mm(mm, ta, tb, False, False, False, 0, batch=1, causal=causal)
        (gx, gy), lsize = matmul_launch(mm, M, N)
        self.launcher.launch(kern, (gx, gy, nz), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc),
                     None, None, f32(alpha), None, i32(0), i32(hb), *(i32(v) for v in (*a_off, *b_off, *c_off))))

    # ---- gradients ----
    def linear_backward(self, N, n_out, n_in, dy, x, W, dW, dx, db=None, epi=0, E=None, ldc=None):
        """Both gradients of y (N, n_out) = x (N, n_in) @ W.T [+ b]: dW += dy.T @ x, db += dy's column sums,
        dx = dy @ W through matmul_epi's epilogue `epi` (E, ldc as there). dy feeds both products, so the
        operand copy made of it for the first serves the second (reuse)."""
        with self.reuse(dy):
            self.matmul(n_out, n_in, N, dy, x, dW, ta=1, accum=True)
            if db is not None:
                self.bias_backward(N, n_out, dy, db)
            self.matmul_epi(N, n_in, n_out, dy, W, dx, epi=epi, E=E, ldc=ldc)

    def bias_backward(self, M, N, dy, db):
        """db (N) += column sums of dy (M,N), in a fixed order."""
        sums = self.copies.colsums_of((dy.int_ptr, M, N))
        if sums is not None:  # made with dy's tiled copy
            self._bias_final(sums[0], N, sums[1], db)
            return
        self.settle(dy)
        if self.caps.bias_v8:
            self.launcher.run("bias_backward_v8", (-(-N // 8),), i32(M), i32(N), dy, db, lsize=(1,))
            return
        if not self.rows:
            self.launcher.runp("bias_backward", (N,), i32(M), i32(N), dy, db)
            return
        rc = self.launch["colsum_rows"]
        R = -(-M // rc)
        if R < self.launch["colsum_min_parts"]:
            self.launcher.runp("bias_backward", (N,), i32(M), i32(N), dy, db)
            return
        part = self.launcher.grown("cparts", R * N)
        self.launcher.runp("bias_partial", (N, R), i32(M), i32(N), i32(rc), dy, part)
        self._bias_final(R, N, part, db)

    def _bias_final(self, R, N, part, db):
        """db (N) += the sums of R rows of parts (bias_partial's, or to_bf16 COLSUM's): kernels/matmul.cl."""
        self.launcher.run("bias_final", (ceil_to(N, 16), 16), i32(R), i32(N), part, db, lsize=(16, 16))

    # ---- transposes (CPU matmul operands) ----
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

    def _transposed(self, slot, x, rows, cols, ldo=None):
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
