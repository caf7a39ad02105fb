"""Llama's GPU per-row kernels against the float64 reference (clgpt.models.reference_llama): RMSNorm's row-slice
forms (kernels/rmsnorm.cl rmsnorm_forward_rows, rmsnorm_backward_rows, rmsnorm_param_final_rows; C % 128 == 0) and
the dense SwiGLU forward 4 outputs a work-item (kernels/swiglu.cl swiglu_rows_forward_v4), each also in its form
that writes the output's bf16 tiled copy (RMS_TILED, SWIGLU_TILED: bit for bit the plain form's fp32 output, the
copy what to_bf16 TILED would make of it); Ops taking them on a GPU launch row; and a llama engine on that row
against the reference.

Tolerances: kernel outputs 1e-5 of the reference's largest magnitude (fp32 sums of C terms), gradients 1e-4
(as tests/test_kernels.py's LayerNorm row checks); the engine as tests/test_llama_engine.py's (loss 1e-5
relative, gradients 1e-4 of each tensor's largest)."""

from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from clgpt.device.knobs import Knobs
from clgpt.model import ModelConfig
from clgpt.models import reference_llama as ref
from clgpt.models.llama import LlamaEngine
from clgpt.ops import Ops
from conftest import assert_close
from opcheck import FD, bf16_pattern, check_op, run_op, tiled_index
from enginecheck import batch, max_rel, noisy_params

i32, f32 = np.int32, np.float32
EPS, RW = 1e-5, 4
rng = np.random.default_rng(2024)


def _rms_inputs(N, C):
    x = (rng.normal(size=(N, C)) * 2 + 0.5).astype(f32)
    w, dout = rng.normal(size=C).astype(f32), rng.normal(size=(N, C)).astype(f32)
    return x, w, dout, rng.normal(size=(N, C)).astype(f32), rng.normal(size=C).astype(f32)


def _forward_args(N, x, w):
    return [("N", i32(N)), ("x", x), ("w", w), ("out", np.zeros_like(x)), ("rstd", np.zeros(N, f32))]


@pytest.mark.parametrize("N,C,rpi", [(37, 128, 3), (100, 256, 2), (8, 128, 2), (19, 384, 1)])
def test_rmsnorm_rows(dev, N, C, rpi):
    """Forward out, rstd; backward dx (accum 1 and 0) with each work-group's dw part the sum over its rows; dw
    after rmsnorm_param_final_rows; N not a multiple of the rows a work-group (nor of RW * rpi); two runs bit for
    bit."""
    x, w, dout, dx0, dw0 = _rms_inputs(N, C)
    want, rstd = ref.rmsnorm_forward(x, w, EPS)
    dx_want, dw_want = ref.rmsnorm_backward(dout, x, w, rstd)
    fwd = lambda x, w: ref.rmsnorm_forward(x, w, EPS)[0]  # noqa: E731
    at, kw, P = {"x": x, "w": w}, dict(C=C, EPS=EPS, RW=RW), -(-N // (RW * rpi))
    rows = (32, -(-N // RW) * RW)
    fargs = _forward_args(N, x, w)
    out = check_op(dev, "rmsnorm", "rmsnorm_forward_rows", rows, fargs, {"out": want, "rstd": rstd}, kw,
                   lsize=(32, RW), atol=1e-5, rtol=1e-5)
    again = run_op(dev, "rmsnorm", "rmsnorm_forward_rows", rows, fargs, kw, lsize=(32, RW))
    assert all(np.array_equal(out[k], again[k]) for k in ("out", "rstd")), "forward: two runs differ"
    xhat = x.astype(np.float64) * rstd[:, None]
    runs = []
    for accum in (1, 0, 0):
        base = dx0 if accum else np.zeros_like(dx0)
        bargs = [("N", i32(N)), ("rpi", i32(rpi)), ("accum", i32(accum)), ("dout", dout), ("x", x), ("w", w),
                 ("rstd", out["rstd"]), ("dx", dx0), ("part", np.full(P * C, np.nan, f32))]  # NaN: all written
        got = check_op(dev, "rmsnorm", "rmsnorm_backward_rows", (32, P * RW), bargs, {"dx": base + dx_want}, kw,
                       lsize=(32, RW), atol=1e-4, rtol=1e-4,
                       fd=FD(fwd, at, dout, grads={"dx": "x"}, base={"dx": base}) if len(runs) < 2 else None)
        parts = got["part"].reshape(P, C)
        for g in range(P):
            n = slice(g * RW * rpi, (g + 1) * RW * rpi)
            assert_close(parts[g], (dout[n] * xhat[n]).sum(0), 1e-4, 1e-4, f"part {g} dw")
        fin = check_op(dev, "rmsnorm", "rmsnorm_param_final_rows", (C // 4, 32),
                       [("P", i32(P)), ("part", got["part"]), ("dw", dw0)], {"dw": dw0 + dw_want}, kw,
                       lsize=(8, 32), atol=1e-4, rtol=1e-4,
                       fd=FD(fwd, at, dout, grads={"dw": "w"}, base={"dw": dw0}) if not runs else None)
        runs.append((got["dx"], got["part"], fin["dw"]))
    assert all(np.array_equal(a, b) for a, b in zip(runs[1], runs[2])), "backward: two runs differ"
    # the final sum over more parts than its 32 work-items a column (parts j, j + 32, ... then the 32 in order)
    part = rng.normal(size=(70, C)).astype(f32)
    check_op(dev, "rmsnorm", "rmsnorm_param_final_rows", (C // 4, 32), [("P", i32(70)), ("part", part), ("dw", dw0)],
             {"dw": dw0 + part.astype(np.float64).sum(0)}, kw, lsize=(8, 32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("N,C", [(128, 128), (64, 384)])
def test_rmsnorm_rows_writes_its_tiled_copy(dev, N, C):
    """rmsnorm_forward_rows with RMS_TILED: out, rstd as without, bit for bit, and out's bf16 tiled copy."""
    x, w, *_ = _rms_inputs(N, C)
    args, kw = _forward_args(N, x, w), dict(C=C, EPS=EPS, RW=RW)
    plain = run_op(dev, "rmsnorm", "rmsnorm_forward_rows", (32, N), args, kw, lsize=(32, RW))
    tiled = run_op(dev, "rmsnorm", "rmsnorm_forward_rows", (32, N), args + [("out16", np.zeros(N * C, np.uint16))],
                   {**kw, "RMS_TILED": 1}, lsize=(32, RW))
    assert all(np.array_equal(plain[k], tiled[k]) for k in ("out", "rstd"))
    assert np.array_equal(tiled["out16"][tiled_index(N, C)], bf16_pattern(plain["out"]))


def _swiglu_h(N, F):
    h = (rng.normal(size=(N, 2 * F)) * 3).astype(f32)
    h[0, :2] = [-100.0, 100.0]  # saturated sigmoid: no NaN
    return h


def _swiglu_grid(N, F):
    return (-(-F // 4 // 64) * 64, -(-N // 4) * 4), (64, 4)


@pytest.mark.parametrize("N,F", [(37, 12), (100, 64), (5, 516), (3, 4)])
def test_swiglu_rows_forward_v4(dev, N, F):
    """4 outputs a work-item against float64 (N not a multiple of the work-group's 4 rows, F / 4 not of its 64),
    and the one-output form's values."""
    h = _swiglu_h(N, F)
    args = [("N", i32(N)), ("h", h), ("y", np.zeros((N, F), f32))]
    gsize, lsize = _swiglu_grid(N, F)
    got = check_op(dev, "swiglu", "swiglu_rows_forward_v4", gsize, args, {"y": ref.swiglu_forward(h[:, :F], h[:, F:])},
                   dict(F=F), lsize=lsize, atol=1e-5, rtol=1e-5)
    el = run_op(dev, "swiglu", "swiglu_rows_forward_el", (F, N), args, dict(F=F))
    assert_close(got["y"], el["y"], 1e-30, 4e-7, "v4 against the one-output form")  # a vector exp may round apart


@pytest.mark.parametrize("N,F", [(64, 64), (128, 192)])
def test_swiglu_rows_forward_v4_writes_its_tiled_copy(dev, N, F):
    """swiglu_rows_forward_v4 with SWIGLU_TILED: y as without, bit for bit, and y's bf16 tiled copy."""
    h = _swiglu_h(N, F)
    args = [("N", i32(N)), ("h", h), ("y", np.zeros((N, F), f32))]
    gsize, lsize = _swiglu_grid(N, F)
    plain = run_op(dev, "swiglu", "swiglu_rows_forward_v4", gsize, args, dict(F=F), lsize=lsize)
    tiled = run_op(dev, "swiglu", "swiglu_rows_forward_v4", gsize, args + [("y16", np.zeros(N * F, np.uint16))],
                   dict(F=F, SWIGLU_TILED=1), lsize=lsize)
    assert np.array_equal(plain["y"], tiled["y"])
    assert np.array_equal(tiled["y16"][tiled_index(N, F)], bf16_pattern(plain["y"]))
    # SWIGLU_TILED 2: the same copy, and y left as it was
    only = run_op(dev, "swiglu", "swiglu_rows_forward_v4", gsize,
                  [("N", i32(N)), ("h", h), ("y", np.full((N, F), -7.0, f32)), ("y16", np.zeros(N * F, np.uint16))],
                  dict(F=F, SWIGLU_TILED=2), lsize=lsize)
    assert np.array_equal(only["y16"], tiled["y16"])
    assert (only["y"] == -7.0).all()


def _to_dev(dev, a):
    return cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))


def _from_dev(dev, buf, shape, dtype=f32):
    out = np.empty(shape, dtype)
    cl.enqueue_copy(dev.queue, out, buf, is_blocking=True)
    return out


def _recorded(ops, monkeypatch) -> list:
    """The names of the kernels ops launches from now on."""
    names = []
    for meth in ("run", "runp"):
        launch = getattr(ops.launcher, meth)
        monkeypatch.setattr(ops.launcher, meth, lambda name, *a, _f=launch, **k: (names.append(name),
                                                                                  _f(name, *a, **k)))
    return names


@pytest.mark.parametrize("N", [64, 100])
def test_ops_write_the_tiled_copies_of_stable_outputs(dev, monkeypatch, N):
    """Ops on a GPU row with tiled outputs (as on wgmma): rmsnorm and swiglu_rows_forward on stable outputs take the
    _tiled forms and keep the copies they write, the bf16 of their fp32 outputs; with N off a multiple of 64, the
    plain forms and no copy."""
    C, F = 128, 192
    cfg = ModelConfig(arch="llama", vocab_size=16, n_ctx=8, n_embd=C, n_head=2, n_layer=1, n_ff=F)
    ops = Ops(dev, cfg, 8, knobs=Knobs(launch="gpu"))
    ops.facts.tiled_outputs = True  # what wgmma sets (sm_90a): no such device here
    ops.build_llama()
    names = _recorded(ops, monkeypatch)
    x, w, *_ = _rms_inputs(N, C)
    h = _swiglu_h(N, F)
    out, act = ops.buf(N * C), ops.buf(N * F)
    ops.stable(out, act)
    ops.rmsnorm(N, _to_dev(dev, x), _to_dev(dev, w), out, ops.buf(N))
    ops.swiglu_rows_forward(N, _to_dev(dev, h), act)
    tiled = N % 64 == 0
    assert names == (["rmsnorm_forward_rows_tiled", "swiglu_rows_forward_v4_tiled"] if tiled else
                     ["rmsnorm_forward_rows", "swiglu_rows_forward_v4"])
    wants = ((out, C, ref.rmsnorm_forward(x, w, EPS)[0]), (act, F, ref.swiglu_forward(h[:, :F], h[:, F:])))
    for buf, cols, want in wants:
        got = _from_dev(dev, buf, (N, cols))
        assert_close(got, want, 1e-5 * np.abs(want).max(), 1e-5, "output")
        kept = ops.copies.kept.get((buf.int_ptr, N, cols))
        assert (kept is not None) is tiled
        if tiled:
            assert kept[1:] == (N, cols)
            copy = _from_dev(dev, kept[0], N * cols, np.uint16)
            assert np.array_equal(copy[tiled_index(N, cols)], bf16_pattern(got))


@pytest.mark.parametrize("wgmma", [True, False])
def test_swiglu_writes_only_the_copy_where_products_alone_read_it(dev, monkeypatch, wgmma):
    """products_only: where both products that read the output (down's forward and weight gradient) run on
    wgmma, swiglu_rows_forward writes only the kept tiled copy (the fp32 output untouched); elsewhere both."""
    N, C, F = 64, 128, 192
    cfg = ModelConfig(arch="llama", vocab_size=16, n_ctx=8, n_embd=C, n_head=2, n_layer=1, n_ff=F)
    ops = Ops(dev, cfg, 8, knobs=Knobs(launch="gpu"))
    ops.facts.tiled_outputs = True
    ops.build_llama()
    asked = []
    monkeypatch.setattr(ops.backend, "on_wgmma", lambda M, Nn, K, epi=0: (asked.append((M, Nn, K)), wgmma)[1])
    names = _recorded(ops, monkeypatch)
    h = _swiglu_h(N, F)
    act = _to_dev(dev, np.full((N, F), -7.0, f32))
    ops.stable(act)
    ops.swiglu_rows_forward(N, _to_dev(dev, h), act, products_only=True)
    assert names == ["swiglu_rows_forward_v4_tiled_only" if wgmma else "swiglu_rows_forward_v4_tiled"]
    assert asked[0] == (N, C, F)
    want = ref.swiglu_forward(h[:, :F], h[:, F:])
    copy = _from_dev(dev, ops.copies.kept[(act.int_ptr, N, F)][0], N * F, np.uint16)
    assert np.array_equal(copy[tiled_index(N, F)], bf16_pattern(_from_dev(dev, act, (N, F)) if not wgmma else
                                                                 _plain_swiglu(dev, h, N, F)))
    got = _from_dev(dev, act, (N, F))
    if wgmma:
        assert (got == -7.0).all()
    else:
        assert_close(got, want, 1e-5 * np.abs(want).max(), 1e-5, "output")


def _plain_swiglu(dev, h, N, F):
    """y of swiglu_rows_forward_v4 without a copy."""
    gsize, lsize = _swiglu_grid(N, F)
    return run_op(dev, "swiglu", "swiglu_rows_forward_v4", gsize,
                  [("N", i32(N)), ("h", h), ("y", np.zeros((N, F), f32))], dict(F=F), lsize=lsize)["y"]


@pytest.mark.parametrize("C,n_ff", [(128, 192), (8, 12), (8, 10)])
def test_llama_engine_on_the_gpu_row_against_float64(monkeypatch, C, n_ff):
    """A dense llama engine on the GPU launch row: with C % 128 == 0 its norms take the row-slice kernels (a
    row-slot several rows, N = 18 rows off a multiple of the work-group's), other widths the one-work-group-a-row
    ones; SwiGLU 4 outputs a work-item (F % 4 == 0) or one; loss, logits and every gradient against the float64
    reference."""
    cfg = ModelConfig(arch="llama", vocab_size=23, n_ctx=6, n_embd=C, n_head=2, n_layer=2, n_ff=n_ff)
    p = noisy_params(cfg)
    eng = LlamaEngine(cfg, p, batch_size=3, seq_len=6, knobs=Knobs(launch="gpu"))
    eng.ops.launch["ln_parts"] = 2  # 18 // (4 * 2) = 2 rows a row-slot, 3 parts
    names = _recorded(eng.ops, monkeypatch)
    tokens, targets, mask = batch(cfg, 3, 6)
    loss = eng.forward(tokens, targets, mask)
    eng.zero_grad()
    eng.backward()
    loss_ref, _, cache = ref.llama_forward(p, cfg, tokens, targets, mask)
    assert abs(loss - loss_ref) < 1e-5 * abs(loss_ref), f"loss {loss} vs reference {loss_ref}"
    worst, where = max_rel(eng.get_grads(), ref.llama_backward(cache))
    assert worst < 1e-4, f"grads: max relative diff {worst:.3e} in {where}"
    got, want = eng.forward(tokens[:2, :5]), ref.llama_logits(p, cfg, tokens[:2, :5])
    # float32 against float64: within 1e-5 of the largest logit (an absolute 1e-5 failed by 2% on an Intel Xeon
    # with AVX-512 under Intel's runtime, whose vector code rounds in another order)
    scale = max(1.0, np.abs(want).max())
    diff = np.abs(got - want).max()
    assert diff < 1e-5 * scale, f"logits: max abs diff {diff:.3e}, scale {scale:.3g}"
    rows = {"rmsnorm_forward_rows", "rmsnorm_backward_rows", "rmsnorm_param_final_rows"}
    wg = {"rmsnorm_forward_wg", "rmsnorm_backward_wg"}
    took, left = (rows, wg) if C % 128 == 0 else (wg, rows)
    assert took <= set(names) and not left & set(names), names
    v4, el = "swiglu_rows_forward_v4" in names, "swiglu_rows_forward_el" in names
    assert (v4, el) == ((True, False) if n_ff % 4 == 0 else (False, True)), names
