"""The gradient norm and AdamW kernels against the reference update (clgpt.models.reference.adamw_step),
itself checked against the formula, and the CPU's float8 forms bit for bit the plain ones."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clgpt.models import reference as ref

from conftest import assert_close, empty, from_dev, to_dev

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(1234)


# ---------------- grad norm + AdamW ----------------
@pytest.mark.parametrize("strided", [0, 1])
@pytest.mark.parametrize("clip", [0.0, 1.0, 100.0])
def test_grad_norm_and_adamw(dev, clip, strided):
    n, n_decay, n_parts = 1001, 600, 7
    chunk = -(-n // n_parts)
    p, g = rng.normal(size=n).astype(f32), (rng.normal(size=n) * 0.1).astype(f32)
    m, v = (rng.normal(size=n) * 0.01).astype(f32), (rng.random(n) * 1e-3).astype(f32)
    pb, gb, mb, vb = (to_dev(dev, a) for a in (p, g, m, v))
    partials, normb = empty(dev, n_parts), empty(dev, 2)
    dev.kernel("adamw", "grad_norm_partial", STRIDED=strided)(dev.queue, (n_parts,), None, i32(n), i32(chunk), gb,
                                                            partials)
    dev.kernel("adamw", "grad_norm_final", STRIDED=strided)(dev.queue, (1,), None, i32(n_parts), f32(clip), partials,
                                                          normb)
    norm_want = np.sqrt((g.astype(np.float64) ** 2).sum())
    norm = from_dev(dev, normb, 2)
    assert abs(norm[0] - norm_want) < 1e-5 * norm_want, f"grad norm {norm[0]} vs {norm_want}"
    scale = min(1.0, clip / norm_want) if clip > 0 else 1.0
    assert abs(norm[1] - scale) < 1e-5, f"clip scale {norm[1]} vs {scale}"
    t, lr, b1, b2, eps, wd = 3, 0.01, 0.9, 0.95, 1e-8, 0.1
    dev.kernel("adamw", "adamw")(dev.queue, (n,), None, i32(n), i32(n_decay), pb, gb, mb, vb, normb, f32(lr), f32(b1),
                                 f32(b2), f32(1 - b1**t), f32(1 - b2**t), f32(eps), f32(wd))
    for lo, hi, decay in ((0, n_decay, True), (n_decay, n, False)):
        pw, mw, vw = ref.adamw_update(p[lo:hi], g[lo:hi] * scale, m[lo:hi], v[lo:hi], t, lr, b1, b2, eps, wd, decay)
        assert_close(from_dev(dev, pb, n)[lo:hi], pw, 1e-6, 1e-5, f"adamw param (decay={decay})")
        assert_close(from_dev(dev, mb, n)[lo:hi], mw, 1e-7, 1e-5, "adamw m")
        assert_close(from_dev(dev, vb, n)[lo:hi], vw, 1e-9, 1e-5, "adamw v")


def test_ref_adamw_matches_formula():
    p, g, m, v = 1.5, 0.2, 0.1, 0.04
    t, lr, b1, b2, eps, wd = 2, 0.1, 0.9, 0.95, 1e-8, 0.1
    pn, mn, vn = ref.adamw_update(np.array(p), np.array(g), np.array(m), np.array(v), t, lr, b1, b2, eps, wd, True)
    m2, v2 = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    want = p * (1 - lr * wd) - lr * (m2 / (1 - b1**t)) / (math.sqrt(v2 / (1 - b2**t)) + eps)
    assert abs(float(pn) - want) < 1e-12 and abs(float(mn) - m2) < 1e-15 and abs(float(vn) - v2) < 1e-15


@pytest.mark.parametrize("clip", [0.0, 1.0])
@pytest.mark.parametrize("n,n_decay", [(1001, 600), (64, 64), (13, 5)])
def test_adamw_v8(dev, clip, n, n_decay):
    """adamw_v8 (8 parameters a work-item, kernels/adamw.cl): the reference update, and bit for bit what the
    scalar adamw writes (same arithmetic per element), on float8 blocks, the decay boundary inside a block
    and the scalar tail."""
    p, g = rng.normal(size=n).astype(f32), (rng.normal(size=n) * 0.1).astype(f32)
    m, v = (rng.normal(size=n) * 0.01).astype(f32), (rng.random(n) * 1e-3).astype(f32)
    norm_want = np.sqrt((g.astype(np.float64) ** 2).sum())
    scale = min(1.0, clip / norm_want) if clip > 0 else 1.0
    t, lr, b1, b2, eps, wd = 3, 0.01, 0.9, 0.95, 1e-8, 0.1
    outs = {}
    for name, per in (("adamw", 1), ("adamw_v8", 8)):
        bufs = [to_dev(dev, a) for a in (p, g, m, v)]
        normb = to_dev(dev, np.array([norm_want, scale], f32))
        dev.kernel("adamw", name)(dev.queue, (-(-n // per),), None, i32(n), i32(n_decay), *bufs, normb, f32(lr),
                                  f32(b1), f32(b2), f32(1 - b1**t), f32(1 - b2**t), f32(eps), f32(wd))
        outs[name] = [from_dev(dev, b, n) for b in bufs]
    for got, want in zip(outs["adamw_v8"], outs["adamw"]):
        assert np.array_equal(got, want)
    pv, mv, vv = outs["adamw_v8"][0], outs["adamw_v8"][2], outs["adamw_v8"][3]
    for lo, hi, decay in ((0, n_decay, True), (n_decay, n, False)):
        pw, mw, vw = ref.adamw_update(p[lo:hi], g[lo:hi] * f32(scale), m[lo:hi], v[lo:hi], t, lr, b1, b2, eps, wd,
                                      decay)
        assert_close(pv[lo:hi], pw, 1e-6, 1e-5, f"adamw_v8 param (decay={decay})")
        assert_close(mv[lo:hi], mw, 1e-7, 1e-5, "adamw_v8 m")
        assert_close(vv[lo:hi], vw, 1e-9, 1e-5, "adamw_v8 v")


@pytest.mark.parametrize("n,parts", [(1000, 7), (4096, 4), (77, 77), (5, 8)])
def test_grad_norm_partial_v8(dev, n, parts):
    """kernels/adamw.cl's float8 chunk sums of squares: the float64 sums over each chunk."""
    g = rng.normal(size=n).astype(f32)
    chunk = -(-n // parts)
    out = empty(dev, parts)
    dev.kernel("adamw", "grad_norm_partial_v8")(dev.queue, (parts,), None, i32(n), i32(chunk), to_dev(dev, g), out)
    g64 = g.astype(np.float64)
    want = np.array([(g64[i * chunk: min(n, (i + 1) * chunk)] ** 2).sum() for i in range(parts)])
    assert_close(from_dev(dev, out, parts), want, 1e-5, 1e-5, "grad_norm_partial_v8")
