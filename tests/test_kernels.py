"""Every OpenCL kernel against the float64 numpy reference (clgpt.models.reference), and every reference
backward against central finite differences in float64. The op kernels go through tests/opcheck.py's
check_op, which also checks each backward kernel's gradients against finite differences of the float64
forward."""

from __future__ import annotations

import math

import numpy as np
import pyopencl as cl
import pytest

from clgpt.device.opencl import get_device
from clgpt.device.knobs import Knobs
from clgpt.models import reference as ref
from clgpt.ops import MATMUL_TILES, matmul_defines, matmul_launch
from opcheck import FD, check_op, run_op

i32, f32 = np.int32, np.float32


@pytest.fixture(scope="module")
def dev(opencl):  # on the implementation tests/conftest.py sets for this module's run
    return get_device()


def to_dev(dev, a):
    a = np.ascontiguousarray(a)
    return cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)


def empty(dev, n, dtype=np.float32):
    return cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, max(1, n) * np.dtype(dtype).itemsize)


def from_dev(dev, buf, shape, dtype=np.float32):
    out = np.empty(shape, dtype)
    cl.enqueue_copy(dev.queue, out, buf, is_blocking=True)
    return out


def assert_close(got, want, atol, rtol, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff = np.abs(got - want)
    ok = diff <= atol + rtol * np.abs(want)
    assert ok.all(), f"{what}: max abs diff {diff.max():.3e} (atol {atol}, rtol {rtol})"


def fd_grad(f, x, eps=1e-6):
    """Central finite differences of the scalar f() w.r.t. every entry of x (modified in place)."""
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


rng = np.random.default_rng(1234)


# ---------------- matmul ----------------
# Each form the tuning table can pick: the local-memory tiled kernel (default tiles; small float4 tiles)
# and the CPU register-blocked one (whose op(B) must have contiguous rows: tb=1 goes through transpose).
MATMUL_FORMS = {
    "tiled": dict(kernel="matmul", LDSV=0, **MATMUL_TILES),
    "tiled_f4": dict(kernel="matmul", TSM=32, TSN=32, TSK=8, WPTM=4, WPTN=4, LDSV=1),
    "tiled_pref": dict(kernel="matmul", TSM=32, TSN=32, TSK=8, WPTM=4, WPTN=4, LDSV=0, PREF=1),
    "rb": dict(kernel="matmul_rb", RM=6, NV=2, lsize=(1, 4)),
    "rb_pf": dict(kernel="matmul_rb", RM=6, NV=2, PREFETCH=1, lsize=(1, 4)),
    "rb16": dict(kernel="matmul_rb", RM=6, NV=4, VW=16, PREFETCH=1, lsize=(1, 1)),  # the CPU row's
    "rb16_nv1": dict(kernel="matmul_rb", RM=6, NV=1, VW=16, lsize=(1, 2)),  # ops' narrowest for ragged N
}


@pytest.mark.parametrize("form", sorted(MATMUL_FORMS))
@pytest.mark.parametrize("ta,tb", [(0, 1), (0, 0), (1, 0)])
@pytest.mark.parametrize("M,N,K", [(37, 53, 29), (64, 32, 16), (1, 7, 3), (70, 65, 130)])
def test_matmul(dev, form, ta, tb, M, N, K):
    mm = MATMUL_FORMS[form]
    A = rng.normal(size=(K, M) if ta else (M, K)).astype(f32)
    B = rng.normal(size=(N, K) if tb else (K, N)).astype(f32)
    bias = rng.normal(size=N).astype(f32)
    R = rng.normal(size=(M, N)).astype(f32)
    C0 = rng.normal(size=(M, N)).astype(f32)
    E0 = rng.normal(size=(M, N)).astype(f32)
    opA = A.T.astype(np.float64) if ta else A.astype(np.float64)
    opB = B.T.astype(np.float64) if tb else B.astype(np.float64)
    Bdev, tbk = B, tb
    if mm["kernel"] == "matmul_rb" and tb:
        Bdev, tbk = np.ascontiguousarray(B.T), 0
    gsize, lsize = matmul_launch(mm, M, N)
    # (bias, resid, accum, epilogue): 1 also writes E = gelu(C), 2 multiplies C by gelu'(E)
    for use_bias, use_r, accum, epi in [(0, 0, 0, 0), (1, 1, 0, 1), (0, 0, 1, 2)]:
        k = dev.kernel("matmul", mm["kernel"], TA=ta, TB=tbk, BIAS=use_bias, RESID=use_r, ACCUM=accum, EPI=epi,
                       **matmul_defines(mm))
        cbuf, ebuf = to_dev(dev, C0), to_dev(dev, E0)
        k(dev.queue, gsize, lsize, i32(M), i32(N), i32(K), to_dev(dev, A), i32(M if ta else K), to_dev(dev, Bdev),
          i32(K if tbk else N), cbuf, i32(N), to_dev(dev, bias) if use_bias else None,
          to_dev(dev, R) if use_r else None, f32(0.5), ebuf)
        want = 0.5 * opA @ opB + (bias if use_bias else 0) + (R if use_r else 0) + (C0 if accum else 0)
        what = f"matmul[{form}] ta={ta} tb={tb} epi={epi} {M}x{N}x{K}"
        if epi == 1:
            assert_close(from_dev(dev, ebuf, (M, N)), ref.gelu_forward(want), 1e-4, 1e-4, what + " E")
        if epi == 2:
            want = ref.gelu_backward(want, E0.astype(np.float64))
        assert_close(from_dev(dev, cbuf, (M, N)), want, 1e-4, 1e-4, what)


@pytest.mark.parametrize("ta", [0, 1])
def test_matmul_rb_tiles_same_bits(dev, ta):
    """matmul_rb sums each output over k in order whatever its tiles (RM, NV vectors of VW floats, local size):
    the same bits, every epilogue, so the tuning row never changes a model's bytes. (The partial last block's
    scalar epilogue may differ from the vector lanes' by an ulp, PoCL's scalar exp not being its vector one:
    Ops._rb_tiles keeps that tail to the last N mod 16 columns whatever it picks, test_rb_tiles_for_ragged_widths.)"""
    M, N, K = 50, 160, 70
    A = rng.normal(size=(K, M) if ta else (M, K)).astype(f32)
    B, bias = rng.normal(size=(K, N)).astype(f32), rng.normal(size=N).astype(f32)
    R, C0, E0 = (rng.normal(size=(M, N)).astype(f32) for _ in range(3))
    forms = [dict(kernel="matmul_rb", RM=rm, NV=nv, VW=vw, PREFETCH=pf, lsize=ls)
             for rm, nv, vw, pf, ls in [(6, 2, 8, 0, (1, 4)), (6, 5, 16, 1, (1, 1)), (6, 2, 16, 0, (1, 2)),
                                        (6, 1, 16, 1, (1, 1)), (4, 5, 8, 0, (2, 1))]]
    for use_bias, use_r, accum, epi in [(0, 0, 0, 0), (1, 1, 0, 1), (0, 0, 1, 2)]:
        outs = []
        for mm in forms:
            k = dev.kernel("matmul", "matmul_rb", TA=ta, TB=0, BIAS=use_bias, RESID=use_r, ACCUM=accum, EPI=epi,
                           **matmul_defines(mm))
            cbuf, ebuf = to_dev(dev, C0), to_dev(dev, E0)
            gsize, lsize = matmul_launch(mm, M, N)
            k(dev.queue, gsize, lsize, i32(M), i32(N), i32(K), to_dev(dev, A), i32(M if ta else K), to_dev(dev, B),
              i32(N), cbuf, i32(N), to_dev(dev, bias) if use_bias else None, to_dev(dev, R) if use_r else None,
              f32(0.5), ebuf)
            outs.append((from_dev(dev, cbuf, (M, N)), from_dev(dev, ebuf, (M, N))))
        for mm, (c, e) in zip(forms[1:], outs[1:]):
            assert np.array_equal(c.view(np.uint32), outs[0][0].view(np.uint32)), f"epi {epi} {mm}"
            assert np.array_equal(e.view(np.uint32), outs[0][1].view(np.uint32)), f"epi {epi} {mm} E"


def test_rb_tiles_for_ragged_widths(dev):
    """Ops._rb_tiles: the CPU row's 4 vectors of 16 columns, fewer where that shortens the scalar tail (N = 96: 2 x 48)."""
    from clgpt.model import ModelConfig
    from clgpt.ops import Ops

    ops = Ops(dev, ModelConfig(), 16)
    ops.mm = dict(kernel="matmul_rb", RM=6, NV=4, VW=16, PREFETCH=1, lsize=(1, 1))  # the AVX-512 CPU row's
    got = {N: ops._rb_tiles(N)["NV"] for N in (64, 128, 96, 160, 32, 16, 48, 260, 7)}
    assert got == {64: 4, 128: 4, 96: 3, 160: 2, 32: 2, 16: 1, 48: 3, 260: 4, 7: 4}, got
    assert ops._rb_tiles(96) is ops._rb_tiles(96)  # one dict per NV (kernels are cached by its id)
    for N in range(1, 400):  # the scalar tail is always the last N mod 16 columns (what 16-column tiles leave)
        assert N % (16 * ops._rb_tiles(N)["NV"]) == N % 16, N


@pytest.mark.parametrize("form", sorted(MATMUL_FORMS))
@pytest.mark.parametrize("M,N,K", [(37, 53, 29), (13, 64, 16)])
def test_matmul_swiglu_backward_epilogue(dev, form, M, N, K):
    """EPI 3 (llama's dense feed-forward backward): dact = dy @ W, and from h = gate | up (M, 2N) the
    product's epilogue writes dh = dgate | dup (rows 2N floats apart): the float64 reference and finite
    differences of silu(gate) * up."""
    from clgpt.models import reference_llama as ref_llama

    mm = MATMUL_FORMS[form]
    dy, W = rng.normal(size=(M, K)).astype(f32), rng.normal(size=(K, N)).astype(f32)
    h = (rng.normal(size=(M, 2 * N)) * 3).astype(f32)
    h[0, :2] = [-100.0, 100.0]  # saturated sigmoid: no NaN
    dact = dy.astype(np.float64) @ W
    dg, du = ref_llama.swiglu_backward(dact, h[:, :N], h[:, N:])
    gsize, lsize = matmul_launch(mm, M, N)
    fwd = lambda h: ref_llama.swiglu_forward(h[:, :N], h[:, N:])  # noqa: E731
    check_op(dev, "matmul", mm["kernel"], gsize, [("M", i32(M)), ("N", i32(N)), ("K", i32(K)), ("A", dy),
             ("lda", i32(K)), ("B", W), ("ldb", i32(N)), ("dh", np.zeros_like(h)), ("ldc", i32(2 * N)),
             ("bias", None), ("R", None), ("alpha", f32(1.0)), ("E", h)], {"dh": np.concatenate([dg, du], 1)},
             dict(TA=0, TB=0, BIAS=0, RESID=0, ACCUM=0, EPI=3, **matmul_defines(mm)), lsize=lsize, atol=1e-4,
             rtol=1e-4, fd=FD(fwd, {"h": h}, dact, grads={"dh": "h"}))


def _gpu_engine(launch="nvidia", **shape):
    """An Engine whose launch table row is a GPU's (split-K, batched attention, row kernels), on any device."""
    from clgpt.model import ModelConfig, init_params
    from clgpt.models.gpt2 import GPT2Engine as Engine

    cfg = ModelConfig(vocab_size=16, n_ctx=shape.get("T", 8), n_embd=shape.get("C", 16), n_head=shape.get("H", 2),
                      n_layer=1, n_ff=32)
    return Engine(cfg, init_params(cfg, 0), batch_size=shape.get("B", 1), seq_len=shape.get("T", 8),
                  knobs=Knobs(launch=launch))


@pytest.mark.parametrize("launch", ["nvidia", "gpu"])
@pytest.mark.parametrize("ta,tb", [(1, 0), (0, 0), (0, 1)])
@pytest.mark.parametrize("M,N,K", [(40, 37, 1100), (130, 7, 1500), (1100, 1030, 2048), (64, 300, 4096)])
def test_matmul_split_k(dev, launch, ta, tb, M, N, K):
    """Engine.matmul on a GPU row: small outputs with a deep K are split along K, the parts summed in order."""
    eng = _gpu_engine(launch)
    assert eng.ops.split_plan(M, N, K)[1] > 1
    A = rng.normal(size=(K, M) if ta else (M, K)).astype(f32)
    B = rng.normal(size=(N, K) if tb else (K, N)).astype(f32)
    C0 = rng.normal(size=(M, N)).astype(f32)
    want = 0.5 * (A.T if ta else A).astype(np.float64) @ (B.T if tb else B) + C0
    outs = []
    for _ in range(2):
        cbuf = to_dev(dev, C0)
        eng.matmul(M, N, K, to_dev(dev, A), to_dev(dev, B), cbuf, ta=ta, tb=tb, accum=True, alpha=0.5)
        outs.append(from_dev(dev, cbuf, (M, N)))
    assert_close(outs[0], want, 1e-4, 1e-4, f"split-K ta={ta} tb={tb} {M}x{N}x{K}")
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("B,T,C,H", [(2, 70, 16, 2), (1, 5, 8, 1), (2, 33, 24, 3)])
def test_attention_batched_matmuls(dev, B, T, C, H):
    """The GPU attention (batched causal matmuls + softmax rows) against the float64 reference."""
    eng = _gpu_engine(B=B, T=T, C=C, H=H)
    eng.ops.attn_gemm = True  # whatever the table's shortest sequence for it
    qkv = rng.normal(size=(B, T, 3 * C)).astype(f32)
    dout = rng.normal(size=(B, T, C)).astype(f32)
    want, att = ref.attention_forward(qkv, H)
    dqkv_want = ref.attention_backward(dout, qkv, att, H)
    qb, ob, ab = to_dev(dev, qkv), empty(dev, B * T * C), empty(dev, B * H * T * T)
    eng.ops.attention_forward(B, T, qb, ob, ab)
    assert_close(from_dev(dev, ob, (B, T, C)), want, 1e-5, 1e-4, "attention out")
    assert_close(from_dev(dev, ab, (B, H, T, T)), att, 1e-6, 1e-4, "attention att")
    dq, datt = empty(dev, B * T * 3 * C), empty(dev, B * H * T * T)
    eng.ops.attention_backward(B, T, to_dev(dev, dout), qb, ab, datt, dq)
    assert_close(from_dev(dev, dq, (B, T, 3 * C)), dqkv_want, 1e-5, 1e-4, "attention backward")


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

# ---------------- gelu ----------------
def test_gelu(dev):
    n = 1000
    x = (rng.normal(size=n) * 3).astype(f32)
    dy = rng.normal(size=n).astype(f32)
    check_op(dev, "gelu", "gelu_forward", (n,), [("n", i32(n)), ("x", x), ("y", np.zeros_like(x))],
             {"y": ref.gelu_forward(x)}, scaled=False)
    check_op(dev, "gelu", "gelu_backward", (n,), [("n", i32(n)), ("dy", dy), ("x", x), ("dx", np.zeros_like(x))],
             {"dx": ref.gelu_backward(dy, x)}, scaled=False, fd=FD(ref.gelu_forward, {"x": x}, dy, grads={"dx": "x"}))


# ---------------- attention ----------------
@pytest.mark.parametrize("vec", [0, 1])
@pytest.mark.parametrize("B,T,C,H", [(2, 7, 12, 3), (1, 1, 8, 1), (3, 9, 16, 2), (2, 5, 48, 3)])
def test_attention(dev, B, T, C, H, vec):
    D = C // H
    qkv = rng.normal(size=(B, T, 3 * C)).astype(f32)
    dout = rng.normal(size=(B, T, C)).astype(f32)
    want, att = ref.attention_forward(qkv, H)
    dqkv_want = ref.attention_backward(dout, qkv, att, H)
    kw = dict(C=C, H=H, D=D, SCALE=1.0 / math.sqrt(D), VEC=vec)
    g, BT = (T, B * H), [("B", i32(B)), ("T", i32(T))]
    out = check_op(dev, "attention", "attention_forward", g, [*BT, ("qkv", qkv), ("out", np.zeros_like(dout)),
                   ("att", np.zeros((B, H, T, T), f32))], {"out": want, "att": att}, kw, rtol=1e-4, scaled=False)
    # the backward is two kernels: the query side writes datt and dq, the key side dk and dv
    q = run_op(dev, "attention", "attention_backward_query", g, [*BT, ("dout", dout), ("qkv", qkv),
               ("att", out["att"]), ("datt", np.zeros_like(out["att"])), ("dqkv", np.zeros_like(qkv))], kw)
    check_op(dev, "attention", "attention_backward_key", g, [*BT, ("dout", dout), ("qkv", qkv), ("att", out["att"]),
             ("datt", q["datt"]), ("dqkv", q["dqkv"])], {"dqkv": dqkv_want}, kw, rtol=1e-4, scaled=False,
             fd=FD(lambda qkv: ref.attention_forward(qkv, H)[0], {"qkv": qkv}, dout, grads={"dqkv": "qkv"}))


# ---------------- softmax + cross-entropy ----------------
def test_softmax_xent(dev):
    N, V = 13, 37
    logits = (rng.normal(size=(N, V)) * 3).astype(f32)
    targets = rng.integers(0, V, N).astype(np.int32)
    mask = (rng.random(N) > 0.4).astype(f32)
    mask[0] = 1
    targets[mask == 0] = -1  # ignored where the mask is 0
    loss_want, probs = ref.softmax_xent_forward(logits, targets, mask)
    dl_want = ref.softmax_xent_backward(probs, targets, mask, dloss=0.7)
    out = run_op(dev, "xent", "xent_forward", (N,), [("N", i32(N)), ("logits", logits), ("targets", targets),
                 ("mask", mask), ("losses", np.zeros(N, f32)), ("lse", np.zeros(N, f32))], dict(V=V))
    loss = out["losses"].astype(np.float64).sum() / mask.sum()
    assert abs(loss - loss_want) < 1e-5 * abs(loss_want), f"xent loss {loss} vs {loss_want}"
    check_op(dev, "xent", "xent_backward", (V, N), [("N", i32(N)), ("s", f32(0.7 / mask.sum())), ("logits", logits),
             ("targets", targets), ("mask", mask), ("lse", out["lse"]), ("dl", np.zeros_like(logits))],
             {"dl": dl_want}, dict(V=V), atol=1e-6, rtol=1e-4, scaled=False,
             fd=FD(lambda logits: ref.softmax_xent_forward(logits, targets, mask)[0], {"logits": logits},
                   np.float64(0.7), grads={"dl": "logits"}))


# ---------------- embedding ----------------
def test_embedding(dev):
    B, T, V, C, n_ctx = 3, 6, 11, 5, 8
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    tokens[0, :3] = 4  # repeated token
    wte, wpe = rng.normal(size=(V, C)).astype(f32), rng.normal(size=(n_ctx, C)).astype(f32)
    dout = rng.normal(size=(B, T, C)).astype(f32)
    N = B * T
    fwd = lambda wte, wpe: ref.embedding_forward(tokens, wte, wpe)  # noqa: E731
    check_op(dev, "embedding", "embedding_forward", (C, N), [("N", i32(N)), ("T", i32(T)), ("tokens", tokens),
             ("wte", wte), ("wpe", wpe), ("out", np.zeros((B, T, C), f32))], {"out": fwd(wte, wpe)}, dict(C=C),
             atol=1e-6, rtol=1e-6)
    for Cr in (C, 16, 19):  # the CPU form, a row a work-item: float8 and scalar tails
        wte_r, wpe_r = rng.normal(size=(V, Cr)).astype(f32), rng.normal(size=(n_ctx, Cr)).astype(f32)
        check_op(dev, "embedding", "embedding_forward_rows", (N,), [("N", i32(N)), ("T", i32(T)), ("tokens", tokens),
                 ("wte", wte_r), ("wpe", wpe_r), ("out", np.zeros((B, T, Cr), f32))],
                 {"out": ref.embedding_forward(tokens, wte_r, wpe_r)}, dict(C=Cr), atol=1e-6, rtol=1e-6)
    dwte_want, dwpe_want = ref.embedding_backward(dout, tokens, V, n_ctx)
    tok = tokens.reshape(-1)
    order = np.argsort(tok, kind="stable").astype(np.int32)
    rows, starts = np.unique(tok[order], return_index=True)
    starts = np.append(starts, N).astype(np.int32)
    at = {"wte": wte, "wpe": wpe}
    check_op(dev, "embedding", "embedding_backward_wte", (C, len(rows)), [("n", i32(len(rows))),
             ("rows", rows.astype(np.int32)), ("starts", starts), ("order", order), ("dout", dout),
             ("dwte", np.zeros((V, C), f32))], {"dwte": dwte_want}, dict(C=C),
             fd=FD(fwd, at, dout, grads={"dwte": "wte"}, n=V * C))
    check_op(dev, "embedding", "embedding_backward_wpe", (C, T), [("B", i32(B)), ("T", i32(T)), ("dout", dout),
             ("dwpe", np.zeros((n_ctx, C), f32))], {"dwpe": dwpe_want}, dict(C=C),
             fd=FD(fwd, at, dout, grads={"dwpe": "wpe"}, n=n_ctx * C))


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


# ---------------- reference backward vs finite differences (float64) ----------------
def _check_fd(loss, inputs, grads, what, atol=1e-6, rtol=1e-5):
    for name, x in inputs.items():
        assert_close(grads[name], fd_grad(loss, x), atol, rtol, f"{what} d{name}")


def test_ref_layernorm_fd():
    x, w, b = rng.normal(size=(2, 3, 6)), rng.normal(size=6), rng.normal(size=6)
    R = rng.normal(size=(2, 3, 6))
    f = lambda: (ref.layernorm_forward(x, w, b)[0] * R).sum()  # noqa: E731
    _, (mean, rstd) = ref.layernorm_forward(x, w, b)
    dx, dw, db = ref.layernorm_backward(R, x, w, mean, rstd)
    _check_fd(f, {"x": x, "w": w, "b": b}, {"x": dx, "w": dw, "b": db}, "layernorm")


def test_ref_linear_fd():
    x, W, b = rng.normal(size=(2, 3, 5)), rng.normal(size=(4, 5)), rng.normal(size=4)
    R = rng.normal(size=(2, 3, 4))
    f = lambda: (ref.linear_forward(x, W, b) * R).sum()  # noqa: E731
    dx, dW, db = ref.linear_backward(R, x, W)
    _check_fd(f, {"x": x, "W": W, "b": b}, {"x": dx, "W": dW, "b": db}, "linear")


def test_ref_gelu_fd():
    x, R = rng.normal(size=20) * 2, rng.normal(size=20)
    _check_fd(lambda: (ref.gelu_forward(x) * R).sum(), {"x": x}, {"x": ref.gelu_backward(R, x)}, "gelu")


def test_ref_attention_fd():
    B, T, C, H = 2, 4, 6, 2
    qkv, R = rng.normal(size=(B, T, 3 * C)), rng.normal(size=(B, T, C))
    _, att = ref.attention_forward(qkv, H)
    dqkv = ref.attention_backward(R, qkv, att, H)
    _check_fd(lambda: (ref.attention_forward(qkv, H)[0] * R).sum(), {"qkv": qkv}, {"qkv": dqkv}, "attention")


def test_ref_softmax_xent_fd():
    logits = rng.normal(size=(3, 4, 7))
    targets = rng.integers(0, 7, (3, 4))
    mask = (rng.random((3, 4)) > 0.3).astype(float)
    mask[0, 0] = 1
    _, probs = ref.softmax_xent_forward(logits, targets, mask)
    d = ref.softmax_xent_backward(probs, targets, mask)
    f = lambda: ref.softmax_xent_forward(logits, targets, mask)[0]  # noqa: E731
    _check_fd(f, {"logits": logits}, {"logits": d}, "softmax_xent")


def test_ref_embedding_fd():
    tokens = np.array([[1, 3, 1], [0, 3, 3]])
    wte, wpe, R = rng.normal(size=(5, 4)), rng.normal(size=(6, 4)), rng.normal(size=(2, 3, 4))
    dwte, dwpe = ref.embedding_backward(R, tokens, 5, 6)
    f = lambda: (ref.embedding_forward(tokens, wte, wpe) * R).sum()  # noqa: E731
    _check_fd(f, {"wte": wte, "wpe": wpe}, {"wte": dwte, "wpe": dwpe}, "embedding")


def test_ref_adamw_matches_formula():
    p, g, m, v = 1.5, 0.2, 0.1, 0.04
    t, lr, b1, b2, eps, wd = 2, 0.1, 0.9, 0.95, 1e-8, 0.1
    pn, mn, vn = ref.adamw_update(np.array(p), np.array(g), np.array(m), np.array(v), t, lr, b1, b2, eps, wd, True)
    m2, v2 = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    want = p * (1 - lr * wd) - lr * (m2 / (1 - b1**t)) / (math.sqrt(v2 / (1 - b2**t)) + eps)
    assert abs(float(pn) - want) < 1e-12 and abs(float(mn) - m2) < 1e-15 and abs(float(vn) - v2) < 1e-15


# ---------------- CPU forms (xent_fused, the float8 transposes, bias sums, attention forms) ----------------
@pytest.mark.parametrize("N,V", [(13, 37), (9, 512), (5, 4099)])
def test_xent_fused(dev, N, V):
    """Loss as xent_forward; dlogits = mask * (softmax - onehot), unscaled (the engine's matmuls scale it)."""
    logits = (rng.normal(size=(N, V)) * 3).astype(f32)
    targets = rng.integers(0, V, N).astype(np.int32)
    mask = (rng.random(N) > 0.4).astype(f32) * rng.choice([1.0, 0.5], N).astype(f32)
    mask[0] = 1
    targets[mask == 0] = -1  # ignored where the mask is 0
    loss_want, probs = ref.softmax_xent_forward(logits, targets, mask)
    dl_want = ref.softmax_xent_backward(probs, targets, mask, dloss=0.7)
    lb, tb, mb = to_dev(dev, logits), to_dev(dev, targets), to_dev(dev, mask)
    losses, lse, dl = empty(dev, N), empty(dev, N), to_dev(dev, np.full(N * V, np.nan, f32))
    dev.kernel("xent", "xent_fused", V=V)(dev.queue, (N,), None, i32(N), lb, tb, mb, losses, lse, dl)
    loss = from_dev(dev, losses, N).astype(np.float64).sum() / mask.sum()
    assert abs(loss - loss_want) < 1e-5 * abs(loss_want), f"xent_fused loss {loss} vs {loss_want}"
    l64 = logits.astype(np.float64)
    lse_want = np.log(np.exp(l64 - l64.max(1, keepdims=True)).sum(1)) + l64.max(1)
    assert_close(from_dev(dev, lse, N), lse_want, 1e-5, 1e-6, "xent_fused lse")
    got = from_dev(dev, dl, (N, V)).astype(np.float64) * (0.7 / mask.astype(np.float64).sum())
    assert_close(got, dl_want, 1e-6, 1e-4, "xent_fused dlogits")


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


@pytest.mark.parametrize("B,T,C,H", [(2, 7, 12, 3), (1, 1, 8, 1), (3, 9, 16, 2), (2, 13, 48, 3), (1, 21, 64, 2)])
def test_attention_u4(dev, B, T, C, H):
    """kernels/attention.cl's 4-keys-at-a-time CPU attention: the float64 reference's values; given the same att, its
    query backward gives attention.cl's (VEC=1) datt and dq bit for bit (backward_key reads that datt)."""
    D = C // H
    qkv = rng.normal(size=(B, T, 3 * C)).astype(f32)
    dout = rng.normal(size=(B, T, C)).astype(f32)
    want, att = ref.attention_forward(qkv, H)
    dqkv_want = ref.attention_backward(dout, qkv, att, H)
    kw = dict(C=C, H=H, D=D, SCALE=1.0 / math.sqrt(D))
    qb, dob = to_dev(dev, qkv), to_dev(dev, dout)
    res = {}
    for form, (fw, bq) in {"u4": ("attention", "_u4"), "vec": ("attention", "")}.items():
        kf = dict(kw, VEC=1)
        ob, ab = empty(dev, B * T * C), empty(dev, B * H * T * T)
        datt, dq = empty(dev, B * H * T * T), empty(dev, B * T * 3 * C)
        dev.kernel(fw, "attention_forward" + bq, **kf)(dev.queue, (T, B * H), None, i32(B), i32(T), qb, ob, ab)
        if form == "vec":  # the same att into both backwards
            cl.enqueue_copy(dev.queue, ab, res["u4"][1])
        dev.kernel(fw, "attention_backward_query" + bq, **kf)(dev.queue, (T, B * H), None, i32(B), i32(T), dob, qb,
                                                              ab, datt, dq)
        dev.kernel("attention", "attention_backward_key", **dict(kw, VEC=1))(dev.queue, (T, B * H), None, i32(B),
                                                                             i32(T), dob, qb, ab, datt, dq)
        res[form] = [from_dev(dev, ob, (B, T, C)), from_dev(dev, ab, (B, H, T, T)),
                     from_dev(dev, datt, (B, H, T, T)), from_dev(dev, dq, (B, T, 3 * C))]
    out, a, _, dq = res["u4"]
    assert_close(out, want, 1e-5, 1e-4, "attention_forward_u4 out")
    assert_close(a, att, 1e-6, 1e-4, "attention_forward_u4 att")
    assert_close(dq, dqkv_want, 1e-5, 1e-4, "attention_backward_query_u4")
    res["u4"][2], res["vec"][2] = np.tril(res["u4"][2]), np.tril(res["vec"][2])  # datt above t: not written
    for x, y, what in zip(res["u4"][2:], res["vec"][2:], ("datt", "dqkv")):
        assert np.array_equal(x, y), f"attention u4 {what} differs from attention.cl's"


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


@pytest.mark.parametrize("ta,tb", [(0, 1), (0, 0), (1, 0)])
@pytest.mark.parametrize("M,N,K", [(70, 128, 130), (13, 64, 256), (40, 192, 64)])
def test_engine_matmul_ld_pad(dev, ta, tb, M, N, K):
    """Engine.matmul on the CPU row with op(B) (and the transposed op(A)) in rows padded off multiples of 64
    floats (ld_pad): the float64 product, and bit for bit the unpadded result (same order of summation)."""
    from clgpt.model import ModelConfig, init_params
    from clgpt.models.gpt2 import GPT2Engine as Engine

    cfg = ModelConfig(vocab_size=16, n_ctx=8, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    eng = Engine(cfg, init_params(cfg, 0), batch_size=1, seq_len=8, device=dev, knobs=Knobs(launch="cpu"))
    assert eng.ops.launch.get("ld_pad") and "copy_ld_v8" in eng.ops.k
    A = rng.normal(size=(K, M) if ta else (M, K)).astype(f32)
    B = rng.normal(size=(N, K) if tb else (K, N)).astype(f32)
    C0 = rng.normal(size=(M, N)).astype(f32)
    want = (A.T if ta else A).astype(np.float64) @ (B.T if tb else B).astype(np.float64) + C0
    outs = []
    for pad, ta_direct in [(0, 0), (16, 0), (16, 1 << 30)]:  # ta_direct 0: op(A) through a transposed copy
        eng.ops.launch = dict(eng.ops.launch, ld_pad=pad, ld_pad_copy=0, ta_direct=ta_direct)
        cbuf = to_dev(dev, C0)
        eng.matmul(M, N, K, to_dev(dev, A), to_dev(dev, B), cbuf, ta=ta, tb=tb, accum=True)
        outs.append(from_dev(dev, cbuf, (M, N)))
        assert_close(outs[-1], want, 1e-4, 1e-4, f"ld_pad={pad} ta={ta} tb={tb} {M}x{N}x{K}")
    assert np.array_equal(outs[0], outs[1]), "padded op(B) changed the result"


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


@pytest.mark.parametrize("B,T,C,H", [(2, 37, 64, 2), (1, 5, 32, 2), (2, 13, 48, 3), (1, 1, 16, 1)])
def test_attention_rb(dev, B, T, C, H):
    """kernels/attention.cl's register-blocked CPU attention products (D % 16 == 0): the u4 kernels with ROWS_RB=1
    plus attention_rows_rb (att @ v, datt @ k) and attention_backward_key_rb give the float64 reference's
    values, and att, datt, out and dqkv bit for bit as the u4 kernels with attention.cl's key backward."""
    D = C // H
    qkv = rng.normal(size=(B, T, 3 * C)).astype(f32)
    dout = rng.normal(size=(B, T, C)).astype(f32)
    want, att = ref.attention_forward(qkv, H)
    dqkv_want = ref.attention_backward(dout, qkv, att, H)
    kw = dict(C=C, H=H, D=D, SCALE=1.0 / math.sqrt(D), VEC=1)
    qb, dob = to_dev(dev, qkv), to_dev(dev, dout)
    q, res = dev.queue, {}
    for rb in (0, 1):
        ob, ab = empty(dev, B * T * C), empty(dev, B * H * T * T)
        datt, dq = empty(dev, B * H * T * T), empty(dev, B * T * 3 * C)
        kf = dict(kw, ROWS_RB=rb)
        dev.kernel("attention", "attention_forward_u4", **kf)(q, (T, B * H), None, i32(B), i32(T), qb, ob, ab)
        g_rows = (-(-T // 6), B * H * (D // 16))
        rows = dev.kernel("attention", "attention_rows_rb", **kw)
        if rb:
            rows(q, g_rows, None, i32(B), i32(T), ab, qb, i32(2 * C), i32(3 * C), ob, i32(0), i32(C), f32(1.0))
        dev.kernel("attention", "attention_backward_query_u4", **kf)(q, (T, B * H), None, i32(B), i32(T), dob, qb, ab,
                                                                datt, dq)
        if rb:
            rows(q, g_rows, None, i32(B), i32(T), datt, qb, i32(C), i32(3 * C), dq, i32(0), i32(3 * C),
                 f32(1.0 / math.sqrt(D)))
            dev.kernel("attention", "attention_backward_key_rb", **kw)(q, (-(-T // 6), B * H * (D // 8)), None, i32(B),
                                                                  i32(T), dob, qb, ab, datt, dq)
        else:
            dev.kernel("attention", "attention_backward_key", **dict(kw, VEC=1))(q, (T, B * H), None, i32(B),
                                                                                 i32(T), dob, qb, ab, datt, dq)
        res[rb] = [from_dev(dev, ob, (B, T, C)), from_dev(dev, ab, (B, H, T, T)),
                   np.tril(from_dev(dev, datt, (B, H, T, T))), from_dev(dev, dq, (B, T, 3 * C))]
    out, a, _, dq = res[1]
    assert_close(out, want, 1e-5, 1e-4, "attention rb out")
    assert_close(a, att, 1e-6, 1e-4, "attention rb att")
    assert_close(dq, dqkv_want, 1e-5, 1e-4, "attention rb dqkv")
    for x, y, what in zip(res[1], res[0], ("out", "att", "datt", "dqkv")):
        assert np.array_equal(x, y), f"attention rb {what} differs from the u4 kernels'"


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


@pytest.mark.parametrize("V", [260, 1003])
def test_xent_forward_wg_one_pass_against_float64(dev, V):
    """xent_forward_wg (GPUs, one pass with a running max per work-item, float4 where V % 4 == 0): losses and lse
    against float64 logsumexp, logits spread wide enough that the running max rescales; masked and out-of-range
    targets give 0."""
    N, LW = 7, 64
    r = np.random.default_rng(5)
    logits = (r.normal(size=(N, V)) * 8 + np.linspace(-20, 20, V)[None] * r.choice([-1, 1], (N, 1))).astype(f32)
    targets = r.integers(0, V, N).astype(i32)
    targets[2] = V
    mask = np.ones(N, f32)
    mask[4] = 0
    out = run_op(dev, "xent", "xent_forward_wg", (N * LW,), [("N", i32(N)), ("logits", logits), ("targets", targets),
                 ("mask", mask), ("losses", np.zeros(N, f32)), ("lse", np.zeros(N, f32))], dict(V=V, LW=LW),
                 lsize=(LW,))
    x = logits.astype(np.float64)
    lse = x.max(1) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1))
    want = np.where((mask != 0) & (targets < V), lse - x[np.arange(N), np.minimum(targets, V - 1)], 0.0)
    err = np.abs(out["lse"] - lse).max()
    assert err < 1e-5 * np.abs(lse).max(), f"lse max diff {err}"
    err = np.abs(out["losses"] - want).max()
    assert err < 1e-5 * np.abs(lse).max(), f"losses max diff {err}"
    assert out["losses"][2] == 0 and out["losses"][4] == 0
