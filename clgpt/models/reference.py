"""Float64 numpy reference of every op and of the whole GPT-2 model; the tests hold the OpenCL kernels to it.

Shapes: B batch, T time, C channels (n_embd), V vocab, H heads, D = C // H head dim, F n_ff, L layers.
Matrices are (out, in) as in clgpt.model: a linear layer is y = x @ W.T + b. Every op comes as an
`<op>_forward` / `<op>_backward` pair; backward functions return gradients w.r.t. their inputs.
"""

from __future__ import annotations

import numpy as np

from clgpt.model import ModelConfig, decays

GELU_SCALE = np.sqrt(2.0 / np.pi)


def _f64(a):
    return np.asarray(a, dtype=np.float64)


# ---- embedding: out (B,T,C) = wte[tokens] + wpe[0..T-1] ----
def embedding_forward(tokens, wte, wpe):
    T = tokens.shape[1]
    return _f64(wte)[tokens] + _f64(wpe)[:T][None]


def embedding_backward(dout, tokens, V, n_ctx):
    """-> dwte (V,C), dwpe (n_ctx,C)."""
    B, T, C = dout.shape
    dwte = np.zeros((V, C))
    np.add.at(dwte, tokens.reshape(-1), dout.reshape(-1, C))
    dwpe = np.zeros((n_ctx, C))
    dwpe[:T] = dout.sum(axis=0)
    return dwte, dwpe


# ---- layernorm over the last axis, biased variance ----
def layernorm_forward(x, w, b, eps=1e-5):
    """-> out, (mean, rstd); mean/rstd have x's shape minus the last axis."""
    x = _f64(x)
    mean = x.mean(axis=-1)
    var = ((x - mean[..., None]) ** 2).mean(axis=-1)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (x - mean[..., None]) * rstd[..., None]
    return xhat * _f64(w) + _f64(b), (mean, rstd)


def layernorm_backward(dout, x, w, mean, rstd):
    """-> dx, dw, db."""
    dout, x = _f64(dout), _f64(x)
    xhat = (x - mean[..., None]) * rstd[..., None]
    C = x.shape[-1]
    axes = tuple(range(x.ndim - 1))
    dw = (dout * xhat).sum(axis=axes)
    db = dout.sum(axis=axes)
    dnorm = dout * _f64(w)
    dx = rstd[..., None] * (
        dnorm - dnorm.mean(axis=-1, keepdims=True) - xhat * (dnorm * xhat).sum(axis=-1, keepdims=True) / C
    )
    return dx, dw, db


# ---- linear: y (..., out) = x (..., in) @ W.T (out, in) + b ----
def linear_forward(x, W, b=None):
    y = _f64(x) @ _f64(W).T
    return y if b is None else y + _f64(b)


def linear_backward(dout, x, W):
    """-> dx, dW, db."""
    dout, x = _f64(dout), _f64(x)
    d2 = dout.reshape(-1, dout.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    return dout @ _f64(W), d2.T @ x2, d2.sum(axis=0)


# ---- GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) ----
def gelu_forward(x):
    x = _f64(x)
    return 0.5 * x * (1.0 + np.tanh(GELU_SCALE * (x + 0.044715 * x**3)))


def gelu_backward(dout, x):
    x = _f64(x)
    t = np.tanh(GELU_SCALE * (x + 0.044715 * x**3))
    dgelu = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_SCALE * (1.0 + 3 * 0.044715 * x * x)
    return _f64(dout) * dgelu


# ---- causal self-attention: qkv (B,T,3C) -> out (B,T,C); att (B,H,T,T) softmax probabilities ----
def _split_heads(qkv, H):
    B, T, C3 = qkv.shape
    C = C3 // 3
    D = C // H
    q, k, v = (qkv[..., i * C : (i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3))
    return q, k, v  # each (B,H,T,D)


def attention_forward(qkv, H, dmask=None):
    """-> out (B,T,C), att (B,H,T,T); dmask (B,H,T,T): dropout's keep / (1 - p) on the probabilities."""
    qkv = _f64(qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = _split_heads(qkv, H)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(C // H)
    causal = np.tril(np.ones((T, T), dtype=bool))
    scores = np.where(causal, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    att = np.exp(scores)
    att /= att.sum(axis=-1, keepdims=True)
    y = (att if dmask is None else att * dmask) @ v  # (B,H,T,D)
    return y.transpose(0, 2, 1, 3).reshape(B, T, C), att


def attention_backward(dout, qkv, att, H, dmask=None):
    """-> dqkv (B,T,3C)."""
    qkv, dout = _f64(qkv), _f64(dout)
    B, T, C3 = qkv.shape
    C = C3 // 3
    D = C // H
    q, k, v = _split_heads(qkv, H)
    dy = dout.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    dm = 1.0 if dmask is None else dmask
    dv = (att * dm).transpose(0, 1, 3, 2) @ dy
    datt = (dy @ v.transpose(0, 1, 3, 2)) * dm
    ds = att * (datt - (att * datt).sum(axis=-1, keepdims=True)) / np.sqrt(D)
    dq = ds @ k
    dk = ds.transpose(0, 1, 3, 2) @ q
    merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, C)  # noqa: E731
    return np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1)


# ---- fused softmax + cross-entropy with a per-token loss mask ----
def softmax_xent_forward(logits, targets, mask=None, label_smoothing=0.0):
    """logits (..., V), targets (...) int, mask (...) -> loss = sum(mask * nll) / sum(mask), probs.
    label_smoothing eps: nll against the target (1 - eps) onehot + eps / V, torch's cross_entropy(label_smoothing)."""
    logits = _f64(logits)
    mask = np.ones(targets.shape) if mask is None else _f64(mask)
    z = logits - logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=-1))
    tgt = np.clip(targets, 0, logits.shape[-1] - 1)
    nll = lse - np.take_along_axis(z, tgt[..., None], axis=-1)[..., 0]
    if label_smoothing:
        nll = (1 - label_smoothing) * nll + label_smoothing * (lse - z.mean(axis=-1))
    nll = np.where(mask != 0, nll, 0.0)
    probs = np.exp(z - lse[..., None])
    return float((mask * nll).sum() / mask.sum()), probs


def softmax_xent_backward(probs, targets, mask=None, dloss=1.0, label_smoothing=0.0):
    """-> dlogits (..., V) = dloss * mask / sum(mask) * (probs - onehot(targets)); with label_smoothing eps the
    target is (1 - eps) onehot + eps / V."""
    mask = np.ones(targets.shape) if mask is None else _f64(mask)
    d = probs.copy()
    tgt = np.clip(targets, 0, probs.shape[-1] - 1)
    hit = 1.0
    if label_smoothing:
        d -= label_smoothing / probs.shape[-1]
        hit = 1.0 - label_smoothing
    np.put_along_axis(d, tgt[..., None], np.take_along_axis(d, tgt[..., None], axis=-1) - hit, axis=-1)
    return d * (dloss * mask / mask.sum())[..., None]


# ---- AdamW (decoupled weight decay, bias-corrected), global-norm clipping ----
def adamw_update(param, grad, m, v, t, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decay=True):
    """One AdamW step at step count t (1-based) -> new (param, m, v)."""
    param, grad = _f64(param), _f64(grad)
    m = beta1 * _f64(m) + (1 - beta1) * grad
    v = beta2 * _f64(v) + (1 - beta2) * grad * grad
    if decay:
        param = param * (1 - lr * weight_decay)
    mhat = m / (1 - beta1**t)
    vhat = v / (1 - beta2**t)
    return param - lr * mhat / (np.sqrt(vhat) + eps), m, v


def muon_momentum(grad, buf, mu, nesterov=True):
    """Muon's momentum as torch.optim.Muon writes it -> (new buf, update): buf = lerp(buf, g, 1 - mu),
    update = lerp(g, buf, mu) with Nesterov, else buf."""
    g, b = _f64(grad), _f64(buf)
    b = b + (1 - mu) * (g - b)
    return b, (g + mu * (b - g) if nesterov else b)


def newton_schulz(u, steps=5, coeffs=(3.4445, -4.7750, 2.0315), eps=1e-7):
    """Muon's quintic Newton-Schulz orthogonalisation of a matrix (R, C), in float64: X = U / max(||U||_F, eps),
    transposed when R > C; steps times A = X X^T, X = a X + (b A + c A A) X; transposed back."""
    a, b, c = coeffs
    x = _f64(u)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(np.linalg.norm(x), eps)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def muon_update(param, grad, buf, lr, mu=0.95, nesterov=True, steps=5, weight_decay=0.0, scale="original"):
    """One Muon step of a matrix (R, C) -> (new param, new momentum buf), torch.optim.Muon's definition:
    p = p (1 - lr wd) - lr s NS(update), s = sqrt(max(1, R / C)) (original) or 0.2 sqrt(max(R, C))."""
    R, C = np.shape(param)
    b, upd = muon_momentum(grad, buf, mu, nesterov)
    s = 0.2 * np.sqrt(max(R, C)) if scale == "match_rms_adamw" else np.sqrt(max(1.0, R / C))
    return _f64(param) * (1 - lr * weight_decay) - lr * s * newton_schulz(upd, steps), b


def grad_norm(grads: dict) -> float:
    return float(np.sqrt(sum((_f64(g) ** 2).sum() for g in grads.values())))


def adamw_step(params, grads, state, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0):
    """Clip by global norm (scale min(1, clip/norm)), then AdamW on every tensor, as Engine.step does.
    state: {"m": {name: arr}, "v": {name: arr}, "t": int}, updated in place. Returns (new params, pre-clip norm)."""
    norm = grad_norm(grads)
    scale = min(1.0, clip / norm) if clip > 0 and norm > 0 else 1.0
    state["t"] = t = state.get("t", 0) + 1
    out = {}
    for name, p in params.items():
        m = state.setdefault("m", {}).get(name, np.zeros(p.shape))
        v = state.setdefault("v", {}).get(name, np.zeros(p.shape))
        out[name], state["m"][name], state["v"][name] = adamw_update(
            p, _f64(grads[name]) * scale, m, v, t, lr, beta1, beta2, eps, weight_decay, decays(name)
        )
    return out, norm


# ---- the whole model ----
def _output_weight(params, cfg):
    return params["token_embd.weight"] if cfg.tied else params["output.weight"]


def dropout_masks(dropout, cfg: ModelConfig, B, T):
    """dropout = (seed, p) or None -> {site: float64 keep / (1 - p)} as the engine draws them, or None."""
    if dropout is None:
        return None
    from clgpt.models.dropout import scale_mask, site

    seed, prob = dropout
    C, H = cfg.n_embd, cfg.n_head
    m = {"embd": scale_mask(seed, site(-1, "embd"), (B, T, C), prob)}
    for i in range(cfg.n_layer):
        m[i, "attn"] = scale_mask(seed, site(i, "attn"), (B, H, T, T), prob)
        for kind in ("attn_res", "ffn_res"):
            m[i, kind] = scale_mask(seed, site(i, kind), (B, T, C), prob)
    return m


def gpt_forward(params, cfg: ModelConfig, tokens, targets, mask=None, dropout=None, label_smoothing=0.0):
    """tokens, targets (B,T) int; mask (B,T) or None; dropout (seed, p) or None; label_smoothing eps (the engine's)
    -> (loss, cache for gpt_backward)."""
    p = {k: _f64(v) for k, v in params.items()}
    tokens = np.asarray(tokens)
    H, eps = cfg.n_head, cfg.norm_eps
    dm = dropout_masks(dropout, cfg, *tokens.shape)
    one = lambda i, kind: 1.0 if dm is None else dm[i, kind]  # noqa: E731
    x = embedding_forward(tokens, p["token_embd.weight"], p["position_embd.weight"])  # (B,T,C)
    if dm is not None:
        x = x * dm["embd"]
    layers = []
    for i in range(cfg.n_layer):
        pre = f"blk.{i}."
        ln1, ln1c = layernorm_forward(x, p[pre + "attn_norm.weight"], p[pre + "attn_norm.bias"], eps)
        qkv = linear_forward(ln1, p[pre + "attn_qkv.weight"], p[pre + "attn_qkv.bias"])  # (B,T,3C)
        atty, att = attention_forward(qkv, H, None if dm is None else dm[i, "attn"])  # (B,T,C), (B,H,T,T)
        x_mid = x + one(i, "attn_res") * linear_forward(atty, p[pre + "attn_output.weight"], p[pre + "attn_output.bias"])
        ln2, ln2c = layernorm_forward(x_mid, p[pre + "ffn_norm.weight"], p[pre + "ffn_norm.bias"], eps)
        h = linear_forward(ln2, p[pre + "ffn_up.weight"], p[pre + "ffn_up.bias"])  # (B,T,F)
        g = gelu_forward(h)
        x_out = x_mid + one(i, "ffn_res") * linear_forward(g, p[pre + "ffn_down.weight"], p[pre + "ffn_down.bias"])
        layers.append(dict(x=x, ln1=ln1, ln1c=ln1c, qkv=qkv, atty=atty, att=att, x_mid=x_mid, ln2=ln2, ln2c=ln2c, h=h, g=g))
        x = x_out
    lnf, lnfc = layernorm_forward(x, p["output_norm.weight"], p["output_norm.bias"], eps)
    logits = lnf @ _output_weight(p, cfg).T  # (B,T,V)
    loss, probs = softmax_xent_forward(logits, np.asarray(targets), mask, label_smoothing)
    cache = dict(p=p, cfg=cfg, tokens=tokens, targets=np.asarray(targets), mask=mask, layers=layers,
                 x=x, lnf=lnf, lnfc=lnfc, probs=probs, dm=dm, label_smoothing=label_smoothing)
    return loss, cache


def gpt_logits(params, cfg: ModelConfig, tokens):
    """-> logits (B,T,V) float64."""
    tokens = np.asarray(tokens)
    _, cache = gpt_forward(params, cfg, tokens, np.zeros_like(tokens), None)
    return cache["lnf"] @ _output_weight(cache["p"], cfg).T


def gpt_backward(cache) -> dict[str, np.ndarray]:
    """-> dloss/dparam for every parameter name (float64)."""
    p, cfg = cache["p"], cache["cfg"]
    H = cfg.n_head
    grads = {k: np.zeros_like(v) for k, v in p.items()}
    dlogits = softmax_xent_backward(cache["probs"], cache["targets"], cache["mask"],
                                    label_smoothing=cache["label_smoothing"])
    W_out = _output_weight(p, cfg)
    dW_out = dlogits.reshape(-1, dlogits.shape[-1]).T @ cache["lnf"].reshape(-1, cache["lnf"].shape[-1])
    grads["token_embd.weight" if cfg.tied else "output.weight"] += dW_out
    dlnf = dlogits @ W_out
    dx, dw, db = layernorm_backward(dlnf, cache["x"], p["output_norm.weight"], *cache["lnfc"])
    grads["output_norm.weight"] += dw
    grads["output_norm.bias"] += db
    dm = cache.get("dm")
    one = lambda i, kind: 1.0 if dm is None else dm[i, kind]  # noqa: E731
    for i in reversed(range(cfg.n_layer)):
        pre, a = f"blk.{i}.", cache["layers"][i]
        dg, dW, db = linear_backward(dx * one(i, "ffn_res"), a["g"], p[pre + "ffn_down.weight"])
        grads[pre + "ffn_down.weight"] += dW
        grads[pre + "ffn_down.bias"] += db
        dh = gelu_backward(dg, a["h"])
        dln2, dW, db = linear_backward(dh, a["ln2"], p[pre + "ffn_up.weight"])
        grads[pre + "ffn_up.weight"] += dW
        grads[pre + "ffn_up.bias"] += db
        dxm, dw, db = layernorm_backward(dln2, a["x_mid"], p[pre + "ffn_norm.weight"], *a["ln2c"])
        grads[pre + "ffn_norm.weight"] += dw
        grads[pre + "ffn_norm.bias"] += db
        dx = dx + dxm
        datty, dW, db = linear_backward(dx * one(i, "attn_res"), a["atty"], p[pre + "attn_output.weight"])
        grads[pre + "attn_output.weight"] += dW
        grads[pre + "attn_output.bias"] += db
        dqkv = attention_backward(datty, a["qkv"], a["att"], H, None if dm is None else dm[i, "attn"])
        dln1, dW, db = linear_backward(dqkv, a["ln1"], p[pre + "attn_qkv.weight"])
        grads[pre + "attn_qkv.weight"] += dW
        grads[pre + "attn_qkv.bias"] += db
        dxa, dw, db = layernorm_backward(dln1, a["x"], p[pre + "attn_norm.weight"], *a["ln1c"])
        grads[pre + "attn_norm.weight"] += dw
        grads[pre + "attn_norm.bias"] += db
        dx = dx + dxa
    if dm is not None:
        dx = dx * dm["embd"]
    dwte, dwpe = embedding_backward(dx, cache["tokens"], cfg.vocab_size, p["position_embd.weight"].shape[0])
    grads["token_embd.weight"] += dwte
    grads["position_embd.weight"] += dwpe
    return grads


# ---- finite differences ----
def fd_entries(f, params, name, idxs, eps):
    """Central differences of the scalar f(params) at the flat indices idxs of params[name] (in place,
    restored afterwards)."""
    out = []
    for i in idxs:
        old = params[name].flat[i]
        params[name].flat[i] = old + eps
        fp = f(params)
        params[name].flat[i] = old - eps
        fm = f(params)
        params[name].flat[i] = old
        out.append((fp - fm) / (2 * eps))
    return np.array(out)


# ---- reduced-precision matmul operands (kernels/precision.cl) ----
def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 x rounded to bf16 (nearest, ties to even), as float32; inf/NaN truncated."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    r = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    special = (u & 0x7F800000) == 0x7F800000
    return np.where(special, u & 0xFFFF0000, r).astype(np.uint32).view(np.float32)


def round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 x rounded to tf32 (10 mantissa bits, nearest, ties away from zero: cvt.rna.tf32.f32)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    r = ((u.astype(np.uint64) + 0x1000) & 0xFFFFE000).astype(np.uint32)
    special = (u & 0x7F800000) == 0x7F800000
    return np.where(special, u, r).astype(np.uint32).view(np.float32)


ROUNDERS = {"fp32": lambda x: np.asarray(x, np.float32), "bf16": round_bf16, "tf32": round_tf32}
