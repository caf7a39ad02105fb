"""GELU and the token + position embedding (forward and backward) against the float64 reference."""

from __future__ import annotations

import numpy as np

from clgpt.models import reference as ref

from opcheck import FD, check_op

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(1234)


# ---------------- gelu ----------------
def test_gelu(dev):
    n = 1000
    x = (rng.normal(size=n) * 3).astype(f32)
    dy = rng.normal(size=n).astype(f32)
    check_op(dev, "gelu", "gelu_forward", (n,), [("n", i32(n)), ("x", x), ("y", np.zeros_like(x))],
             {"y": ref.gelu_forward(x)}, scaled=False)
    check_op(dev, "gelu", "gelu_backward", (n,), [("n", i32(n)), ("dy", dy), ("x", x), ("dx", np.zeros_like(x))],
             {"dx": ref.gelu_backward(dy, x)}, scaled=False, fd=FD(ref.gelu_forward, {"x": x}, dy, grads={"dx": "x"}))


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
