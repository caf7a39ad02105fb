"""Float64 numpy reference of the llama ops and the whole llama (dense and mixture-of-experts) model.

Shapes: B batch, T time, N = B*T, C n_embd, V vocab, H heads, Hkv kv heads, G = H // Hkv, D = C // H,
F n_ff, E experts, K experts used, L layers. Matrices are (out, in): y = x @ W.T. Ops come as
`<op>_forward` / `<op>_backward`; backward functions return gradients w.r.t. their inputs.

Routing is discrete: `llama_forward(..., routing=...)` can fix each layer's top-k indices (N,K), which is
how gradients are checked against finite differences; the backward always holds the routing fixed.
The objective the backward differentiates is loss + cfg.moe_aux_loss * aux (aux summed over layers).
"""

from __future__ import annotations

import numpy as np

from clgpt.model import ModelConfig
from clgpt.models.reference import (attention_backward, attention_forward, dropout_masks, softmax_xent_backward,
                             softmax_xent_forward)


def _f64(a):
    return np.asarray(a, dtype=np.float64)


# ---- RMSNorm over the last axis: out = x * rsqrt(mean(x^2) + eps) * w ----
def rmsnorm_forward(x, w, eps=1e-5):
    """-> out, rstd (x's shape minus the last axis)."""
    x = _f64(x)
    rstd = 1.0 / np.sqrt((x * x).mean(axis=-1) + eps)
    return x * rstd[..., None] * _f64(w), rstd


def rmsnorm_backward(dout, x, w, rstd):
    """-> dx, dw."""
    dout, x = _f64(dout), _f64(x)
    xhat = x * rstd[..., None]
    dn = dout * _f64(w)
    dw = (dout * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
    dx = rstd[..., None] * (dn - xhat * (dn * xhat).mean(axis=-1, keepdims=True))
    return dx, dw


# ---- RoPE, llama.cpp "normal" layout: pairs (2i, 2i+1) of each head, angle t * base^(-2i/D) ----
def rope_tables(T, D, base=10000.0):
    """-> cos, sin (T, D/2) float64."""
    theta = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(T, dtype=np.float64)[:, None] * theta[None]
    return np.cos(ang), np.sin(ang)


def rope_forward(x, cos, sin):
    """x (B,T,H,D) -> rotated (B,T,H,D)."""
    x = _f64(x)
    T = x.shape[1]
    c, s = cos[:T][None, :, None], sin[:T][None, :, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def rope_backward(dout, cos, sin):
    """The transposed rotation."""
    return rope_forward(dout, cos, -sin)


def rope_qkv_forward(q, k, v, H, Hkv, cos, sin):
    """q (B,T,C), k, v (B,T,Hkv*D) -> qkv (B,T,3C) as kernels/attention.cl reads it (kv heads repeated)."""
    B, T, C = q.shape
    D, G = C // H, H // Hkv
    qr = rope_forward(_f64(q).reshape(B, T, H, D), cos, sin)
    kr = rope_forward(_f64(k).reshape(B, T, Hkv, D), cos, sin)
    kr, vr = np.repeat(kr, G, axis=2), np.repeat(_f64(v).reshape(B, T, Hkv, D), G, axis=2)
    return np.concatenate([a.reshape(B, T, C) for a in (qr, kr, vr)], axis=-1)


def rope_qkv_backward(dqkv, H, Hkv, cos, sin):
    """-> dq (B,T,C), dk, dv (B,T,Hkv*D)."""
    B, T, C3 = dqkv.shape
    C = C3 // 3
    D, G = C // H, H // Hkv
    dq, dk, dv = (_f64(dqkv[..., i * C:(i + 1) * C]).reshape(B, T, H, D) for i in range(3))
    dk = dk.reshape(B, T, Hkv, G, D).sum(axis=3)
    dv = dv.reshape(B, T, Hkv, G, D).sum(axis=3)
    return (rope_backward(dq, cos, sin).reshape(B, T, C), rope_backward(dk, cos, sin).reshape(B, T, -1),
            dv.reshape(B, T, -1))


# ---- SwiGLU: y = silu(g) * u ----
def swiglu_forward(g, u):
    g = _f64(g)
    return g / (1.0 + np.exp(-g)) * _f64(u)


def swiglu_backward(dout, g, u):
    """-> dg, du."""
    g, u, dout = _f64(g), _f64(u), _f64(dout)
    sg = 1.0 / (1.0 + np.exp(-g))
    return dout * u * sg * (1.0 + g * (1.0 - sg)), dout * g * sg


def swiglu_ffn_forward(x, Wg, Wu, Wd):
    """x (M,C) -> y (M,C), cache."""
    hg, hu = _f64(x) @ _f64(Wg).T, _f64(x) @ _f64(Wu).T
    act = swiglu_forward(hg, hu)
    return act @ _f64(Wd).T, (hg, hu, act)


def swiglu_ffn_backward(dy, x, Wg, Wu, Wd, cache):
    """-> dx, dWg, dWu, dWd."""
    hg, hu, act = cache
    dy, x = _f64(dy), _f64(x)
    dact = dy @ _f64(Wd)
    dhg, dhu = swiglu_backward(dact, hg, hu)
    dx = dhg @ _f64(Wg) + dhu @ _f64(Wu)
    return dx, dhg.T @ x, dhu.T @ x, dy.T @ act


# ---- router: softmax, top-k (descending, ties to the lower index), renormalised weights ----
def router_forward(rlogits, K, sel=None):
    """rlogits (N,E) -> probs (N,E), sel (N,K) int, w (N,K). sel given: routing fixed."""
    z = _f64(rlogits)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if sel is None:
        sel = np.argsort(-p, axis=-1, kind="stable")[:, :K]
    ps = np.take_along_axis(p, sel, axis=-1)
    return p, sel, ps / ps.sum(axis=-1, keepdims=True)


def router_backward(dw, probs, sel, w, dprobs=None):
    """dw (N,K) [+ dprobs (N,E), e.g. the load-balancing loss's] -> drlogits (N,E), routing fixed."""
    ssel = np.take_along_axis(probs, sel, axis=-1).sum(axis=-1, keepdims=True)
    dsel = (dw - (dw * w).sum(axis=-1, keepdims=True)) / ssel
    dp = np.zeros_like(probs) if dprobs is None else _f64(dprobs).copy()
    np.put_along_axis(dp, sel, np.take_along_axis(dp, sel, axis=-1) + dsel, axis=-1)
    return probs * (dp - (probs * dp).sum(axis=-1, keepdims=True))


def load_balance(probs, sel, E):
    """Switch-style aux = E * sum_e f_e P_e, f_e = share of the N*K assignments on e, P_e = mean_n p[n,e].
    -> aux, d aux / d probs (f_e held constant: it is discrete), counts (E)."""
    N, K = sel.shape
    counts = np.bincount(sel.reshape(-1), minlength=E).astype(np.float64)
    f, P = counts / (N * K), probs.mean(axis=0)
    return float(E * (f * P).sum()), np.broadcast_to(E * f / N, probs.shape).copy(), counts


def moe_forward(x, Wr, Wg, Wu, Wd, K, sel=None):
    """x (N,C); Wr (E,C); Wg, Wu (E,F,C); Wd (E,C,F) -> y (N,C), cache. y_n = sum_k w_nk expert_sel(x_n)."""
    x = _f64(x)
    probs, sel, w = router_forward(x @ _f64(Wr).T, K, sel)
    y = np.zeros_like(x)
    experts = []
    for e in range(Wr.shape[0]):
        n_idx, k_idx = np.nonzero(sel == e)  # tokens in increasing order
        ye, c = swiglu_ffn_forward(x[n_idx], Wg[e], Wu[e], Wd[e])
        np.add.at(y, n_idx, w[n_idx, k_idx][:, None] * ye)
        experts.append((n_idx, k_idx, ye, c))
    return y, dict(x=x, probs=probs, sel=sel, w=w, experts=experts)


def moe_backward(dy, Wr, Wg, Wu, Wd, cache, aux_coef=0.0):
    """-> dx, dWr, dWg, dWu, dWd for y [+ aux_coef * aux] (routing fixed)."""
    x, probs, sel, w = cache["x"], cache["probs"], cache["sel"], cache["w"]
    dy = _f64(dy)
    dx = np.zeros_like(x)
    dw = np.zeros_like(w)
    dWg, dWu, dWd = np.zeros(Wg.shape), np.zeros(Wu.shape), np.zeros(Wd.shape)
    for e, (n_idx, k_idx, ye, c) in enumerate(cache["experts"]):
        dw[n_idx, k_idx] = (dy[n_idx] * ye).sum(axis=-1)
        dxe, dWg[e], dWu[e], dWd[e] = swiglu_ffn_backward(w[n_idx, k_idx][:, None] * dy[n_idx], x[n_idx],
                                                          Wg[e], Wu[e], Wd[e], c)
        np.add.at(dx, n_idx, dxe)
    _, daux, _ = load_balance(probs, sel, Wr.shape[0])
    drl = router_backward(dw, probs, sel, w, aux_coef * daux)
    return dx + drl @ _f64(Wr), drl.T @ x, dWg, dWu, dWd


# ---- the whole model ----
def llama_forward(params, cfg: ModelConfig, tokens, targets, mask=None, routing=None, dropout=None,
                  label_smoothing=0.0):
    """-> (loss, aux, cache). loss: masked mean NLL (label_smoothing eps: against (1 - eps) onehot + eps / V); aux:
    load-balancing loss summed over layers (0 when dense). routing: None, or a list of (B*T, K) index arrays per
    layer to hold the routing fixed. dropout: (seed, p) or None, the engine's masks
    (clgpt.models.reference.dropout_masks)."""
    p = {k: _f64(v) for k, v in params.items()}
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    N, C, H, Hkv, eps = B * T, cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.norm_eps
    cos, sin = rope_tables(T, cfg.head_dim, cfg.rope_base)
    dm = dropout_masks(dropout, cfg, B, T)
    one = lambda i, kind: 1.0 if dm is None else dm[i, kind]  # noqa: E731
    x = p["token_embd.weight"][tokens]  # (B,T,C)
    if dm is not None:
        x = x * dm["embd"]
    layers, aux = [], 0.0
    for i in range(cfg.n_layer):
        pre = f"blk.{i}."
        ln1, r1 = rmsnorm_forward(x, p[pre + "attn_norm.weight"], eps)
        q, k, v = (ln1 @ p[pre + f"attn_{n}.weight"].T for n in "qkv")
        qkv = rope_qkv_forward(q, k, v, H, Hkv, cos, sin)  # (B,T,3C)
        atty, att = attention_forward(qkv, H, None if dm is None else dm[i, "attn"])
        x_mid = x + one(i, "attn_res") * (atty @ p[pre + "attn_output.weight"].T)
        ln2, r2 = rmsnorm_forward(x_mid, p[pre + "ffn_norm.weight"], eps)
        a = dict(x=x, ln1=ln1, r1=r1, qkv=qkv, atty=atty, att=att, x_mid=x_mid, ln2=ln2, r2=r2)
        if cfg.n_expert:
            y, a["moe"] = moe_forward(ln2.reshape(N, C), p[pre + "ffn_gate_inp.weight"], p[pre + "ffn_gate_exps.weight"],
                                      p[pre + "ffn_up_exps.weight"], p[pre + "ffn_down_exps.weight"],
                                      cfg.n_expert_used, None if routing is None else routing[i])
            la, _, a["counts"] = load_balance(a["moe"]["probs"], a["moe"]["sel"], cfg.n_expert)
            aux += la
        else:
            y, a["ffn"] = swiglu_ffn_forward(ln2.reshape(N, C), p[pre + "ffn_gate.weight"], p[pre + "ffn_up.weight"],
                                             p[pre + "ffn_down.weight"])
        layers.append(a)
        x = x_mid + one(i, "ffn_res") * y.reshape(B, T, C)
    lnf, rf = rmsnorm_forward(x, p["output_norm.weight"], eps)
    W_out = p["token_embd.weight"] if cfg.tied else p["output.weight"]
    logits = lnf @ W_out.T
    loss, probs = softmax_xent_forward(logits, np.asarray(targets), mask, label_smoothing)
    cache = dict(p=p, cfg=cfg, tokens=tokens, targets=np.asarray(targets), mask=mask, layers=layers, x=x, lnf=lnf,
                 rf=rf, probs=probs, logits=logits, cos=cos, sin=sin, dm=dm, label_smoothing=label_smoothing)
    return loss, aux, cache


def llama_logits(params, cfg: ModelConfig, tokens):
    """-> logits (B,T,V) float64."""
    tokens = np.asarray(tokens)
    return llama_forward(params, cfg, tokens, np.zeros_like(tokens))[2]["logits"]


def routing_of(cache) -> list[np.ndarray]:
    """Each layer's top-k indices (N,K) of a forward, to hold the routing fixed in another."""
    return [a["moe"]["sel"] for a in cache["layers"]]


def expert_usage(cache) -> np.ndarray:
    """(L,E): the fraction of tokens that route to each expert (each row sums to K)."""
    N = cache["tokens"].size
    return np.array([a["counts"] / N for a in cache["layers"]])


def llama_backward(cache) -> dict[str, np.ndarray]:
    """-> d(loss + cfg.moe_aux_loss * aux)/dparam for every parameter (float64), routing fixed."""
    p, cfg = cache["p"], cache["cfg"]
    B, T = cache["tokens"].shape
    N, C, H, Hkv = B * T, cfg.n_embd, cfg.n_head, cfg.kv_heads
    cos, sin = cache["cos"], cache["sin"]
    grads = {k: np.zeros_like(v) for k, v in p.items()}
    dlogits = softmax_xent_backward(cache["probs"], cache["targets"], cache["mask"],
                                    label_smoothing=cache["label_smoothing"])
    out_name = "token_embd.weight" if cfg.tied else "output.weight"
    grads[out_name] += dlogits.reshape(-1, dlogits.shape[-1]).T @ cache["lnf"].reshape(N, C)
    dx, dw = rmsnorm_backward(dlogits @ p[out_name], cache["x"], p["output_norm.weight"], cache["rf"])
    grads["output_norm.weight"] += dw
    dm = cache.get("dm")
    one = lambda i, kind: 1.0 if dm is None else dm[i, kind]  # noqa: E731
    for i in reversed(range(cfg.n_layer)):
        pre, a = f"blk.{i}.", cache["layers"][i]
        ln2 = a["ln2"].reshape(N, C)
        dy = dx * one(i, "ffn_res")
        if cfg.n_expert:
            names = [pre + n + ".weight" for n in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
            dln2, *dws = moe_backward(dy.reshape(N, C), *(p[n] for n in names), a["moe"], cfg.moe_aux_loss)
        else:
            names = [pre + n + ".weight" for n in ("ffn_gate", "ffn_up", "ffn_down")]
            dln2, *dws = swiglu_ffn_backward(dy.reshape(N, C), ln2, *(p[n] for n in names), a["ffn"])
        for n, g in zip(names, dws):
            grads[n] += g
        dxm, dw = rmsnorm_backward(dln2.reshape(B, T, C), a["x_mid"], p[pre + "ffn_norm.weight"], a["r2"])
        grads[pre + "ffn_norm.weight"] += dw
        dx = dx + dxm
        dy = dx * one(i, "attn_res")
        grads[pre + "attn_output.weight"] += dy.reshape(N, C).T @ a["atty"].reshape(N, C)
        dqkv = attention_backward(dy @ p[pre + "attn_output.weight"], a["qkv"], a["att"], H,
                                  None if dm is None else dm[i, "attn"])
        dq, dk, dv = rope_qkv_backward(dqkv, H, Hkv, cos, sin)
        dln1 = np.zeros_like(a["ln1"])
        for n, d in zip("qkv", (dq, dk, dv)):
            W = p[pre + f"attn_{n}.weight"]
            grads[pre + f"attn_{n}.weight"] += d.reshape(N, -1).T @ a["ln1"].reshape(N, C)
            dln1 += d @ W
        dxa, dw = rmsnorm_backward(dln1, a["x"], p[pre + "attn_norm.weight"], a["r1"])
        grads[pre + "attn_norm.weight"] += dw
        dx = dx + dxa
    if dm is not None:
        dx = dx * dm["embd"]
    np.add.at(grads["token_embd.weight"], cache["tokens"].reshape(-1), dx.reshape(N, C))
    return grads


def llama_objective(params, cfg, tokens, targets, mask=None, routing=None, dropout=None, label_smoothing=0.0) -> float:
    """loss + cfg.moe_aux_loss * aux: what llama_backward differentiates."""
    loss, aux, _ = llama_forward(params, cfg, tokens, targets, mask, routing, dropout, label_smoothing)
    return loss + cfg.moe_aux_loss * aux
