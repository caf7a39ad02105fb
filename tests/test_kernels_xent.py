"""Softmax + cross-entropy against the float64 reference: the plain kernels, the CPU's fused form and the
GPU's one-pass work-group form."""

from __future__ import annotations

import numpy as np
import pytest

from clgpt.models import reference as ref

from conftest import assert_close, empty, from_dev, to_dev
from opcheck import FD, check_op, run_op

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(1234)


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
