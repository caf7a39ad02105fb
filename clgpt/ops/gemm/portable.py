"""The portable GEMM: kernels/matmul.cl's local-memory tiled form (GPUs without tensor cores, and every device's
grouped and batched products where no tensor-core form runs), split-K with splitk_reduce; the tile choice
(`tiles`, `split_plan`, `matmul_launch`, `matmul_defines`) every portable form shares.

bf16 storage (Facts.bf16_storage: precision bf16 on the tiled form): the products read bf16 copies of their
operands (kernels/matmul.cl A16, B16), made by kernels/matmul_bf16.cl's to_bf16 and kept as the copy book says
(clgpt/ops/copies.py plain_copy: a weight's or a saved activation's once a forward, a gradient's once for both of
its products), the same bits as ROUND=1 on the fp32 operands; batched products (attention) keep fp32 storage.

Launches kernels/matmul.cl (matmul; splitk_reduce for split-K, which every backend's split-K launches through
clgpt/ops/core.py's run_split_k) and kernels/matmul_bf16.cl (to_bf16, bf16 storage only).
"""

from __future__ import annotations

from clgpt.ops.copies import TiledCopies
from clgpt.ops.core import Facts, Part, ceil_to, f32, i32, run_split_k
from clgpt.device.precision import BF16_COPY_OPTIONS
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


class PortableGemm(Part):
    """matmul on kernels/matmul.cl's tiled form; the GEMM interface every backend has (matmul, matmul_epi, bmm,
    on_wgmma, copies)."""

    def __init__(self, f: Facts):
        super().__init__(f)
        self.rb = None  # the register-blocked backend, where the device's row runs matmul_rb (its tiles)
        self.copies = TiledCopies(f, self)  # no tiled copies here: the book, and bf16 storage's plain copies
        self.k["splitk_reduce"] = self.dev.kernel("matmul", "splitk_reduce")

    def to_bf16(self, slot, X, rows, cols, Rp, Cp, out=None):
        """-> the bf16 copy (Rp x Cp, zero-padded, rows Cp ushorts apart) of X (rows x cols, row-major); into
        `out`, else scratch `slot`. Rp and Cp multiples of 32."""
        if out is None:
            out = self.launcher.slot(slot, Rp * Cp * 2)
        kern = self.k.get("to_bf16_plain")
        if kern is None:
            kern = self.k["to_bf16_plain"] = self.dev.kernel("matmul_bf16", "to_bf16", **BF16_COPY_OPTIONS)
        self.launcher.launch(kern, (Cp // 8, Rp), (4, 32), (i32(rows), i32(cols), X, i32(cols), out, i32(Cp)))
        return out

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
        """-> (config, work-groups) for an (M,N) output (times nz batches): the big tiles, or the small ones
        where the big give fewer than SMALL_GROUPS work-groups."""
        mm = self.f.mm
        if mm["kernel"] == "matmul_rb":
            return self.rb.rb_tiles(N), 0
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

    def kernel(self, mm, ta, tb, bias, resid, accum, epi, split=0, batch=0, causal=0, init=0, store16=0):
        key = (ta, tb, bias, resid, accum, epi, split, batch, causal, store16, id(mm), init)
        kern = self.product_kernels.get(key)
        if kern is None:
            extra = {}
            if split:
                extra["SPLITK"] = 1
            if init:  # matmul_rb continuing the raw sums of an earlier launch (a product split along K)
                extra["INIT"] = 1
            if batch:
                extra.update(BATCH=1, CAUSAL=causal)
            if self.f.round:  # tf32/bf16 operands (fp32 builds keep their options, so their binaries, unchanged)
                extra["ROUND"] = self.f.round
            if store16:  # both operands bf16 copies (bf16 storage)
                extra.update(A16=1, B16=1)
            if self.launch.get("tile_band"):  # tiles in bands of rows (clgpt.device.tuning says where)
                extra["TILE_BAND"] = self.launch["tile_band"]
            kern = self.product_kernels[key] = self.dev.kernel(
                "matmul", mm["kernel"], TA=ta, TB=tb, BIAS=int(bias), RESID=int(resid), ACCUM=int(accum), EPI=epi,
                **extra, **matmul_defines(mm))
        return kern

    def split_plan(self, M, N, K):
        """-> (config, S, kc): split-K into S chunks of kc (S = 1: no split), GPUs only."""
        mm, groups = self.tiles(M, N)
        if not self.launch.get("split_k") or K < SPLIT_MIN_TOTAL_K:
            return mm, 1, K
        target = SPLIT_SMALL_GROUPS
        if mm is not self.launch.get("matmul_small"):  # big (or narrow) tiles: split only a short last wave
            if groups >= target:
                return mm, 1, K
            s = min(-(-target // groups), K // SPLIT_MIN_K["big"])
        else:
            big = self.f.mm
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
        # the device tuner's tiles (and split) for this product where it measured it (clgpt/device/tuner.py)
        tuned = self.launch.get("matmul_shapes", {}).get((M, N, K, ta, tb))
        mm = tuned[0] if tuned else self.tiles(M, N)[0]
        ldb = K if tb else N
        lda = M if ta else K
        store16 = int(self.f.bf16_storage and mm["kernel"] == "matmul" and K > 0)
        if store16:  # bf16 copies of op(A), op(B) in their fp32 layouts, rows lda / ldb ushorts apart
            A, lda = self.copies.plain_copy(0, A, *((K, M) if ta else (M, K)))
            B, ldb = self.copies.plain_copy(1, B, *((N, K) if tb else (K, N)))
        if mm["kernel"] == "matmul" and bias is None and resid is None and epi == 0 and K > 0:
            mm, S, kc = self.split_plan(M, N, K) if tuned is None else self.tuned_split(mm, K, tuned[1])
            if S > 1:
                run_split_k(self.launcher, self.kernel(mm, ta, tb, False, False, False, 0, split=1, store16=store16),
                            *matmul_launch(mm, M, N), M, N, S, (i32(K), A, i32(lda), B, i32(ldb)),
                            (i32(kc), i32(1), *(i32(0),) * 9), accum, alpha, Cm)
                return
        kern = self.kernel(mm, ta, tb, bias is not None, resid is not None, bool(accum), epi, store16=store16)
        gsize, lsize = matmul_launch(mm, M, N)
        self.launcher.launch(kern, gsize, lsize, (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc or N),
                                          bias, resid, f32(alpha), E))

    def bmm(self, M, N, K, nz, hb, A, lda, a_off, B, ldb, b_off, Cm, ldc, c_off, ta=0, tb=0, alpha=1.0, causal=0,
            mm=None, accum=False):
        """Batched matmul (the local-memory form): for z < nz, (zb, zh) = divmod(z, hb), Cm_z (M,N) =
        alpha op(A_z) @ op(B_z) where X_z = X + o + zb * s_b + zh * s_h and x_off = (o, s_b, s_h); causal: see
        kernels/matmul.cl; accum: Cm_z += the product. `mm` overrides the tiles (CPUs, whose table row has none of
        this form)."""
        if mm is None:
            mm, _ = self.tiles(M, N, nz)
        kern = self.kernel(mm, ta, tb, False, False, bool(accum), 0, batch=1, causal=causal)
        (gx, gy), lsize = matmul_launch(mm, M, N)
        self.launcher.launch(kern, (gx, gy, nz), lsize + (1,), (i32(M), i32(N), i32(K), A, i32(lda), B, i32(ldb), Cm, i32(ldc),
                     None, None, f32(alpha), None, i32(0), i32(hb), *(i32(v) for v in (*a_off, *b_off, *c_off))))
