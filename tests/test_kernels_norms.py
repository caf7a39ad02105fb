"""The LayerNorm kernels against the float64 reference: the plain form, the CPU's blocked forms (bit for
bit the plain one) and the GPU's row-slice forms, alone and as Ops launches them."""

from __future__ import annotations

import numpy as np
import pytest

from clgpt.models import reference as ref

from conftest import assert_close, empty, from_dev, to_dev
from opcheck import FD, _gpu_engine, check_op, run_op

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(1234)


# ---------------- layernorm ----------------
def test_layernorm(dev):
    N, C, eps = 11, 24, 1e-5
    x = (rng.normal(size=(N, C)) * 2 + 0.5).astype(f32)
    w, b = rng.normal(size=C).astype(f32), rng.normal(size=C).astype(f32)
    dout = rng.normal(size=(N, C)).astype(f32)
    want, (mean, rstd) = ref.layernorm_forward(x, w, b, eps)
    dx_want, dw_want, db_want = ref.layernorm_backward(dout, x, w, mean, rstd)
    kw = dict(C=C, EPS=eps)
    out = check_op(dev, "layernorm", "layernorm_forward", (N,), [("N", i32(N)), ("x", x), ("w", w), ("b", b),
                   ("out", np.zeros_like(x)), ("mean", np.zeros(N, f32)), ("rstd", np.zeros(N, f32))],
                   {"out": want, "rstd": rstd}, kw, rtol=1e-5)
    stats = [("mean", out["mean"]), ("rstd", out["rstd"])]
    fwd = lambda x, w, b: ref.layernorm_forward(x, w, b, eps)[0]  # noqa: E731
    at = {"x": x, "w": w, "b": b}
    dx0 = rng.normal(size=(N, C)).astype(f32)
    for accum in (1, 0):
        base = dx0 if accum else np.zeros_like(dx0)
        check_op(dev, "layernorm", "layernorm_backward", (N,), [("N", i32(N)), ("accum", i32(accum)), ("dout", dout),
                 ("x", x), ("w", w), *stats, ("dx", dx0)], {"dx": base + dx_want}, kw, atol=1e-4, rtol=1e-4,
                 fd=FD(fwd, at, dout, grads={"dx": "x"}, base={"dx": base}))
    check_op(dev, "layernorm", "layernorm_param_backward", (C,), [("N", i32(N)), ("dout", dout), ("x", x), *stats,
             ("dw", np.ones(C, f32)), ("db", np.zeros(C, f32))], {"dw": 1 + dw_want, "db": db_want}, kw, atol=1e-4,
             rtol=1e-4, fd=FD(fwd, at, dout, grads={"dw": "w", "db": "b"}, base={"dw": 1.0}))


def same_forms(dev, a, b) -> bool:
    """Two forms of one op that do the same float operations in the same order: bit for bit on PoCL. OpenCL C
    lets a compiler contract a * b + c into one rounding and divide within 2.5 ulp, and Intel's CPU compiler does so
    differently in a vectorised form than in a scalar one: there, within a few ulp."""
    if "portable computing language" in dev.device.platform.name.lower():
        return np.array_equal(a, b)
    return np.allclose(a, b, rtol=4e-7 * 8, atol=1e-7)


@pytest.mark.parametrize("N,C", [(19, 32), (8, 16), (5, 24)])
def test_layernorm_blocked(dev, N, C):
    """The CPU forms (tuning's norm_rb = 8 rows, norm_cb = 16 channels a work-item, one work-item a work-group:
    8x8 register transposes, float16 column sums; C % 16 != 0 keeps the scalar loops) against the float64
    reference and finite differences, and bit for bit against the one-row, one-channel forms."""
    eps = 1e-5
    x = (rng.normal(size=(N, C)) * 2 + 0.5).astype(f32)
    w, b = rng.normal(size=C).astype(f32), rng.normal(size=C).astype(f32)
    dout, dx0 = rng.normal(size=(N, C)).astype(f32), rng.normal(size=(N, C)).astype(f32)
    want, (mean, rstd) = ref.layernorm_forward(x, w, b, eps)
    dx_want, dw_want, db_want = ref.layernorm_backward(dout, x, w, mean, rstd)
    fwd = lambda x, w, b: ref.layernorm_forward(x, w, b, eps)[0]  # noqa: E731
    at = {"x": x, "w": w, "b": b}
    plain, blocked = dict(C=C, EPS=eps), dict(C=C, EPS=eps, RB=8, CB=16)
    rows, chans = (-(-N // 8),), (-(-C // 16),)
    fargs = [("N", i32(N)), ("x", x), ("w", w), ("b", b), ("out", np.zeros_like(x)), ("mean", np.zeros(N, f32)),
             ("rstd", np.zeros(N, f32))]
    out = check_op(dev, "layernorm", "layernorm_forward", rows, fargs, {"out": want, "rstd": rstd}, blocked,
                   lsize=(1,), rtol=1e-5)
    one = run_op(dev, "layernorm", "layernorm_forward", (N,), fargs, plain)
    for key in ("out", "mean", "rstd"):
        assert same_forms(dev, out[key], one[key]), f"layernorm_forward {key}: blocked form differs from one row"
    stats = [("mean", out["mean"]), ("rstd", out["rstd"])]
    bargs = [("N", i32(N)), ("accum", i32(1)), ("dout", dout), ("x", x), ("w", w), *stats, ("dx", dx0)]
    got = check_op(dev, "layernorm", "layernorm_backward", rows, bargs, {"dx": dx0 + dx_want}, blocked, lsize=(1,),
                   atol=1e-4, rtol=1e-4, fd=FD(fwd, at, dout, grads={"dx": "x"}, base={"dx": dx0}))
    assert same_forms(dev, got["dx"], run_op(dev, "layernorm", "layernorm_backward", (N,), bargs, plain)["dx"])
    pargs = [("N", i32(N)), ("dout", dout), ("x", x), *stats, ("dw", np.ones(C, f32)), ("db", np.zeros(C, f32))]
    got = check_op(dev, "layernorm", "layernorm_param_backward", chans, pargs, {"dw": 1 + dw_want, "db": db_want},
                   blocked, lsize=(1,), atol=1e-4, rtol=1e-4,
                   fd=FD(fwd, at, dout, grads={"dw": "w", "db": "b"}, base={"dw": 1.0}))
    one = run_op(dev, "layernorm", "layernorm_param_backward", (C,), pargs, plain)
    assert same_forms(dev, got["dw"], one["dw"]) and same_forms(dev, got["db"], one["db"])


def _ln_inputs(N, C):
    """x (N, C), w, b, dout, dx's, dw's and db's starting values for the LayerNorm row-slice checks."""
    x = (rng.normal(size=(N, C)) * 2 + 0.5).astype(f32)
    w, b = rng.normal(size=C).astype(f32), rng.normal(size=C).astype(f32)
    dout, dx0 = rng.normal(size=(N, C)).astype(f32), rng.normal(size=(N, C)).astype(f32)
    return x, w, b, dout, dx0, rng.normal(size=C).astype(f32), rng.normal(size=C).astype(f32)


@pytest.mark.parametrize("N,C,rpi", [(37, 128, 3), (19, 384, 1), (8, 128, 2)])
def test_layernorm_rows(dev, N, C, rpi):
    """The GPU row-slice forms (C % 128 == 0: 32 work-items a row, RW rows a work-group; the backward's dw, db as
    one part a work-group, rpi rows a row-slot, added by layernorm_param_final_rows) against the float64 reference
    and finite differences, N not a multiple of the rows a work-group; each part the sums over its rows; two runs
    bit for bit."""
    eps, RW = 1e-5, 4
    x, w, b, dout, dx0, dw0, db0 = _ln_inputs(N, C)
    want, (mean, rstd) = ref.layernorm_forward(x, w, b, eps)
    dx_want, dw_want, db_want = ref.layernorm_backward(dout, x, w, mean, rstd)
    fwd = lambda x, w, b: ref.layernorm_forward(x, w, b, eps)[0]  # noqa: E731
    at, kw, P = {"x": x, "w": w, "b": b}, dict(C=C, EPS=eps, RW=RW), -(-N // (RW * rpi))
    fargs = [("N", i32(N)), ("x", x), ("w", w), ("b", b), ("out", np.zeros_like(x)), ("mean", np.zeros(N, f32)),
             ("rstd", np.zeros(N, f32))]
    rows = (32, -(-N // RW) * RW)
    out = check_op(dev, "layernorm", "layernorm_forward_rows", rows, fargs, {"out": want, "mean": mean, "rstd": rstd},
                   kw, lsize=(32, RW), rtol=1e-5)
    again = run_op(dev, "layernorm", "layernorm_forward_rows", rows, fargs, kw, lsize=(32, RW))
    assert all(np.array_equal(out[k], again[k]) for k in ("out", "mean", "rstd")), "forward: two runs differ"
    stats = [("mean", out["mean"]), ("rstd", out["rstd"])]
    xhat = (x - mean[:, None]) * rstd[:, None]
    runs = []
    for accum in (1, 0, 0):
        base = dx0 if accum else np.zeros_like(dx0)
        bargs = [("N", i32(N)), ("rpi", i32(rpi)), ("accum", i32(accum)), ("dout", dout), ("x", x), ("w", w), *stats,
                 ("dx", dx0), ("part", np.full(2 * P * C, np.nan, f32))]  # NaN: every part must be written
        got = check_op(dev, "layernorm", "layernorm_backward_rows", (32, P * RW), bargs, {"dx": base + dx_want}, kw,
                       lsize=(32, RW), atol=1e-4, rtol=1e-4,
                       fd=FD(fwd, at, dout, grads={"dx": "x"}, base={"dx": base}) if len(runs) < 2 else None)
        parts = got["part"].reshape(P, 2, C)
        for g in range(P):
            n = slice(g * RW * rpi, (g + 1) * RW * rpi)
            assert_close(parts[g, 0], (dout[n] * xhat[n]).sum(0), 1e-4, 1e-4, f"part {g} dw")
            assert_close(parts[g, 1], dout[n].astype(np.float64).sum(0), 1e-4, 1e-4, f"part {g} db")
        fin = check_op(dev, "layernorm", "layernorm_param_final_rows", (C // 2, 32),
                       [("P", i32(P)), ("part", got["part"]), ("dw", dw0), ("db", db0)],
                       {"dw": dw0 + dw_want, "db": db0 + db_want}, kw, lsize=(8, 32), atol=1e-4, rtol=1e-4,
                       fd=FD(fwd, at, dout, grads={"dw": "w", "db": "b"}, base={"dw": dw0, "db": db0}) if not runs
                       else None)
        runs.append((got["dx"], got["part"], fin["dw"], fin["db"]))
    assert all(np.array_equal(a, b) for a, b in zip(runs[1], runs[2])), "backward: two runs differ"
    # the final sum over more parts than its 32 work-items a column (parts j, j + 32, ... then the 32 in order)
    part = rng.normal(size=(70, 2, C)).astype(f32)
    check_op(dev, "layernorm", "layernorm_param_final_rows", (C // 2, 32), [("P", i32(70)), ("part", part),
             ("dw", dw0), ("db", db0)], {"dw": dw0 + part[:, 0].astype(np.float64).sum(0),
             "db": db0 + part[:, 1].astype(np.float64).sum(0)}, kw, lsize=(8, 32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("C,new", [(128, True), (24, False)])
def test_engine_layernorm_rows(dev, monkeypatch, C, new):
    """Ops on a GPU row: C % 128 == 0 takes the row-slice kernels (one row-slot taking several rows here), other
    widths the one-work-group-per-row ones; both against the float64 reference (dw, db added to what was there)."""
    eng = _gpu_engine("gpu", C=C, H=2)
    ops, N, eps = eng.ops, 37, eng.cfg.norm_eps
    ops.launch["ln_parts"] = 2  # 37 // (4 * 2) = 4 rows a row-slot, 3 parts
    names = []  # the kernels launched
    for meth in ("run", "runp"):
        launch = getattr(ops, meth)
        monkeypatch.setattr(ops, meth, lambda name, *a, _f=launch, **k: (names.append(name), _f(name, *a, **k)))
    x, w, b, dout, dx0, dw0, db0 = _ln_inputs(N, C)
    want, (mean, rstd) = ref.layernorm_forward(x, w, b, eps)
    dx_want, dw_want, db_want = ref.layernorm_backward(dout, x, w, mean, rstd)
    xb, wb, ob, mb, rb = to_dev(dev, x), to_dev(dev, w), empty(dev, N * C), empty(dev, N), empty(dev, N)
    ops.layernorm(N, xb, wb, to_dev(dev, b), ob, mb, rb)
    assert_close(from_dev(dev, ob, (N, C)), want, 1e-5, 1e-5, "layernorm out")
    assert_close(from_dev(dev, rb, N), rstd, 1e-5, 1e-5, "layernorm rstd")
    dxb, dwb, dbb = to_dev(dev, dx0), to_dev(dev, dw0), to_dev(dev, db0)
    ops.layernorm_backward(N, to_dev(dev, dout), xb, mb, rb, wb, dwb, dbb, dxb, accum=1)
    assert_close(from_dev(dev, dxb, (N, C)), dx0 + dx_want, 1e-4, 1e-4, "layernorm dx")
    assert_close(from_dev(dev, dwb, C), dw0 + dw_want, 1e-4, 1e-4, "layernorm dw")
    assert_close(from_dev(dev, dbb, C), db0 + db_want, 1e-4, 1e-4, "layernorm db")
    rows = {"layernorm_forward_rows", "layernorm_backward_rows", "layernorm_param_final_rows"}
    assert rows <= set(names) if new else not rows & set(names), names
    assert new or {"layernorm_forward_wg", "layernorm_backward_wg"} <= set(names), names
