"""kernels/matmul_wgmma.cl with wgmma emulated (WGMMA_EMULATE: its bulk copies and products done in C on the same
swizzled tiles, its epilogues and output passes as they stand), through the engine's wgmma GEMM on a CPU: each
operand layout, tile row, epilogue and split-K, and the experts' grouped products, against float64 of the
bf16-rounded operands, and a whole GPT-2 step against the float64 reference. The instructions themselves run on an
H100 or H200 only (bench/gpu_tc.py check)."""

from __future__ import annotations

import numpy as np
import pytest

from clgpt.device.knobs import OFF
from clgpt.model import ModelConfig, init_params
from clgpt.models import reference as ref

from conftest import from_dev, to_dev
from precisioncheck import ROUNDED_TOL, _engine, assert_bf16_step, assert_scaled, emulated_knobs, operands

f32 = np.float32
rng = np.random.default_rng(90)

TILES = {"narrow": dict(BM=128, BN=128, STAGES=3, PIPE=1), "mid": dict(BM=128, BN=192, STAGES=3, PIPE=1),
         "wide, no pipe": dict(BM=128, BN=256, STAGES=4, PIPE=0), "BN 96": dict(BM=128, BN=96, STAGES=2, PIPE=1),
         "BM 256": dict(BM=256, BN=128, STAGES=3, PIPE=1),
         "BM 64": dict(BM=64, BN=128, STAGES=3, PIPE=1), "BM 64 mid": dict(BM=64, BN=192, STAGES=3, PIPE=1)}
# the narrow row (most products take it) on each operand layout, the others on one or two (each case builds and
# emulates two kernels on PoCL: seconds apiece)
CASES = [("narrow", 0, 1), ("narrow", 0, 0), ("narrow", 1, 0), ("narrow", 1, 1), ("mid", 0, 1), ("mid", 1, 1),
         ("wide, no pipe", 1, 0), ("BN 96", 0, 1), ("BM 256", 0, 0), ("BM 64", 0, 1), ("BM 64", 1, 0),
         ("BM 64 mid", 0, 1)]


def wgmma_knobs(tiles=None):
    """Every bf16 product on matmul_wgmma.cl (emulated) on the narrow row `tiles` (None: the table's), no mid row."""
    return emulated_knobs(wgmma_emulate=True, wgmma_min_mnk=0, wgmma_mid=OFF,
                          **({"wgmma_narrow": tiles} if tiles else {}))


@pytest.mark.parametrize("tiles,ta,tb", CASES)
def test_wgmma_products_against_float64(dev, tiles, ta, tb):
    """C = 0.5 op(A) op(B) + bias + R + C on each operand layout (ragged M, N, K: part tiles, a k tile past K),
    and a deep product of one output tile, split along K and summed by splitk_reduce."""
    eng = _engine("bf16", knobs=wgmma_knobs(TILES[tiles]))
    gemm = eng.ops.gemms.wgmma
    assert gemm is not None and gemm.tiles(300, 200, 130, tb)["BN"] == TILES[tiles]["BN"]
    rnd = ref.ROUNDERS["bf16"]
    for M, N, K, epilogue in [(200, 300, 130, True), (64, 96, 4096, False)]:
        A, B = operands(ta, tb, M, N, K)
        opA, opB = rnd(A.T if ta else A).astype(np.float64), rnd(B.T if tb else B).astype(np.float64)
        C0, bias, R = (rng.normal(size=s).astype(f32) for s in ((M, N), (N,), (M, N)))
        cbuf = to_dev(dev, C0)
        kw = dict(bias=to_dev(dev, bias), resid=to_dev(dev, R)) if epilogue else {}
        eng.matmul(M, N, K, to_dev(dev, A), to_dev(dev, B), cbuf, ta=ta, tb=tb, accum=True, alpha=0.5, **kw)
        want = 0.5 * opA @ opB + C0 + ((bias + R) if epilogue else 0)
        scale = 0.5 * np.abs(opA) @ np.abs(opB) + np.abs(C0) + ((np.abs(bias) + np.abs(R)) if epilogue else 0)
        assert_scaled(from_dev(dev, cbuf, (M, N)), want, scale, ROUNDED_TOL, f"wgmma {tiles} {M}x{N}x{K}")
    split = [key for key in eng.ops.product_kernels if key[0] == "wgmma" and key[6]]
    assert split, "the deep product of one tile was not split along K"


def test_wgmma_bf16_copy_beside_or_alone(dev):
    """matmul_half with a copy (flash attention's of q | k | v): C = A @ B^T + bias in fp32 with its row-major bf16
    copy at an offset (OUT_BF16 2), and the copy alone with C left as it was (OUT_BF16 3), the same copy's bytes."""
    eng = _engine("bf16", knobs=wgmma_knobs())
    gemm = eng.ops.gemms.wgmma
    M, N, K, at = 200, 300, 130, 64  # ragged: part tiles and a part quad of columns; at in halves
    A, B = operands(0, 1, M, N, K)
    bias = rng.normal(size=N).astype(f32)
    C0 = rng.normal(size=(M, N)).astype(f32)
    out = []
    for fp32 in (True, False):
        cbuf, copy = to_dev(dev, C0), to_dev(dev, np.zeros(at + M * N, np.uint16))
        assert gemm.matmul_half(M, N, K, to_dev(dev, A), to_dev(dev, B), cbuf, tb=1, bias=to_dev(dev, bias),
                                copy=(copy, at), fp32=fp32)
        out.append((from_dev(dev, cbuf, (M, N)), from_dev(dev, copy, (at + M * N,), np.uint16)))
    (C, copy), (C_alone, copy_alone) = out
    rnd = ref.ROUNDERS["bf16"]
    opA, opB = rnd(A).astype(np.float64), rnd(B).astype(np.float64).T
    assert_scaled(C, opA @ opB + bias, np.abs(opA) @ np.abs(opB) + np.abs(bias), ROUNDED_TOL, "fp32 output")
    assert np.array_equal(copy[at:], (C.view(np.uint32) + 0x7FFF + ((C.view(np.uint32) >> 16) & 1)).ravel() >> 16), \
        "the copy is not C rounded to bf16 (nearest even)"
    assert not copy[:at].any(), "the copy wrote before its offset"
    assert np.array_equal(copy_alone, copy), "the copy alone differs from the copy beside fp32"
    assert np.array_equal(C_alone, C0), "the copy alone wrote C"


@pytest.mark.parametrize("attention", ["batched", "flash"])
def test_wgmma_engine_step_against_float64(dev, attention):
    """A GPT-2 bf16 step with every product on wgmma (emulated), rows and widths multiples of 64 so that the products
    writing only tiled copies (GELU's, dh's with its column sums) and bf16 logits run, attention batched or as flash
    attention (whose bf16 copy of q | k | v the product then writes alone): loss and every gradient against the
    float64 reference, and the same bytes twice. Batched, at 128 channels: the norms run as rows of 32 work-items,
    and LayerNorm's backward writes the residual gradient's copy and column sums (the bias gradients') for the
    products after it (64 with flash attention, whose emulated kernels build for minutes at 128). A logits-only
    forward after it (the KV cache's prefill) writes q | k | v in fp32 too."""
    from clgpt.models.factory import make_engine

    T = 64 if attention == "flash" else 16
    cfg = ModelConfig(vocab_size=64, n_ctx=T, n_embd=64 if attention == "flash" else 128, n_head=2, n_layer=1,
                      n_ff=128)
    params = init_params(cfg, 0)
    r = np.random.default_rng(7)
    B = 4 * 16 // T
    tok, tgt = (r.integers(0, 64, size=(B, T)).astype(np.int32) for _ in range(2))
    runs = []
    for _ in range(2):
        eng = make_engine(cfg, params, batch_size=B, seq_len=T, precision="bf16", knobs=wgmma_knobs(),
                          attention=attention)
        assert eng.ops.gemms.wgmma is not None and eng.ops.flash == (attention == "flash")
        names = []
        real = eng.ops.launcher.launch
        eng.ops.launcher.launch = lambda *a, real=real, names=names: (names.append(a[0].function_name), real(*a))
        eng.zero_grad()
        loss = eng.forward(tok, tgt)
        names.clear()
        eng.backward()
        runs.append((loss, eng.get_grads()))
    keys = [key for key in eng.ops.product_kernels if key[0] == "wgmma"]
    assert {1, 2} <= {key[7] for key in keys}, f"no product wrote only its tiled copy: {keys}"  # TILED_OUT
    if attention == "batched":  # the backward's reuse copies left to make: q | k | v's gradient's (its column sums
        # with it), none of the residual gradient's
        assert "layernorm_backward_rows_tiled_colsum" in eng.ops.k and names.count("to_bf16") == 1, names
    halves = {key[11] for key in keys}  # OUT_BF16: the logits (1), flash's copy of q | k | v alone (3)
    assert ({1, 3} if attention == "flash" else {1}) <= halves, f"no product wrote bf16: {keys}"
    want_loss, cache = ref.gpt_forward(params, cfg, tok, tgt)
    want = ref.gpt_backward(cache)
    assert_bf16_step(runs, want_loss, want)
    if attention == "flash":  # no targets: q | k | v in fp32 beside the copy
        eng.forward(tok)
        assert 2 in {key[11] for key in eng.ops.product_kernels if key[0] == "wgmma"}
        qkv = from_dev(dev, eng.acts[0]["qkv"], (B * T, 3 * cfg.n_embd))
        x = from_dev(dev, eng.acts[0]["ln1"], (B * T, cfg.n_embd))
        rnd = ref.ROUNDERS["bf16"]
        W = rnd(params["blk.0.attn_qkv.weight"]).astype(np.float64)
        xr = rnd(x).astype(np.float64)
        assert_scaled(qkv, xr @ W.T + params["blk.0.attn_qkv.bias"], np.abs(xr) @ np.abs(W.T) + 1, ROUNDED_TOL,
                      "q | k | v of a logits-only forward")


def test_wgmma_grouped_products_against_float64(dev):
    """The mixture of experts' products on wgmma (emulated; clgpt/ops/grouped.py, GROUP 1 and 2) with uneven
    groups and an empty one: x @ W_e.T, h @ V_e and the weight gradients h_e.T @ x_e against float64 of the rounded
    operands, an empty group's gradient zero, the same bytes twice."""
    from clgpt.ops import Ops

    cfg = ModelConfig(arch="llama", vocab_size=64, n_ctx=8, n_embd=64, n_ff=128, n_head=2, n_layer=1, n_expert=4,
                      n_expert_used=2)
    ops = Ops(dev, cfg, 8, precision="bf16", knobs=wgmma_knobs())
    assert ops.grouped_mma() and ops.grouped_on_wgmma(1 << 20, 1024, 384, 1 << 20)
    rnd, RM = ref.ROUNDERS["bf16"], ops.grouped_tiles()["RM"]
    C, F, counts = 64, 128, np.array([30, 0, 170, 5], np.int32)  # widths multiples of 64, as wgmma takes them
    E = len(counts)
    offs = np.concatenate([[0], np.cumsum(-(-counts // RM) * RM)]).astype(np.int32)
    R, offs = int(offs[-1]), offs[:-1].copy()
    x = rng.normal(size=(R, C)).astype(f32)
    W, V = (rng.normal(size=(E, F, C)).astype(f32) for _ in range(2))
    runs = []
    for _ in range(2):
        h, y, g = (to_dev(dev, np.zeros(s, f32)) for s in ((R, F), (R, C), (E, F, C)))
        bn, bo = to_dev(dev, counts), to_dev(dev, offs)
        ops.matmul_grouped_rows(E, R // RM, F, C, to_dev(dev, x), C, to_dev(dev, W), C, F * C, h, F, bn, bo, None,
                                tb=1, packed=R)
        ops.matmul_grouped_rows(E, R // RM, C, F, h, F, to_dev(dev, V), C, F * C, y, C, bn, bo, None, packed=R)
        ops.matmul_grouped_k(E, F, C, h, F, to_dev(dev, x), C, g, C, F * C, bn, bo, max_rows=R,
                             total_rows=int(counts.sum()), packed=R)
        runs.append((from_dev(dev, h, (R, F)), from_dev(dev, y, (R, C)), from_dev(dev, g, (E, F, C))))
    (h, y, g), again = runs
    assert all(np.array_equal(a, b) for a, b in zip((h, y, g), again))
    assert {key[8] for key in ops.product_kernels if key[0] == "wgmma"} == {1, 2}, list(ops.product_kernels)
    rx, rh = rnd(x).astype(np.float64), rnd(h).astype(np.float64)
    for e in range(E):
        rows = slice(offs[e], offs[e] + counts[e])
        if not counts[e]:
            assert not g[e].any(), "an empty group's weight gradient is not zero"
            continue
        rW, rV = rnd(W[e]).astype(np.float64), rnd(V[e]).astype(np.float64)
        for what, got, a, b in (("x @ W_e.T", h[rows], rx[rows], rW.T), ("h @ V_e", y[rows], rh[rows], rV),
                                ("h_e.T @ x_e", g[e], rh[rows].T, rx[rows])):
            assert_scaled(got, a @ b, np.abs(a) @ np.abs(b), ROUNDED_TOL, f"grouped {what}, expert {e}")
