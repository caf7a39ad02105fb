"""The layout kernels (transposes, padded copies) exactly, and the bias gradients' column sums against
float64: the plain forms and the CPU (float8) and GPU (two-stage) ones."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_close, empty, from_dev, to_dev
from opcheck import check_op

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(1234)


@pytest.mark.parametrize("K,N", [(13, 29), (64, 16), (1, 1)])
def test_transpose(dev, K, N):
    x = rng.normal(size=(K, N)).astype(f32)
    out = empty(dev, N * K)
    dev.kernel("transpose", "transpose")(dev.queue, (-(-N // 8), -(-K // 8)), None, i32(K), i32(N), to_dev(dev, x), out)
    assert np.array_equal(from_dev(dev, out, (N, K)), x.T)


def test_bias_backward(dev):
    M, N = 37, 29
    dy, db0 = rng.normal(size=(M, N)).astype(f32), rng.normal(size=N).astype(f32)
    check_op(dev, "bias", "bias_backward", (N,), [("M", i32(M)), ("N", i32(N)), ("dy", dy), ("db", db0)],
             {"db": db0 + dy.astype(np.float64).sum(0)}, scaled=False)


@pytest.mark.parametrize("R,N", [(37, 45), (3, 32), (256, 70)])
def test_bias_final(dev, R, N):
    """bias_final (GPUs): db += the sums of R rows of parts, 16 slices of rows a column then the slices in order,
    against float64; N off multiples of the 16-column work-group and R off multiples of the 16 slices."""
    part, db0 = rng.normal(size=(R, N)).astype(f32), rng.normal(size=N).astype(f32)
    check_op(dev, "bias", "bias_final", (-(-N // 16) * 16, 16), [("R", i32(R)), ("N", i32(N)), ("part", part),
             ("db", db0)], {"db": db0 + part.astype(np.float64).sum(0)}, lsize=(16, 16), scaled=False)


@pytest.mark.parametrize("M,N", [(37, 29), (640, 64), (3, 8), (50, 3)])
def test_bias_backward_v8(dev, M, N):
    dy = rng.normal(size=(M, N)).astype(f32)
    db0 = rng.normal(size=N).astype(f32)
    buf, old = to_dev(dev, db0), to_dev(dev, db0)
    dyb = to_dev(dev, dy)
    dev.kernel("bias", "bias_backward_v8")(dev.queue, (-(-N // 8),), (1,), i32(M), i32(N), dyb, buf)
    got = from_dev(dev, buf, N)
    # float32 sums of M terms in order: the error grows with M (the order itself is checked just below)
    assert_close(got, db0 + dy.astype(np.float64).sum(0), 1e-6 * M, 1e-5, "bias_backward_v8")
    dev.kernel("bias", "bias_backward")(dev.queue, (N,), None, i32(M), i32(N), dyb, old)
    assert np.array_equal(got, from_dev(dev, old, N)), "bias_backward_v8 sums in another order than bias_backward"


@pytest.mark.parametrize("K,N", [(37, 53), (16, 8), (5, 3), (130, 70), (64, 256)])
def test_transpose_v8(dev, K, N):
    """kernels/transpose.cl's register-shuffle transpose: exactly x.T, full 16x8 blocks and ragged edges alike."""
    x = rng.normal(size=(K, N)).astype(f32)
    out = empty(dev, K * N)
    dev.kernel("transpose", "transpose_v8")(dev.queue, (-(-(-(-N // 8)) // 4) * 4, -(-K // 16)), (4, 1), i32(K), i32(N),
                                      to_dev(dev, x), out)
    assert np.array_equal(from_dev(dev, out, (N, K)), x.T)


@pytest.mark.parametrize("K,N,pad", [(37, 53, 16), (16, 8, 3), (130, 70, 16), (64, 256, 16)])
def test_transpose_ld_v8(dev, K, N, pad):
    """transpose_ld_v8: x.T into rows K + pad floats apart; the padding is left as it was."""
    x = rng.normal(size=(K, N)).astype(f32)
    ldo = K + pad
    init = np.full((N, ldo), -7.0, f32)
    out = to_dev(dev, init)
    dev.kernel("transpose", "transpose_ld_v8")(dev.queue, (-(-(-(-N // 8)) // 4) * 4, -(-K // 16)), (4, 1), i32(K),
                                         i32(N), to_dev(dev, x), out, i32(ldo))
    got = from_dev(dev, out, (N, ldo))
    assert np.array_equal(got[:, :K], x.T)
    assert np.all(got[:, K:] == -7.0)


@pytest.mark.parametrize("K,N,pad", [(37, 53, 16), (5, 64, 16), (9, 200, 8), (3, 1, 1)])
def test_copy_ld_v8(dev, K, N, pad):
    """copy_ld_v8: x (K,N) into rows N + pad floats apart; the padding is left as it was."""
    x = rng.normal(size=(K, N)).astype(f32)
    ldo = N + pad
    out = to_dev(dev, np.full((K, ldo), -7.0, f32))
    dev.kernel("transpose", "copy_ld_v8")(dev.queue, (-(-N // 64), K), (1, 1), i32(K), i32(N), to_dev(dev, x), out,
                                    i32(ldo))
    got = from_dev(dev, out, (K, ldo))
    assert np.array_equal(got[:, :N], x)
    assert np.all(got[:, N:] == -7.0)


def test_to_bf16_plain_copy(dev):
    """kernels/matmul_bf16.cl's to_bf16 as the portable GEMM builds it for bf16 storage (BF16_COPY_OPTIONS: the
    program's tensor-core GEMM in its portable emulation, so it builds on any device): numpy's nearest-even bf16
    bits of every value, ties of both signs included, and zeros in the padding to multiples of 32."""
    from clgpt.device.precision import BF16_COPY_OPTIONS
    from clgpt.models import reference as ref

    R, K, Rp, Kp = 37, 45, 64, 64
    x = rng.normal(size=(R, K)).astype(f32)
    x.reshape(-1)[:4] = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F808001], np.uint32).view(f32)
    out = empty(dev, Rp * Kp, np.uint16)
    dev.kernel("matmul_bf16", "to_bf16", **BF16_COPY_OPTIONS)(dev.queue, (Kp // 8, Rp), (4, 32), i32(R), i32(K),
                                                               to_dev(dev, x), i32(K), out, i32(Kp))
    want = np.zeros((Rp, Kp), np.uint16)
    want[:R, :K] = ref.round_bf16(x).view(np.uint32) >> 16
    assert np.array_equal(from_dev(dev, out, (Rp, Kp), np.uint16), want)
