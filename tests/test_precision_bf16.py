"""The bf16 GEMM kernels/matmul_bf16.cl (cp.async, ldmatrix and mma emulated) against the portable kernel bit
for bit, and the tiled bf16 copies its products read: rounding, layout, when they are made and kept, and the
kernels that write them (column sums, cross-entropy backward plain and label-smoothed, LayerNorm, expert operands,
gate | up); the GPU rows' gradient norm in work-groups."""

from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from clgpt.errors import ClgptError
from clgpt.models import reference as ref

from conftest import from_dev, to_dev
from opcheck import bf16_pattern as _bf16_pattern, fd_grad, run_op, tiled_index as _tiled_index
from precisioncheck import _bf16_ops, operands, run_matmul

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(4321)


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


def test_bf16_gemm_in_bands_of_tiles_covers_every_tile_once(dev):
    """With TILE_BAND (epilogue.cl tile_of_group: work-groups take their tiles down bands of rows, the last band
    shorter) every output tile is computed once, as in launch order: the product equals the portable kernel's."""
    ops = _bf16_ops("bands")
    M, N, K = 131, 70, 67  # 5 rows of tiles (bands of 3 and 2), 3 columns
    A, B = operands(0, 1, M, N, K)
    bias = rng.normal(size=N).astype(f32)
    C0 = rng.normal(size=(M, N)).astype(f32)
    mm = ops.bf16[0]
    assert mm["TILE_BAND"] == 3
    cbuf = to_dev(dev, C0)
    args = ops.bf16_operands(mm, M, N, K, to_dev(dev, A), to_dev(dev, B), 0, 1)
    ops.matmul_bf16(mm, M, N, *args, cbuf, bias=to_dev(dev, bias), resid=None, accum=True, alpha=0.5, epi=0,
                    E=cbuf, split_k=False)
    want = run_matmul(dev, "tiled", "bf16", A, B, 0, 1, M, N, K, alpha=0.5, bias=bias, C0=C0)
    assert np.array_equal(from_dev(dev, cbuf, (M, N)), want[0])


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
    ops.k["to_bf16_tiled"] = dev.kernel("matmul_bf16", "to_bf16", TILED=1, **ops.bf16_options)
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
    got = _xent_backward_tiled(dev, logits, targets, mask, lse, s)
    assert not got[N:].any() and not got[:, V:].any()
    assert np.abs(got[:N, :V] - want).max() <= 2.0**-8 * np.abs(want).max()


@pytest.mark.parametrize("V", [72, 70])
def test_xent_backward_tiled_on_bf16_logits_against_float64(dev, V):
    """xent_backward_tiled with -D LOGITS_BF16 (the logits as the head's product wrote them, bf16 row-major): the
    gradient of the logits the bf16 halves hold, into the tiled copy, zeros outside N x V; against float64, to bf16's
    rounding (V % 8 == 0: a row's 8 halves in one load). The fp32 logits' gradient differs from it by more than
    that, so reading them as floats fails."""
    N, s = 37, 0.37
    logits = rng.normal(size=(N, V)).astype(f32) * 3
    half = ref.round_bf16(logits)
    targets = rng.integers(0, V, N).astype(np.int32)
    mask = (rng.random(N) > 0.3).astype(f32)
    l64 = half.astype(np.float64)
    lse = np.log(np.exp(l64).sum(1))
    want = s * mask[:, None] * (np.exp(l64 - lse[:, None]) - (np.arange(V)[None, :] == targets[:, None]))
    bits = (half.view(np.uint32) >> 16).astype(np.uint16)
    got = _xent_backward_tiled(dev, bits, targets, mask, lse, s, LOGITS_BF16=1)
    assert not got[N:].any() and not got[:, V:].any()
    assert np.abs(got[:N, :V] - want).max() <= 2.0**-8 * np.abs(want).max()


def _xent_backward_tiled(dev, logits, targets, mask, lse, s, **ls):
    """xent_backward_tiled's output (64 x 128, the tiled bf16 copy read back as fp32 rows) for N x V logits; ls: its
    -D LS or LOGITS_BF16, if any."""
    N, V = logits.shape
    Rp, Cp = 64, 128
    k = dev.kernel("xent", "xent_backward_tiled", V=V, **ls)
    out = np.empty(Rp * Cp, np.uint16)
    o_buf = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, out.nbytes)
    k(dev.queue, (Cp // 8, Rp), (4, 32), np.int32(N), np.float32(s), to_dev(dev, logits), to_dev(dev, targets),
      to_dev(dev, mask), to_dev(dev, lse.astype(f32)), o_buf)
    cl.enqueue_copy(dev.queue, out, o_buf, is_blocking=True)
    return (out[_tiled_index(Rp, Cp)].astype(np.uint32) << 16).view(f32)


def test_xent_backward_tiled_label_smoothed_against_float64_and_fd(dev):
    """xent_backward_tiled with -D LS: s * mask * (softmax - (1 - LS) onehot - LS / V) into the tiled bf16 copy, zeros
    outside N x V; against the float64 reference and finite differences of its smoothed loss, each element to bf16's
    rounding."""
    r = np.random.default_rng(77)
    N, V, s, eps = 37, 70, 0.37, 0.1
    logits = r.normal(size=(N, V)).astype(f32) * 3
    targets = r.integers(0, V, N).astype(np.int32)
    mask = (r.random(N) > 0.3).astype(f32)
    targets[mask == 0] = -1
    msum = float(mask.astype(np.float64).sum())
    _, probs = ref.softmax_xent_forward(logits, targets, mask, eps)
    want = ref.softmax_xent_backward(probs, targets, mask, dloss=s * msum, label_smoothing=eps)
    l64 = logits.astype(np.float64)
    lse = np.log(np.exp(l64).sum(1))
    got = _xent_backward_tiled(dev, logits, targets, mask, lse, s, LS=eps)
    assert not got[N:].any() and not got[:, V:].any()
    bad = np.abs(got[:N, :V] - want) > 2.0**-8 * np.abs(want) + 1e-6
    assert not bad.any(), f"{bad.sum()} elements off, max diff {np.abs(got[:N, :V] - want).max():.3e}"
    idx, num = fd_grad(lambda logits: ref.softmax_xent_forward(logits, targets, mask, eps)[0], {"logits": logits},
                       np.float64(s * msum), "logits", 60, 1e-6)
    near = np.abs(got[:N, :V].reshape(-1)[idx] - num) <= 2.0**-8 * np.abs(num) + 1e-6
    assert near.all(), f"against finite differences: {(~near).sum()} of {len(idx)} off"


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
    ops.k["to_bf16_tiled"] = dev.kernel("matmul_bf16", "to_bf16", TILED=1, **ops.bf16_options)
    rows, cols = 100, 70
    X, Y, Z = (rng.normal(size=(rows, cols)).astype(f32) for _ in range(3))
    xb, yb, zb = to_dev(dev, X), to_dev(dev, Y), to_dev(dev, Z)
    ops.stable(xb)
    launches = []
    real = ops.launcher.launch
    monkeypatch.setattr(ops.launcher, "launch", lambda *a: (launches.append(a[0]), real(*a)))
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


def _wgmma_recorded(ops, monkeypatch, calls):
    """A wgmma backend on the bf16 Ops' bf16 GEMM and copies (no sm_90a here): every product on wgmma but those
    with GELU' in the epilogue, their launches recorded in calls as (epi, tiled_out), not run."""
    from clgpt.ops.gemm.wgmma import WgmmaGemm

    gemm = WgmmaGemm(ops.facts, ops.gemms.bf16)
    monkeypatch.setattr(gemm, "on_wgmma", lambda M, N, K, epi=0: epi != 2)
    monkeypatch.setattr(gemm, "matmul_wgmma", lambda *a, tiled_out=None, **_: calls.append((a[12], tiled_out)))
    return gemm


def test_head_logits_for_the_loss_in_bf16_on_wgmma(dev, monkeypatch):
    """On wgmma (emulated: the product recorded, not run) the head's product for a loss writes its logits as bf16
    (OUT_BF16) and the cross-entropy reads them so: the forward's losses and the gradient's tiled copy, computed
    here on bf16 logits put where the product writes them, against float64. For the host (for_loss False), with
    V % 4 != 0 or off wgmma the logits stay fp32 and the fp32 kernels read them."""
    from clgpt.ops.layers import Layers

    ops = _bf16_ops()
    calls = []
    gemm = _wgmma_recorded(ops, monkeypatch, calls)
    monkeypatch.setattr(gemm, "matmul_wgmma", lambda *a, half=False, **_: calls.append(("wgmma", half)))
    if not ops.facts.rows:
        ops.facts.rows = 64
    monkeypatch.setattr(ops.facts, "wgmma", ops.facts.wgmma or ({}, {}))
    ly = Layers(ops.facts, gemm)
    names, launch = [], ly.launcher.launch
    kname = {id(v): name for name, v in ly.k.items()}
    monkeypatch.setattr(ly.launcher, "launch", lambda k, *a: (names.append(kname.get(id(k))), launch(k, *a)))
    N, C, V = 8, 16, ops.cfg.vocab_size
    x, W, logits, dlogits = ops.buf(N * C), ops.buf(V * C), ops.buf(N * V), ops.buf(N * V)
    ly.head_logits(N, C, x, W, logits, for_loss=True)
    assert calls == [("wgmma", True)]
    r = np.random.default_rng(9)
    half = ref.round_bf16((r.normal(size=(N, V)) * 3).astype(f32))
    cl.enqueue_copy(dev.queue, logits, (half.view(np.uint32) >> 16).astype(np.uint16), is_blocking=True)
    targets, mask = r.integers(0, V, N).astype(np.int32), np.ones(N, f32)
    tb, mb, losses, lse = to_dev(dev, targets), to_dev(dev, mask), ops.buf(N), ops.buf(N)
    ly.xent_forward(N, logits, tb, mb, losses, lse, dlogits)
    x64 = half.astype(np.float64)
    lse_want = np.log(np.exp(x64).sum(1))
    assert np.abs(from_dev(dev, losses, N) - (lse_want - x64[np.arange(N), targets])).max() < 1e-5
    with ly.copies.reuse(dlogits):
        assert ly.xent_backward(N, 0.5, logits, tb, mb, lse, dlogits) == 1.0
        copy, Rp, Cp = ly.copies.book.hit((dlogits.int_ptr, N, V))
        out = np.empty(Rp * Cp, np.uint16)
        cl.enqueue_copy(dev.queue, out, copy, is_blocking=True)
    got = (out[_tiled_index(Rp, Cp)].astype(np.uint32) << 16).view(f32)[:N, :V]
    want = 0.5 * (np.exp(x64 - lse_want[:, None]) - (np.arange(V)[None, :] == targets[:, None]))
    assert np.abs(got - want).max() <= 2.0**-8 * np.abs(want).max()
    assert names == ["xent_forward_wg_h", "xent_backward_tiled_h"]
    ly.head_logits(N, C, x, W, logits, for_loss=False)  # for the host: fp32, and the fp32 kernels after
    assert calls[-1] == ("wgmma", False)
    ly.xent_forward(N, logits, tb, mb, losses, lse, dlogits)
    assert names[-1] == "xent_forward_wg"
    monkeypatch.setattr(gemm, "on_wgmma", lambda M, N, K, epi=0: False)
    ly.head_logits(N, C, x, W, logits, for_loss=True)  # off wgmma: fp32
    assert ly._logit_form(logits) == ""


def test_products_that_write_only_their_tiled_copy(dev, monkeypatch):
    """On wgmma (emulated here: the launches recorded, not run), the GELU product writes g = gelu(h) only as g's
    kept tiled copy (TILED_OUT 1) and the GELU' product dh only as dh's tiled copy with its column sums (TILED_OUT
    2), which dh's reuse block then takes without a copy; reading such a dh any other way, or never, is an error;
    sizes off multiples of 64 keep the fp32 outputs."""
    ops = _bf16_ops()
    calls = []
    gemm = _wgmma_recorded(ops, monkeypatch, calls)
    monkeypatch.setattr(ops.launcher, "launch", lambda *a: calls.append(("launch", a[0])))
    ops.k["to_bf16_colsum_gelu"] = ops.k["to_bf16_colsum"] = "copy"
    monkeypatch.setattr(ops.facts, "colsum_copies", True)
    monkeypatch.setattr(ops.facts, "tiled_outputs", True)
    M, N, K = 128, 192, 64
    A, B, h, g, dh = (ops.buf(n) for n in (M * K, N * K, M * N, M * N, M * N))
    ops.stable(g)
    gemm.matmul_epi(M, N, K, A, B, h, 0, 1, None, None, False, 1.0, 1, g)
    assert calls[-1][0] == 1 and calls[-1][1][1] is None
    assert ops.tiled_copy(0, g, M, N) == (calls[-1][1][0], M, N) and calls[-1][0] == 1  # kept: no copy made
    gemm.matmul_epi(M, N, K, A, B, dh, 0, 0, None, None, False, 1.0, 2, h)
    copy, parts = calls[-1][1]
    assert calls[-1][0] == 2 and ops.copies.premade[dh.int_ptr][:3] == (copy, M, N)
    with ops.reuse(dh):
        assert ops.tiled_copy(2, dh, M, N) == (copy, M, N) and ops.tiled_copy(0, dh, M, N) == (copy, M, N)
        assert ops.copies.colsums == ((dh.int_ptr, M, N), M // 64, parts) and calls[-1][0] == 2
    gemm.matmul_epi(M, N, K, A, B, dh, 0, 0, None, None, False, 1.0, 2, h)
    with pytest.raises(ClgptError, match="read as fp32"):
        ops.settle(dh)
    with pytest.raises(ClgptError, match="never read"):
        with ops.reuse(dh):
            pass
    ops.forget_copies()
    gemm.matmul_epi(M + 8, N, K, A, B, h, 0, 1, None, None, False, 1.0, 1, g)  # M off 64: fp32 g
    assert calls[-1] == (1, None) and not ops.copies.kept


def test_swiglu_gradient_written_only_as_its_tiled_copy(dev, monkeypatch):
    """On wgmma (emulated here: the launches recorded, not run), the SwiGLU backward's product (EPI 3, dgate | dup
    rows 2N apart) writes its output only as the (M, 2N) tiled copy (TILED_OUT 3), which its reuse block takes
    without a copy; sizes off multiples of 64 keep the fp32 output."""
    ops = _bf16_ops()
    calls = []
    gemm = _wgmma_recorded(ops, monkeypatch, calls)
    monkeypatch.setattr(ops.launcher, "launch", lambda *a: calls.append(("launch", a[0])))
    monkeypatch.setattr(ops.facts, "tiled_outputs", True)
    M, N, K = 128, 192, 64
    A, B, hgu, dhgu = (ops.buf(n) for n in (M * K, N * K, M * 2 * N, M * 2 * N))
    gemm.matmul_epi(M, N, K, A, B, dhgu, 0, 0, None, None, False, 1.0, 3, hgu, ldc=2 * N)
    copy, part = calls[-1][1]
    assert calls[-1][0] == 3 and part is None and ops.copies.premade[dhgu.int_ptr][:3] == (copy, M, 2 * N)
    with ops.reuse(dhgu):
        assert ops.tiled_copy(0, dhgu, M, 2 * N) == (copy, M, 2 * N) == ops.tiled_copy(1, dhgu, M, 2 * N)
    assert not any(c[0] == "launch" for c in calls)
    gemm.matmul_epi(M + 8, N, K, A, B, dhgu, 0, 0, None, None, False, 1.0, 3, hgu, ldc=2 * N)
    assert calls[-1] == (3, None) and dhgu.int_ptr not in ops.copies.premade


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


@pytest.mark.parametrize("arch,N,dx_copy", [("llama", 64, True), ("gpt2", 128, True), ("llama", 128, False),
                                             ("gpt2", 100, True)])
def test_norm_backward_writes_dx_copy_for_the_products_after_it(dev, monkeypatch, arch, N, dx_copy):
    """rmsnorm_backward / layernorm_backward with dx_copy on a GPU row with tiled outputs (as on wgmma): the
    DX_TILED form writes dx (accumulating) and the weight gradients bit for bit as the plain form does, and beside
    dx its tiled copy, the bf16 of that dx, which dx's next reuse block takes without a launch of its own; N off a
    multiple of 64, or dx_copy off: the plain form, and the reuse block makes its copy. A later write of dx without
    a copy drops the one written before."""
    from clgpt.model import ModelConfig
    from clgpt.ops import Ops
    from precisioncheck import emulated_knobs

    C = 128
    cfg = ModelConfig(arch=arch, vocab_size=16, n_ctx=8, n_embd=C, n_head=2, n_layer=1, n_ff=192)
    ops = Ops(dev, cfg, 8, "bf16", knobs=emulated_knobs())  # the bf16 GEMM's copies, emulated
    assert ops.facts.ln_rows
    ops.facts.tiled_outputs = True  # what wgmma sets (sm_90a): no such device here
    ops.build_llama() if arch == "llama" else ops.build_gpt2()
    ops.k["to_bf16_tiled"] = dev.kernel("matmul_bf16", "to_bf16", TILED=1, **ops.bf16_options)  # the reuse copy's
    x, dout, dx0 = (rng.normal(size=(N, C)).astype(f32) for _ in range(3))
    w = rng.normal(size=C).astype(f32)
    x64 = x.astype(np.float64)
    mean = x64.mean(1)
    rstd = 1.0 / np.sqrt(((x64 - mean[:, None]) ** 2).mean(1) + 1e-5 if arch == "gpt2" else (x64 ** 2).mean(1) + 1e-5)
    stats = [to_dev(dev, a.astype(f32)) for a in ((rstd,) if arch == "llama" else (mean, rstd))]
    ins = [to_dev(dev, a) for a in (dout, x)]
    zeros = lambda: to_dev(dev, np.zeros(C, f32))  # noqa: E731  (dw, db accumulate)
    grads = {k: [zeros() for _ in range(1 if arch == "llama" else 2)] for k in ("plain", "copy")}
    dxs = {k: to_dev(dev, dx0) for k in grads}

    def backward(kind, **kw):
        if arch == "llama":
            ops.rmsnorm_backward(N, *ins, *stats, to_dev(dev, w), *grads[kind], dxs[kind], 1, **kw)
        else:
            ops.layernorm_backward(N, *ins, *stats, to_dev(dev, w), *grads[kind], dxs[kind], 1, **kw)

    backward("plain")
    names = []
    real = ops.launcher.launch
    monkeypatch.setattr(ops.launcher, "launch", lambda *a: (names.append(a[0].function_name), real(*a)))
    backward("copy", dx_copy=dx_copy)
    beside = dx_copy and N % 64 == 0
    norm = "rmsnorm" if arch == "llama" else "layernorm"
    assert names[0] == f"{norm}_backward_rows"
    assert (ops.copies.beside_copies.get(dxs["copy"].int_ptr) is not None) is beside
    got = from_dev(dev, dxs["copy"], (N, C))
    assert np.array_equal(got, from_dev(dev, dxs["plain"], (N, C)))
    for a, b in zip(grads["plain"], grads["copy"]):
        assert np.array_equal(from_dev(dev, a, C), from_dev(dev, b, C))
    names.clear()
    dx = dxs["copy"]
    with ops.reuse(dx):
        copy, Rp, Cp = ops.tiled_copy(0, dx, N, C)
        assert ops.tiled_copy(1, dx, N, C)[0] is copy
    assert names == ([] if beside else ["to_bf16"])
    host = np.empty(Rp * Cp, np.uint16)
    cl.enqueue_copy(dev.queue, host, copy, is_blocking=True)
    want = np.zeros((Rp, Cp), np.uint16)
    want[:N] = _bf16_pattern(got)
    assert np.array_equal(host[_tiled_index(Rp, Cp)], want)
    backward("copy", dx_copy=dx_copy)
    backward("copy")  # dx written again, no copy
    with ops.reuse(dx):
        ops.tiled_copy(0, dx, N, C)
    assert names.count("to_bf16") == (1 if beside else 2)


def test_layernorm_backward_writes_dx_column_sums_with_its_copy(dev, monkeypatch):
    """layernorm_backward with dx_copy and dx_colsums (GPT-2's, whose linear layers have biases) on a GPU row with
    tiled outputs: the DX_COLSUM form writes dx and the weight gradients bit for bit as the plain form does, dx's
    copy beside it, and dx's column sums; dx's next reuse block takes both without a launch, and the bias gradient
    the block adds is dx's column sums (float64, within fp32 summation's error). Without dx_colsums' kernel (no
    column-sum copies on the device) a bias model gets no copy, as before."""
    from clgpt.model import ModelConfig
    from clgpt.ops import Ops
    from precisioncheck import emulated_knobs

    C, N = 128, 192
    cfg = ModelConfig(vocab_size=16, n_ctx=8, n_embd=C, n_head=2, n_layer=1, n_ff=192)
    ops = Ops(dev, cfg, 8, "bf16", knobs=emulated_knobs())
    assert ops.facts.ln_rows
    ops.facts.tiled_outputs = ops.facts.colsum_copies = True  # what wgmma sets (sm_90a): no such device here
    ops.build_gpt2()
    assert "layernorm_backward_rows_tiled_colsum" in ops.k
    x, dout, dx0 = (rng.normal(size=(N, C)).astype(f32) for _ in range(3))
    w = rng.normal(size=C).astype(f32)
    x64 = x.astype(np.float64)
    mean = x64.mean(1)
    rstd = 1.0 / np.sqrt(((x64 - mean[:, None]) ** 2).mean(1) + 1e-5)
    args = [to_dev(dev, a) for a in (dout, x, mean.astype(f32), rstd.astype(f32), w)]
    grads = {k: [to_dev(dev, np.zeros(C, f32)) for _ in range(2)] for k in ("plain", "sums")}
    dxs = {k: to_dev(dev, dx0) for k in grads}
    ops.layernorm_backward(N, *args, *grads["plain"], dxs["plain"], 1)
    names = []
    real = ops.launcher.launch
    monkeypatch.setattr(ops.launcher, "launch", lambda *a: (names.append(a[0].function_name), real(*a)))
    ops.layernorm_backward(N, *args, *grads["sums"], dxs["sums"], 1, dx_copy=True, dx_colsums=True)
    got = from_dev(dev, dxs["sums"], (N, C))
    assert np.array_equal(got, from_dev(dev, dxs["plain"], (N, C)))
    for a, b in zip(grads["plain"], grads["sums"]):
        assert np.array_equal(from_dev(dev, a, C), from_dev(dev, b, C))
    names.clear()
    db = to_dev(dev, np.zeros(C, f32))
    dx = dxs["sums"]
    with ops.reuse(dx):
        copy, Rp, Cp = ops.tiled_copy(0, dx, N, C)
        ops.bias_backward(N, C, dx, db)
    assert "to_bf16" not in names and "bias_final" in names, names
    host = np.empty(Rp * Cp, np.uint16)
    cl.enqueue_copy(dev.queue, host, copy, is_blocking=True)
    assert np.array_equal(host[_tiled_index(Rp, Cp)], _bf16_pattern(got))
    want = got.astype(np.float64).sum(0)
    assert np.allclose(from_dev(dev, db, C), want, rtol=0, atol=1e-5 * np.abs(got).sum(0).max())
    del ops.k["layernorm_backward_rows_tiled_colsum"]  # a device without column-sum copies: no copy for dx
    ops.layernorm_backward(N, *args, *grads["sums"], dx, 1, dx_copy=True, dx_colsums=True)
    assert ops.copies.beside_copies.get(dx.int_ptr) is None


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


def test_weight_copies_made_in_one_launch_bit_for_bit(dev, monkeypatch):
    """Ops.weight_copies: the tiled copies of the weights whose products run on wgmma, made together by one
    to_bf16_batch launch when a product first asks for one after forget_copies (once a forward), each the bytes
    to_bf16 TILED makes of it alone (numpy's bf16 in the wgmma layout); a weight left off (its product not on
    wgmma) gets its own launch as before."""
    ops = _bf16_ops()
    ops.k["to_bf16_tiled"] = dev.kernel("matmul_bf16", "to_bf16", TILED=1, **ops.bf16_options)
    shapes = [(37, 100), (64, 64), (130, 45), (3, 200), (200, 8)]
    offs, off = [], 0
    for r, c in shapes:
        offs.append(off)
        off = -(-(off + r * c + 5) // ops.align) * ops.align  # gaps between them, as the store's padding
    host = rng.normal(size=off).astype(f32)
    flat = to_dev(dev, host)
    views = [flat.get_sub_region(o * 4, r * c * 4) for o, (r, c) in zip(offs, shapes)]
    ops.stable(*views)
    monkeypatch.setattr(ops.backend, "on_wgmma", lambda M, N, K, epi=0: N * K > 600)  # (3, 200) stays off wgmma
    ops.weight_copies(64, flat, [(v, o, r, c) for v, o, (r, c) in zip(views, offs, shapes)])
    launches = []
    real = ops.launcher.launch
    monkeypatch.setattr(ops.launcher, "launch", lambda *a: (launches.append(a[0].function_name), real(*a)))
    for forward in range(2):
        ops.forget_copies()
        for i in (2, 0, 3, 1, 4, 0):
            (r, c), o = shapes[i], offs[i]
            copy, Rp, Cp = ops.tiled_copy(i % 2, views[i], r, c)
            assert (Rp, Cp) == (-(-r // 64) * 64, -(-c // 64) * 64)
            got = np.empty(Rp * Cp, np.uint16)
            cl.enqueue_copy(dev.queue, got, copy, is_blocking=True)
            want = np.zeros((Rp, Cp), np.uint16)
            want[:r, :c] = _bf16_pattern(host[o: o + r * c].reshape(r, c))
            assert np.array_equal(got[_tiled_index(Rp, Cp)], want), f"copy of {shapes[i]}, forward {forward}"
            if i == 3:
                continue
            alone = np.empty(Rp * Cp, np.uint16)
            cl.enqueue_copy(dev.queue, alone, ops.to_bf16(0, views[i], r, c, Rp, Cp, tiled=True), is_blocking=True)
            launches.pop()  # the reference copy's launch
            assert np.array_equal(got, alone), f"{shapes[i]}: not to_bf16's bytes"
        assert launches == ["to_bf16_batch", "to_bf16"] * (forward + 1)


def test_wgmma_takes_its_tiles_in_bands_where_b_outgrows_the_cache():
    """GPT-2 small's head forward (A the final norm's copy, B the 50304 x 768 weights' copy) takes its tiles in
    bands; its gradients (A the 8192 x 50304 logits' gradient copy) and the products whose B fits keep launch
    order. The GPU rows' generic GEMM takes bands on every product."""
    from clgpt.device import tuning
    from clgpt.ops.gemm.wgmma import WgmmaGemm

    assert WgmmaGemm.band(8192 * 768 * 2, 50304 * 768 * 2) == tuning.WGMMA_BAND > 1
    assert WgmmaGemm.band(8192 * 50304 * 2, 50304 * 768 * 2) == 0  # the head's input gradient
    assert WgmmaGemm.band(8192 * 50304 * 2, 8192 * 768 * 2) == 0  # its weight gradient
    assert WgmmaGemm.band(8192 * 768 * 2, 3072 * 768 * 2) == 0
    rows = {vendor: row for kind, vendor, row in tuning.TABLE}
    assert rows[""]["tile_band"] > 1 and "tile_band" not in rows["nvidia"]


def test_wgmma_takes_the_wide_tile_only_on_deep_products():
    """The wgmma rows as the device tuning sets them: a product at least WGMMA_WIDE_MIN_K deep that keeps
    WGMMA_SPLIT_GROUPS work-groups on the wide tile takes it (GPT-2 small's head gradients); a shallow one, one the
    wide tile would leave with too few work-groups (then split along K), one whose N the wide tile pads by over an
    eighth more, and a grouped product (no M, K given) take the narrow."""
    import types

    from clgpt.device import tuning
    from clgpt.ops.gemm.wgmma import WgmmaGemm

    wide, narrow = tuning._NVIDIA_WGMMA, tuning._NVIDIA_WGMMA_NARROW
    assert wide["BN"] > narrow["BN"]
    gemm = types.SimpleNamespace(f=types.SimpleNamespace(wgmma=(wide, narrow), wgmma_mid=None))

    def tiles(M, N, K):
        return WgmmaGemm.tiles(gemm, N, M, K)

    assert tiles(8192, 768, 50304) is wide  # the head's input gradient, K = vocabulary
    assert tiles(50304, 768, 8192) is wide  # the head's weight gradient, K = tokens
    assert tiles(8192, 1024, 4096) is wide  # GPT-2 medium's down projection
    assert tiles(8192, 50304, 768) is narrow  # the head's forward: shallow
    assert tiles(8192, 768, 3072) is narrow  # GPT-2 small's down projection: shallow
    assert tiles(3072, 768, 8192) is narrow  # 24 x 3 work-groups on the wide tile
    assert tiles(8192, 640, 8192) is narrow  # padded to 768 against 640: over an eighth more
    assert tiles(8192, 2304, 8192) is wide
    assert WgmmaGemm.tiles(gemm, 768) is narrow  # a grouped product


@pytest.mark.parametrize("sms", [132, 114])  # the H100 and H200 SXM, the H100 PCIe
def test_wgmma_mid_tile_where_its_waves_end_sooner(sms):
    """The mid row goes to a product at least WGMMA_MID_MIN_K and under WGMMA_WIDE_MIN_K deep where the busiest SM,
    at the rates clgpt.device.tuning gives, ends sooner on it than on the narrow (the estimate worked here by hand
    from the tile counts); never to deep products, shallower ones, grouped products (no M given), or with a BN that
    leaves part of a 64-column block where B lies K x N."""
    import types

    from clgpt.device import tuning
    from clgpt.ops.gemm.wgmma import WgmmaGemm

    wide, narrow, mid = tuning._NVIDIA_WGMMA, tuning._NVIDIA_WGMMA_NARROW, tuning._NVIDIA_WGMMA_MID
    f = types.SimpleNamespace(wgmma=(wide, narrow), wgmma_mid=mid)
    gemm = types.SimpleNamespace(f=f, dev=types.SimpleNamespace(device=types.SimpleNamespace(max_compute_units=sms)))
    gemm.mid_ends_sooner = types.MethodType(WgmmaGemm.mid_ends_sooner, gemm)

    def by_hand(M, N):
        def busiest(mm):
            return -(-(-(-M // mm["BM"]) * -(-N // mm["BN"])) // sms), mm["BM"] * mm["BN"]
        h, a = busiest(narrow)
        hm, am = busiest(mid)
        return hm * am / tuning.WGMMA_MID_RATE < h // 2 * 2 * a + h % 2 * a / tuning.WGMMA_NARROW_ALONE_RATE

    for M, N, K in [(8192, 768, 768), (8192, 768, 3072), (8192, 3072, 768), (8192, 2304, 768), (16384, 384, 1536),
                    (8192, 1024, 1024), (8192, 50304, 768)]:
        want = mid if by_hand(M, N) else narrow
        assert WgmmaGemm.tiles(gemm, N, M, K) is want, (M, N, K)
    if sms == 132:  # measured on an H100: GPT-2 small's 8192 x 768 outputs gain, the MLP's 8192 x 3072 lose
        assert WgmmaGemm.tiles(gemm, 768, 8192, 3072) is mid
        assert WgmmaGemm.tiles(gemm, 3072, 8192, 768) is narrow
        # where the estimate alone would take the mid tiles: deep (they trained slower), and shallower than
        # WGMMA_MID_MIN_K
        assert by_hand(3072, 768) and WgmmaGemm.tiles(gemm, 768, 3072, 8192) is narrow
        assert by_hand(16384, 384) and WgmmaGemm.tiles(gemm, 384, 16384, 384) is narrow
    assert WgmmaGemm.tiles(gemm, 768, 8192, 50304) is wide  # deep, enough wide tiles: the wide row as before
    assert WgmmaGemm.tiles(gemm, 768) is narrow  # a grouped product
    f.wgmma_mid = dict(mid, BN=96)
    assert not gemm.mid_ends_sooner(3072, 768, tb=0) and gemm.mid_ends_sooner(3072, 768, tb=1)
