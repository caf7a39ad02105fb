"""Portable flash attention (kernels/flash_portable.cl: local-memory tiles, fp32, no extension) against the float64
reference (clgpt/models/reference.py) and finite differences, with and without dropout (the batched form's mask),
at T not a multiple of any tile and head widths 16 to 128, under several tiles; on every CPU implementation.

Tolerance: fp32 sums over at most T = 75 keys and D = 128 columns: 1e-5 relative to each output's largest
|value| (about 1e-6 seen), the same bytes on a second run.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from clgpt.device.tuner_flash import (DEFAULT, Run, build_first, candidates, check, default_tiles, fits, local_bytes,
                                      reference)
from clgpt.models import reference as ref
from clgpt.models.dropout import scale_mask
from opcheck import assert_directional_fd

TOL = 1e-5
OTHER = dict(forward=(32, 16, 8), dq=(128, 32, 2), dkv=(32, 64, 4))  # other row, step and row-split shapes


def _run(dev, qkv, dout, H, tiles, drop=(0, 0, 0.0), rnd=0):
    """-> out, dqkv, lse: the forward, dq and dk/dv launches with `tiles` (each kernel's), operands rounded as
    precision.cl's ROUND rnd."""
    B, T, C3 = qkv.shape
    run = Run(dev, B, H, T, C3 // 3 // H, qkv, dout, rnd)
    for kernel in ("forward", "dq", "dkv"):
        run.launch(kernel, tiles[kernel], drop)
    return run.results()


def _rel(got, want):
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))  # T 1: dq, dk are 0


@pytest.mark.parametrize("B, H, T, D, p, tiles", [
    (2, 2, 75, 16, 0.0, DEFAULT), (2, 2, 75, 16, 0.2, DEFAULT), (1, 3, 70, 32, 0.2, OTHER),
    (1, 1, 37, 128, 0.1, dict(forward=(32, 16, 4), dq=(16, 16, 4), dkv=(16, 16, 4))), (3, 1, 1, 8, 0.0, DEFAULT)],
    ids=["p0", "p0.2", "other-tiles", "D128", "T1"])
def test_flash_portable_against_float64_and_deterministic(dev, B, H, T, D, p, tiles):
    """out, dq, dk, dv within fp32's tolerance of float64 (dropout: the batched form's mask, element index
    (b*H + h, query, key)); lse the log2 of each row's sum of exp2 over its scores in the log2 domain; a second run
    gives the same bytes."""
    C = H * D
    r = np.random.default_rng(11)
    qkv, dout = r.normal(size=(B, T, 3 * C)), r.normal(size=(B, T, C))
    drop = (0xC0FFEE, 7, p)
    dmask = scale_mask(drop[0], drop[1], (B, H, T, T), p) if p else None
    out, dqkv, lse = _run(dev, qkv, dout, H, tiles, drop)
    want, att = ref.attention_forward(qkv, H, dmask)
    dwant = ref.attention_backward(dout, qkv, att, H, dmask)
    for name, got, w in (("out", out, want), ("dq", dqkv[..., :C], dwant[..., :C]),
                         ("dk", dqkv[..., C:2 * C], dwant[..., C:2 * C]), ("dv", dqkv[..., 2 * C:], dwant[..., 2 * C:])):
        assert _rel(got, w) < TOL, f"{name} (p={p}): relative error {_rel(got, w):.2e}"
    x = qkv.reshape(B, T, 3, H, D)
    s = np.einsum("bihd,bjhd->bhij", x[:, :, 0], x[:, :, 1]) / math.sqrt(D) * math.log2(math.e)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    lse_want = np.log2(np.exp2(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    assert np.abs(lse - lse_want).max() < TOL * max(1.0, np.abs(lse_want).max())
    again = _run(dev, qkv, dout, H, tiles, drop)
    assert all(np.array_equal(a, b) for a, b in zip((out, dqkv, lse), again))


@pytest.mark.parametrize("rnd, tol", [(1, 1e-2), (2, 2e-3)], ids=["bf16", "tf32"])
def test_flash_portable_rounds_operands_as_the_precision_asks(dev, rnd, tol):
    """ROUND 1 (bf16) and 2 (tf32): the products' operands rounded as the batched form's GEMM rounds them, sums
    fp32: out, dqkv within twice the format's epsilon of float64 relative to their largest value (8 and 11
    significant bits), and off by more than fp32's 1e-5, so the rounding is there."""
    B, H, T, D = 2, 2, 75, 16
    r = np.random.default_rng(13)
    qkv, dout = r.normal(size=(B, T, 3 * H * D)), r.normal(size=(B, T, H * D))
    drop = (0xC0FFEE, 7, 0.2)
    dmask = scale_mask(drop[0], drop[1], (B, H, T, T), drop[2])
    out, dqkv, _ = _run(dev, qkv, dout, H, DEFAULT, drop, rnd)
    want, att = ref.attention_forward(qkv, H, dmask)
    dwant = ref.attention_backward(dout, qkv, att, H, dmask)
    for name, got, w in (("out", out, want), ("dqkv", dqkv, dwant)):
        assert 1e-5 < _rel(got, w) < tol, f"{name} (ROUND {rnd}): relative error {_rel(got, w):.2e}"


def test_flash_portable_backward_against_finite_differences(dev):
    """The kernels' gradient of sum(out * R) along random directions equals central differences of the float64
    attention."""
    B, H, T, D = 1, 2, 45, 16
    r = np.random.default_rng(5)
    qkv, R = r.normal(size=(B, T, 3 * H * D)), r.normal(size=(B, T, H * D))
    _, dqkv, _ = _run(dev, qkv, R, H, DEFAULT)
    f = lambda x: float((ref.attention_forward(x, H)[0] * R).sum())  # noqa: E731
    assert_directional_fd(f, qkv, dqkv, 1e-4, r)


def test_tuner_check_rejects_wrong_tiles_and_takes_right_ones(dev):
    """The tuner's float64 check (its own reference, the same math as clgpt/models/reference.py) passes good tiles
    and rejects tiles that do not build (NC 3 divides neither D 16 nor BC 16: the kernel's #error)."""
    qkv, dout = np.random.default_rng(2).normal(size=(1, 20, 24)), np.random.default_rng(3).normal(size=(1, 20, 8))
    want_out, att = ref.attention_forward(qkv, 2)
    out, dqkv = reference(qkv, dout, 2)
    assert np.allclose(out, want_out) and np.allclose(dqkv, ref.attention_backward(dout, qkv, att, 2))
    default = default_tiles(dev, 2, 16)
    assert check(dev, 2, 16, "forward", (32, 16, 4), default) == ""
    assert check(dev, 2, 16, "dkv", (32, 16, 3), default).startswith("fails to build")


def test_tiles_that_do_not_build_fall_back_to_the_first_that_does(dev):
    """A record's tiles that do not build here (NC 3: the kernel's #error) give way to the first candidate that
    fits the device and builds, as an untuned run takes."""
    lim = dev.device.max_work_group_size, dev.device.local_mem_size
    tiles, kern = build_first(dev, "forward", 32, 2, 16, (32, 16, 3))
    assert tiles == candidates("forward", 16, *lim)[0] == default_tiles(dev, 2, 16)["forward"]
    assert kern.function_name == "flash_portable_forward"


def test_tiles_fit_the_strictest_devices():
    """Every kernel's default tiles at head widths up to 128 fit 256 work-items and 32 KB of local memory (Arm
    Mali, AMD); tiles over a limit are refused with the reason."""
    for D in (16, 64, 128):
        for kernel in DEFAULT:
            lim = (256, 32768)
            tiles = candidates(kernel, D, *lim)[0]
            assert not fits(kernel, D, tiles, *lim) and local_bytes(kernel, D, tiles) <= 32768
    assert "work-group limit 256" in fits("forward", 64, (128, 32, 4), 256, 1 << 16)
    assert "local memory" in fits("dkv", 128, (64, 64, 4), 1024, 32768)
    assert "divide" in fits("dq", 48, (64, 16, 32), 1024, 1 << 16)
