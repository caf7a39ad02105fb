"""The tensor-core kernel kernels/matmul_mma.cl (mma emulated, MMA_EMULATE=1): its data movement against the
portable kernel bit for bit, and its grouped forms (mixture of experts) against float64."""

from __future__ import annotations

import numpy as np
import pytest

from clgpt.models import reference as ref

from opcheck import run_op
from precisioncheck import FORMS, ROUNDED_TOL, assert_scaled, operands, run_matmul

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(4321)


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
