"""Every backward of the float64 reference (clgpt.models.reference) against central finite differences
in float64: the references the kernel tests compare with are right."""

from __future__ import annotations

import numpy as np

from clgpt.models import reference as ref

from conftest import assert_close

rng = np.random.default_rng(1234)


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



def test_ref_label_smoothed_xent_against_torch_and_fd():
    """softmax_xent with label_smoothing: loss and gradient equal torch's cross_entropy(label_smoothing=eps) (per
    token, weighted by the mask, ignored where the target is -1) in float64; the gradient also finite differences."""
    import torch
    import torch.nn.functional as F

    r = np.random.default_rng(21)
    N, V, eps = 11, 13, 0.1
    logits = r.normal(size=(N, V)) * 3
    targets = r.integers(0, V, N)
    mask = (r.random(N) > 0.3) * r.choice([1.0, 0.5], N)
    mask[0] = 1
    targets[mask == 0] = -1
    loss, probs = ref.softmax_xent_forward(logits, targets, mask, eps)
    d = ref.softmax_xent_backward(probs, targets, mask, label_smoothing=eps)
    x = torch.tensor(logits, requires_grad=True)
    per_token = F.cross_entropy(x, torch.tensor(targets), ignore_index=-1, label_smoothing=eps, reduction="none")
    want = (per_token * torch.tensor(mask)).sum() / mask.sum()
    want.backward()
    assert abs(loss - want.item()) < 1e-12 * abs(loss), f"loss {loss} vs torch {want.item()}"
    assert_close(d, x.grad.numpy(), 1e-12, 1e-10, "label-smoothed dlogits vs torch")
    f = lambda: ref.softmax_xent_forward(logits, targets, mask, eps)[0]  # noqa: E731
    _check_fd(f, {"logits": logits}, {"logits": d}, "label-smoothed softmax_xent")

def test_ref_embedding_fd():
    tokens = np.array([[1, 3, 1], [0, 3, 3]])
    wte, wpe, R = rng.normal(size=(5, 4)), rng.normal(size=(6, 4)), rng.normal(size=(2, 3, 4))
    dwte, dwpe = ref.embedding_backward(R, tokens, 5, 6)
    f = lambda: (ref.embedding_forward(tokens, wte, wpe) * R).sum()  # noqa: E731
    _check_fd(f, {"wte": wte, "wpe": wpe}, {"wte": dwte, "wpe": dwpe}, "embedding")
