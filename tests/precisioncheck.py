"""Helpers of the reduced-precision tests (tests/test_precision_*.py): one matmul through one kernel form,
operands, the tolerance scaled by |op(A)| @ |op(B)|, and engines with the tensor-core path emulated.

Tolerances, relative to |op(A)| @ |op(B)| (the scale of each output's sum):
  against float64 of the ROUNDED operands: 1e-5 for every precision (products are exact; fp32 sums)
  against float64 of the operands as given: 2^-7 for bf16 (8 significant bits: 2^-8 per operand, two per
  product), 2^-10 for tf32 (11 bits: 2^-11 per operand)
"""

from __future__ import annotations

import numpy as np

from clgpt.device.knobs import Knobs
from clgpt.model import ModelConfig, init_params
from clgpt.models.gpt2 import GPT2Engine
from clgpt.ops import matmul_defines, matmul_launch
from clgpt.device.precision import ROUND

from conftest import from_dev, to_dev

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(4321)
ROUNDED_TOL = 1e-5
GIVEN_TOL = {"bf16": 2.0**-7, "tf32": 2.0**-10}


def assert_scaled(got, want, scale, tol, what):
    """|got - want| <= tol * scale elementwise (scale: |op(A)| @ |op(B)|)."""
    err = np.abs(np.asarray(got, np.float64) - want) / np.maximum(scale, 1e-30)
    assert err.max() <= tol, f"{what}: max error {err.max():.3e} x |A||B| (tolerance {tol:.1e})"
    return err.max()


def assert_bf16_step(runs, want_loss, want_grads):
    """Two bf16 steps' (loss, grads) against the float64 reference's: the loss within 2%, each gradient within 0.2
    of its largest magnitude, and the second step's bytes the first's."""
    (loss, grads), (loss2, grads2) = runs
    assert abs(loss - want_loss) < 2e-2 * abs(want_loss), f"loss {loss} vs {want_loss}"
    for name, g in want_grads.items():
        err = np.abs(grads[name] - g).max() / max(np.abs(g).max(), 1e-12)
        assert err < 0.2, f"grad {name}: relative error {err:.2e}"
    assert loss2 == loss and all(np.array_equal(grads[n], grads2[n]) for n in grads)


# Each portable form the tuning table can pick, and the tensor-core kernel with its mma emulated (small tiles
# to keep PoCL's compile short; the 8-warp 128x128 tiles the H200 runs are checked on the GPU, bench/gpu_tc.py).
FORMS = {
    "tiled": dict(kernel="matmul", TSM=32, TSN=32, TSK=8, WPTM=4, WPTN=4, LDSV=1, PREF=1),
    "rb": dict(kernel="matmul_rb", RM=6, NV=2, lsize=(1, 4)),
    "mma": dict(kernel="matmul_mma", BM=32, BN=16, WM=1, WN=1),
    "mma_4warps": dict(kernel="matmul_mma", BM=32, BN=32, WM=2, WN=2),
}


def run_matmul(dev, form, precision, A, B, ta, tb, M, N, K, bias=None, R=None, C0=None, epi=0, E0=None, alpha=1.0):
    """C = epi(alpha op(A) op(B) [+ bias] [+ R] [+ C0]) through one kernel form -> (C, E)."""
    mm = FORMS[form]
    Bd, tbk = B, tb
    if mm["kernel"] == "matmul_rb" and tb:  # its op(B) rows must be contiguous (the engine transposes)
        Bd, tbk = np.ascontiguousarray(B.T), 0
    opts = dict(TA=ta, TB=tbk, BIAS=int(bias is not None), RESID=int(R is not None), ACCUM=int(C0 is not None),
                EPI=epi, ROUND=ROUND[precision])
    if mm["kernel"] == "matmul_mma":
        opts.update(BM=mm["BM"], BN=mm["BN"], WM=mm["WM"], WN=mm["WN"], MMA_EMULATE=1, ALIGN4=int(K % 4 == 0 and M % 4 == 0 and N % 4 == 0))
        nth = 32 * mm["WM"] * mm["WN"]
        gsize, lsize = (-(-N // mm["BN"]) * nth, -(-M // mm["BM"])), (nth, 1)
        k = dev.kernel("matmul_mma", "matmul_mma", **opts)
    else:
        gsize, lsize = matmul_launch(mm, M, N)
        k = dev.kernel("matmul", mm["kernel"], **opts, **matmul_defines(mm))
    cbuf = to_dev(dev, C0 if C0 is not None else np.zeros((M, N), f32))
    ebuf = to_dev(dev, E0 if E0 is not None else np.zeros((M, N), f32))
    k(dev.queue, gsize, lsize, i32(M), i32(N), i32(K), to_dev(dev, A), i32(M if ta else K), to_dev(dev, Bd),
      i32(K if tbk else N), cbuf, i32(N), None if bias is None else to_dev(dev, bias),
      None if R is None else to_dev(dev, R), f32(alpha), ebuf)
    return from_dev(dev, cbuf, (M, N)), from_dev(dev, ebuf, (M, N))


def operands(ta, tb, M, N, K):
    A = rng.normal(size=(K, M) if ta else (M, K)).astype(f32)
    B = rng.normal(size=(N, K) if tb else (K, N)).astype(f32)
    return A, B


BF16_TILES = {  # small tiles of kernels/matmul_bf16.cl (PoCL emulates them slowly): 4 warps / 1 warp / 8-row masks
    "4warps": dict(BM=32, BN=32, WM=2, WN=2, STAGES=3),
    "1warp": dict(BM=32, BN=32, WM=1, WN=1, STAGES=2),
    "64": dict(BM=64, BN=64, WM=2, WN=2, STAGES=2),
    "bands": dict(BM=32, BN=32, WM=2, WN=2, STAGES=3, TILE_BAND=3),  # tiles taken in bands of 3 rows
}


def emulated_knobs(launch="nvidia", **over) -> Knobs:
    """Knobs for the tensor-core path emulated on any device, on the launch row `launch`, with small tiles (PoCL
    compiles them quickly); `over` replaces any field."""
    return Knobs(**{**dict(launch=launch, mma_emulate=True, mma=dict(BM=32, BN=32, WM=2, WN=2),
                           mma_small=dict(BM=32, BN=16, WM=1, WN=1), bf16=BF16_TILES["4warps"],
                           bf16_small=BF16_TILES["1warp"]), **over})


def _bf16_ops(tiles="4warps", **over):
    """The Ops of a bf16 engine whose tensor-core path is emulated (launch row nvidia), bf16 GEMM tiles `tiles`."""
    kn = emulated_knobs(bf16=BF16_TILES[tiles], bf16_small=BF16_TILES[tiles], **over)
    ops = _engine("bf16", knobs=kn).ops
    assert ops.bf16 is not None
    return ops


def _engine(precision, launch="cpu", emulate=False, knobs=None, **shape):
    """A GPT-2 engine of `shape` on the launch row `launch`, the tensor-core path emulated with `emulate`; or
    under `knobs` as given."""
    if knobs is None:
        knobs = emulated_knobs(launch) if emulate else Knobs(launch=launch)
    cfg = ModelConfig(vocab_size=shape.get("V", 16), n_ctx=shape.get("T", 8), n_embd=shape.get("C", 16),
                      n_head=shape.get("H", 2), n_layer=shape.get("L", 1), n_ff=shape.get("F", 32))
    return GPT2Engine(cfg, init_params(cfg, 0), batch_size=shape.get("B", 1), seq_len=shape.get("T", 8),
                  precision=precision, knobs=knobs)
