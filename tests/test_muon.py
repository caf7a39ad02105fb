"""Muon (clgpt/ops/muon.py, kernels/muon.cl, ParamStore's Muon step): each kernel against its float64 reference,
the Newton-Schulz orthogonalisation through the device's GEMM, whole engine steps against the float64 reference
(Muon for the block matrices, AdamW for the rest), the reference against torch.optim.Muon, same bytes twice."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from clgpt.device.knobs import OFF, Knobs
from clgpt.model import ModelConfig, init_params, muon_matrices
from clgpt.models import reference as ref
from clgpt.models.factory import make_engine
from clgpt.ops import Ops
from clgpt.ops.gemm import mma as mma_gemm
from clgpt.ops.muon import Muon, gram_splits, lr_scale
from conftest import assert_close, from_dev, to_dev
from opcheck import check_op, run_op
from precisioncheck import emulated_knobs

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


def test_muon_norms_scale_poly_update_kernels(dev):
    """Three matrices of one shape at scattered offsets (one of them all zero), each kernel one launch for all."""
    n, offs, parts = 777, np.array([33, 1000, 2000], np.int32), 5
    G, chunk = len(offs), -(-n // parts)
    x = rand(3000, 2)
    x[offs[2]: offs[2] + n] = 0.0
    mats = [x[o: o + n].astype(np.float64) for o in offs]
    norms = [np.linalg.norm(m) for m in mats]
    # the floor: an all-zero matrix is scaled by 1 / eps, not divided by zero
    inv = np.array([1.0 / max(v, 1e-7) for v in norms])
    got = run_op(dev, "muon", "muon_norms", (parts * G,), [("n", i32(n)), ("c", i32(chunk)), ("eps", f32(1e-7)),
                                                            ("offs", offs), ("x", x), ("s", np.zeros(G, f32))],
                 lsize=(parts,))
    assert_close(got["s"], inv, 0, 1e-5, "muon_norms")
    ld = 800  # the stack's stride: padding between its matrices
    check_op(dev, "muon", "muon_scale", (n, G), [("n", i32(n)), ("ld", i32(ld)), ("offs", offs), ("x", x),
                                                 ("s", inv.astype(f32)), ("y", np.zeros((G, ld), f32))],
             {"y": np.stack([np.pad(m * v, (0, ld - n)) for m, v in zip(mats, inv)])}, atol=1e-6, rtol=1e-5)
    r, rr = 7, 64  # (r, r) matrices rr floats apart: the padding stays as it was
    A, P = rand((G, rr), 6), rand((G, rr), 7)
    want = P.astype(np.float64).copy()
    want[:, : r * r] += (-4.775 * A[:, : r * r].astype(np.float64) + 3.4445 * np.eye(r).reshape(-1))
    check_op(dev, "muon", "muon_poly", (G * rr,), [("t", i32(G * rr)), ("r", i32(r)), ("ld", i32(rr)),
                                                   ("a", f32(3.4445)), ("b", f32(-4.775)), ("A", A), ("P", P)],
             {"P": want}, atol=1e-6, rtol=1e-6)
    p, o = rand(3000, 3), rand(G * ld, 4)
    want_p = p.astype(np.float64).copy()
    for g, off in enumerate(offs):
        want_p[off: off + n] = want_p[off: off + n] * 0.998 - 0.03 * o[g * ld: g * ld + n]
    check_op(dev, "muon", "muon_update", (n, G), [("n", i32(n)), ("ld", i32(ld)), ("offs", offs), ("p", p), ("o", o),
                                                  ("d", f32(0.998)), ("lr", f32(0.03))], {"p": want_p},
             atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunk", [300, 5])
def test_muon_norm_parts_and_scale_parts_kernels(dev, chunk):
    """The GPU form of the norm and the copy into the stack: three matrices (one all zero) summed in chunks by many
    work-groups, the parts summed again by every work-group that scales (chunk 5: more parts than its work-items)."""
    n, offs, L, ld = 777, np.array([33, 1000, 2000], np.int32), 128, 800
    G, parts = len(offs), -(-n // chunk)
    x = rand(3000, 12)
    x[offs[1]: offs[1] + n] = 0.0
    mats = [x[o: o + n].astype(np.float64) for o in offs]
    got = run_op(dev, "muon", "muon_norm_parts", (parts * L, G), [("n", i32(n)), ("c", i32(chunk)), ("offs", offs),
                                                                   ("x", x), ("part", np.zeros(G * parts, f32))],
                 lsize=(L, 1))
    want = [[(m[p * chunk: (p + 1) * chunk] ** 2).sum() for p in range(parts)] for m in mats]
    assert_close(got["part"], np.array(want).reshape(-1), 1e-6, 1e-5, "muon_norm_parts")
    inv = np.array([1.0 / max(np.linalg.norm(m), 1e-7) for m in mats])
    y0 = rand((G, ld), 13)  # the padding between the stack's matrices stays as it was
    want_y = y0.astype(np.float64).copy()
    want_y[:, :n] = np.stack([m * v for m, v in zip(mats, inv)])
    for items in (L, 2 * L):  # a work-item scales entries a global size apart
        check_op(dev, "muon", "muon_scale_parts", (items, G),
                 [("n", i32(n)), ("ld", i32(ld)), ("parts", i32(parts)), ("eps", f32(1e-7)), ("offs", offs),
                  ("x", x), ("part", got["part"]), ("y", y0)], {"y": want_y}, atol=1e-6, rtol=1e-5, lsize=(L, 1))


def test_muon_gram_poly_kernel(dev):
    """Two matrices' Gram parts (3 chunks, then 1; the stride 3 chunks a matrix): summed in order from the lower
    triangle only (the upper entries NaN, as the product leaves them), mirrored into A, and P = b A + a I, in work-
    groups of 16 x 16 entries (37 wide: tiles above, on and below the diagonal, partial ones at the edge); the
    padding after each r x r matrix stays."""
    r, rr, smax, splits, a, b = 37, 1408, 3, np.array([3, 1], np.int32), 3.4445, -4.775  # 3 x 3 tiles of 16
    G = len(splits)
    part = rand((G, smax, rr), 14)
    upper = np.triu(np.ones((r, r), bool), 1).reshape(-1)
    part[:, :, : r * r][:, :, upper] = np.nan
    A0, P0 = rand((G, rr), 15), rand((G, rr), 16)
    want_A, want_P = A0.astype(np.float64).copy(), P0.astype(np.float64).copy()
    for g, S in enumerate(splits):
        low = np.tril(part[g, :S, : r * r].astype(np.float64).sum(0).reshape(r, r))
        full = low + np.tril(low, -1).T
        want_A[g, : r * r] = full.reshape(-1)
        want_P[g, : r * r] = (b * full + a * np.eye(r)).reshape(-1)
    check_op(dev, "muon", "muon_gram_poly", (48, 48, G), [("r", i32(r)), ("rr", i32(rr)), ("smax", i32(smax)),
                                                          ("splits", splits), ("a", f32(a)), ("b", f32(b)),
                                                          ("part", part), ("A", A0), ("P", P0)],
             {"A": want_A, "P": want_P}, atol=1e-6, rtol=1e-5, lsize=(16, 16, 1))


# ---- Newton-Schulz through the GEMM ----

@pytest.mark.parametrize("rows, cols", [(24, 40), (40, 24), (32, 32), (96, 8)])
def test_newton_schulz_on_the_gemm_matches_float64(dev, rows, cols):
    """Three matrices of one shape at scattered offsets of a flat buffer, orthogonalised as one stack."""
    cfg = ModelConfig(vocab_size=32, n_ctx=8, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    ops = Ops(dev, cfg, 8, "fp32", knobs=Knobs())
    n = rows * cols
    offs = [64, 64 + n + 128, 3 * n + 320]  # as tensors' places in the flat store, not evenly apart
    u = rand(offs[-1] + n, 5, 0.1)
    u[offs[1]: offs[1] + n] *= 1e3  # each matrix its own norm
    mu = Muon(ops)
    X = mu.orthogonalize(to_dev(dev, u), offs, rows, cols, 5)
    ld = mu.stack_stride(rows, cols)
    got = from_dev(dev, X, len(offs) * ld).reshape(len(offs), ld)[:, :n].reshape(len(offs), rows, cols)
    for g, off in enumerate(offs):
        want = ref.newton_schulz(u[off: off + n].reshape(rows, cols))
        assert_close(got[g], want, 2e-5, 1e-4, f"Newton-Schulz {rows}x{cols}, matrix {g}")
        # what Muon is for: singular values pulled into roughly (0.5, 1.5) from a spread of 1e3
        sv = np.linalg.svd(got[g].astype(np.float64), compute_uv=False)
        assert 0.3 < sv.min() and sv.max() < 1.3, sv


BATCHED_FORMS = {  # the device's GEMM forms that orthogonalise a shape's matrices in batched products
    "local-fp32": (lambda: Knobs(launch="gpu"), "fp32", 2e-5),
    "mma-tf32": (emulated_knobs, "tf32", 6e-3),
    "mma-bf16": (emulated_knobs, "bf16", 4e-2),  # bf16 operands: a few percent of the largest entry
}


@pytest.mark.parametrize("form", list(BATCHED_FORMS))
@pytest.mark.parametrize("rows, cols", [(72, 40), (40, 72), (512, 48), (48, 512)])
def test_newton_schulz_batched_products_match_float64(dev, form, rows, cols, monkeypatch):
    """The GPU forms (local-memory tiles; tensor cores, emulated) take the batched products: each matrix of the
    stack against float64, to its precision's tolerance. 512 deep, the Gram product runs as 2 chunks of K
    (gram_splits); its 40 or 48 wide output is more than one tile of the tests' 32 (a tile above the diagonal
    skipped, its entries mirrored from below)."""
    knobs, precision, tol = BATCHED_FORMS[form]
    cfg = ModelConfig(vocab_size=32, n_ctx=8, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    monkeypatch.setattr(mma_gemm, "MMA_SMALL_GROUPS", 1)  # other products this size take the big tiles
    ops = Ops(dev, cfg, 8, precision, knobs=knobs())
    mu = Muon(ops)
    assert mu.batched and gram_splits(max(rows, cols)) == (2 if max(rows, cols) == 512 else 1)
    n = rows * cols
    offs = [64, 64 + n + 128, 3 * n + 320]
    u = rand(offs[-1] + n, 8, 0.1)
    X = mu.orthogonalize(to_dev(dev, u), offs, rows, cols, 5)
    ld = mu.stack_stride(rows, cols)
    got = from_dev(dev, X, len(offs) * ld).reshape(len(offs), ld)[:, :n]
    for g, off in enumerate(offs):
        want = ref.newton_schulz(u[off: off + n].reshape(rows, cols))
        assert_close(got[g].reshape(rows, cols), want, tol, 1e-3, f"{form} Newton-Schulz {rows}x{cols}, matrix {g}")
    if ops.mma is not None:  # on tensor cores every product took the small tiles (the big ones: 2 x 2 tiles here)
        assert {key[11] for key in ops.product_kernels if key[0] == "mma" and key[9]} == {id(ops.mma[1])}


@pytest.mark.parametrize("rows, cols", [(96, 64), (32, 512)])
def test_newton_schulz_on_bf16_stacks_matches_float64_and_the_mma_form(dev, rows, cols):
    """Where the bf16 GEMM is on and a shape fits its tiles (emulated here, 32 x 32), the stacks are kept in bf16
    and the products run on matmul_bf16: each matrix against float64 to bf16's tolerance, and bit for bit what
    the mma kernel gives on fp32 stacks with the bf16 GEMM off (the same operands rounded the same way, the same
    sums in the same order). Tall and wide; 512 deep, the Gram product runs as 2 chunks of K."""
    cfg = ModelConfig(vocab_size=32, n_ctx=8, n_embd=16, n_head=2, n_layer=1, n_ff=32)
    n = rows * cols
    offs = [32, 32 + n + 96, 3 * n + 160]
    u = rand(offs[-1] + n, 9, 0.1)
    got = {}
    for form, knobs in (("bf16", emulated_knobs()), ("mma", emulated_knobs(bf16=OFF))):
        ops = Ops(dev, cfg, 8, "bf16", knobs=knobs)
        mu = Muon(ops)
        assert (mu.bf16 is not None) == (form == "bf16")
        X = mu.orthogonalize(to_dev(dev, u), offs, rows, cols, 5)
        ld = mu.stack_stride(rows, cols)
        got[form] = from_dev(dev, X, len(offs) * ld).reshape(len(offs), ld)[:, :n]
        batched = {key[0] for key in ops.product_kernels if key[0] in ("bf16", "mma") and key[9]}
        assert batched == {form}, batched
    for g, off in enumerate(offs):
        want = ref.newton_schulz(u[off: off + n].reshape(rows, cols))
        assert_close(got["bf16"][g].reshape(rows, cols), want, 4e-2, 1e-3, f"bf16 Newton-Schulz {rows}x{cols} {g}")
    np.testing.assert_array_equal(got["bf16"], got["mma"])


# ---- whole steps: the store's Muon step against the reference ----

def _engine(cfg, dev, params, muon=True, knobs=None):
    return make_engine(cfg, params, batch_size=2, seq_len=cfg.n_ctx, device=dev, muon=muon, knobs=knobs or Knobs())


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


def _step_launches(cfg, dev, knobs) -> int:
    """Kernel launches of one Muon step (clip, Muon, AdamW for the rest): every launch goes through the launcher."""
    eng = make_engine(cfg, init_params(cfg, 4), batch_size=2, seq_len=cfg.n_ctx, device=dev, muon=True,
                      knobs=knobs)
    launcher, count = eng.ops.launcher, [0]
    for name in ("launch", "launch_plain", "launch_set"):
        def counted(*a, _fn=getattr(launcher, name), **k):
            count[0] += 1
            return _fn(*a, **k)
        setattr(launcher, name, counted)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, cfg.n_ctx)).astype(np.int32)
    eng.zero_grad()
    eng.forward(tokens, tokens)
    eng.backward()
    count[0] = 0
    eng.step(3e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, MUON)
    return count[0]


@pytest.mark.parametrize("arch", list(CFGS))
def test_muon_launches_grow_with_shapes_not_matrices(dev, arch):
    """With batched products a step's launches stay the same from 1 layer to 3 (3x the matrices, the same
    shapes), and a shape more (experts of another width) costs a fixed number more. On the CPU form the products
    go one matrix at a time: there they grow with the layers."""
    base = CFGS[arch]
    cfgs = [replace(base, n_layer=1), replace(base, n_layer=3)]
    shapes = [len({(r, c) for _, r, c in muon_matrices(c).values()}) for c in cfgs]
    assert shapes[0] == shapes[1] and sum(n for n, _, _ in muon_matrices(cfgs[1]).values()) == 3 * sum(
        n for n, _, _ in muon_matrices(cfgs[0]).values())
    gpu = [_step_launches(c, dev, Knobs(launch="gpu")) for c in cfgs]
    assert gpu[0] == gpu[1], gpu
    cpu = [_step_launches(c, dev, Knobs(launch="cpu")) for c in cfgs]
    assert cpu[1] > cpu[0], cpu


def test_muon_launches_a_shape(dev):
    """gpt2 with n_ff = 3 n_embd: the feed-forward's first matrix has attention's qkv shape and shares its stack;
    at 4 n_embd it is a shape of its own, of the same r = min(rows, cols) as the others: one norm, one copy into
    the stack, 2 launches an NS step (its Gram product and X' = P X: the A A product and muon_gram_poly run once
    an r for all its shapes), one update more."""
    cfg = CFGS["gpt2"]
    shared, own = replace(cfg, n_ff=3 * cfg.n_embd), replace(cfg, n_ff=4 * cfg.n_embd)
    assert [len({(r, c) for _, r, c in muon_matrices(c).values()}) for c in (shared, own)] == [3, 4]
    assert len({min(r, c) for _, r, c in muon_matrices(own).values()}) == 1
    counts = [_step_launches(c, dev, Knobs(launch="gpu")) for c in (shared, own)]
    assert counts[1] - counts[0] == 3 + 2 * MUON["ns_steps"], counts



@pytest.mark.parametrize("row", ["device", "gpu"])
@pytest.mark.parametrize("arch", list(CFGS))
def test_muon_steps_match_the_float64_reference(dev, arch, row):
    """Two steps (momentum carried): the block matrices move by Muon, every other tensor by AdamW. Row gpu: the
    GPU row's batched form (its norm in parts, the Gram product on the lower tiles, fp32)."""
    cfg = CFGS[arch]
    p = init_params(cfg, 3)
    eng = _engine(cfg, dev, p, knobs=Knobs(launch="gpu") if row == "gpu" else None)
    assert Muon(eng.ops).batched == (row == "gpu")
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


@pytest.mark.parametrize("row", ["device", "gpu"])
def test_same_settings_same_bytes(dev, row):
    """Twice the same three steps, the same bytes: on the gpu row too (the norm's parts, the Gram chunks and their
    sums all in fixed orders)."""
    cfg = CFGS["gpt2"]
    outs = []
    for _ in range(2):
        eng = _engine(cfg, dev, init_params(cfg, 4), knobs=Knobs(launch="gpu") if row == "gpu" else None)
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
