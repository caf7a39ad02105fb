"""The key/value cache: kernels/kvcache.cl against float64 numpy, and prefill + one-token steps (clgpt.inference.kvcache)
against the engine's full forward for gpt2, llama with grouped-query heads, and mixture of experts, with
sequences of different lengths decoding in one batch. Generation with the cache against llama.cpp is in
tests/test_llama_parity.py and tests/test_llama_gguf.py (Generator decodes with it)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clgpt.device.opencl import get_device
from clgpt.inference.kvcache import KVCache
from clgpt.model import ModelConfig, init_params
from clgpt.models.factory import make_engine
from clgpt.device.knobs import Knobs

from opcheck import check_op

i32 = np.int32


def rope64(x, t, base=10000.0):
    """Adjacent-pair RoPE of head vectors x (..., D) at position t, float64."""
    D = x.shape[-1]
    ang = t * base ** (-np.arange(0, D, 2) / D)
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("rope,G", [(1, 2), (1, 1), (0, 1)])
def test_kv_append_matches_float64(dev, rope, G):
    rng = np.random.default_rng(1)
    B, H, D, TMAX = 3, 4, 8, 16
    C, CKV = H * D, H * D // G
    src = rng.standard_normal((B, C + 2 * CKV)).astype(np.float32)
    pos = np.array([0, 5, 15], np.int32)
    ang = np.arange(TMAX)[:, None] * 10000.0 ** (-np.arange(0, D, 2) / D)[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    kc0, vc0 = rng.standard_normal((2, B, TMAX, C)).astype(np.float32)
    s64 = src.astype(np.float64)
    q = s64[:, :C].reshape(B, H, D)
    k = np.repeat(s64[:, C:C + CKV].reshape(B, H // G, D), G, axis=1)
    v = np.repeat(s64[:, C + CKV:].reshape(B, H // G, D), G, axis=1)
    kc, vc = kc0.astype(np.float64), vc0.astype(np.float64)
    for b in range(B):
        if rope:
            q[b], k[b] = rope64(q[b], pos[b]), rope64(k[b], pos[b])
        kc[b, pos[b]], vc[b, pos[b]] = k[b].reshape(C), v[b].reshape(C)
    check_op(dev, "kvcache", "kv_append", (3 * H, B),
             [("B", i32(B)), ("src", src), ("pos", pos), ("cos", cos), ("sin", sin),
              ("q", np.zeros((B, C), np.float32)), ("kc", kc0), ("vc", vc0)],
             want={"q": q.reshape(B, C), "kc": kc, "vc": vc},
             defines=dict(C=C, D=D, CKV=CKV, G=G, TMAX=TMAX, SCALE=1.0, ROPE=rope, POS_EMBD=0), atol=1e-6, rtol=1e-6)


def test_attention_decode_matches_float64(dev):
    rng = np.random.default_rng(2)
    B, H, D, TMAX = 3, 2, 16, 40
    C = H * D
    q = rng.standard_normal((B, C)).astype(np.float32)
    kc, vc = rng.standard_normal((2, B, TMAX, C)).astype(np.float32)
    pos = np.array([0, 17, 39], np.int32)
    want = np.zeros((B, C))
    for b in range(B):
        for h in range(H):
            cols = slice(h * D, (h + 1) * D)
            s = kc[b, : pos[b] + 1, cols].astype(np.float64) @ q[b, cols] / math.sqrt(D)
            p = np.exp(s - s.max())
            want[b, cols] = (p / p.sum()) @ vc[b, : pos[b] + 1, cols]
    check_op(dev, "kvcache", "attention_decode", (H, B),
             [("B", i32(B)), ("q", q), ("kc", kc), ("vc", vc), ("pos", pos), ("out", np.zeros((B, C), np.float32))],
             want={"out": want}, defines=dict(C=C, D=D, CKV=C, G=1, TMAX=TMAX, SCALE=1 / math.sqrt(D), ROPE=0,
                                              POS_EMBD=0), atol=1e-6, rtol=1e-5)


def test_embed_at_matches_float64(dev):
    rng = np.random.default_rng(3)
    B, C, V, T = 3, 24, 50, 10
    wte, wpe = rng.standard_normal((V, C)).astype(np.float32), rng.standard_normal((T, C)).astype(np.float32)
    tokens, pos = np.array([4, 49, 0], np.int32), np.array([9, 0, 3], np.int32)
    check_op(dev, "kvcache", "embed_at", (C, B),
             [("B", i32(B)), ("tokens", tokens), ("pos", pos), ("wte", wte), ("wpe", wpe),
              ("x", np.zeros((B, C), np.float32))],
             want={"x": wte[tokens].astype(np.float64) + wpe[pos]},
             defines=dict(C=C, D=8, CKV=C, G=1, TMAX=T, SCALE=1.0, ROPE=0, POS_EMBD=1), atol=1e-7, rtol=0)


@pytest.mark.parametrize("K,bias,resid,gelu", [(128, 0, 1, 0), (37, 1, 0, 1), (8, 1, 1, 0)])
def test_gemv_matches_float64(dev, K, bias, resid, gelu):
    rng = np.random.default_rng(K)
    B, N = 3, 70
    x, W = rng.standard_normal((B, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)
    b, r = rng.standard_normal(N).astype(np.float32), rng.standard_normal((B, N)).astype(np.float32)
    y = x.astype(np.float64) @ W.T.astype(np.float64) + (b if bias else 0) + (r if resid else 0)
    want = {"y": y}
    if gelu:
        want["E"] = 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))
    check_op(dev, "gemv", "gemv_nt", (80, B),
             [("B", i32(B)), ("N", i32(N)), ("x", x), ("W", W), ("bias", b if bias else None),
              ("resid", r if resid else None), ("y", np.zeros((B, N), np.float32)),
              ("E", np.zeros((B, N), np.float32) if gelu else None)],
             want=want, defines=dict(K=K, BIAS=bias, RESID=resid, GELU=gelu), lsize=(16, 1), atol=1e-6, rtol=1e-5)


def _rms64(x, w, eps=1e-5):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("K,N,norm,resid", [(128, 70, 1, 0), (37, 9, 0, 1), (8, 1024, 1, 1)])
def test_gemv_pairs_matches_float64(dev, K, N, norm, resid):
    """The plain form: an optional RMSNorm of the row first, two outputs a work-item (N odd too), residual."""
    rng = np.random.default_rng(K + N)
    B = 3
    x, W = rng.standard_normal((B, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)
    nw, r = rng.standard_normal(K).astype(np.float32), rng.standard_normal((B, N)).astype(np.float32)
    xn = _rms64(x, nw) if norm else x.astype(np.float64)
    want = xn @ W.T.astype(np.float64) + (r if resid else 0)
    check_op(dev, "gemv", "gemv_pairs", (-(-N // 32) * 16, B),
             [("B", i32(B)), ("N", i32(N)), ("x", x), ("tokens", None), ("wte", None),
              ("nw", nw if norm else None), ("W", W), ("resid", r if resid else None),
              ("y", np.zeros((B, N), np.float32)), ("pos", None), ("cos", None), ("sin", None), ("kc", None),
              ("vc", None)],
             want={"y": want, "x": x}, defines=dict(K=K, NORM=norm, EMBED=0, EPI=0, RESID=resid, LW=16),
             lsize=(16, 1), atol=1e-6, rtol=1e-5)


def test_gemv_pairs_swiglu_matches_float64(dev):
    rng = np.random.default_rng(5)
    B, K, F = 2, 40, 24
    x, W = rng.standard_normal((B, K)).astype(np.float32), rng.standard_normal((2 * F, K)).astype(np.float32)
    nw = rng.standard_normal(K).astype(np.float32)
    h = _rms64(x, nw) @ W.T.astype(np.float64)
    g, u = h[:, :F], h[:, F:]
    check_op(dev, "gemv", "gemv_pairs", (32, B),
             [("B", i32(B)), ("N", i32(2 * F)), ("x", x), ("tokens", None), ("wte", None), ("nw", nw), ("W", W),
              ("resid", None), ("y", np.zeros((B, F), np.float32)), ("pos", None), ("cos", None), ("sin", None),
              ("kc", None), ("vc", None)],
             want={"y": g / (1 + np.exp(-g)) * u}, defines=dict(K=K, NORM=1, EMBED=0, EPI=2, RESID=0, LW=16),
             lsize=(16, 1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("G", [1, 2])
def test_gemv_pairs_qkv_matches_float64(dev, G):
    """The q|k|v form from the token table (EMBED): x takes the embedding row, q and k pairs turned at pos[b],
    k and v written to the caches with each kv head repeated G times; the rest of the caches untouched."""
    rng = np.random.default_rng(6 + G)
    B, H, D, TMAX, V = 3, 4, 8, 16, 11
    C, CKV = H * D, H * D // G
    N = C + 2 * CKV
    wte, W = rng.standard_normal((V, C)).astype(np.float32), rng.standard_normal((N, C)).astype(np.float32)
    nw = rng.standard_normal(C).astype(np.float32)
    tokens, pos = np.array([3, 10, 0], np.int32), np.array([0, 5, 15], np.int32)
    ang = np.arange(TMAX)[:, None] * 10000.0 ** (-np.arange(0, D, 2) / D)[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    kc0, vc0 = rng.standard_normal((2, B, TMAX, C)).astype(np.float32)
    h = _rms64(wte[tokens], nw) @ W.T.astype(np.float64)
    q = h[:, :C].reshape(B, H, D)
    k = np.repeat(h[:, C:C + CKV].reshape(B, H // G, D), G, axis=1)
    v = np.repeat(h[:, C + CKV:].reshape(B, H // G, D), G, axis=1)
    kc, vc = kc0.astype(np.float64), vc0.astype(np.float64)
    for b in range(B):
        q[b], k[b] = rope64(q[b], pos[b]), rope64(k[b], pos[b])
        kc[b, pos[b]], vc[b, pos[b]] = k[b].reshape(C), v[b].reshape(C)
    check_op(dev, "gemv", "gemv_pairs", (-(-N // 32) * 16, B),
             [("B", i32(B)), ("N", i32(N)), ("x", np.zeros((B, C), np.float32)), ("tokens", tokens), ("wte", wte),
              ("nw", nw), ("W", W), ("resid", None), ("y", np.zeros((B, C), np.float32)), ("pos", pos),
              ("cos", cos), ("sin", sin), ("kc", kc0), ("vc", vc0)],
             want={"x": wte[tokens], "y": q.reshape(B, C), "kc": kc, "vc": vc},
             defines=dict(K=C, NORM=1, EMBED=1, EPI=1, RESID=0, LW=16, C=C, D=D, CKV=CKV, G=G, TMAX=TMAX),
             lsize=(16, 1), atol=1e-6, rtol=1e-5)


SHAPES = {
    "gpt2": dict(arch="gpt2", n_head=2, n_ff=128),
    "llama_gqa": dict(arch="llama", n_head=4, n_head_kv=2, n_ff=96),
    "moe": dict(arch="llama", n_head=4, n_head_kv=1, n_ff=64, n_expert=4, n_expert_used=2, tied=False),
}


@pytest.mark.parametrize("kind,by_op", [(kind, False) for kind in SHAPES] + [("llama_gqa", True)])
def test_prefill_then_steps_match_full_forward(dev, kind, by_op):
    """Three sequences of different lengths: prefill, then 12 steps each at its own position; each step's logits
    equal the full forward's at that position (same weights, every earlier token) to float32 rounding."""
    cfg = ModelConfig(vocab_size=97, n_ctx=64, n_embd=32, n_layer=2, **SHAPES[kind])
    params = init_params(cfg, 7)
    for name in params:  # larger weights than the init's, so attention is far from uniform
        params[name] = params[name] * (4.0 if params[name].ndim > 1 else 1.0)
    rng = np.random.default_rng(4)
    lengths = [5, 17, 32]
    seqs = [list(rng.integers(0, cfg.vocab_size, n + 12)) for n in lengths]
    eng = make_engine(cfg, params, batch_size=3, seq_len=cfg.n_ctx, device=dev, knobs=Knobs())
    ref = make_engine(cfg, params, batch_size=1, seq_len=cfg.n_ctx, device=dev, knobs=Knobs())
    cache = KVCache(eng)
    assert cache.fused == (kind == "llama_gqa")  # dense llama: the step as gemv_pairs launches
    if by_op:
        cache.fused = False
    W = 32
    tokens = np.zeros((3, W), np.int32)
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        tokens[b, :n] = s[:n]
    got = [cache.prefill(tokens, [n - 1 for n in lengths])]
    for k in range(12):
        got.append(cache.step([s[n + k] for s, n in zip(seqs, lengths)], [n + k for n in lengths]))
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        full = ref.forward(np.array([s], np.int32))[0].astype(np.float64)  # (T, V)
        scale = np.abs(full).max()
        for k in range(13):
            diff = np.abs(got[k][b] - full[n - 1 + k]).max()
            assert diff <= 2e-5 * scale, f"{kind} row {b} step {k}: max diff {diff:.3g} of scale {scale:.3g}"
            assert np.argmax(got[k][b]) == np.argmax(full[n - 1 + k])


def test_generation_decodes_on_intels_runtime_where_it_works(monkeypatch):
    """clgpt generate and chat decode on Intel's CPU runtime where the automatic choice is a CPU and that runtime
    works (its launches return in microseconds, PoCL's in tens); a device named, or PYOPENCL_CTX, is taken as
    given; training's choice stays get_device's."""
    from clgpt.device.opencl import cpu_implementations, decode_device, get_device

    monkeypatch.delenv("PYOPENCL_CTX", raising=False)
    impls = cpu_implementations(gpu_first=True)
    if "intel" in impls:
        assert "intel" in decode_device().device.platform.name.lower()
    else:
        assert decode_device() is get_device()
    for spec in impls.values():
        if spec:
            assert decode_device(spec) is get_device(spec)
            monkeypatch.setenv("PYOPENCL_CTX", spec)
            assert decode_device() is get_device(spec)
            monkeypatch.delenv("PYOPENCL_CTX")
