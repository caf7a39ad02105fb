"""The matmul kernels against the float64 numpy reference: each form the tuning table can pick (tiled,
register-blocked), their epilogues, the CPU row's padded operands and the GPU rows' split along K."""

from __future__ import annotations

import numpy as np
import pytest

from clgpt.device.knobs import Knobs
from clgpt.models import reference as ref
from clgpt.ops import MATMUL_TILES, matmul_defines, matmul_launch

from conftest import assert_close, empty, from_dev, to_dev
from opcheck import FD, _gpu_engine, check_op

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(1234)


# ---------------- matmul ----------------
# Each form the tuning table can pick: the local-memory tiled kernel (default tiles; small float4 tiles)
# and the CPU register-blocked one (whose op(B) must have contiguous rows: tb=1 goes through transpose).
MATMUL_FORMS = {
    "tiled": dict(kernel="matmul", LDSV=0, **MATMUL_TILES),
    "tiled_f4": dict(kernel="matmul", TSM=32, TSN=32, TSK=8, WPTM=4, WPTN=4, LDSV=1),
    "tiled_pref": dict(kernel="matmul", TSM=32, TSN=32, TSK=8, WPTM=4, WPTN=4, LDSV=0, PREF=1),
    # float4 global loads of whole aligned tiles (VEC, the tuner's candidates), plain and double-buffered
    "tiled_vec": dict(kernel="matmul", TSM=32, TSN=32, TSK=8, WPTM=4, WPTN=4, LDSV=1, VEC=1),
    "tiled_vec_pref": dict(kernel="matmul", TSM=32, TSN=32, TSK=16, WPTM=4, WPTN=4, LDSV=0, PREF=1, VEC=1),
    # the warp-tiled form (kernels/matmul_warp.cl): one warp; 64 work-items of 8x8 with 4 float4 per tile each; 256
    # work-items with fewer float4 in a tile than work-items (the last loads guarded)
    "warp": dict(kernel="matmul", TSM=16, TSN=32, TSK=8, WPTM=4, WPTN=4, LDSV=1, PREF=1, WARP=1),
    "warp_88": dict(kernel="matmul", TSM=64, TSN=64, TSK=16, WPTM=8, WPTN=8, LDSV=1, PREF=1, WARP=1),
    "warp_part": dict(kernel="matmul", TSM=64, TSN=64, TSK=8, WPTM=4, WPTN=4, LDSV=1, PREF=1, WARP=1),
    "rb": dict(kernel="matmul_rb", RM=6, NV=2, lsize=(1, 4)),
    "rb_pf": dict(kernel="matmul_rb", RM=6, NV=2, PREFETCH=1, lsize=(1, 4)),
    "rb16": dict(kernel="matmul_rb", RM=6, NV=4, VW=16, PREFETCH=1, lsize=(1, 1)),  # the CPU row's
    "rb16_nv1": dict(kernel="matmul_rb", RM=6, NV=1, VW=16, lsize=(1, 2)),  # ops' narrowest for ragged N
}


LAYOUTS = [(0, 1), (0, 0), (1, 0)]  # y = x W.T, dx = dy W, dW = dy.T x


# the warp-tiled form's forms here only as warp_part (its guarded partial loads at every size): each warp form's
# build takes seconds per compiler, and test_matmul_vec_mixed_tiles runs all three at ragged and aligned sizes
@pytest.mark.parametrize("form", sorted(f for f in MATMUL_FORMS if f not in ("warp", "warp_88")))
@pytest.mark.parametrize("ta,tb", LAYOUTS)
@pytest.mark.parametrize("M,N,K", [(37, 53, 29), (64, 32, 16), (1, 7, 3), (70, 65, 130)])
def test_matmul(dev, form, ta, tb, M, N, K):
    _check_matmul(dev, MATMUL_FORMS[form], form, ta, tb, M, N, K)


@pytest.mark.parametrize("form,ta,tb", [(f, ta, tb) for f in ("tiled_vec", "tiled_vec_pref") for ta, tb in LAYOUTS]
                         + [("warp", ta, tb) for ta, tb in LAYOUTS + [(1, 1)]]
                         + [(f, ta, tb) for f in ("warp_88", "warp_part") for ta, tb in ((0, 1), (1, 1))])
@pytest.mark.parametrize("M,N,K", [(70, 68, 132), (96, 64, 44)])
def test_matmul_vec_mixed_tiles(dev, form, ta, tb, M, N, K):
    """VEC and the warp-tiled form: aligned operands whose inner tiles load as float4 while the edge tiles (m, n
    or k) take the one-float loads, in one launch; the outputs stored as float4 inside, one by one at the edge."""
    _check_matmul(dev, MATMUL_FORMS[form], form, ta, tb, M, N, K)


@pytest.mark.parametrize("form", ["tiled", "warp_part"])
@pytest.mark.parametrize("ta,tb", [(0, 1), (1, 0)])
def test_matmul_in_bands_of_tiles(dev, form, ta, tb):
    """TILE_BAND (the generic GPU row's tile order, kernels/epilogue.cl tile_of_group): down bands of 2 rows of
    tiles, the last band one row, every tile computed once."""
    mm = dict(MATMUL_FORMS[form], TILE_BAND=2)
    M = 4 * mm["TSM"] + 5  # 5 rows of tiles: bands of 2, 2 and 1
    _check_matmul(dev, mm, form + " bands", ta, tb, M, 3 * mm["TSN"] - 7, 41)


def _check_matmul(dev, mm, form, ta, tb, M, N, K):
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
    """Ops.rb_tiles: the CPU row's 4 vectors of 16 columns, fewer where that shortens the scalar tail (N = 96: 2 x 48)."""
    from clgpt.model import ModelConfig
    from clgpt.ops import Ops

    ops = Ops(dev, ModelConfig(), 16, knobs=Knobs())
    ops.facts.mm = dict(kernel="matmul_rb", RM=6, NV=4, VW=16, PREFETCH=1, lsize=(1, 1))  # the AVX-512 CPU row's
    got = {N: ops.rb_tiles(N)["NV"] for N in (64, 128, 96, 160, 32, 16, 48, 260, 7)}
    assert got == {64: 4, 128: 4, 96: 3, 160: 2, 32: 2, 16: 1, 48: 3, 260: 4, 7: 4}, got
    assert ops.rb_tiles(96) is ops.rb_tiles(96)  # one dict per NV (kernels are cached by its id)
    for N in range(1, 400):  # the scalar tail is always the last N mod 16 columns (what 16-column tiles leave)
        assert N % (16 * ops.rb_tiles(N)["NV"]) == N % 16, N


@pytest.mark.parametrize("form", sorted(f for f in MATMUL_FORMS if f not in ("warp_88", "warp_part")))
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
        eng.ops.launch.update(ld_pad=pad, ld_pad_copy=0, ta_direct=ta_direct)  # the row every part reads
        eng.ops.rb_plans.clear()  # plans are made once per shape: again under the new row
        cbuf = to_dev(dev, C0)
        eng.matmul(M, N, K, to_dev(dev, A), to_dev(dev, B), cbuf, ta=ta, tb=tb, accum=True)
        outs.append(from_dev(dev, cbuf, (M, N)))
        assert_close(outs[-1], want, 1e-4, 1e-4, f"ld_pad={pad} ta={ta} tb={tb} {M}x{N}x{K}")
    assert np.array_equal(outs[0], outs[1]), "padded op(B) changed the result"


@pytest.mark.parametrize("form", ["warp", "warp_part"])
def test_warp_form_split_k_and_batched_attention(dev, form):
    """The warp-tiled form as a GPU row's only tiles: a deep product split along K (the parts summed in order, the
    same bits twice) and the batched causal attention products (BATCH with CAUSAL 1, 2 and 3) against float64."""
    eng = _gpu_engine("gpu", B=2, T=70, C=16, H=2)
    mm = MATMUL_FORMS[form]
    eng.ops.facts.mm = mm
    eng.ops.launch.update(matmul=mm, matmul_small=mm)
    M, N, K = 40, 36, 1100
    assert eng.ops.split_plan(M, N, K)[1] > 1
    A, B = rng.normal(size=(K, M)).astype(f32), rng.normal(size=(K, N)).astype(f32)
    C0 = rng.normal(size=(M, N)).astype(f32)
    want = 0.5 * A.T.astype(np.float64) @ B + C0
    outs = []
    for _ in range(2):
        cbuf = to_dev(dev, C0)
        eng.matmul(M, N, K, to_dev(dev, A), to_dev(dev, B), cbuf, ta=1, accum=True, alpha=0.5)
        outs.append(from_dev(dev, cbuf, (M, N)))
    assert_close(outs[0], want, 1e-4, 1e-4, f"split-K {form}")
    assert np.array_equal(outs[0], outs[1])
    assert {key[-2] for key in eng.ops.product_kernels} == {id(mm)}

    Bt, T, C, H = 2, 70, 16, 2
    eng.ops.facts.attn_gemm = True
    qkv = rng.normal(size=(Bt, T, 3 * C)).astype(f32)
    dout = rng.normal(size=(Bt, T, C)).astype(f32)
    out_want, att = ref.attention_forward(qkv, H)
    dqkv_want = ref.attention_backward(dout, qkv, att, H)
    qb, ob, ab = to_dev(dev, qkv), to_dev(dev, np.zeros((Bt, T, C), f32)), to_dev(dev, np.zeros((Bt, H, T, T), f32))
    eng.ops.attention_forward(Bt, T, qb, ob, ab)
    assert_close(from_dev(dev, ob, (Bt, T, C)), out_want, 1e-5, 1e-4, f"attention out {form}")
    dq, datt = to_dev(dev, np.zeros((Bt, T, 3 * C), f32)), to_dev(dev, np.zeros((Bt, H, T, T), f32))
    eng.ops.attention_backward(Bt, T, to_dev(dev, dout), qb, ab, datt, dq)
    assert_close(from_dev(dev, dq, (Bt, T, 3 * C)), dqkv_want, 1e-5, 1e-4, f"attention backward {form}")
    assert {key[8] for key in eng.ops.product_kernels if key[7]} == {1, 2, 3}  # batched: every causal mode
    assert {key[-2] for key in eng.ops.product_kernels} == {id(mm)}


def _bf16_store(x, ld):
    """numpy's bf16 copy of x (rows, cols) as rows of `ld` uint16 (the top halves of the rounded floats; zeros past
    cols): what kernels/matmul.cl reads with A16 / B16."""
    bits = (ref.round_bf16(x).view(np.uint32) >> 16).astype(np.uint16)
    out = np.zeros((x.shape[0], ld), np.uint16)
    out[:, : x.shape[1]] = bits
    return out


# ---------------- bf16 storage ----------------
# A16, B16: each layout; inner tiles on VEC's float4 loads beside ragged edges; split-K; the tiled form, and the
# warp-tiled one (kernels/matmul_warp.cl: four-element loads wherever a tile lies inside)
@pytest.mark.parametrize("ta,tb", [(0, 1), (0, 0), (1, 0)])
@pytest.mark.parametrize("M,N,K,vec,split,warp", [(37, 53, 70, 0, 0, 0), (67, 45, 131, 1, 0, 0), (40, 36, 200, 1, 3, 0),
                                                  (67, 45, 131, 0, 0, 1), (40, 36, 200, 0, 3, 1)])
def test_bf16_storage_gives_round1_bits(dev, ta, tb, M, N, K, vec, split, warp):
    """A product on bf16-stored operands (numpy's copies, rows padded to 32) has the same bits as ROUND=1's on the
    fp32 operands, and is within fp32 sums of float64 of the rounded operands."""
    A = rng.normal(size=(K, M) if ta else (M, K)).astype(f32)
    B = rng.normal(size=(N, K) if tb else (K, N)).astype(f32)
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
    err = np.abs(got.sum(axis=0, dtype=np.float64) - rA @ rB) / (np.abs(rA) @ np.abs(rB))
    assert err.max() <= 1e-5, f"bf16 storage ta={ta} tb={tb} {M}x{N}x{K}: {err.max():.2e} x |A||B| from float64"
