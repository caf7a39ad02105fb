"""Reduced-precision matmuls (clgpt/device/precision.py): operand rounding against numpy bit for bit, every form
against float64 with tolerances per precision, the tensor-core kernels' data movement (kernels/matmul_mma.cl
and the bf16 GEMM kernels/matmul_bf16.cl with cp.async, ldmatrix and mma emulated, MMA_EMULATE=1) against
the portable kernel bit for bit, which device gets which kernel, the engine with each precision, and the setting.

Tolerances, relative to |op(A)| @ |op(B)| (the scale of each output's sum):
  against float64 of the ROUNDED operands: 1e-5 for every precision (products are exact; fp32 sums)
  against float64 of the operands as given: 2^-7 for bf16 (8 significant bits: 2^-8 per operand, two per
  product), 2^-10 for tf32 (11 bits: 2^-11 per operand)
"""

from __future__ import annotations


import numpy as np
import pyopencl as cl
import pytest

from clgpt.device import sm90a
from clgpt.config import validate_config
from clgpt.device.opencl import get_device
from clgpt.errors import ClgptError
from clgpt.device.knobs import OFF, Knobs
from clgpt.model import ModelConfig, init_params
from clgpt.models import reference as ref
from clgpt.models.gpt2 import GPT2Engine
from clgpt.ops import matmul_defines, matmul_launch
from clgpt.device.precision import ROUND, matrix_path, resolve
from opcheck import bf16_pattern as _bf16_pattern, run_op, tiled_index as _tiled_index

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(4321)
ROUNDED_TOL = 1e-5
GIVEN_TOL = {"bf16": 2.0**-7, "tf32": 2.0**-10}


@pytest.fixture(scope="module")
def dev(opencl):  # the device tests/conftest.py sets for this module
    return get_device()


def to_dev(dev, a):
    return cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))


def from_dev(dev, buf, shape):
    out = np.empty(shape, f32)
    cl.enqueue_copy(dev.queue, out, buf, is_blocking=True)
    return out


def assert_scaled(got, want, scale, tol, what):
    """|got - want| <= tol * scale elementwise (scale: |op(A)| @ |op(B)|)."""
    err = np.abs(np.asarray(got, np.float64) - want) / np.maximum(scale, 1e-30)
    assert err.max() <= tol, f"{what}: max error {err.max():.3e} x |A||B| (tolerance {tol:.1e})"
    return err.max()


# Each portable form the tuning table can pick, and the tensor-core kernel with its mma emulated (small tiles
# to keep PoCL's compile short; the 8-warp 128x128 tiles the H200 runs are checked on the GPU, bench/gpu_tc.py).
FORMS = {
    "tiled": dict(kernel="matmul", TSM=32, TSN=32, TSK=8, WPTM=4, WPTN=4, LDSV=1, PREF=1),
    "rb": dict(kernel="matmul_rb", RM=6, NV=2, lsize=(1, 4)),
    "mma": dict(kernel="matmul_mma", BM=32, BN=16, WM=1, WN=1),
    "mma_4warps": dict(kernel="matmul_mma", BM=32, BN=32, WM=2, WN=2),
}


def run_matmul(dev, form, precision, A, B, ta, tb, M, N, K, bias=None, R=None, C0=None, epi=0, E0=None, alpha=1.0):
    """C = epi(alpha op(A) op(B) [+ bias] [+ R] [+ C0]) through one kernel form -> (C, E)."""
    mm = FORMS[form]
    Bd, tbk = B, tb
    if mm["kernel"] == "matmul_rb" and tb:  # its op(B) rows must be contiguous (the engine transposes)
        Bd, tbk = np.ascontiguousarray(B.T), 0
    opts = dict(TA=ta, TB=tbk, BIAS=int(bias is not None), RESID=int(R is not None), ACCUM=int(C0 is not None),
                EPI=epi, ROUND=ROUND[precision])
    if mm["kernel"] == "matmul_mma":
        opts.update(BM=mm["BM"], BN=mm["BN"], WM=mm["WM"], WN=mm["WN"], MMA_EMULATE=1, ALIGN4=int(K % 4 == 0 and M % 4 == 0 and N % 4 == 0))
        nth = 32 * mm["WM"] * mm["WN"]
        gsize, lsize = (-(-N // mm["BN"]) * nth, -(-M // mm["BM"])), (nth, 1)
        k = dev.kernel("matmul_mma", "matmul_mma", **opts)
    else:
        gsize, lsize = matmul_launch(mm, M, N)
        k = dev.kernel("matmul", mm["kernel"], **opts, **matmul_defines(mm))
    cbuf = to_dev(dev, C0 if C0 is not None else np.zeros((M, N), f32))
    ebuf = to_dev(dev, E0 if E0 is not None else np.zeros((M, N), f32))
    k(dev.queue, gsize, lsize, i32(M), i32(N), i32(K), to_dev(dev, A), i32(M if ta else K), to_dev(dev, Bd),
      i32(K if tbk else N), cbuf, i32(N), None if bias is None else to_dev(dev, bias),
      None if R is None else to_dev(dev, R), f32(alpha), ebuf)
    return from_dev(dev, cbuf, (M, N)), from_dev(dev, ebuf, (M, N))


def operands(ta, tb, M, N, K):
    A = rng.normal(size=(K, M) if ta else (M, K)).astype(f32)
    B = rng.normal(size=(N, K) if tb else (K, N)).astype(f32)
    return A, B


def test_round_reference_ties_and_specials():
    """The numpy rounding the tests trust: nearest-even (bf16) and nearest-away (tf32) on exact ties."""
    bits = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F808001, 0x3F801000, 0x3F803000, 0xBF801000,
                     0x7F800000, 0x7FC00000, 0x00000001], np.uint32)
    x = bits.view(f32)
    assert ref.round_bf16(x).view(np.uint32)[:4].tolist() == [0x3F800000, 0x3F820000, 0xBF800000, 0x3F810000]
    assert ref.round_tf32(x).view(np.uint32)[4:7].tolist() == [0x3F802000, 0x3F804000, 0xBF802000]
    for rnd in (ref.round_bf16, ref.round_tf32):
        out = rnd(x)
        assert out[7] == np.inf and np.isnan(out[8])
    assert ref.round_bf16(x)[9] == 0.0  # the smallest subnormal rounds to zero in bf16's 16 bits


@pytest.mark.parametrize("form", ["tiled", "rb", "mma"])
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_matmul_with_identity_rounds_operands_like_numpy(dev, form, precision):
    """round(A) @ I: one exact product per output, so C must equal numpy's rounding of A bit for bit
    (ties and both signs included)."""
    M, K = 40, 24
    A = rng.normal(size=(M, K)).astype(f32)
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F801000, 0xBF803000, 0x40001000], np.uint32).view(f32)
    A.reshape(-1)[: ties.size] = ties
    C, _ = run_matmul(dev, form, precision, A, np.eye(K, dtype=f32), 0, 0, M, K, K)
    want = ref.ROUNDERS[precision](A)
    assert np.array_equal(C.view(np.uint32), want.view(np.uint32)), f"{form} {precision}: rounding differs"


# The portable forms; the mma kernel equals the tiled one bit for bit (next test), so it is covered too.
@pytest.mark.parametrize("form", ["tiled", "rb"])
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
@pytest.mark.parametrize("ta,tb", [(0, 1), (0, 0), (1, 0)])
@pytest.mark.parametrize("M,N,K", [(37, 53, 70), (3, 9, 5)])
def test_matmul_precision_against_float64(dev, form, precision, ta, tb, M, N, K):
    A, B = operands(ta, tb, M, N, K)
    opA, opB = (A.T if ta else A).astype(np.float64), (B.T if tb else B).astype(np.float64)
    scale = np.abs(opA) @ np.abs(opB)
    C, _ = run_matmul(dev, form, precision, A, B, ta, tb, M, N, K)
    rnd = ref.ROUNDERS[precision]
    what = f"{form} {precision} ta={ta} tb={tb} {M}x{N}x{K}"
    rA, rB = rnd(A.T if ta else A).astype(np.float64), rnd(B.T if tb else B).astype(np.float64)
    assert_scaled(C, rA @ rB, scale, ROUNDED_TOL, what + " vs rounded operands")
    err = assert_scaled(C, opA @ opB, scale, GIVEN_TOL[precision], what + " vs given operands")
    if K >= 48:  # the rounding really happened: fp32 operands would be within 1e-6
        assert err > 1e-5, f"{what}: error {err:.1e} is fp32's; operands were not rounded"


# every layout in both precisions; the epilogues (the same code whatever the layout) once
MMA_CASES = ([("mma", "bf16", 0, 1, True)] + [("mma", "bf16", ta, tb, False) for ta, tb in [(0, 0), (1, 0), (1, 1)]]
             + [("mma", "tf32", ta, tb, False) for ta, tb in [(0, 1), (0, 0), (1, 0), (1, 1)]]
             + [("mma_4warps", p, ta, 0, False) for p, ta in (("bf16", 0), ("tf32", 1))])


@pytest.mark.parametrize("form,precision,ta,tb,epilogues", MMA_CASES)
def test_mma_kernel_moves_data_like_the_portable_kernel(dev, form, precision, ta, tb, epilogues):
    """matmul_mma with its mma emulated (products summed in k order) equals the portable tiled kernel bit for
    bit, epilogues included: staging, rounding, swizzle, fragment and output mapping all check out."""
    M, N, K = 45, 38, 67
    A, B = operands(ta, tb, M, N, K)
    bias = rng.normal(size=N).astype(f32)
    R = rng.normal(size=(M, N)).astype(f32)
    C0 = rng.normal(size=(M, N)).astype(f32)
    E0 = rng.normal(size=(M, N)).astype(f32)
    for kw in (dict(), dict(bias=bias, R=R, epi=1), dict(C0=C0, epi=2, E0=E0))[: 3 if epilogues else 1]:
        got = run_matmul(dev, form, precision, A, B, ta, tb, M, N, K, alpha=0.5, **kw)
        want = run_matmul(dev, "tiled", precision, A, B, ta, tb, M, N, K, alpha=0.5, **kw)
        assert np.array_equal(got[0], want[0]), f"{form} {precision} ta={ta} tb={tb} {sorted(kw)}: C differs"
        assert np.array_equal(got[1], want[1]), f"{form} {precision} ta={ta} tb={tb} {sorted(kw)}: E differs"


GROUPED_MMA_COUNTS = np.array([7, 0, 70, 1], np.int32)  # ragged, an empty group, one over two row tiles


def _grouped_mma(dev, group, ta, tb, M, N, K, args, kc=0, GS=1):
    """One launch of matmul_mma with GROUP (the 4-warp tiles, bf16, mma emulated) -> its output C."""
    mm = FORMS["mma_4warps"]
    nth = 32 * mm["WM"] * mm["WN"]
    gsize, lsize = (-(-N // mm["BN"]) * nth, -(-M // mm["BM"])), (nth, 1)
    if group == 2:
        gsize, lsize = gsize + (4 * GS,), lsize + (1,)
    align4 = all(int(v) % 4 == 0 for k, v in args if k in ("lda", "ldb", "bstride"))
    d = dict(GROUP=group, NGROUPS=4, TA=ta, TB=tb, ACCUM=int(not kc), SPLITK=int(bool(kc)), ROUND=1,
             MMA_EMULATE=1, ALIGN4=int(align4), BM=mm["BM"], BN=mm["BN"], WM=mm["WM"], WN=mm["WN"])
    return run_op(dev, "matmul_mma", "matmul_mma", gsize, args, d, lsize)["C"]


@pytest.mark.parametrize("tb,N,K", [(1, 20, 40), (0, 19, 37)], ids=["tb_align4", "nn_ragged"])
def test_mma_grouped_rows_against_float64(dev, tb, N, K):
    """matmul_mma GROUP 1 (bf16, mma emulated): each group's packed rows (offsets multiples of BM = 32) times
    op(B_e), B_e = B + e*bstride, against float64 products of the bf16-rounded operands; the rows between and
    after the groups keep C."""
    counts = GROUPED_MMA_COUNTS
    offs = np.concatenate([[0], np.cumsum(-(-counts // 32) * 32)]).astype(np.int32)
    R, offs = int(offs[-1]), offs[:-1].copy()
    x, W = rng.normal(size=(R, K)).astype(f32), rng.normal(size=(4, N, K) if tb else (4, K, N)).astype(f32)
    c0 = rng.normal(size=(R, N)).astype(f32)
    got = _grouped_mma(dev, 1, 0, tb, R, N, K, [
        ("M", i32(R)), ("N", i32(N)), ("K", i32(K)), ("A", x), ("lda", i32(K)), ("B", W), ("ldb", i32(K if tb else N)),
        ("C", c0), ("ldc", i32(N)), ("bias", None), ("R", None), ("alpha", f32(0.5)), ("E", None), ("kc", i32(0)),
        ("GS", i32(1)), ("bstride", i32(N * K)), ("cstride", i32(0)), ("counts", counts), ("offs", offs)])
    live = np.zeros(R, bool)
    for e in np.nonzero(counts)[0]:
        rows = slice(offs[e], offs[e] + counts[e])
        live[rows] = True
        opA, opB = ref.round_bf16(x[rows]).astype(np.float64), ref.round_bf16(W[e].T if tb else W[e]).astype(np.float64)
        assert_scaled(got[rows], c0[rows] + 0.5 * opA @ opB, 0.5 * np.abs(opA) @ np.abs(opB) + np.abs(c0[rows]),
                      ROUNDED_TOL, f"GROUP 1 tb={tb} group {e}")
    assert np.array_equal(got[~live], c0[~live]), "rows outside the groups were written"


@pytest.mark.parametrize("ta", [0, 1])
@pytest.mark.parametrize("kc", [0, 32], ids=["whole", "split"])
def test_mma_grouped_k_against_float64(dev, ta, kc):
    """matmul_mma GROUP 2 (bf16, mma emulated): each group's weight gradient dY_e.T @ X_e over its K = counts[e]
    rows (the empty group's: C kept, or nothing written when split), whole or in chunks of kc rows (raw sums, empty
    chunks unwritten) that splitk_reduce_grouped adds; against float64 of the bf16-rounded operands."""
    M, N = 19, 13
    counts = GROUPED_MMA_COUNTS
    offs = np.concatenate([[0], np.cumsum(-(-counts // 32) * 32)]).astype(np.int32)
    R, offs = int(offs[-1]), offs[:-1].copy()
    dy, x, g0 = (rng.normal(size=shape).astype(f32) for shape in ((R, M), (R, N), (4, M, N)))
    A = dy if ta else np.ascontiguousarray(dy.T)  # TA=1 reads dy (R,M) in place; TA=0 an (M,R) copy
    GS = -(-int(counts.max()) // kc) if kc else 1
    out = np.full((GS, 4, M, N), np.nan, f32) if kc else g0
    got = _grouped_mma(dev, 2, ta, 0, M, N, 0, [
        ("M", i32(M)), ("N", i32(N)), ("K", i32(0)), ("A", A), ("lda", i32(M if ta else R)), ("B", x), ("ldb", i32(N)),
        ("C", out), ("ldc", i32(N)), ("bias", None), ("R", None), ("alpha", f32(1.0 if kc else 2.0)), ("E", None),
        ("kc", i32(kc or 1 << 30)), ("GS", i32(GS)), ("bstride", i32(0)), ("cstride", i32(M * N)),
        ("counts", counts), ("offs", offs)], kc, GS)
    if kc:
        for e in range(4):
            assert np.isnan(got[-(-counts[e] // kc):, e]).all(), f"group {e}: an empty chunk was written"
        got = run_op(dev, "matmul", "splitk_reduce_grouped", (M * N, 4), [
            ("MN", i32(M * N)), ("kc", i32(kc)), ("accum", i32(1)), ("alpha", f32(2.0)), ("counts", counts),
            ("P", got), ("C", g0)], dict(GROUP=2, NGROUPS=4))["C"]
    for e in range(4):
        rows = slice(offs[e], offs[e] + counts[e])
        opA, opB = ref.round_bf16(dy[rows].T).astype(np.float64), ref.round_bf16(x[rows]).astype(np.float64)
        assert_scaled(got[e], g0[e] + 2.0 * opA @ opB, 2.0 * np.abs(opA) @ np.abs(opB) + np.abs(g0[e]),
                      ROUNDED_TOL, f"GROUP 2 ta={ta} kc={kc} group {e}")


BF16_TILES = {  # small tiles of kernels/matmul_bf16.cl (PoCL emulates them slowly): 4 warps / 1 warp / 8-row masks
    "4warps": dict(BM=32, BN=32, WM=2, WN=2, STAGES=3),
    "1warp": dict(BM=32, BN=32, WM=1, WN=1, STAGES=2),
    "64": dict(BM=64, BN=64, WM=2, WN=2, STAGES=2),
}


def emulated_knobs(launch="nvidia", **over) -> Knobs:
    """Knobs for the tensor-core path emulated on any device, on the launch row `launch`, with small tiles (PoCL
    compiles them quickly); `over` replaces any field."""
    return Knobs(**{**dict(launch=launch, mma_emulate=True, mma=dict(BM=32, BN=32, WM=2, WN=2),
                           mma_small=dict(BM=32, BN=16, WM=1, WN=1), bf16=BF16_TILES["4warps"],
                           bf16_small=BF16_TILES["1warp"]), **over})


def _bf16_ops(tiles="4warps", **over):
    """The Ops of a bf16 engine whose tensor-core path is emulated (launch row nvidia), bf16 GEMM tiles `tiles`."""
    kn = emulated_knobs(bf16=BF16_TILES[tiles], bf16_small=BF16_TILES[tiles], **over)
    ops = _engine("bf16", knobs=kn).ops
    assert ops.bf16 is not None
    return ops


@pytest.mark.parametrize("tiles,ta,tb,epilogues,N", [("4warps", 0, 1, True, 70), ("4warps", 0, 1, True, 37),
                                                      ("4warps", 0, 0, False, 70), ("4warps", 1, 0, False, 70),
                                                      ("1warp", 1, 1, False, 37), ("64", 1, 0, False, 70)])
def test_bf16_gemm_moves_data_like_the_portable_kernel(dev, tiles, ta, tb, epilogues, N):
    """matmul_bf16 (cp.async stages, swizzled local rows, ldmatrix with and without .trans, mma.m16n8k16 fragments,
    all emulated; products summed in k order) on the bf16 copies equals the portable bf16 kernel bit for bit,
    epilogues included (N even: float2 outputs; odd: single floats), in every operand layout (ta, tb: each copy
    k-contiguous or m/n-contiguous as its fp32 buffer lies)."""
    ops = _bf16_ops(tiles)
    M, K = 45, 67
    A, B = operands(ta, tb, M, N, K)
    bias = rng.normal(size=N).astype(f32)
    R = rng.normal(size=(M, N)).astype(f32)
    C0 = rng.normal(size=(M, N)).astype(f32)
    E0 = rng.normal(size=(M, N)).astype(f32)
    mm = ops.bf16[0]
    for kw in (dict(), dict(bias=bias, R=R, epi=1), dict(C0=C0, epi=2, E0=E0))[: 3 if epilogues is True else 1]:
        cbuf = to_dev(dev, kw["C0"] if "C0" in kw else np.zeros((M, N), f32))
        ebuf = to_dev(dev, kw["E0"] if "E0" in kw else np.zeros((M, N), f32))
        args = ops.bf16_operands(mm, M, N, K, to_dev(dev, A), to_dev(dev, B), ta, tb)
        assert (args[1], args[4]) == ((True, True) if epilogues == "k-major" else (not ta, bool(tb)))
        ops.matmul_bf16(mm, M, N, *args, cbuf, bias=to_dev(dev, bias) if "bias" in kw else None,
                        resid=to_dev(dev, R) if "R" in kw else None, accum="C0" in kw, alpha=0.5,
                        epi=kw.get("epi", 0), E=ebuf, split_k=False)
        want = run_matmul(dev, "tiled", "bf16", A, B, ta, tb, M, N, K, alpha=0.5, **kw)
        assert np.array_equal(from_dev(dev, cbuf, (M, N)), want[0]), f"bf16 {tiles} ta={ta} tb={tb} {sorted(kw)}: C"
        assert np.array_equal(from_dev(dev, ebuf, (M, N)), want[1]), f"bf16 {tiles} ta={ta} tb={tb} {sorted(kw)}: E"


def test_bf16_copies_round_like_numpy_and_pad_with_zeros(dev):
    """to_bf16: X rounded to bf16 as numpy rounds it (ties, signs, inf, NaN), zeros in the
    padding rows and columns."""
    ops = _bf16_ops()
    rows, cols, Rp, Cp = 37, 45, 64, 64
    X = rng.normal(size=(rows, cols)).astype(f32)
    special = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F800000, 0x7FC00000, 0xFF800000], np.uint32)
    X.reshape(-1)[: special.size] = special.view(f32)
    out = np.empty((Rp, Cp), np.uint16)
    cl.enqueue_copy(dev.queue, out, ops.to_bf16(0, to_dev(dev, X), rows, cols, Rp, Cp), is_blocking=True)
    want = np.zeros((Rp, Cp), np.uint16)
    want[:rows, :cols] = (ref.round_bf16(X).view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal(out, want)


def test_bf16_tiled_copies_are_the_wgmma_layout(dev):
    """to_bf16 with TILED 1 (what kernels/matmul_wgmma.cl reads): the same rounded, zero-padded
    values, in Kp/64 x Rp/8 atoms of 8 rows x 64 k, row r's 16-byte chunk c stored at c ^ r."""
    ops = _bf16_ops()
    ops.k["to_bf16_tiled"] = dev.kernel("matmul_bf16", "to_bf16", TILED=1, **ops._bf16_opts)
    rows, cols, Rp, Cp = 37, 100, 128, 128
    X = rng.normal(size=(rows, cols)).astype(f32)
    out = np.empty(Rp * Cp, np.uint16)
    cl.enqueue_copy(dev.queue, out, ops.to_bf16(0, to_dev(dev, X), rows, cols, Rp, Cp, tiled=True),
                    is_blocking=True)
    flat = np.zeros((Rp, Cp), np.uint16)
    flat[:rows, :cols] = (ref.round_bf16(X).view(np.uint32) >> 16).astype(np.uint16)
    r, c, e = np.arange(Rp)[:, None], np.arange(Cp)[None, :] // 8, np.arange(Cp)[None, :] % 8
    index = ((((c // 8) * (Rp // 8) + r // 8) * 8 + r % 8) * 8 + ((c % 8) ^ (r % 8))) * 8 + e
    assert np.array_equal(out[index], flat)


def test_sm90a_ptx_patch():
    """clgpt/device/sm90a.py's rewrite: the target, the marked comments (registers filled in by the compiler) and the
    local array's size and alignment; PTX for another target is refused."""
    ptx = (".version 9.0\n.target sm_90, texmode_independent\n.address_size 64\n"
           ".shared .align 16 .b8 matmul_wgmma_$_smem[49152];\n"
           "\t// begin inline asm\n\t// @sm90a@ wgmma.fence.sync.aligned;\n\t// end inline asm\n")
    out = sm90a.patch_ptx(ptx, 196672)
    assert ".target sm_90a, texmode_independent" in out
    assert "\twgmma.fence.sync.aligned;" in out and "@sm90a@" not in out
    assert ".shared .align 1024 .b8 matmul_wgmma_$_smem[196672];" in out
    assert sm90a.patch_ptx(ptx) == out.replace("align 1024 .b8 matmul_wgmma_$_smem[196672]",
                                               "align 16 .b8 matmul_wgmma_$_smem[49152]")
    with pytest.raises(ClgptError, match="no .target sm_90"):
        sm90a.patch_ptx(ptx.replace("sm_90,", "sm_80,"))


def test_register_cap_goes_on_every_kernel_entry():
    """clgpt/device/sm90a.py cap_ptx: `.maxnreg` after each .entry's parameter list (before its other directives and
    body); PTX without an entry is refused."""
    ptx = (".target sm_90\n.entry flash_forward(\n\t.param .u32 flash_forward_param_0,\n\t.param .u64 .ptr "
           ".global .align 4 flash_forward_param_1\n)\n.reqntid 256, 1, 1\n{\n\tret;\n}\n"
           ".entry flash_bf16(\n\t.param .u32 flash_bf16_param_0\n)\n{\n\tret;\n}\n")
    out = sm90a.cap_ptx(ptx, 128)
    assert out.count(".maxnreg 128") == 2
    assert "flash_forward_param_1\n)\n.maxnreg 128\n.reqntid 256, 1, 1\n{" in out
    assert "flash_bf16_param_0\n)\n.maxnreg 128\n{" in out
    with pytest.raises(ClgptError, match="no PTX .entry"):
        sm90a.cap_ptx(".target sm_90\n", 128)


@pytest.mark.parametrize("defines", [dict(BN=128, BIAS=1, RESID=1, ACCUM=1, EPI=1), dict(BN=256, SPLITK=1),
                                     dict(BN=256, EPI=2, PIPE=0), dict(BN=128, TA=1, TB=1, SPLITK=1),
                                     dict(BN=256, TB=1, BIAS=1), dict(BN=128, BIAS=1, RESID=1, STAGE_OUT=0),
                                     dict(BN=128, EPI=3), dict(BN=256, BIAS=1, EPI=1, TILED_OUT=1),
                                     dict(BN=128, EPI=2, TILED_OUT=2)])
def test_wgmma_kernel_compiles_apart_from_its_ptx(dev, defines):
    """kernels/matmul_wgmma.cl runs only on sm_90 GPUs; here its OpenCL C (descriptors, bulk-copy addresses,
    epilogue.cl's store_pair) builds on this device with the inline PTX stubbed out, so a C-level slip shows in CI."""
    from clgpt.device.opencl import KERNEL_DIR, kernel_source

    src = kernel_source(KERNEL_DIR / "matmul_wgmma.cl")
    assert sm90a.MARK in src and "asm volatile(" in src
    src = "#define STUB_ASM(...) ((void)0)\n" + src.replace("asm volatile(", "STUB_ASM(")
    smem = 4 * (128 + defines["BN"]) * 128 + 64
    options = [f"-D{k}={v}" for k, v in {**defines, "SMEM_BYTES": smem}.items()]
    cl.Kernel(cl.Program(dev.ctx, src).build(options=options), "matmul_wgmma")


@pytest.mark.parametrize("vendor,cc,want", [("NVIDIA Corporation", (9, 0), True), ("NVIDIA Corporation", (8, 0), False),
                                            ("NVIDIA Corporation", (10, 0), False), ("The pocl project", None, False)])
def test_wgmma_only_on_sm90(vendor, cc, want):
    """wgmma (sm_90a) exists on compute capability 9.0 only: not on Ampere, not on Blackwell's sm_100."""
    assert sm90a.supported(FakeDevice(vendor, cc)) is want


class FakeDevice:
    """Enough of a pyopencl Device for clgpt.device.precision's checks (vendor, platform, extensions, NV attributes)."""

    def __init__(self, vendor, cc=None, gpu=True):
        self.vendor = vendor
        self.platform = type("P", (), {"name": "NVIDIA CUDA" if "NVIDIA" in vendor else "Other"})()
        self.extensions = "cl_khr_fp64" + (" cl_nv_device_attribute_query" if cc else "")
        self.type = cl.device_type.GPU if gpu else cl.device_type.CPU
        self._cc = cc

    def get_info(self, what):
        if what == cl.device_info.COMPUTE_CAPABILITY_MAJOR_NV:
            return self._cc[0]
        if what == cl.device_info.COMPUTE_CAPABILITY_MINOR_NV:
            return self._cc[1]
        raise cl.Error("not this attribute")


@pytest.mark.parametrize("vendor,cc,gpu,path", [
    ("NVIDIA Corporation", (9, 0), True, "nv_mma"), ("NVIDIA Corporation", (8, 0), True, "nv_mma"),
    ("NVIDIA Corporation", (7, 5), True, None),  # Turing: no bf16 mma.sync
    ("NVIDIA Corporation", None, True, None),  # no cl_nv_device_attribute_query: capability unknown
    ("NVIDIA Corporation", (9, 0), False, None),
    ("Intel(R) Corporation", None, True, None), ("The pocl project", None, False, None)])
def test_matrix_path_guard_on_vendor_and_compute_capability( vendor, cc, gpu, path):
    """Tensor cores only on NVIDIA GPUs of compute capability 8.0 or more; auto is bf16 there, fp32 elsewhere."""
    d = FakeDevice(vendor, cc, gpu)
    assert matrix_path(d, Knobs()) == path
    assert resolve("auto", d, Knobs()) == ("bf16" if path else "fp32")
    assert resolve("tf32", d, Knobs()) == "tf32" and resolve("fp32", d, Knobs()) == "fp32"


def test_kernel_selection_per_precision(dev):
    """Which kernel each precision runs: PoCL (no matrix path) -> the portable kernels, auto -> fp32; a matrix
    path (emulated) -> bf16 on kernels/matmul_bf16.cl (CLGPT_BF16=off: matmul_mma.cl), tf32 on matmul_mma.cl."""
    for precision in ("bf16", "tf32", "auto"):
        ops = _engine(precision, launch="nvidia").ops
        assert ops.mma is None and ops.bf16 is None and ops.precision == ("fp32" if precision == "auto" else precision)
    ops = _engine("bf16", launch="nvidia", emulate=True).ops
    assert ops.mma is not None and ops.bf16 is not None and ops._bf16_opts == {"MMA_EMULATE": 1}
    assert _engine("auto", launch="nvidia", emulate=True).ops.bf16 is not None
    ops = _engine("tf32", launch="nvidia", emulate=True).ops
    assert ops.mma is not None and ops.bf16 is None
    ops = _engine("bf16", knobs=emulated_knobs(bf16=OFF)).ops
    assert ops.mma is not None and ops.bf16 is None


def _engine(precision, launch="cpu", emulate=False, knobs=None, **shape):
    """A GPT-2 engine of `shape` on the launch row `launch`, the tensor-core path emulated with `emulate`; or
    under `knobs` as given."""
    if knobs is None:
        knobs = emulated_knobs(launch) if emulate else Knobs(launch=launch)
    cfg = ModelConfig(vocab_size=shape.get("V", 16), n_ctx=shape.get("T", 8), n_embd=shape.get("C", 16),
                      n_head=shape.get("H", 2), n_layer=shape.get("L", 1), n_ff=shape.get("F", 32))
    return GPT2Engine(cfg, init_params(cfg, 0), batch_size=shape.get("B", 1), seq_len=shape.get("T", 8),
                  precision=precision, knobs=knobs)


@pytest.mark.parametrize("precision,ta,tb,M,N,K", [("bf16", 1, 0, 40, 37, 1100), ("bf16", 0, 0, 130, 70, 40),
                                                   ("tf32", 1, 0, 40, 37, 1100)])
def test_engine_tensor_core_path(dev, precision, ta, tb, M, N, K):
    """Engine.matmul through the mma kernel (emulated): split-K for the deep product, tiles otherwise."""
    eng = _engine(precision, launch="nvidia", emulate=True)
    assert eng.mma is not None
    A, B = operands(ta, tb, M, N, K)
    C0 = rng.normal(size=(M, N)).astype(f32)
    rnd = ref.ROUNDERS[precision]
    opA, opB = rnd(A.T if ta else A).astype(np.float64), rnd(B.T if tb else B).astype(np.float64)
    cbuf = to_dev(dev, C0)
    eng.matmul(M, N, K, to_dev(dev, A), to_dev(dev, B), cbuf, ta=ta, tb=tb, accum=True, alpha=0.5)
    scale = 0.5 * np.abs(opA) @ np.abs(opB) + np.abs(C0)
    assert_scaled(from_dev(dev, cbuf, (M, N)), 0.5 * opA @ opB + C0, scale, ROUNDED_TOL, f"engine mma {precision}")


def test_engine_tensor_core_attention(dev):
    """GPU attention (batched causal products) on the mma kernel (emulated) with bf16 operands."""
    B, T, C, H = 2, 40, 16, 2
    eng = _engine("bf16", launch="nvidia", emulate=True, B=B, T=T, C=C, H=H)
    eng.ops.attn_gemm = True
    qkv = rng.normal(size=(B, T, 3 * C)).astype(f32)
    want, _ = ref.attention_forward(qkv, H)
    ob, ab = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, B * T * C * 4), cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, B * H * T * T * 4)
    eng.ops.attention_forward(B, T, to_dev(dev, qkv), ob, ab)
    got = from_dev(dev, ob, (B, T, C))
    err = np.abs(got - want).max()
    assert 1e-5 < err < 3e-2, f"bf16 attention: max error {err:.2e} (expected bf16's, not fp32's or worse)"


def _losses_and_grads(precision, steps=0, **kw):
    eng = _engine(precision, V=32, T=16, C=32, H=2, F=64, B=2, L=2, **kw)
    r = np.random.default_rng(7)
    tok = r.integers(0, 32, size=(2, 16)).astype(np.int32)
    tgt = r.integers(0, 32, size=(2, 16)).astype(np.int32)
    loss = eng.forward(tok, tgt)
    eng.zero_grad()
    eng.backward()
    grads = eng.get_grads()
    return eng, loss, grads, tok, tgt


@pytest.mark.parametrize("launch,precision", [("cpu", "bf16"), ("cpu", "tf32"), ("nvidia", "bf16")])
def test_engine_precision_loss_grads_and_determinism(dev, launch, precision):
    """Loss and grads of a reduced-precision engine (portable kernels) against the float64 reference, within a
    band that fp32 meets 100x tighter; and the same bytes run to run."""
    eng, loss, grads, tok, tgt = _losses_and_grads(precision, launch=launch)
    want_loss, cache = ref.gpt_forward(init_params(eng.cfg, 0), eng.cfg, tok, tgt)
    want_grads = ref.gpt_backward(cache)
    band = 2e-2 if precision == "bf16" else 5e-3
    assert abs(loss - want_loss) < band * abs(want_loss), f"{precision} loss {loss} vs {want_loss}"
    for name, g in want_grads.items():
        err = np.abs(grads[name] - g).max() / max(np.abs(g).max(), 1e-12)
        assert err < 10 * band, f"{precision} grad {name}: relative error {err:.2e}"
    _, loss2, grads2, _, _ = _losses_and_grads(precision, launch=launch)
    assert loss2 == loss and all(np.array_equal(grads[n], grads2[n]) for n in grads)


def test_engine_fp32_is_unchanged(dev):
    """precision fp32 is the engine as it was: same loss and gradient bytes as the default."""
    cfg = ModelConfig(vocab_size=32, n_ctx=16, n_embd=32, n_head=2, n_layer=1, n_ff=64)
    r = np.random.default_rng(3)
    tok, tgt = (r.integers(0, 32, size=(2, 16)).astype(np.int32) for _ in range(2))
    out = []
    for kw in (dict(), dict(precision="fp32"), dict(precision="auto")):  # auto: PoCL has no matrix path
        eng = GPT2Engine(cfg, init_params(cfg, 0), batch_size=2, seq_len=16, knobs=Knobs(launch="cpu"), **kw)
        assert eng.round == 0 and eng.mma is None
        loss = eng.forward(tok, tgt)
        eng.zero_grad()
        eng.backward()
        out.append((loss, eng.get_grads()))
    for loss, g in out[1:]:
        assert loss == out[0][0] and all(np.array_equal(g[n], out[0][1][n]) for n in g)


def test_training_curve_reduced_precision_tracks_fp32(dev):
    """60 AdamW steps on a fixed small set: bf16 and tf32 losses stay within 0.05 nats of fp32's at every
    step past the first 10, and all three learn (the loss falls by over 1 nat)."""
    cfg = ModelConfig(vocab_size=32, n_ctx=16, n_embd=32, n_head=2, n_layer=1, n_ff=64)
    r = np.random.default_rng(11)
    data = [(r.integers(0, 8, size=(4, 16)).astype(np.int32),) for _ in range(2)]
    data = [(t, np.roll(t, -1, axis=1)) for (t,) in data]  # learnable: the next token of a short cycle
    curves = {}
    for precision in ("fp32", "bf16", "tf32"):
        eng = GPT2Engine(cfg, init_params(cfg, 0), batch_size=4, seq_len=16, precision=precision, knobs=Knobs(launch="cpu"))
        losses = []
        for step in range(60):
            tok, tgt = data[step % 2]
            losses.append(eng.forward(tok, tgt))
            eng.zero_grad()
            eng.backward()
            eng.step(3e-3)
        curves[precision] = np.array(losses)
    assert curves["fp32"][0] - curves["fp32"][-1] > 1.0
    for precision in ("bf16", "tf32"):
        gap = np.abs(curves[precision][10:] - curves["fp32"][10:]).max()
        assert gap < 0.05, f"{precision}: {gap:.3f} nats from fp32"
        assert curves[precision][0] - curves[precision][-1] > 1.0


def test_precision_setting(dev):
    cfg = validate_config({"pretrain": {"precision": "bf16"}})
    assert cfg["pretrain"]["precision"] == "bf16" and cfg["tune"]["precision"] == "auto"  # the default
    with pytest.raises(ClgptError, match="pretrain.precision"):
        validate_config({"pretrain": {"precision": "fp16"}})
    assert resolve("auto", dev.device) == ("bf16" if dev.device.vendor.lower().startswith("nvidia") else "fp32")
    with pytest.raises(ClgptError, match="precision 'half'"):
        resolve("half", dev.device)


@pytest.mark.parametrize("gelu", [False, True])
def test_tiled_copy_with_column_sums(dev, gelu):
    """to_bf16 with TILED and COLSUM (what a reused gradient's copy runs on GPUs): the tiled bf16 copy, and each
    64 rows' column sums added in row order, as bias_partial adds them (bit for bit), for bias_final. With
    GELU_GRAD, of X * gelu'(E) (the deferred GELU' of the backward), against float64."""
    rows, cols, Rp, Cp = 150, 70, 192, 128
    X = rng.normal(size=(rows, cols)).astype(f32)
    E = rng.normal(size=(rows, cols)).astype(f32) * 2
    k = dev.kernel("matmul_bf16", "to_bf16", TILED=1, COLSUM=1, MMA_EMULATE=1, **({"GELU_GRAD": 1} if gelu else {}))
    out, part = np.empty(Rp * Cp, np.uint16), np.empty(Rp // 64 * cols, f32)
    o_buf, p_buf = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, out.nbytes), to_dev(dev, part)
    k(dev.queue, (Cp // 8, Rp), (4, 64), np.int32(rows), np.int32(cols), to_dev(dev, X), np.int32(cols), o_buf,
      np.int32(Cp), p_buf, *((to_dev(dev, E),) if gelu else ()))
    cl.enqueue_copy(dev.queue, out, o_buf)
    cl.enqueue_copy(dev.queue, part, p_buf, is_blocking=True)
    part = part.reshape(Rp // 64, cols)
    got = (out[_tiled_index(Rp, Cp)].astype(np.uint32) << 16).view(f32)
    assert not got[rows:].any() and not got[:, cols:].any()
    if gelu:
        e = E.astype(np.float64)
        t = np.tanh(np.sqrt(2 / np.pi) * (e + 0.044715 * e**3))
        want = X * (0.5 * (1 + t) + 0.5 * e * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * e * e))
        assert np.abs(got[:rows, :cols] - want).max() <= 2.0**-8 * np.abs(want).max()
        sums = np.add.reduceat(np.vstack([want, np.zeros((Rp - rows, cols))]), np.arange(0, Rp, 64), axis=0)
        assert np.abs(part - sums).max() <= 1e-5 * np.abs(want).max() * 64
        return
    flat = np.zeros((Rp, Cp), np.uint16)
    flat[:rows, :cols] = _bf16_pattern(X)
    assert np.array_equal(out[_tiled_index(Rp, Cp)], flat)
    padded = np.zeros((Rp, cols), f32)
    padded[:rows] = X
    want = np.stack([np.cumsum(padded[64 * i:64 * i + 64], axis=0, dtype=f32)[-1] for i in range(Rp // 64)])
    assert np.array_equal(part, want)


def test_xent_backward_tiled_against_float64(dev):
    """xent_backward_tiled: s * mask * (softmax - onehot) from the forward's lse, straight into the tiled bf16
    copy the head's wgmma products read, zeros outside N x V; against float64, to bf16's rounding."""
    N, V, s = 37, 70, 0.37
    logits = rng.normal(size=(N, V)).astype(f32) * 3
    targets = rng.integers(0, V, N).astype(np.int32)
    mask = (rng.random(N) > 0.3).astype(f32)
    l64 = logits.astype(np.float64)
    lse = np.log(np.exp(l64).sum(1))
    want = s * mask[:, None] * (np.exp(l64 - lse[:, None]) - (np.arange(V)[None, :] == targets[:, None]))
    Rp, Cp = 64, 128
    k = dev.kernel("xent", "xent_backward_tiled", V=V)
    out = np.empty(Rp * Cp, np.uint16)
    o_buf = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, out.nbytes)
    k(dev.queue, (Cp // 8, Rp), (4, 32), np.int32(N), np.float32(s), to_dev(dev, logits), to_dev(dev, targets),
      to_dev(dev, mask), to_dev(dev, lse.astype(f32)), o_buf)
    cl.enqueue_copy(dev.queue, out, o_buf, is_blocking=True)
    got = (out[_tiled_index(Rp, Cp)].astype(np.uint32) << 16).view(f32)
    assert not got[N:].any() and not got[:, V:].any()
    assert np.abs(got[:N, :V] - want).max() <= 2.0**-8 * np.abs(want).max()


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_grad_norm_work_groups_against_float64(dev, clip):
    """grad_norm_partial_wg / grad_norm_final_wg (GPUs): the norm and the clip factor against float64."""
    n, parts, LW = 100003, 37, 64
    g = rng.normal(size=n).astype(f32) * 0.01
    partials, out = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, parts * 4), np.empty(2, f32)
    o_buf = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, 8)
    dev.kernel("adamw", "grad_norm_partial_wg", LW=LW)(dev.queue, (parts * LW,), (LW,), np.int32(n), to_dev(dev, g),
                                                       partials)
    dev.kernel("adamw", "grad_norm_final_wg", LW=LW)(dev.queue, (LW,), (LW,), np.int32(parts), np.float32(clip),
                                                     partials, o_buf)
    cl.enqueue_copy(dev.queue, out, o_buf, is_blocking=True)
    norm = np.sqrt((g.astype(np.float64) ** 2).sum())
    assert abs(out[0] - norm) <= 1e-5 * norm
    assert out[1] == (np.float32(clip) / out[0] if 0 < clip < out[0] else 1.0)


def test_tiled_copies_kept_for_stable_and_reused_buffers(dev, monkeypatch):
    """Ops.tiled_copy: a stable buffer's copy is made once per forward (forget_copies drops it), a reuse block's
    buffer's once per block, any other buffer's at every call; the copy holds the tiled bf16 values."""
    ops = _bf16_ops()
    ops.k["to_bf16_tiled"] = dev.kernel("matmul_bf16", "to_bf16", TILED=1, **ops._bf16_opts)
    rows, cols = 100, 70
    X, Y, Z = (rng.normal(size=(rows, cols)).astype(f32) for _ in range(3))
    xb, yb, zb = to_dev(dev, X), to_dev(dev, Y), to_dev(dev, Z)
    ops.stable(xb)
    launches = []
    real = ops._launch
    monkeypatch.setattr(ops, "_launch", lambda *a: (launches.append(a[0]), real(*a)))
    first = ops.tiled_copy(0, xb, rows, cols)
    assert ops.tiled_copy(1, xb, rows, cols) is first and len(launches) == 1
    out = np.empty(first[1] * first[2], np.uint16)
    cl.enqueue_copy(dev.queue, out, first[0], is_blocking=True)
    flat = np.zeros(first[1:], np.uint16)
    flat[:rows, :cols] = _bf16_pattern(X)
    assert first[1:] == (128, 128) and np.array_equal(out[_tiled_index(*first[1:])], flat)
    ops.forget_copies()
    assert ops.tiled_copy(0, xb, rows, cols) is not first and len(launches) == 2
    with ops.reuse(yb):
        y1 = ops.tiled_copy(0, yb, rows, cols)
        assert ops.tiled_copy(1, yb, rows, cols) is y1 and len(launches) == 3
        ops.tiled_copy(0, zb, rows, cols)
        ops.tiled_copy(0, zb, rows, cols)
        assert len(launches) == 5
        with pytest.raises(ClgptError, match="do not nest"):
            with ops.reuse(zb):
                pass
    ops.tiled_copy(0, yb, rows, cols)
    assert len(launches) == 6


def test_products_that_write_only_their_tiled_copy(dev, monkeypatch):
    """On wgmma (emulated here: the launches recorded, not run), the GELU product writes g = gelu(h) only as g's
    kept tiled copy (TILED_OUT 1) and the GELU' product dh only as dh's tiled copy with its column sums (TILED_OUT
    2), which dh's reuse block then takes without a copy; reading such a dh any other way, or never, is an error;
    sizes off multiples of 64 keep the fp32 outputs."""
    ops = _bf16_ops()
    calls = []
    monkeypatch.setattr(ops, "on_wgmma", lambda M, N, K, epi=0: epi != 2)
    monkeypatch.setattr(ops, "_matmul_wgmma", lambda *a, tiled_out=None, **_: calls.append((a[12], tiled_out)))
    monkeypatch.setattr(ops, "_launch", lambda *a: calls.append(("launch", a[0])))
    ops.k["to_bf16_colsum_gelu"] = ops.k["to_bf16_colsum"] = "copy"
    monkeypatch.setattr(ops, "colsum_copies", True)
    monkeypatch.setattr(ops, "tiled_outputs", True)
    M, N, K = 128, 192, 64
    A, B, h, g, dh = (ops.buf(n) for n in (M * K, N * K, M * N, M * N, M * N))
    ops.stable(g)
    ops._matmul_bf16(M, N, K, A, B, h, 0, 1, None, None, False, 1.0, 1, g)
    assert calls[-1][0] == 1 and calls[-1][1][1] is None
    assert ops.tiled_copy(0, g, M, N) == (calls[-1][1][0], M, N) and calls[-1][0] == 1  # kept: no copy made
    ops._matmul_bf16(M, N, K, A, B, dh, 0, 0, None, None, False, 1.0, 2, h)
    copy, parts = calls[-1][1]
    assert calls[-1][0] == 2 and ops._premade[dh.int_ptr][:3] == (copy, M, N)
    with ops.reuse(dh):
        assert ops.tiled_copy(2, dh, M, N) == (copy, M, N) and ops.tiled_copy(0, dh, M, N) == (copy, M, N)
        assert ops._colsums == ((dh.int_ptr, M, N), M // 64, parts) and calls[-1][0] == 2
    ops._matmul_bf16(M, N, K, A, B, dh, 0, 0, None, None, False, 1.0, 2, h)
    with pytest.raises(ClgptError, match="read as fp32"):
        ops._settle(dh)
    with pytest.raises(ClgptError, match="never read"):
        with ops.reuse(dh):
            pass
    ops.forget_copies()
    ops._matmul_bf16(M + 8, N, K, A, B, h, 0, 1, None, None, False, 1.0, 1, g)  # M off 64: fp32 g
    assert calls[-1] == (1, None) and not ops._kept


def test_swiglu_gradient_written_only_as_its_tiled_copy(dev, monkeypatch):
    """On wgmma (emulated here: the launches recorded, not run), the SwiGLU backward's product (EPI 3, dgate | dup
    rows 2N apart) writes its output only as the (M, 2N) tiled copy (TILED_OUT 3), which its reuse block takes
    without a copy; sizes off multiples of 64 keep the fp32 output."""
    ops = _bf16_ops()
    calls = []
    monkeypatch.setattr(ops, "on_wgmma", lambda M, N, K, epi=0: epi != 2)
    monkeypatch.setattr(ops, "_matmul_wgmma", lambda *a, tiled_out=None, **_: calls.append((a[12], tiled_out)))
    monkeypatch.setattr(ops, "_launch", lambda *a: calls.append(("launch", a[0])))
    monkeypatch.setattr(ops, "tiled_outputs", True)
    M, N, K = 128, 192, 64
    A, B, hgu, dhgu = (ops.buf(n) for n in (M * K, N * K, M * 2 * N, M * 2 * N))
    ops._matmul_bf16(M, N, K, A, B, dhgu, 0, 0, None, None, False, 1.0, 3, hgu, ldc=2 * N)
    copy, part = calls[-1][1]
    assert calls[-1][0] == 3 and part is None and ops._premade[dhgu.int_ptr][:3] == (copy, M, 2 * N)
    with ops.reuse(dhgu):
        assert ops.tiled_copy(0, dhgu, M, 2 * N) == (copy, M, 2 * N) == ops.tiled_copy(1, dhgu, M, 2 * N)
    assert not any(c[0] == "launch" for c in calls)
    ops._matmul_bf16(M + 8, N, K, A, B, dhgu, 0, 0, None, None, False, 1.0, 3, hgu, ldc=2 * N)
    assert calls[-1] == (3, None) and dhgu.int_ptr not in ops._premade


@pytest.mark.parametrize("N,C", [(128, 128), (64, 384)])
def test_layernorm_writes_its_tiled_copy(dev, N, C):
    """layernorm_forward_rows with LN_TILED (GPU rows, on wgmma): out, mean, rstd as without, bit for bit, and
    out's bf16 copy in the wgmma layout (what to_bf16 TILED would make of out), for the products to read."""
    x = (rng.normal(size=(N, C)) * 2 + 0.5).astype(f32)
    w, b = rng.normal(size=C).astype(f32), rng.normal(size=C).astype(f32)
    args = [("N", i32(N)), ("x", x), ("w", w), ("b", b), ("out", np.zeros_like(x)), ("mean", np.zeros(N, f32)),
            ("rstd", np.zeros(N, f32))]
    kw = dict(C=C, EPS=1e-5, RW=4)
    plain = run_op(dev, "layernorm", "layernorm_forward_rows", (32, N), args, kw, lsize=(32, 4))
    tiled = run_op(dev, "layernorm", "layernorm_forward_rows", (32, N), args + [("out16", np.zeros(N * C, np.uint16))],
                   {**kw, "LN_TILED": 1}, lsize=(32, 4))
    assert all(np.array_equal(plain[k], tiled[k]) for k in ("out", "mean", "rstd"))
    assert np.array_equal(tiled["out16"][_tiled_index(N, C)], _bf16_pattern(plain["out"]))


@pytest.mark.parametrize("shape", [dict(), dict(n_head=4, n_head_kv=2), dict(n_expert=4, n_expert_used=2)])
def test_llama_engine_on_tensor_cores_against_float64(dev, shape):
    """llama's bf16 engine with every product on the tensor-core kernels (emulated), the SwiGLU backward's
    two-output epilogue (EPI 3, rows 2F apart) among them, dense, grouped-query and MoE: loss and every gradient
    against the float64 reference (MoE with the engine's routing: top-k may pick differently at a near tie; its
    grouped products on matmul_mma with GROUP 1 and 2, bf16 as the dense ones), and the same bytes twice."""
    from clgpt.models import reference_llama
    from clgpt.models.factory import make_engine

    cfg = ModelConfig(**{**dict(arch="llama", vocab_size=32, n_ctx=16, n_embd=32, n_head=2, n_layer=2, n_ff=64),
                         **shape})
    params = init_params(cfg, 0)
    r = np.random.default_rng(7)
    tok, tgt = (r.integers(0, 32, size=(2, 16)).astype(np.int32) for _ in range(2))
    runs = []
    for _ in range(2):
        eng = make_engine(cfg, params, batch_size=2, seq_len=16, precision="bf16", knobs=emulated_knobs())
        assert eng.ops.bf16 is not None
        eng.zero_grad()
        loss = eng.forward(tok, tgt)
        eng.backward()
        runs.append((loss, eng.get_grads()))
    if cfg.n_expert:  # _kernel_mma's keys end (group, groups); no grouped product left on kernels/matmul.cl
        assert {key[-2:] for key in eng.ops._mm if key[0] == "mma" and key[-2]} == {(1, 4), (2, 4)}
        assert not any(key[0] == "grouped" for key in eng.ops._mm)
    routing = None
    if cfg.n_expert:
        routing = [from_dev(dev, a["sel"], (tok.size, cfg.n_expert_used)).view(np.int32) for a in eng.acts]
    want_loss, _, cache = reference_llama.llama_forward(params, cfg, tok, tgt, routing=routing)
    want = reference_llama.llama_backward(cache)
    (loss, grads), (loss2, grads2) = runs
    assert abs(loss - want_loss) < 2e-2 * abs(want_loss), f"loss {loss} vs {want_loss}"
    for name, g in want.items():
        err = np.abs(grads[name] - g).max() / max(np.abs(g).max(), 1e-12)
        assert err < 0.2, f"grad {name}: relative error {err:.2e}"
    assert loss2 == loss and all(np.array_equal(grads[n], grads2[n]) for n in grads)


def test_expert_operands_written_as_tiled_copies(dev):
    """On wgmma the experts' operands go straight to their tiled bf16 copies (moe.cl MOE_TILED, swiglu.cl
    EXPERTS_TILED): each copy holds what to_bf16 TILED would make of the fp32 output of the plain kernel, at the
    rows the routing gave (uneven experts, padding rows left as they were)."""
    E, K, C, F, N, RM = 4, 2, 64, 128, 40, 32
    r = np.random.default_rng(3)
    sel = np.stack([r.permutation(E)[:K] for _ in range(N)]).astype(np.int32)
    counts = np.bincount(sel.ravel(), minlength=E)
    offs = np.concatenate([[0], np.cumsum(-(-counts // RM) * RM)[:-1]])
    pos, seen = np.empty(N * K, np.int32), np.zeros(E, int)
    for a, e in enumerate(sel.ravel()):
        pos[a], seen[e] = offs[e] + seen[e], seen[e] + 1
    R = -(-(N * K + E * (RM - 1)) // 64) * 64
    x, dout = (r.normal(size=(N, C)).astype(f32) for _ in range(2))
    w = r.random(N * K).astype(f32)
    g, u = (r.normal(size=(R, F)).astype(f32) * 3 for _ in range(2))
    moe = dict(E=E, K=K, C=C, RM=RM)

    def copy_of(fp32, cols, rows=None):  # the bf16 pattern of fp32's rows (all, or those in `rows`) in tiled order
        flat = np.zeros((R, cols), np.uint16)
        rows = np.arange(R) if rows is None else rows
        flat[rows] = _bf16_pattern(fp32[rows])
        return flat

    z16 = lambda cols: np.zeros(R * cols, np.uint16)  # noqa: E731
    plain = run_op(dev, "moe", "moe_gather_packed", (C, N * K),
                   [("N", i32(N)), ("pos", pos), ("x", x), ("xg", np.zeros((R, C), f32))], moe)
    tiled = run_op(dev, "moe", "moe_gather_packed_tiled", (C // 4, N * K),
                   [("N", i32(N)), ("Rp", i32(R)), ("pos", pos), ("x", x), ("xg16", z16(C))], {**moe, "MOE_TILED": 1})
    assert np.array_equal(tiled["xg16"][_tiled_index(R, C)], copy_of(plain["xg"], C, pos))
    plain = run_op(dev, "moe", "moe_combine_backward", (C, N * K),
                   [("N", i32(N)), ("dout", dout), ("w", w), ("pos", pos), ("dye", np.zeros((R, C), f32))], moe)
    tiled = run_op(dev, "moe", "moe_combine_backward_tiled", (C // 4, N * K),
                   [("N", i32(N)), ("Rp", i32(R)), ("dout", dout), ("w", w), ("pos", pos), ("dye16", z16(C))],
                   {**moe, "MOE_TILED": 1})
    assert np.array_equal(tiled["dye16"][_tiled_index(R, C)], copy_of(plain["dye"], C, pos))
    n = R * F
    plain = run_op(dev, "swiglu", "swiglu_forward", (n,),
                   [("n", i32(n)), ("gate", g), ("up", u), ("y", np.zeros((R, F), f32))])
    plain_y = plain["y"]
    # gate | up from one product (each row gate | up): the copy of the y the plain kernel makes of gate and up
    h = np.concatenate([g, u], axis=1)
    tiled = run_op(dev, "swiglu", "swiglu_rows_forward_tiled", (F // 4, R),
                   [("R", i32(R)), ("F", i32(F)), ("h", h), ("y16", z16(F))], {"EXPERTS_TILED": 1})
    assert np.array_equal(tiled["y16"][_tiled_index(R, F)], copy_of(plain_y, F))


def test_gate_up_pair_copy(dev):
    """to_bf16_pair: the stacked gate and up weights (E, F, C) as one tiled (E, 2F, C) copy, expert e's gate rows
    then its up rows, each value what to_bf16 TILED makes of it, zeros past C."""
    E, F, C = 3, 64, 100
    r = np.random.default_rng(4)
    gate, up = (r.normal(size=(E, F, C)).astype(f32) for _ in range(2))
    Rp, Cp = 2 * E * F, 128
    out = run_op(dev, "matmul_bf16", "to_bf16_pair", (Cp // 8, Rp),
                 [("F", i32(F)), ("K", i32(C)), ("gate", gate), ("up", up), ("O", np.zeros(Rp * Cp, np.uint16))],
                 {"TILED": 1, "MMA_EMULATE": 1}, lsize=(4, 32))
    flat = np.zeros((Rp, Cp), np.uint16)
    flat[:, :C] = _bf16_pattern(np.concatenate([gate, up], axis=1).reshape(Rp, C))
    assert np.array_equal(out["O"][_tiled_index(Rp, Cp)], flat)
