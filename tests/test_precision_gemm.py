"""Reduced-precision matmuls (clgpt/device/precision.py): operand rounding against numpy bit for bit, and
every portable form against float64 with the tolerances per precision of tests/precisioncheck.py."""

from __future__ import annotations

import numpy as np
import pytest

from clgpt.models import reference as ref

from clgpt.ops import matmul_launch

from conftest import empty, from_dev, to_dev
from precisioncheck import GIVEN_TOL, ROUNDED_TOL, assert_scaled, operands, run_matmul

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(4321)


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


def _bf16_store(x, ld):
    """numpy's bf16 copy of x (rows, cols) as rows of `ld` uint16 (the top halves of the rounded floats; zeros past
    cols): what kernels/matmul.cl reads with A16 / B16."""
    bits = (ref.round_bf16(x).view(np.uint32) >> 16).astype(np.uint16)
    out = np.zeros((x.shape[0], ld), np.uint16)
    out[:, : x.shape[1]] = bits
    return out


# bf16 storage (A16, B16): each layout, a tile wholly inside (VEC's float4 loads) and ragged edges, split-K; the
# tiled form and the warp-tiled one (kernels/matmul_warp.cl: its four-element loads wherever a tile lies inside)
@pytest.mark.parametrize("warp", [0, 1], ids=["tiled", "warp"])
@pytest.mark.parametrize("ta,tb", [(0, 1), (0, 0), (1, 0)])
@pytest.mark.parametrize("M,N,K,vec,split", [(37, 53, 70, 0, 0), (64, 64, 96, 1, 0), (67, 45, 131, 1, 0),
                                             (40, 36, 200, 0, 3)])
def test_bf16_storage_gives_round1_bits(dev, ta, tb, M, N, K, vec, split, warp):
    """A product on bf16-stored operands (numpy's copies, rows padded to 32) has the same bits as ROUND=1's on the
    fp32 operands, and is within fp32 sums of float64 of the rounded operands."""
    A, B = operands(ta, tb, M, N, K)
    tiles = dict(TSM=32, TSN=32, TSK=8, WPTM=4, WPTN=4, LDSV=1, PREF=1, **(dict(WARP=1) if warp else dict(VEC=vec)))
    (gx, gy), lsize = matmul_launch(dict(tiles, kernel="matmul"), M, N)
    S = max(split, 1)
    kc = -(-(-(-K // S)) // 8) * 8  # S chunks of whole TSK tiles (split-K's)
    extra = (i32(kc), i32(1), *(i32(0),) * 9) if split else ()

    def product(a, lda, b, ldb, **store):
        opts = dict(TA=ta, TB=tb, BIAS=0, RESID=0, ACCUM=0, EPI=0, ROUND=1, SPLITK=int(bool(split)), **tiles, **store)
        C = empty(dev, S * M * N)
        dev.kernel("matmul", "matmul", **opts)(dev.queue, (gx, gy, S), (*lsize, 1), i32(M), i32(N), i32(K),
                                               to_dev(dev, a), i32(lda), to_dev(dev, b), i32(ldb), C, i32(N), None,
                                               None, f32(1.0), None, *extra)
        return from_dev(dev, C, (S, M, N))  # split-K: the raw sums of each chunk

    want = product(A, A.shape[1], B, B.shape[1])
    lda, ldb = -(-A.shape[1] // 32) * 32, -(-B.shape[1] // 32) * 32
    got = product(_bf16_store(A, lda), lda, _bf16_store(B, ldb), ldb, A16=1, B16=1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "bf16 storage differs from ROUND=1"
    rA = ref.round_bf16(A.T if ta else A).astype(np.float64)
    rB = ref.round_bf16(B.T if tb else B).astype(np.float64)
    assert_scaled(got.sum(axis=0, dtype=np.float64), rA @ rB, np.abs(rA) @ np.abs(rB), ROUNDED_TOL, f"bf16 storage ta={ta} tb={tb} {M}x{N}x{K}")
