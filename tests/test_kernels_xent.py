"""Softmax + cross-entropy against the float64 reference: the plain kernels, the CPU's fused form and the
GPU's one-pass work-group form; each again built with label smoothing (-D LS), its gradients also against
finite differences."""

from __future__ import annotations

import numpy as np
import pytest

from clgpt.models import reference as ref

from conftest import assert_close, empty, from_dev, to_dev
from opcheck import FD, assert_directional_fd, check_op, fd_grad, run_op

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


@pytest.mark.parametrize("V,ls", [(260, {}), (1003, {}), (260, {"LS": 0.1})])
def test_xent_forward_wg_on_bf16_logits_against_float64(dev, V, ls):
    """xent_forward_wg with -D LOGITS_BF16 (the head's product wrote the logits as bf16, row-major): losses and lse
    of the logits the bf16 halves hold, against float64 (plain and label-smoothed; float4 loads and single ones).
    The bf16 logits are random bits' halves, not the fp32 kernel's input cut short: a load that read the wrong
    half, or a whole float, gives other values."""
    N, LW = 7, 64
    r = np.random.default_rng(6)
    logits = (r.normal(size=(N, V)) * 8 + np.linspace(-20, 20, V)[None] * r.choice([-1, 1], (N, 1))).astype(f32)
    half = ref.round_bf16(logits)
    bits = (half.view(np.uint32) >> 16).astype(np.uint16)
    targets = r.integers(0, V, N).astype(i32)
    mask = np.ones(N, f32)
    mask[4] = 0
    out = run_op(dev, "xent", "xent_forward_wg", (N * LW,), [("N", i32(N)), ("logits", bits), ("targets", targets),
                 ("mask", mask), ("losses", np.zeros(N, f32)), ("lse", np.zeros(N, f32))],
                 dict(V=V, LW=LW, LOGITS_BF16=1, **ls), lsize=(LW,))
    x = half.astype(np.float64)
    lse = x.max(1) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1))
    eps = ls.get("LS", 0.0)
    nll = lse - x[np.arange(N), targets]
    want = np.where(mask != 0, (1 - eps) * nll + eps * (lse - x.mean(1)), 0.0)
    assert np.abs(out["lse"] - lse).max() < 1e-5 * np.abs(lse).max()
    assert np.abs(out["losses"] - want).max() < 1e-5 * np.abs(lse).max()
    assert out["losses"][4] == 0


# ---------------- label smoothing (-D LS): every variant against float64 and finite differences ----------------
EPS = 0.1  # the target (1 - EPS) onehot + EPS / V, torch's cross_entropy(label_smoothing=EPS)


def _smoothing_case(N, V, seed):
    """logits (N,V) wide enough that the logit sum matters, targets, a mask of weights 0, 0.5 and 1 (targets -1
    where it is 0: ignored), the first row live."""
    r = np.random.default_rng(seed)
    logits = (r.normal(size=(N, V)) * 3 + r.normal(size=(N, 1)) * 4).astype(f32)
    targets = r.integers(0, V, N).astype(i32)
    mask = (r.random(N) > 0.3).astype(f32) * r.choice([1.0, 0.5], N).astype(f32)
    mask[0] = 1
    targets[mask == 0] = -1
    return logits, targets, mask


def _row_losses(logits, targets, mask, eps):
    """Per-row float64 losses as the kernels write them: mask * smoothed NLL, 0 where the mask is 0 or the
    target is outside the vocabulary."""
    V = logits.shape[1]
    return np.array([m * ref.softmax_xent_forward(logits[n:n + 1], targets[n:n + 1], None, eps)[0]
                     if m != 0 and 0 <= targets[n] < V else 0.0 for n, m in enumerate(mask)])


def _assert_grad_is_fd(got, logits, targets, mask, dloss, what, atol=1e-6):
    """got (N,V) = dloss * d(smoothed loss)/d(logits), against central differences of the float64 reference."""
    fwd = lambda logits: ref.softmax_xent_forward(logits, targets, mask, EPS)[0]  # noqa: E731
    idx, num = fd_grad(fwd, {"logits": logits}, np.float64(dloss), "logits", 60, 1e-6)
    s = max(1.0, float(np.abs(num).max()))
    got = np.asarray(got, np.float64).reshape(-1)[idx]
    assert_close(got, num, atol * s, 1e-4, f"{what} against finite differences")


def test_xent_label_smoothing_zero_is_the_plain_reference():
    logits, targets, mask = _smoothing_case(9, 31, 11)
    plain, p0 = ref.softmax_xent_forward(logits, targets, mask)
    zero, p1 = ref.softmax_xent_forward(logits, targets, mask, 0.0)
    assert zero == plain and np.array_equal(p0, p1)
    assert np.array_equal(ref.softmax_xent_backward(p0, targets, mask, 0.7),
                          ref.softmax_xent_backward(p0, targets, mask, 0.7, label_smoothing=0.0))
    assert abs(ref.softmax_xent_forward(logits, targets, mask, EPS)[0] - plain) > 1e-2  # smoothing moves it


@pytest.mark.parametrize("N,V", [(13, 37), (6, 1003)])
def test_xent_forward_and_backward_label_smoothed(dev, N, V):
    """xent_forward's per-row losses and xent_backward's gradient with -D LS against the float64 reference; the
    gradient also against finite differences of the float64 loss, and along random directions against those of
    the kernel's own float32 loss."""
    logits, targets, mask = _smoothing_case(N, V, 3)
    msum = float(mask.astype(np.float64).sum())
    _, probs = ref.softmax_xent_forward(logits, targets, mask, EPS)
    defines = dict(V=V, LS=EPS)

    def forward(x):
        return run_op(dev, "xent", "xent_forward", (N,), [("N", i32(N)), ("logits", np.asarray(x, f32)),
                      ("targets", targets), ("mask", mask), ("losses", np.zeros(N, f32)), ("lse", np.zeros(N, f32))],
                      defines)

    out = forward(logits)
    assert_close(out["losses"], _row_losses(logits, targets, mask, EPS), 1e-5, 1e-5, "xent_forward LS losses")
    dl_want = ref.softmax_xent_backward(probs, targets, mask, dloss=0.7, label_smoothing=EPS)
    got = check_op(dev, "xent", "xent_backward", (V, N), [("N", i32(N)), ("s", f32(0.7 / msum)), ("logits", logits),
                   ("targets", targets), ("mask", mask), ("lse", out["lse"]), ("dl", np.zeros_like(logits))],
                   {"dl": dl_want}, defines, atol=1e-6, rtol=1e-4, scaled=False)["dl"]
    _assert_grad_is_fd(got, logits, targets, mask, 0.7, "xent_backward LS")
    loss32 = lambda x: float(forward(x)["losses"].astype(np.float64).sum() / msum)  # noqa: E731
    assert_directional_fd(loss32, logits.astype(np.float64), got / 0.7, 2e-2, np.random.default_rng(4), eps=1e-2)


@pytest.mark.parametrize("N,V", [(13, 37), (9, 512), (5, 4099)])
def test_xent_fused_label_smoothed(dev, N, V):
    """xent_fused with -D LS: losses, lse and the unscaled gradient mask * (softmax - (1 - LS) onehot - LS / V)
    against float64, the gradient also against finite differences of the float64 loss."""
    logits, targets, mask = _smoothing_case(N, V, 5)
    msum = float(mask.astype(np.float64).sum())
    _, probs = ref.softmax_xent_forward(logits, targets, mask, EPS)
    lb, tb, mb = to_dev(dev, logits), to_dev(dev, targets), to_dev(dev, mask)
    losses, lse, dl = empty(dev, N), empty(dev, N), to_dev(dev, np.full(N * V, np.nan, f32))
    dev.kernel("xent", "xent_fused", V=V, LS=EPS)(dev.queue, (N,), None, i32(N), lb, tb, mb, losses, lse, dl)
    assert_close(from_dev(dev, losses, N), _row_losses(logits, targets, mask, EPS), 1e-5, 1e-5, "xent_fused LS losses")
    l64 = logits.astype(np.float64)
    lse_want = np.log(np.exp(l64 - l64.max(1, keepdims=True)).sum(1)) + l64.max(1)
    assert_close(from_dev(dev, lse, N), lse_want, 1e-5, 1e-6, "xent_fused LS lse")
    got = from_dev(dev, dl, (N, V)).astype(np.float64) * (0.7 / msum)
    want = ref.softmax_xent_backward(probs, targets, mask, dloss=0.7, label_smoothing=EPS)
    assert_close(got, want, 1e-6, 1e-4, "xent_fused LS dlogits")
    _assert_grad_is_fd(got, logits, targets, mask, 0.7, "xent_fused LS")


@pytest.mark.parametrize("V", [260, 1003])
def test_xent_forward_wg_label_smoothed(dev, V):
    """xent_forward_wg with -D LS (the logit sum a third work-group reduction; float4 where V % 4 == 0): losses
    and lse against float64; masked rows and out-of-range targets give 0."""
    N, LW = 7, 64
    logits, targets, mask = _smoothing_case(N, V, 9)
    targets[2], mask[2] = V, 1
    out = run_op(dev, "xent", "xent_forward_wg", (N * LW,), [("N", i32(N)), ("logits", logits), ("targets", targets),
                 ("mask", mask), ("losses", np.zeros(N, f32)), ("lse", np.zeros(N, f32))], dict(V=V, LW=LW, LS=EPS),
                 lsize=(LW,))
    want = _row_losses(logits, targets, mask, EPS)
    assert want[2] == 0 and (want[mask == 0] == 0).all()
    assert_close(out["losses"], want, 1e-5 * np.abs(logits).max(), 1e-5, "xent_forward_wg LS losses")
    x = logits.astype(np.float64)
    assert_close(out["lse"], x.max(1) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)), 1e-5, 1e-6,
                 "xent_forward_wg LS lse")
