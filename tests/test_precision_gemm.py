"""Reduced-precision matmuls (clgpt/device/precision.py): operand rounding against numpy bit for bit, and
every portable form against float64 with the tolerances per precision of tests/precisioncheck.py."""

from __future__ import annotations

import numpy as np
import pytest

from clgpt.models import reference as ref

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

