"""Flash attention (kernels/flash.cl): the fused causal attention the bf16 path runs on NVIDIA tensor cores, here
with its mma and quad shuffles emulated (MMA_EMULATE=1, PoCL), against the float64 reference (clgpt/models/reference.py)
and finite differences, with and without dropout; and in the engine, against the batched form it replaces. Llama's
RoPE inside flash (flash_bf16_rope, the ROPE stores) against rope.cl's launches and, in the engine, float64.

Tolerance (bf16 operands: q, k, v, dout, the probabilities and their gradient rounded to 8 significant bits;
fp32 sums and softmax): relative to the largest |value| of each output, 1e-2 (twice 2^-7); errors are also
required to exceed 1e-5, so an fp32 path (or no rounding) would fail the check as well.
"""

from __future__ import annotations

import math

import numpy as np
import pyopencl as cl
import pytest

from clgpt.bench import device_bytes
from clgpt.errors import ClgptError
from clgpt.device.knobs import Knobs
from clgpt.model import ModelConfig, init_params
from clgpt.models import reference as ref
from clgpt.models.dropout import scale_mask
from clgpt.models.gpt2 import GPT2Engine
from clgpt.ops import FLASH_LONG_T, FLASH_MIN_GROUPS
from opcheck import assert_directional_fd, bf16_pattern, tiled_index

# one set of widths for every test here: PoCL compiles the emulated kernels once (about a minute)
B, T, C, H = 2, 70, 32, 2  # T: two 64-row blocks, the second partial
D = C // H
TOL = 1e-2
i32, u32, f32 = np.int32, np.uint32, np.float32


def _kernels(dev, **extra):
    kw = dict(C=C, H=H, D=D, SCALE=float(1.0 / math.sqrt(D)), MMA_EMULATE=1, **extra)
    return [dev.kernel("flash", n, **kw)
            for n in ("flash_bf16", "flash_forward", "flash_backward_dq", "flash_backward_dkv")]


def _copy_at(b, t, h):
    """kernels/flash.cl COPY_AT: the float where att (datt) holds the bf16 copy of qkv (dout)"""
    return -(-b * h * t // 64) * 64


def _run(dev, qkv, dout, p=0.0, seed=0, site=0, mt=1, ks=64, kq=16, qk=16):
    """-> out (B,T,C), dqkv (B,T,3C), lse (B,H,T) from the kernels: the bf16 copies, then the three passes. mt, ks,
    kq, qk: the forward's and dq's m tiles a warp, and the keys or queries a step of the forward, dq and dk/dv
    (clgpt/ops/attention.py FLASH_TILES)."""
    tiles = dict(MT=mt, KS=ks, KQ=kq, QK=qk)
    cp, fwd, bdq, bdkv = _kernels(dev, **({} if (mt, ks, kq, qk) == (1, 64, 16, 16) else tiles))
    mf, q = cl.mem_flags, dev.queue
    bq = cl.Buffer(dev.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(qkv, f32))
    bd = cl.Buffer(dev.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(dout, f32))
    natt = (_copy_at(B, T, H) + B * T * 3 * C // 2) * 4
    bo, bl = cl.Buffer(dev.ctx, mf.READ_WRITE, B * T * C * 4), cl.Buffer(dev.ctx, mf.READ_WRITE, natt)
    bdl, bg = cl.Buffer(dev.ctx, mf.READ_WRITE, natt), cl.Buffer(dev.ctx, mf.READ_WRITE, B * T * 3 * C * 4)
    tail = (u32(seed), u32(site), f32(p))
    nq = 256 // mt  # work-items of 128 query rows
    gq, gk = ((-(-T // 128) * nq, B * H), (nq, 1)), ((-(-T // 64) * 128, B * H), (128, 1))
    for src, cols, dst in ((bq, 3 * C, bl), (bd, C, bdl)):
        n8 = B * T * cols // 8
        cp(q, (-(-n8 // 256) * 256,), (256,), i32(n8), i32(T), i32(B * H), src, dst)
    fwd(q, *gq, i32(T), bo, bl, *tail)
    bdq(q, *gq, i32(T), bd, bo, bl, bdl, bg, *tail)
    bdkv(q, *gk, i32(T), bl, bdl, bg, *tail)
    out, dqkv, att = np.empty((B, T, C), f32), np.empty((B, T, 3 * C), f32), np.empty(natt // 4, f32)
    for host, buf in ((out, bo), (dqkv, bg), (att, bl)):
        cl.enqueue_copy(q, host, buf)
    q.finish()
    return out, dqkv, att[:B * H * T].reshape(B, H, T)


def _rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("p, tiles", [(0.0, (1, 64)), (0.2, (1, 64)), (0.2, (2, 32, 64, 32))],
                         ids=["p0", "p0.2", "p0.2-other-tiles"])
def test_flash_attention_against_float64_and_deterministic(dev, p, tiles):
    """out, dq, dk, dv and the softmax statistic within bf16's tolerance of float64 (dropout drawing the same
    mask as the batched form, index (b*H + h, query, key)); a second run gives the same bytes. Also with two m
    tiles a warp, other key and query steps (clgpt/ops/attention.py FLASH_TILES)."""
    r = np.random.default_rng(11)
    qkv, dout = r.normal(size=(B, T, 3 * C)).astype(f32), r.normal(size=(B, T, C)).astype(f32)
    seed, site = 0xC0FFEE, 7
    dmask = scale_mask(seed, site, (B, H, T, T), p) if p else None
    out, dqkv, lse = _run(dev, qkv, dout, p, seed, site, *tiles)
    want, att = ref.attention_forward(qkv, H, dmask)
    dwant = ref.attention_backward(dout, qkv, att, H, dmask)
    for name, got, w in (("out", out, want), ("dq", dqkv[..., :C], dwant[..., :C]),
                         ("dk", dqkv[..., C:2 * C], dwant[..., C:2 * C]), ("dv", dqkv[..., 2 * C:], dwant[..., 2 * C:])):
        err = _rel(got, w)
        assert 1e-5 < err < TOL, f"flash {name} (p={p}): relative error {err:.2e}"
    # lse: log2 of each row's sum of exp2 over scores in the log2 domain
    x = qkv.astype(np.float64).reshape(B, T, 3, H, D)
    s = np.einsum("bihd,bjhd->bhij", x[:, :, 0], x[:, :, 1]) / math.sqrt(D) * math.log2(math.e)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    lse_want = np.log2(np.exp2(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    assert np.abs(lse - lse_want).max() < TOL * np.abs(lse_want).max()
    again = _run(dev, qkv, dout, p, seed, site, *tiles)
    assert all(np.array_equal(a, b) for a, b in zip((out, dqkv, lse), again))


def test_flash_backward_against_finite_differences(dev):
    """The kernels' gradient of sum(out * R) along random directions equals central differences of the float64
    attention, within bf16's tolerance."""
    r = np.random.default_rng(5)
    qkv, R = r.normal(size=(B, T, 3 * C)), r.normal(size=(B, T, C))
    _, dqkv, _ = _run(dev, qkv.astype(f32), R.astype(f32))
    f = lambda x: float((ref.attention_forward(x, H)[0] * R).sum())  # noqa: E731
    assert_directional_fd(f, qkv, dqkv, 0.02, r)


def _engine(flash, arch="gpt2", heads=H, batch=B, seq=T):
    """A bf16 engine with dropout whose tensor-core path is emulated; flash True / False / "auto" (the stage's
    `attention`: flash, batched, auto)."""
    from precisioncheck import emulated_knobs  # small tiles: PoCL compiles them quickly

    attention = flash if isinstance(flash, str) else "flash" if flash else "batched"
    cfg = ModelConfig(vocab_size=32, n_ctx=seq, n_embd=C, n_head=heads, n_layer=2, n_ff=64, arch=arch)
    return GPT2Engine(cfg, init_params(cfg, 0), batch_size=batch, seq_len=seq, precision="bf16", dropout=0.2,
                      knobs=emulated_knobs(), attention=attention)


def test_engine_flash_matches_the_batched_form_with_dropout(dev):
    """A bf16 engine with dropout: flash attention (no T x T state: att holds (B,H,T) floats) gives the loss and
    every gradient of the batched form (T x T probabilities through the GEMM) within bf16's tolerance."""
    r = np.random.default_rng(7)
    tok, tgt = (r.integers(0, 32, size=(B, T)).astype(np.int32) for _ in range(2))
    res, mem = {}, {}
    for flash in (True, False):
        eng = _engine(flash)
        assert eng.ops.flash is flash
        assert eng.ops.att_floats(B, T) == (_copy_at(B, T, H) + B * T * 3 * C // 2 if flash else B * H * T * T)
        mem[flash] = device_bytes(eng)
        loss = eng.forward(tok, tgt, dropout_seed=99)
        eng.zero_grad()
        eng.backward()
        res[flash] = loss, eng.get_grads()
    assert abs(res[True][0] - res[False][0]) < 1e-3 * abs(res[False][0])
    # memory: per layer att (B,H,T,T) -> (B,H,T) and qkv's bf16 copy, and no att_d (dropout's probabilities);
    # the shared datt too
    bhtt, flash_att, L = B * H * T * T, _copy_at(B, T, H) + B * T * 3 * C // 2, 2
    assert mem[False] - mem[True] == 4 * (L * (2 * bhtt - flash_att) + bhtt - flash_att)
    for name, g in res[False][1].items():
        err = _rel(res[True][1][name], g)
        assert err < TOL, f"grad {name}: flash vs batched {err:.2e}"


def test_gpt2_qkv_product_can_write_flash_attention_copy(dev, monkeypatch):
    """Where the GEMM writes a bf16 copy beside its output (matmul_half with copy: on wgmma, OUT_BF16 2), GPT-2's
    q | k | v product writes flash attention's copy of qkv into att from COPY_AT, and the forward launches no
    flash_bf16 for it (the backward's copy of dout stays): the loss and every gradient are those of the separate
    copy, bit for bit. Here the product's copy is made by the host from the product's fp32 output, as the kernel
    rounds it; a copy put anywhere else leaves the kernels reading another qkv. A forward with targets asks for the
    copy alone (fp32 False: OUT_BF16 3), since only the copy is read after it."""
    r = np.random.default_rng(8)
    tok, tgt = (r.integers(0, 32, size=(B, T)).astype(np.int32) for _ in range(2))
    res, launched, offsets, wanted = {}, {}, [], []
    for fused in (False, True):
        eng = _engine(True)
        be, q = eng.ops.backend, eng.queue
        if fused:
            def half(M, N, K, A, Bm, Cm, tb=0, bias=None, copy=None, fp32=True, be=be, q=q):
                if copy is None:
                    return False
                wanted.append(fp32)
                be.matmul(M, N, K, A, Bm, Cm, tb=tb, bias=bias)
                x = np.empty(M * N, f32)
                cl.enqueue_copy(q, x, Cm, is_blocking=True)
                bits = (ref.round_bf16(x).view(np.uint32) >> 16).astype(np.uint16)
                cl.enqueue_copy(q, copy[0], bits, dst_offset=2 * int(copy[1]), is_blocking=True)
                offsets.append(int(copy[1]))
                return True
            monkeypatch.setattr(be, "matmul_half", half)
        names, run = launched.setdefault(fused, []), eng.ops.launcher.run
        monkeypatch.setattr(eng.ops.launcher, "run", lambda name, *a, run=run, names=names, **kw: (
            names.append(name), run(name, *a, **kw)))
        loss = eng.forward(tok, tgt, dropout_seed=99)
        eng.zero_grad()
        eng.backward()
        res[fused] = loss, eng.get_grads()
    assert len(offsets) == 2 and wanted == [False, False]  # one a layer, no fp32 qkv
    assert launched[False].count("flash_bf16") == 4 and launched[True].count("flash_bf16") == 2
    assert res[True][0] == res[False][0]
    for name, g in res[False][1].items():
        assert np.array_equal(res[True][1][name], g), name


def test_flash_needs_the_bf16_path_and_a_head_width_of_16_to_64(dev):
    """Flash runs where the bf16 GEMM does and the head width is a multiple of 16 up to 64; attention: batched
    turns it off; PoCL without emulation (the CPU path) never takes it. auto (the default): flash when B x H x
    ceil(T/64) work-groups reach FLASH_MIN_GROUPS a compute unit, or T >= FLASH_LONG_T."""
    cfg = ModelConfig(vocab_size=32, n_ctx=16, n_embd=C, n_head=H, n_layer=1, n_ff=64)
    assert not GPT2Engine(cfg, init_params(cfg, 0), batch_size=1, seq_len=16, precision="bf16",
                      knobs=Knobs(launch="cpu"), attention="flash").ops.flash
    assert _engine(True).ops.flash and not _engine(False).ops.flash
    eng = _engine(True, heads=4)  # head width 8
    assert eng.ops.bf16 is not None and not eng.ops.flash
    units = dev.device.max_compute_units
    for batch, seq in ((1, 70), (FLASH_MIN_GROUPS * units, 64), (FLASH_MIN_GROUPS * units - 1, 64),
                       (1, FLASH_LONG_T)):
        groups = batch * H * -(-seq // 64)
        want = groups >= FLASH_MIN_GROUPS * units or seq >= FLASH_LONG_T
        assert _engine("auto", batch=batch, seq=seq).ops.flash is want, (batch, seq)
    with pytest.raises(ClgptError, match="attention 'on': use auto, flash, batched"):
        GPT2Engine(cfg, init_params(cfg, 0), batch_size=1, seq_len=16, precision="bf16", attention="on", knobs=Knobs())


def test_flash_forward_writes_its_tiled_copy(dev):
    """flash_forward with OUT_TILED (bf16 on wgmma): out and lse as without, bit for bit, and out's bf16 copy in
    the wgmma layout (what to_bf16 TILED would make of out) for the output projection's products."""
    b, t, c, h = 2, 64, 64, 2  # B T and C multiples of 64
    kw = dict(C=c, H=h, D=c // h, SCALE=float(1.0 / math.sqrt(c // h)), MMA_EMULATE=1)
    qkv = np.random.default_rng(5).normal(size=(b, t, 3 * c)).astype(f32)
    mf, q = cl.mem_flags, dev.queue
    bq = cl.Buffer(dev.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=qkv)
    outs = []
    natt = _copy_at(b, t, h) + b * t * 3 * c // 2
    for tiled in (0, 1):
        bo, bl = cl.Buffer(dev.ctx, mf.READ_WRITE, b * t * c * 4), cl.Buffer(dev.ctx, mf.READ_WRITE, natt * 4)
        b16 = cl.Buffer(dev.ctx, mf.READ_WRITE, b * t * c * 2)
        n8 = b * t * 3 * c // 8
        dev.kernel("flash", "flash_bf16", **kw)(q, (-(-n8 // 256) * 256,), (256,), i32(n8), i32(t), i32(b * h), bq, bl)
        k = dev.kernel("flash", "flash_forward", **kw, **({"OUT_TILED": 1} if tiled else {}))
        k(q, (256, b * h), (256, 1), i32(t), bo, bl, u32(0), u32(0), f32(0.0), *((b16,) if tiled else ()))
        out, lse, copy = np.empty((b * t, c), f32), np.empty(b * h * t, f32), np.empty(b * t * c, np.uint16)
        for host, buf in ((out, bo), (lse, bl), (copy, b16)):
            cl.enqueue_copy(q, host, buf)
        q.finish()
        outs.append((out, lse, copy))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    assert np.array_equal(outs[1][2][tiled_index(b * t, c)], bf16_pattern(outs[1][0]))


def test_flash_backward_writes_only_the_tiled_copy_of_dqkv(dev):
    """flash_backward_dq / _dkv with DQKV_TILED (llama on wgmma, where the q | k | v product's two gradient products
    alone read dqkv): dqkv's bf16 copy in the wgmma layout, the bf16 of what the plain kernels write, bit for bit,
    and dqkv itself untouched. This module's widths at T 64 (B T a multiple of 64, the copy's rows)."""
    t, n = 64, B * 64
    r = np.random.default_rng(8)
    qkv, dout = r.normal(size=(B, t, 3 * C)).astype(f32), r.normal(size=(B, t, C)).astype(f32)
    mf, q = cl.mem_flags, dev.queue
    rw = lambda a: cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))  # noqa: E731
    natt = _copy_at(B, t, H) + n * 3 * C // 2
    tail, cp3 = (u32(0), u32(0), f32(0.0)), -(-3 * C // 64) * 64  # the copy's columns, padded to 64
    cp, fwd, bdq, bdkv = _kernels(dev)
    tiled = [dev.kernel("flash", k, C=C, H=H, D=D, SCALE=float(1.0 / math.sqrt(D)), MMA_EMULATE=1, DQKV_TILED=1)
             for k in ("flash_backward_dq", "flash_backward_dkv")]
    att, datt = cl.Buffer(dev.ctx, mf.READ_WRITE, natt * 4), cl.Buffer(dev.ctx, mf.READ_WRITE, natt * 4)
    bo, bd = cl.Buffer(dev.ctx, mf.READ_WRITE, n * C * 4), rw(dout)
    for src, cols, dst in ((rw(qkv), 3 * C, att), (bd, C, datt)):
        n8 = n * cols // 8
        cp(q, (-(-n8 // 256) * 256,), (256,), i32(n8), i32(t), i32(B * H), src, dst)
    fwd(q, (256, B * H), (256, 1), i32(t), bo, att, *tail)
    got = []
    for kq, kk in ((bdq, bdkv), tiled):
        bg, b16 = rw(np.full((n, 3 * C), -7.0, f32)), rw(np.zeros(n * cp3, np.uint16))
        more = (b16,) if kq is tiled[0] else ()
        kq(q, (256, B * H), (256, 1), i32(t), bd, bo, att, datt, bg, *tail, *more)
        kk(q, (128, B * H), (128, 1), i32(t), att, datt, bg, *tail, *more)
        got.append((_host(dev, bg, n * 3 * C).reshape(n, 3 * C), _host(dev, b16, n * cp3, np.uint16)))
    (plain, _), (untouched, copy) = got
    assert (untouched == -7.0).all() and np.abs(plain).max() > 0
    assert np.array_equal(copy[tiled_index(n, 3 * C)], bf16_pattern(plain))


@pytest.mark.parametrize("products_only, wgmma, rows", [(True, True, 128), (False, True, 128), (True, False, 128),
                                                         (True, True, 140)])
def test_attention_backward_hands_dqkv_over_as_its_tiled_copy(dev, monkeypatch, products_only, wgmma, rows):
    """attention_backward on llama's flash path with RoPE inside (the launches recorded, not run: 3C 192 here):
    with products_only, both products on wgmma and B T a multiple of 64, the _tiled_only kernels and dqkv's copy
    waiting for its reuse block, which takes it (an fp32 read is an error); else the plain kernels."""
    from clgpt.models.llama import _rope_tables
    from clgpt.ops import Ops
    from precisioncheck import emulated_knobs

    c, h, t = 64, 2, rows // 2
    cfg = ModelConfig(arch="llama", vocab_size=32, n_ctx=t, n_embd=c, n_head=h, n_layer=1, n_ff=64)
    from clgpt.device import capabilities as capmod

    monkeypatch.setattr(capmod, "subgroup_sizes", lambda device: ((), False))  # NVIDIA's: none, and no probe to build
    monkeypatch.setattr(dev, "kernel", lambda stem, name, build_options=(), **d: (name, d.get("DQKV_TILED", 0)))
    ops = Ops(dev, cfg, t, "bf16", batch_size=2, knobs=emulated_knobs(), attention="flash")
    assert ops.flash and ops.rope_fused
    monkeypatch.setattr(ops.facts, "tiled_outputs", True)
    monkeypatch.setattr(ops.backend, "on_wgmma", lambda M, N, K, epi=0: wgmma)
    ops.flash_setup()
    assert ops.k["flash_backward_dq_tiled_only"] == ("flash_backward_dq", 1)
    launched = []
    monkeypatch.setattr(ops.launcher, "run", lambda name, *a, **kw: launched.append(name))
    cos, sin = (ops.buf(x.size) for x in _rope_tables(t, c // h, 10000.0))
    dout, qkv, att, datt, dqkv, out = (ops.buf(k) for k in (rows * c, rows * 3 * c, ops.att_floats(2, t),
                                                           ops.att_floats(2, t), rows * 3 * c, rows * c))
    ops.attention_backward(2, t, dout, qkv, att, datt, dqkv, out=out, rope=(dqkv, cos, sin),
                           products_only=products_only)
    only = products_only and wgmma and rows % 64 == 0
    suffix = "_tiled_only" if only else ""
    assert launched == ["flash_bf16", "flash_backward_dq" + suffix, "flash_backward_dkv" + suffix]
    assert (dqkv.int_ptr in ops.copies.premade) is only
    if only:
        copy = ops.copies.premade[dqkv.int_ptr][0]
        with pytest.raises(ClgptError, match="read as fp32"):
            ops.settle(dqkv)
        with ops.reuse(dqkv):
            assert ops.tiled_copy(0, dqkv, rows, 3 * c) == (copy, rows, 3 * c)


# ---- llama: RoPE inside flash attention (rope_fused: n_head_kv == n_head) ----
def _host(dev, buf, n, dtype=f32):
    out = np.empty(n, dtype)
    cl.enqueue_copy(dev.queue, out, buf, is_blocking=True)
    return out


def test_flash_rope_kernels_match_the_separate_rope_launches(dev):
    """flash_bf16_rope's copy of qkv holds bf16(rope_forward_el's rotated q, k) bit for bit (v as flash_bf16
    copies it) and leaves qkv as it was; flash_backward_dq / _dkv built with ROPE store dq and dk rotated back as
    rope_backward_el rotates the plain kernels' dqkv after them, within fp32 rounding (2^-22 of the largest value:
    a compiler may contract the products differently once the stores and the rotation are one kernel; PoCL gives
    the same bits), and dv as the plain kernels. Rotated q, k against float64's rotation, too."""
    from clgpt.models import reference_llama as rl
    from clgpt.models.llama import _rope_tables

    r = np.random.default_rng(3)
    qkv, dout = r.normal(size=(B, T, 3 * C)).astype(f32), r.normal(size=(B, T, C)).astype(f32)
    cos, sin = _rope_tables(T + 5, D, 10000.0)
    mf, q, N = cl.mem_flags, dev.queue, B * T
    rw = lambda a: cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))  # noqa: E731
    bcos, bsin = rw(cos), rw(sin)
    natt = _copy_at(B, T, H) + B * T * 3 * C // 2
    rope = dict(C=C, D=D, G=1, CKV=C)
    plain, fused = _kernels(dev), _kernels(dev, ROPE=1)
    copy_rope = dev.kernel("flash", "flash_bf16_rope", C=C, H=H, D=D, SCALE=float(1.0 / math.sqrt(D)),
                           MMA_EMULATE=1, ROPE=1)
    fwd_el, bwd_el = (dev.kernel("rope", n, **rope) for n in ("rope_forward_el", "rope_backward_el"))
    gq, gk = ((-(-T // 128) * 256, B * H), (256, 1)), ((-(-T // 64) * 128, B * H), (128, 1))
    tail = (u32(0), u32(0), f32(0.0))
    el = ((2 * H * D // 2 + 63) // 64 * 64, N), (64, 1)  # rope.cl's per-pair launch (2H slots in place)

    def copy(kern, src, tables=()):  # qkv's bf16 copy into a fresh att
        att = cl.Buffer(dev.ctx, mf.READ_WRITE, natt * 4)
        n8 = N * 3 * C // 8
        kern(q, (-(-n8 // 256) * 256,), (256,), i32(n8), i32(T), i32(B * H), src, *tables, att)
        return att

    def back(kerns, att, tables=()):  # dqkv from the forward's statistics and dout's copy
        _, f, bdq, bdkv = kerns
        bo, bg = cl.Buffer(dev.ctx, mf.READ_WRITE, N * C * 4), cl.Buffer(dev.ctx, mf.READ_WRITE, N * 3 * C * 4)
        bdl, bd = cl.Buffer(dev.ctx, mf.READ_WRITE, natt * 4), rw(dout)
        f(q, *gq, i32(T), bo, att, *tail)
        n8 = N * C // 8
        kerns[0](q, (-(-n8 // 256) * 256,), (256,), i32(n8), i32(T), i32(B * H), bd, bdl)
        bdq(q, *gq, i32(T), bd, bo, att, bdl, bg, *tail, *tables)
        bdkv(q, *gk, i32(T), att, bdl, bg, *tail, *tables)
        return bg

    host = lambda buf, n, dtype=f32: _host(dev, buf, n, dtype)  # noqa: E731
    # the separate launches: rope_forward_el in place, flash_bf16; the plain backward, rope_backward_el in place
    b1 = rw(qkv)
    fwd_el(q, *el, i32(N), i32(T), b1, bcos, bsin, b1)
    rotated = host(b1, N * 3 * C).reshape(B, T, 3 * C)
    att1 = copy(plain[0], b1)
    g1 = back(plain, att1)
    bwd_el(q, *el, i32(N), i32(T), g1, bcos, bsin, g1)
    # fused
    b2 = rw(qkv)
    att2 = copy(copy_rope, b2, (bcos, bsin))
    g2 = back(fused, att2, (bcos, bsin))
    assert np.array_equal(host(b2, N * 3 * C).reshape(qkv.shape), qkv)  # qkv only read
    at = _copy_at(B, T, H)
    copy1, copy2 = (host(a, 2 * natt, np.uint16)[2 * at:].reshape(B, T, 3 * C) for a in (att1, att2))
    assert np.array_equal(copy2, bf16_pattern(rotated)) and np.array_equal(copy2, copy1)
    c64, s64 = rl.rope_tables(T, D)
    for part in (0, 1):  # q, k against float64's rotation of the same fp32 inputs
        x = qkv[..., part * C:(part + 1) * C].reshape(B, T, H, D)
        want = rl.rope_forward(x, c64, s64).reshape(B, T, C)
        assert np.abs(rotated[..., part * C:(part + 1) * C] - want).max() < 1e-5 * np.abs(want).max()
    d1, d2 = (host(g, N * 3 * C).reshape(B, T, 3 * C) for g in (g1, g2))
    assert np.array_equal(d1[..., 2 * C:], d2[..., 2 * C:])  # dv: no rotation
    for name, sl in (("dq", slice(0, C)), ("dk", slice(C, 2 * C))):
        big = np.abs(d1[..., sl]).max()
        assert big > 0 and np.abs(d2[..., sl] - d1[..., sl]).max() <= 2.0 ** -22 * big, name


def _llama_engine(attention, heads_kv=0, dropout=0.2):
    """A bf16 llama engine (tensor-core path emulated) at this module's widths, n_head_kv heads_kv."""
    from clgpt.models.factory import make_engine
    from precisioncheck import emulated_knobs

    cfg = ModelConfig(arch="llama", vocab_size=32, n_ctx=T, n_embd=C, n_head=H, n_head_kv=heads_kv, n_layer=2,
                      n_ff=64)
    eng = make_engine(cfg, init_params(cfg, 0), batch_size=B, seq_len=T, precision="bf16", dropout=dropout,
                      knobs=emulated_knobs(), attention=attention)
    launched = []
    run = eng.ops.launcher.run
    eng.ops.launcher.run = lambda name, *a, **kw: (launched.append(name), run(name, *a, **kw))  # noqa: E731
    return eng, launched


@pytest.mark.parametrize("heads_kv", [0, 1])
def test_llama_flash_with_rope_against_float64(dev, heads_kv):
    """llama's bf16 engine on flash attention with dropout: RoPE inside flash's kernels without grouped kv heads
    (no rope_forward_el / rope_backward_el launch), rope.cl's launches around flash with them (n_head_kv 1: the
    repacking and the heads' sums stay rope.cl's); loss and every gradient against the float64 reference (bf16
    GEMMs and attention: gradients within 3 TOL of their largest value, about 1e-2 seen; test_precision's llama
    test allows 0.2), and the same bytes twice."""
    from clgpt.models import reference_llama

    r = np.random.default_rng(7)
    tok, tgt = (r.integers(0, 32, size=(B, T)).astype(np.int32) for _ in range(2))
    runs = []
    for _ in range(2):
        eng, launched = _llama_engine("flash", heads_kv)
        assert eng.ops.flash and eng.ops.rope_fused is (heads_kv == 0)
        eng.zero_grad()
        loss = eng.forward(tok, tgt, dropout_seed=99)
        eng.backward()
        runs.append((loss, eng.get_grads()))
    rope_launches = [n for n in launched if n.startswith("rope_")]
    if heads_kv == 0:
        assert not rope_launches and launched.count("flash_bf16_rope") == 2  # a layer's copy of qkv
        assert launched.count("flash_bf16") == 2  # dout's
    else:
        assert rope_launches == ["rope_forward_el"] * 2 + ["rope_backward_el"] * 2
        assert "flash_bf16_rope" not in launched
    (loss, grads), (loss2, grads2) = runs
    assert loss2 == loss and all(np.array_equal(grads[n], grads2[n]) for n in grads)
    want_loss, _, cache = reference_llama.llama_forward(init_params(eng.cfg, 0), eng.cfg, tok, tgt,
                                                        dropout=(99, 0.2))
    want = reference_llama.llama_backward(cache)
    assert abs(loss - want_loss) < 2e-2 * abs(want_loss), f"loss {loss} vs {want_loss}"
    for name, g in want.items():
        err = np.abs(grads[name] - g).max() / max(np.abs(g).max(), 1e-12)
        assert err < 3 * TOL, f"grad {name}: relative error {err:.2e}"


def test_llama_batched_attention_keeps_rope_launches_and_prefill_rotates_keys(dev):
    """The batched form (no flash) launches rope_forward_el / rope_backward_el a layer, as before. A key/value
    cache's prefill on the flash engine (whose forward leaves qkv's q, k unrotated) caches the rotated keys: layer
    0's (the same product and rotation in both engines) bit for bit as the batched engine's, layer 1's close."""
    from clgpt.inference.kvcache import KVCache

    r = np.random.default_rng(9)
    tok, tgt = (r.integers(0, 32, size=(B, T)).astype(np.int32) for _ in range(2))
    eng, launched = _llama_engine("batched")
    assert not eng.ops.flash and not eng.ops.rope_fused
    eng.forward(tok, tgt, dropout_seed=5)
    eng.backward()
    assert [n for n in launched if n.startswith("rope_")] == ["rope_forward_el"] * 2 + ["rope_backward_el"] * 2
    caches = {}
    for attention in ("batched", "flash"):
        eng, _ = _llama_engine(attention, dropout=0.0)
        assert eng.ops.rope_fused is (attention == "flash")
        cache = KVCache(eng)
        cache.prefill(tok, [T - 1] * B)
        caches[attention] = [_host(dev, kc, B * T * C) for kc in cache.kc]
    assert np.array_equal(caches["flash"][0], caches["batched"][0])
    assert _rel(caches["flash"][1], caches["batched"][1]) < TOL
