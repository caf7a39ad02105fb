"""Muon (clgpt/ops/muon.py, kernels/muon.cl, ParamStore's Muon step): each kernel against its float64 reference,
the Newton-Schulz orthogonalisation through the device's GEMM, whole engine steps against the float64 reference
(Muon for the block matrices, AdamW for the rest), the reference against torch.optim.Muon, same bytes twice."""

from __future__ import annotations

import numpy as np
import pytest

from clgpt.model import ModelConfig, init_params, muon_matrices
from clgpt.models import reference as ref
from clgpt.models.factory import make_engine
from clgpt.ops import Ops
from clgpt.ops.muon import Muon, lr_scale
from clgpt.device.knobs import Knobs
from conftest import assert_close, from_dev, to_dev
from opcheck import check_op, run_op

i32, f32 = np.int32, np.float32
MUON = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "ns_steps": 5, "lr_scale": "original", "weight_decay": 0.1}


def rand(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).normal(0, scale, shape)).astype(np.float32)


# ---- the kernels ----

@pytest.mark.parametrize("nesterov", [1, 0])
def test_muon_momentum_kernel(dev, nesterov):
    n, mu, s = 1000, 0.9, 0.5
    g, b = rand(n, 0), rand(n, 1)
    want_b, want_u = ref.muon_momentum(g.astype(np.float64) * s, b, mu, bool(nesterov))
    out = check_op(dev, "muon", "muon_momentum", (n,),
                   [("n", i32(n)), ("mu", f32(mu)), ("nest", i32(nesterov)), ("g", g), ("buf", b),
                    ("u", np.zeros(n, f32)), ("norm", np.array([3.0, s], f32))],
                   {"buf": want_b, "u": want_u}, atol=1e-6, rtol=1e-5)
    assert np.array_equal(out["g"], g), "muon_momentum must leave the gradient as it is"


def test_muon_norm_scale_poly_update_kernels(dev):
    n, off, parts = 777, 33, 5
    x = rand(off + n, 2)
    chunk = -(-n // parts)
    got = run_op(dev, "muon", "muon_sumsq", (parts,), [("n", i32(n)), ("off", i32(off)), ("c", i32(chunk)),
                                                        ("x", x), ("partials", np.zeros(parts, f32))])
    want = [np.sum(x[off + i * chunk: off + min(n, (i + 1) * chunk)].astype(np.float64) ** 2) for i in range(parts)]
    assert_close(got["partials"], want, 1e-5, 1e-5, "muon_sumsq")
    inv = 1.0 / np.linalg.norm(x[off:].astype(np.float64))
    check_op(dev, "muon", "muon_inv_norm", (1,), [("p", i32(parts)), ("eps", f32(1e-7)), ("partials", got["partials"]),
                                                   ("out", np.zeros(1, f32))], {"out": [inv]}, atol=0, rtol=1e-5)
    # the floor: an all-zero matrix is scaled by 1 / eps, not divided by zero
    check_op(dev, "muon", "muon_inv_norm", (1,), [("p", i32(2)), ("eps", f32(1e-7)), ("partials", np.zeros(2, f32)),
                                                   ("out", np.zeros(1, f32))], {"out": [1e7]}, atol=0, rtol=1e-6)
    check_op(dev, "muon", "muon_scale", (n,), [("n", i32(n)), ("off", i32(off)), ("x", x),
                                               ("s", np.array([inv], f32)), ("y", np.zeros(n, f32))],
             {"y": x[off:].astype(np.float64) * inv}, atol=1e-6, rtol=1e-5)
    r = 7
    A = rand((r, r), 6)
    check_op(dev, "muon", "muon_poly_init", (r * r,), [("r", i32(r)), ("a", f32(3.4445)), ("b", f32(-4.775)),
                                                       ("A", A), ("P", np.zeros((r, r), f32))],
             {"P": -4.775 * A.astype(np.float64) + 3.4445 * np.eye(r)}, atol=1e-6, rtol=1e-6)
    p, o = rand(off + n, 3), rand(n, 4)
    want_p = p.astype(np.float64).copy()
    want_p[off:] = want_p[off:] * 0.998 - 0.03 * o
    check_op(dev, "muon", "muon_update", (n,), [("n", i32(n)), ("off", i32(off)), ("p", p), ("o", o),
                                                ("d", f32(0.998)), ("lr", f32(0.03))], {"p": want_p},
             atol=1e-6, rtol=1e-6)


# ---- Newton-Schulz through the GEMM ----

@pytest.mark.parametrize("rows, cols", [(24, 40), (40, 24), (32, 32), (96, 8)])
def test_newton_schulz_on_the_gemm_matches_float64(dev, rows, cols):
    cfg = ModelConfig(vocab_size=32, n_ctx=8, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    ops = Ops(dev, cfg, 8, "fp32", knobs=Knobs())
    off = 64  # inside a larger buffer, as a tensor's place in the flat store
    u = rand(off + rows * cols, 5, 0.1)
    X = Muon(ops).orthogonalize(to_dev(dev, u), off, rows, cols, 5)
    got = from_dev(dev, X, rows * cols)
    want = ref.newton_schulz(u[off:].reshape(rows, cols))
    assert_close(got.reshape(rows, cols), want, 2e-5, 1e-4, f"Newton-Schulz {rows}x{cols}")
    # what Muon is for: singular values pulled into roughly (0.5, 1.5) from a spread of 1e3
    sv = np.linalg.svd(got.reshape(rows, cols).astype(np.float64), compute_uv=False)
    assert 0.3 < sv.min() and sv.max() < 1.3, sv


# ---- whole steps: the store's Muon step against the reference ----

def _engine(cfg, dev, params, muon=True):
    return make_engine(cfg, params, batch_size=2, seq_len=cfg.n_ctx, device=dev, muon=muon, knobs=Knobs())


def _step(eng, cfg, seed, lr=3e-3, muon=MUON, clip=1.0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (2, cfg.n_ctx)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab_size, (2, cfg.n_ctx)).astype(np.int32)
    eng.zero_grad()
    eng.forward(tokens, targets)
    eng.backward()
    grads = eng.get_grads()
    norm = eng.step(lr, 0.9, 0.95, 1e-8, 0.1, clip, muon)
    return grads, norm


CFGS = {
    "gpt2": ModelConfig(vocab_size=40, n_ctx=8, n_embd=16, n_head=2, n_layer=2, n_ff=48),
    "llama-moe": ModelConfig(arch="llama", vocab_size=40, n_ctx=8, n_embd=16, n_head=2, n_head_kv=1, n_layer=1,
                             n_ff=24, n_expert=3, n_expert_used=2),
}


@pytest.mark.parametrize("arch", list(CFGS))
def test_muon_steps_match_the_float64_reference(dev, arch):
    """Two steps (momentum carried): the block matrices move by Muon, every other tensor by AdamW."""
    cfg = CFGS[arch]
    p = init_params(cfg, 3)
    eng = _engine(cfg, dev, p)
    mats = muon_matrices(cfg)
    assert mats and all(n.startswith("blk.") for n in mats) and "token_embd.weight" not in mats
    want = {k: v.astype(np.float64) for k, v in p.items()}
    buf = {k: np.zeros(v.shape) for k, v in p.items()}
    m, v = dict(buf), dict(buf)
    lr, clip = 3e-3, 0.05  # a small clip: the clip factor reaches Muon's momentum too
    for t in (1, 2):
        grads, norm = _step(eng, cfg, seed=t, lr=lr, clip=clip)
        s = min(1.0, clip / norm)
        for name, g in grads.items():
            g = g.astype(np.float64) * s
            if name in mats:
                count, R, C = mats[name]
                new_p, new_b = [], []
                for e in range(count):
                    sl = (e,) if count > 1 and len(g.shape) == 3 else ()
                    pe, be = ref.muon_update(want[name][sl].reshape(R, C), g[sl].reshape(R, C),
                                             buf[name][sl].reshape(R, C), MUON["lr"], MUON["momentum"], True,
                                             MUON["ns_steps"], MUON["weight_decay"])
                    new_p.append(pe)
                    new_b.append(be)
                want[name] = np.stack(new_p).reshape(g.shape)
                buf[name] = np.stack(new_b).reshape(g.shape)
            else:
                decay = name.endswith(".weight") and "norm" not in name
                want[name], m[name], v[name] = ref.adamw_update(want[name], g, m[name], v[name], t, lr, 0.9, 0.95,
                                                                1e-8, 0.1, decay)
    got = eng.get_params()
    for name in want:
        assert_close(got[name], want[name], 2e-6, 1e-3, f"{arch} {name} after 2 steps")
    state = eng.get_optimizer_state()
    for name in mats:  # the momentum is what a checkpoint saves (m), so resume carries it
        assert_close(state["m"][name], buf[name], 1e-7, 1e-4, f"{name} momentum")


def test_same_settings_same_bytes(dev):
    cfg = CFGS["gpt2"]
    outs = []
    for _ in range(2):
        eng = _engine(cfg, dev, init_params(cfg, 4))
        for t in range(3):
            _step(eng, cfg, seed=t)
        outs.append(eng.get_params())
    assert all(outs[0][k].tobytes() == outs[1][k].tobytes() for k in outs[0])


def test_a_store_without_muon_refuses_muon_settings(dev):
    cfg = CFGS["gpt2"]
    eng = _engine(cfg, dev, init_params(cfg, 4), muon=False)
    with pytest.raises(Exception, match="without Muon"):
        _step(eng, cfg, seed=0)


# ---- the reference against torch.optim.Muon ----

def _torch_ns_float64(torch):
    """torch.optim.Muon's own Newton-Schulz (torch/optim/_muon.py) with its bf16 cast made float64."""
    def ns(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.double()
        if grad.size(0) > grad.size(1):
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return (x.T if grad.size(0) > grad.size(1) else x).to(grad.dtype)
    return ns


@pytest.mark.parametrize("bf16", [False, True], ids=["ns-float64", "ns-bf16"])
@pytest.mark.parametrize("rows, cols, scale", [(48, 16, "original"), (16, 40, "match_rms_adamw")])
def test_reference_matches_torch_muon(rows, cols, scale, bf16, monkeypatch):
    """Three steps of torch.optim.Muon (momentum, Nesterov, lr by shape, decoupled decay): float tolerance with
    its Newton-Schulz products in float64; as shipped it rounds the update to bf16 for them, so the update then
    agrees to bf16 precision (a few percent of the largest step)."""
    import torch  # the test extra's referee
    import torch.optim._muon as tmuon
    if not bf16:
        monkeypatch.setattr(tmuon, "_zeropower_via_newtonschulz", _torch_ns_float64(torch))
    p0, lr, wd = rand((rows, cols), 7, 0.02), 0.02, 0.1
    w = torch.nn.Parameter(torch.tensor(p0))
    opt = torch.optim.Muon([w], lr=lr, weight_decay=wd, momentum=0.95, adjust_lr_fn=scale)
    want_p, buf = p0.astype(np.float64), np.zeros((rows, cols))
    for t in range(3):
        g = rand((rows, cols), 10 + t)
        w.grad = torch.tensor(g)
        opt.step()
        want_p, buf = ref.muon_update(want_p, g, buf, lr, 0.95, True, 5, wd, scale)
        assert_close(opt.state[w]["momentum_buffer"].numpy(), buf, 1e-6, 1e-5, "momentum against torch")
        step = lr * lr_scale(scale, rows, cols) * np.abs(ref.newton_schulz(buf)).max()
        assert_close(w.detach().numpy(), want_p, (0.06 if bf16 else 1e-4) * step, 1e-6,
                     f"param against torch, step {t + 1}")
