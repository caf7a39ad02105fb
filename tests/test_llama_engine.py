"""The llama kernels and LlamaEngine beyond the contract every engine keeps (tests/test_engine_contract.py):
each kernel forward and backward against the float64 reference (clgpt.models.reference_llama) and finite
differences, the grouped (mixture-of-experts) products and their Ops launchers, the load-balancing loss, the
engine factory and the config checks.

Tolerances: kernels 1e-5 of the largest value."""

from __future__ import annotations

import numpy as np
import pytest

from clgpt.device.opencl import get_device
from clgpt.errors import ClgptError
from clgpt.device.knobs import Knobs
from clgpt.model import ModelConfig, init_params, param_shapes
from clgpt.models import reference_llama as ref
from clgpt.models.factory import make_engine
from clgpt.models.gpt2 import GPT2Engine as Engine
from clgpt.models.llama import LlamaEngine
from clgpt.models.reference import fd_entries
from enginecheck import batch, noisy_params
from opcheck import FD, check_op, run_op

KERNEL_TOL = 1e-5


def llama_cfg(E=0, K=0, hkv=0, tied=True, **kw) -> ModelConfig:
    d = dict(arch="llama", vocab_size=23, n_ctx=6, n_embd=8, n_head=2, n_head_kv=hkv, n_layer=2, n_ff=12,
             tied=tied, n_expert=E, n_expert_used=K, moe_aux_loss=0.05)
    d.update(kw)
    return ModelConfig(**d)


CFGS = {  # dense, dense + GQA, MoE + GQA (untied), MoE with k = 1, MoE with k = E
    "dense": llama_cfg(),
    "gqa": llama_cfg(n_head=4, hkv=2, tied=False),
    "moe": llama_cfg(E=4, K=2, hkv=1, tied=False),
    "moe_k1": llama_cfg(E=3, K=1),
    "moe_all": llama_cfg(E=2, K=2),
}


# ---- kernels ------------------------------------------------------------------------------------


class Launcher:
    """Runs one kernel on numpy inputs (tests/opcheck.py run_op); `out` names the buffers returned."""

    def __init__(self):
        self.dev = get_device()

    def __call__(self, file, name, defines, gsize, args, out):
        res = run_op(self.dev, file, name, gsize, args, defines)
        return {key: res[key] for key in out}


@pytest.fixture(scope="module")
def launch(opencl):  # one Launcher a run on each implementation
    return Launcher()


def close(got, want, what):
    err = np.abs(np.asarray(got, np.float64) - want).max()
    assert err <= KERNEL_TOL * max(1.0, np.abs(want).max()), f"{what}: max abs diff {err:.3e}"


def rnd(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).normal(0, scale, shape)).astype(np.float32)


def test_rmsnorm_kernels(launch):
    N, C = 7, 12
    x, w, dout = rnd(N, C, seed=1), rnd(C, seed=2), rnd(N, C, seed=3)
    want, rstd = ref.rmsnorm_forward(x, w)
    d, dev = dict(C=C, EPS=1e-5), launch.dev
    check_op(dev, "rmsnorm", "rmsnorm_forward", (N,), [("N", np.int32(N)), ("x", x), ("w", w),
             ("out", np.zeros_like(x)), ("rstd", np.zeros(N, np.float32))], {"out": want, "rstd": rstd}, d,
             atol=KERNEL_TOL)
    dx, dw = ref.rmsnorm_backward(dout, x, w, rstd)
    prev = rnd(N, C, seed=4)
    fwd = lambda x, w: ref.rmsnorm_forward(x, w)[0]  # noqa: E731
    check_op(dev, "rmsnorm", "rmsnorm_backward", (N,), [("N", np.int32(N)), ("acc", np.int32(1)), ("dout", dout),
             ("x", x), ("w", w), ("rstd", rstd.astype(np.float32)), ("dx", prev)], {"dx": dx + prev}, d,
             atol=KERNEL_TOL, fd=FD(fwd, {"x": x, "w": w}, dout, grads={"dx": "x"}, base={"dx": prev}))
    check_op(dev, "rmsnorm", "rmsnorm_param_backward", (C,), [("N", np.int32(N)), ("dout", dout), ("x", x),
             ("rstd", rstd.astype(np.float32)), ("dw", np.ones(C, np.float32))], {"dw": dw + 1}, d,
             atol=KERNEL_TOL, fd=FD(fwd, {"x": x, "w": w}, dout, grads={"dw": "w"}, base={"dw": 1.0}))


@pytest.mark.parametrize("N,C,LW", [(7, 12, 8), (5, 40, 16)])
def test_rmsnorm_kernels_workgroup_per_row(launch, N, C, LW):
    """The GPU forms (one work-group of LW work-items a row, tree sums) against the float64 reference and
    finite differences."""
    x, w, dout, prev = rnd(N, C, seed=1), rnd(C, seed=2), rnd(N, C, seed=3), rnd(N, C, seed=4)
    want, rstd = ref.rmsnorm_forward(x, w)
    dx, _ = ref.rmsnorm_backward(dout, x, w, rstd)
    d, dev = dict(C=C, EPS=1e-5, LW=LW), launch.dev
    fwd = lambda x, w: ref.rmsnorm_forward(x, w)[0]  # noqa: E731
    out = check_op(dev, "rmsnorm", "rmsnorm_forward_wg", (N * LW,), [("N", np.int32(N)), ("x", x), ("w", w),
                   ("out", np.zeros_like(x)), ("rstd", np.zeros(N, np.float32))], {"out": want, "rstd": rstd}, d,
                   lsize=(LW,), atol=KERNEL_TOL)
    check_op(dev, "rmsnorm", "rmsnorm_backward_wg", (N * LW,), [("N", np.int32(N)), ("acc", np.int32(1)),
             ("dout", dout), ("x", x), ("w", w), ("rstd", out["rstd"]), ("dx", prev)], {"dx": dx + prev}, d,
             lsize=(LW,), atol=KERNEL_TOL, fd=FD(fwd, {"x": x, "w": w}, dout, grads={"dx": "x"}, base={"dx": prev}))

@pytest.mark.parametrize("N,C", [(19, 32), (5, 24)])
def test_rmsnorm_kernels_blocked(launch, N, C):
    """The CPU forms (8 rows a work-item through 8x8 register transposes, dw 16 channels as a float16; C % 16 != 0
    keeps the scalar dw loop) against the float64 reference and finite differences, and bit for bit against the
    one-row, one-channel forms."""
    x, w, dout, prev = rnd(N, C, seed=1), rnd(C, seed=2), rnd(N, C, seed=3), rnd(N, C, seed=4)
    want, rstd = ref.rmsnorm_forward(x, w)
    dx, dw = ref.rmsnorm_backward(dout, x, w, rstd)
    dev, plain, blocked = launch.dev, dict(C=C, EPS=1e-5), dict(C=C, EPS=1e-5, RB=8, CB=16)
    rows, chans = (-(-N // 8),), (-(-C // 16),)
    fwd = lambda x, w: ref.rmsnorm_forward(x, w)[0]  # noqa: E731
    fargs = [("N", np.int32(N)), ("x", x), ("w", w), ("out", np.zeros_like(x)), ("rstd", np.zeros(N, np.float32))]
    out = check_op(dev, "rmsnorm", "rmsnorm_forward", rows, fargs, {"out": want, "rstd": rstd}, blocked, lsize=(1,),
                   atol=KERNEL_TOL)
    one = run_op(dev, "rmsnorm", "rmsnorm_forward", (N,), fargs, plain)
    assert np.array_equal(out["out"], one["out"]) and np.array_equal(out["rstd"], one["rstd"])
    bargs = [("N", np.int32(N)), ("acc", np.int32(1)), ("dout", dout), ("x", x), ("w", w),
             ("rstd", out["rstd"]), ("dx", prev)]
    got = check_op(dev, "rmsnorm", "rmsnorm_backward", rows, bargs, {"dx": dx + prev}, blocked, lsize=(1,),
                   atol=KERNEL_TOL, fd=FD(fwd, {"x": x, "w": w}, dout, grads={"dx": "x"}, base={"dx": prev}))
    assert np.array_equal(got["dx"], run_op(dev, "rmsnorm", "rmsnorm_backward", (N,), bargs, plain)["dx"])
    pargs = [("N", np.int32(N)), ("dout", dout), ("x", x), ("rstd", out["rstd"]), ("dw", np.ones(C, np.float32))]
    got = check_op(dev, "rmsnorm", "rmsnorm_param_backward", chans, pargs, {"dw": dw + 1}, blocked, lsize=(1,),
                   atol=KERNEL_TOL, fd=FD(fwd, {"x": x, "w": w}, dout, grads={"dw": "w"}, base={"dw": 1.0}))
    assert np.array_equal(got["dw"], run_op(dev, "rmsnorm", "rmsnorm_param_backward", (C,), pargs, plain)["dw"])

@pytest.mark.parametrize("D,form", [(6, "loop"), (16, "loop"), (16, "vec"), (6, "el"), (16, "el")])
@pytest.mark.parametrize("H,Hkv", [(2, 2), (4, 2), (4, 1)])
def test_rope_kernels(launch, H, Hkv, D, form):
    """rope_forward / rope_backward on the q | k | v product (N, C + 2Ckv), into and from attention's
    (N, 3C) layout; with Hkv == H in place (one buffer: src is qkv). Against float64 and finite differences in
    each form, which must also give the pair-by-pair loop's bits: "vec", the CPU form (ROPE_VEC, 4 pairs a
    step), and "el", the GPU form (rope_*_el, one work-item a pair)."""
    B, T = 2, 5
    C, Ckv, N = H * D, Hkv * D, B * T
    src = rnd(N, C + 2 * Ckv, seed=1)
    cos, sin = ref.rope_tables(T + 3, D, 10000.0)  # the table may be longer than T

    def fwd(src):  # (N, C+2Ckv) -> (N, 3C)
        s = src.reshape(B, T, -1)
        return ref.rope_qkv_forward(s[..., :C], s[..., C:C + Ckv], s[..., C + Ckv:], H, Hkv, cos, sin).reshape(N, -1)

    want = fwd(src.astype(np.float64))
    d, dev = dict(C=C, D=D, G=H // Hkv, CKV=Ckv), launch.dev
    plain = dict(d)
    if form == "vec":
        d["ROPE_VEC"] = 1
    el = "_el" if form == "el" else ""
    inplace = H == Hkv  # then the output is the input buffer (v stays as it was)
    fslots, bslots = (2 * H, 2 * H) if inplace else (3 * H, H + 2 * Hkv)
    grid = (lambda slots: (slots * D // 2, N)) if el else (lambda slots: (slots, N))  # noqa: E731
    tabs = [("cos", cos.astype(np.float32)), ("sin", sin.astype(np.float32))]
    out = ("qkv", "src") if inplace else ("qkv", np.zeros((N, 3 * C), np.float32))
    fargs = [("N", np.int32(N)), ("T", np.int32(T)), ("src", src), *tabs, out]
    fkey = "src" if inplace else "qkv"
    got = check_op(dev, "rope", "rope_forward" + el, grid(fslots), fargs, {fkey: want}, d, atol=KERNEL_TOL)
    if form != "loop":
        one = run_op(dev, "rope", "rope_forward", (fslots, N), fargs, plain)
        assert np.array_equal(got[fkey], one[fkey])
    dqkv = rnd(N, 3 * C, seed=4)
    dq, dk, dv = ref.rope_qkv_backward(dqkv.reshape(B, T, -1), H, Hkv, cos, sin)
    dsrc = np.concatenate([dq, dk, dv], axis=-1).reshape(N, -1)
    key = "dqkv" if inplace else "dsrc"
    out = ("dsrc", "dqkv") if inplace else ("dsrc", np.zeros_like(src))
    bargs = [("N", np.int32(N)), ("T", np.int32(T)), ("dqkv", dqkv), *tabs, out]
    got = check_op(dev, "rope", "rope_backward" + el, grid(bslots), bargs, {key: dsrc}, d,
                   atol=KERNEL_TOL, fd=FD(fwd, {"src": src}, dqkv, grads={key: "src"}))
    if form != "loop":
        one = run_op(dev, "rope", "rope_backward", (bslots, N), bargs, plain)
        assert np.array_equal(got[key], one[key])
    # the backward is the transpose of the forward: <dqkv, fwd(src)> = <bwd(dqkv), src>
    assert abs((dqkv * want).sum() - (dsrc * src).sum()) < 1e-9 * abs((dqkv * want).sum())


def test_rope_is_llama_cpp_normal_layout():
    """Pairs (2i, 2i+1) rotate by t * base^(-2i/D): position 1, head dim 4, base 100."""
    cos, sin = ref.rope_tables(2, 4, 100.0)
    x = np.array([1.0, 0.0, 1.0, 0.0]).reshape(1, 1, 1, 4)
    y = ref.rope_forward(np.concatenate([x, x], axis=1), cos, sin)[0, 1, 0]
    np.testing.assert_allclose(y, [np.cos(1), np.sin(1), np.cos(0.1), np.sin(0.1)], rtol=1e-12)


def test_swiglu_kernels(launch):
    """The elementwise pair (mixture of experts: gate and up apart)."""
    n, dev = 50, launch.dev
    g, u, dy = rnd(n, seed=1, scale=3), rnd(n, seed=2), rnd(n, seed=3)
    g[:2] = [-100.0, 100.0]  # saturated sigmoid: no NaN
    check_op(dev, "swiglu", "swiglu_forward", (n,), [("n", np.int32(n)), ("g", g), ("u", u),
             ("y", np.zeros(n, np.float32))], {"y": ref.swiglu_forward(g, u)}, atol=KERNEL_TOL)
    dg, du = ref.swiglu_backward(dy, g, u)
    check_op(dev, "swiglu", "swiglu_backward", (n,), [("n", np.int32(n)), ("dy", dy), ("g", g), ("u", u),
             ("dg", np.zeros(n, np.float32)), ("du", np.zeros(n, np.float32))], {"dg": dg, "du": du},
             atol=KERNEL_TOL, fd=FD(ref.swiglu_forward, {"g": g, "u": u}, dy, grads={"dg": "g", "du": "u"}))


@pytest.mark.parametrize("N,F", [(5, 12), (3, 32), (4, 19), (3, 40)])
def test_swiglu_rows_forward(launch, N, F):
    """The dense feed-forward's form: h (N, 2F) = gate | up per row (float8 or float16 blocks and a scalar tail);
    its backward is the matmul epilogue EPI 3 (tests/test_kernels.py). The float16 form gives the float8 one's bits."""
    h = rnd(N, 2 * F, seed=1, scale=3)
    h[0, :2] = [-100.0, 100.0]
    args = [("N", np.int32(N)), ("h", h), ("y", np.zeros((N, F), np.float32))]
    want = {"y": ref.swiglu_forward(h[:, :F], h[:, F:])}
    y8 = check_op(launch.dev, "swiglu", "swiglu_rows_forward", (N,), args, want, dict(F=F), lsize=(1,), atol=KERNEL_TOL)
    y16 = check_op(launch.dev, "swiglu", "swiglu_rows_forward", (N,), args, want, dict(F=F, SW=16), lsize=(1,),
                   atol=KERNEL_TOL)
    assert np.array_equal(y8["y"], y16["y"])
    # the GPU form, one work-item per output
    check_op(launch.dev, "swiglu", "swiglu_rows_forward_el", (F, N), args, want, dict(F=F), atol=KERNEL_TOL)


@pytest.mark.parametrize("E,K", [(4, 2), (3, 1), (2, 2)])
def test_moe_kernels(launch, E, K):
    N, C, RM = 9, 5, 4
    R = N * K + E * (RM - 1)
    x, rl = rnd(N, C, seed=1), rnd(N, E, seed=2, scale=2)
    rl[0] = 0.0  # an exact tie: the lower index wins
    probs, sel, w = ref.router_forward(rl, K)
    d = dict(E=E, K=K, C=C, RM=RM)
    r = launch("moe", "moe_router_forward", d, (N,), [("N", np.int32(N)), ("fixed", np.int32(0)), ("rl", rl),
               ("probs", np.zeros((N, E), np.float32)), ("sel", np.zeros((N, K), np.int32)),
               ("w", np.zeros((N, K), np.float32))], ["probs", "sel", "w"])
    assert np.array_equal(r["sel"], sel) and list(sel[0]) == list(range(K))
    close(r["probs"], probs, "router probs")
    close(r["w"], w, "router weights")
    sel32, probs32, w32 = sel.astype(np.int32), probs.astype(np.float32), w.astype(np.float32)
    r = launch("moe", "moe_route_packed", d, (E,), [("N", np.int32(N)), ("probs", probs32), ("sel", sel32),
               ("pos", np.zeros(N * K, np.int32)), ("counts", np.zeros(E, np.int32)), ("offs", np.zeros(E, np.int32)),
               ("tiles", np.zeros(E + 1, np.int32)), ("pmean", np.zeros(E, np.float32))],
               ["pos", "counts", "offs", "tiles", "pmean"])
    counts, pos, offs, tiles = r["counts"], r["pos"], r["offs"], r["tiles"]
    assert np.array_equal(counts, np.bincount(sel.reshape(-1), minlength=E))
    want_offs = np.concatenate([[0], np.cumsum(-(-counts // RM) * RM)])
    assert np.array_equal(offs, want_offs[:E]) and np.array_equal(tiles, want_offs // RM)
    close(r["pmean"], probs.mean(axis=0), "pmean")
    tok = np.repeat(np.arange(N), K)
    for e in range(E):  # expert e's rows: its tokens, increasing, packed from offs[e]
        rows = pos[sel.reshape(-1) == e]
        assert list(rows) == list(range(offs[e], offs[e] + counts[e]))
        assert list(tok[sel.reshape(-1) == e]) == sorted(tok[sel.reshape(-1) == e])
    assert len(set(pos)) == N * K and pos.max() < R
    # gather, combine, and their backward against the dense formula out[n] = resid[n] + sum_k w ye[pos]
    r = launch("moe", "moe_gather_packed", d, (C, N * K), [("N", np.int32(N)), ("pos", pos), ("x", x),
               ("xg", np.zeros((R, C), np.float32))], ["xg"])
    assert np.array_equal(r["xg"][pos], np.repeat(x, K, axis=0))
    ye, resid, dout = rnd(R, C, seed=5), rnd(N, C, seed=6), rnd(N, C, seed=7)
    want = resid + (w[..., None] * ye[pos].reshape(N, K, C)).sum(axis=1)
    r = launch("moe", "moe_combine_forward", d, (C, N), [("N", np.int32(N)), ("resid", resid), ("w", w32),
               ("pos", pos), ("ye", ye), ("out", np.zeros((N, C), np.float32))], ["out"])
    close(r["out"], want, "combine forward")
    r = launch("moe", "moe_combine_backward", d, (C, N * K), [("N", np.int32(N)), ("dout", dout), ("w", w32),
               ("pos", pos), ("dye", np.zeros((R, C), np.float32))], ["dye"])
    close(r["dye"][pos], (w[..., None] * dout[:, None]).reshape(N * K, C), "combine backward dye")
    dw = (dout[:, None] * ye[pos].reshape(N, K, C)).sum(-1)
    r = launch("moe", "moe_weight_backward", d, (N * K,), [("N", np.int32(N)), ("dout", dout), ("pos", pos),
               ("ye", ye), ("dw", np.zeros((N, K), np.float32))], ["dw"])
    close(r["dw"], dw, "combine backward dw")
    aux_scale = 0.3 / N
    want = ref.router_backward(dw, probs, sel, w, np.broadcast_to(aux_scale * counts, (N, E)))
    r = launch("moe", "moe_router_backward", d, (N,), [("N", np.int32(N)), ("aux", np.float32(aux_scale)),
               ("dw", dw.astype(np.float32)), ("probs", probs32), ("sel", sel32), ("w", w32), ("counts", counts),
               ("drl", np.zeros((N, E), np.float32))], ["drl"])
    close(r["drl"], want, "router backward")
    # the GPU forms: routing by one work-group (same rows; pmean summed in another order), dw a work-group a row
    for lw in (E, 8):
        r = run_op(launch.dev, "moe", "moe_route_packed_wg", (lw,), [
            ("N", np.int32(N)), ("probs", probs32), ("sel", sel32), ("pos", np.zeros(N * K, np.int32)),
            ("counts", np.zeros(E, np.int32)), ("offs", np.zeros(E, np.int32)), ("tiles", np.zeros(E + 1, np.int32)),
            ("pmean", np.zeros(E, np.float32))], dict(d, LW=lw), (lw,))
        for key, v in (("pos", pos), ("counts", counts), ("offs", offs), ("tiles", tiles)):
            assert np.array_equal(r[key], v), f"moe_route_packed_wg LW {lw}: {key}"
        close(r["pmean"], probs.mean(axis=0), f"pmean LW {lw}")
    r = run_op(launch.dev, "moe", "moe_weight_backward_wg", (N * K * 4,), [("N", np.int32(N)), ("dout", dout),
               ("pos", pos), ("ye", ye), ("dw", np.zeros((N, K), np.float32))], dict(d, LW=4), (4,))
    close(r["dw"], dw, "combine backward dw (work-group form)")
    dxg, dx0 = rnd(R, C, seed=8), rnd(N, C, seed=9)
    r = launch("moe", "moe_scatter_backward", d, (C, N), [("N", np.int32(N)), ("pos", pos), ("dxg", dxg),
               ("dx", dx0)], ["dx"])
    close(r["dx"], dx0 + dxg[pos].reshape(N, K, C).sum(1), "scatter backward")
    # the router backward against finite differences of sum(dw * w) + <aux grad, p>, routing fixed
    f = lambda a: (ref.router_forward(a["rl"], K, sel)[2] * dw).sum() + (  # noqa: E731
        ref.router_forward(a["rl"], K, sel)[0] * aux_scale * counts).sum()
    pr = {"rl": rl.astype(np.float64)}
    assert np.abs(fd_entries(f, pr, "rl", range(N * E), 1e-6) - want.reshape(-1)).max() < 1e-7


@pytest.mark.parametrize("ta_rows", [0, 1])
def test_grouped_matmuls(launch, ta_rows):
    """matmul_rb_grouped: GROUP 1 (each expert's packed rows times its matrix slice) and GROUP 2 (each expert's
    weight gradient over its rows), experts of 0, 1 and several tiles, against float64 per-expert products."""
    E, RM, NV, C, F = 4, 6, 2, 21, 19  # F, C: a partial column block too
    counts = np.array([7, 0, 13, 1], np.int32)
    offs = np.concatenate([[0], np.cumsum(-(-counts // RM) * RM)]).astype(np.int32)
    tiles, offs = offs // RM, offs[:E].copy()
    R = int(tiles[-1] * RM)
    x, W = rnd(R, C, seed=1), rnd(E, C, F, seed=2)
    c0 = rnd(R, F, seed=3)
    d = dict(GROUP=1, NGROUPS=E, TA=0, TB=0, ACCUM=1, RM=RM, NV=NV)
    r = launch("matmul", "matmul_rb_grouped", d, (int(tiles[-1]) + 2, -(-F // (8 * NV))),
               [("M", np.int32(0)), ("N", np.int32(F)), ("K", np.int32(C)), ("A", x), ("lda", np.int32(C)),
                ("B", W), ("ldb", np.int32(F)), ("bs", np.int32(C * F)), ("C", c0.copy()), ("ldc", np.int32(F)),
                ("cs", np.int32(0)), ("alpha", np.float32(0.5)), ("counts", counts), ("offs", offs),
                ("tiles", tiles.astype(np.int32))], ["C"])
    for e in np.nonzero(counts)[0]:
        rows = slice(offs[e], offs[e] + counts[e])
        close(r["C"][rows], c0[rows] + 0.5 * x[rows].astype(np.float64) @ W[e], f"GROUP 1 expert {e}")
    live = np.zeros(R, bool)
    for e in range(E):
        live[offs[e]: offs[e] + counts[e]] = True
    assert np.array_equal(r["C"][~live], c0[~live]), "rows between experts were written"
    dy = rnd(R, F, seed=4)
    g0 = rnd(E, F, C, seed=5)
    A = dy if ta_rows else np.ascontiguousarray(dy.T)  # TA=1 reads dy (R,F) in place; TA=0 a (F,R) copy
    d = dict(GROUP=2, NGROUPS=E, TA=ta_rows, TB=0, ACCUM=1, RM=RM, NV=NV)
    r = launch("matmul", "matmul_rb_grouped", d, (-(-F // RM), -(-C // (8 * NV)), E),
               [("M", np.int32(F)), ("N", np.int32(C)), ("K", np.int32(0)), ("A", A),
                ("lda", np.int32(F if ta_rows else R)), ("B", x), ("ldb", np.int32(C)), ("bs", np.int32(0)),
                ("C", g0.copy()), ("ldc", np.int32(C)), ("cs", np.int32(F * C)), ("alpha", np.float32(1.0)),
                ("counts", counts), ("offs", offs), ("tiles", counts)], ["C"])
    for e in range(E):
        rows = slice(offs[e], offs[e] + counts[e])
        close(r["C"][e], g0[e] + dy[rows].T.astype(np.float64) @ x[rows], f"GROUP 2 expert {e}")


GROUPED_COUNTS = np.array([7, 0, 21, 1], np.int32)  # ragged, an empty expert, one over two row tiles


def grouped_layout(counts, RM):
    """(offs, R): each group's rows from a multiple of RM (kernels/moe.cl), the rows in all."""
    offs = np.concatenate([[0], np.cumsum(-(-counts // RM) * RM)]).astype(np.int32)
    return offs[:-1].copy(), int(offs[-1])


@pytest.mark.parametrize("mm", [dict(TSM=16, TSN=8, TSK=4, WPTM=4, WPTN=4, LDSV=1, PREF=1),
                                dict(TSM=8, TSN=8, TSK=8, WPTM=2, WPTN=2),
                                dict(TSM=16, TSN=32, TSK=8, WPTM=4, WPTN=4, LDSV=1, PREF=1, WARP=1)],
                         ids=["ldsv_pref", "plain", "warp"])
@pytest.mark.parametrize("tb", [0, 1])
def test_grouped_matmul_tiled_rows(launch, mm, tb):
    """The tiled `matmul` with GROUP 1 (GPUs): each expert's packed rows times op(B_e), B_e read in place from
    the stacked (E, C, F) or, tb, (E, F, C) tensor; rows aligned to 16 (TSM 8: tiles in the padding exit)."""
    from clgpt.ops import matmul_launch
    E, C, F = 4, 21, 19  # partial k and column tiles
    counts = GROUPED_COUNTS
    offs, R = grouped_layout(counts, 16)
    x, W = rnd(R, C, seed=1), rnd(E, F, C, seed=2) if tb else rnd(E, C, F, seed=2)
    c0 = rnd(R, F, seed=3)
    want = c0.astype(np.float64)
    for e in range(E):
        rows = slice(offs[e], offs[e] + counts[e])
        want[rows] += 0.5 * x[rows].astype(np.float64) @ (W[e].T if tb else W[e])
    gsize, lsize = matmul_launch(dict(mm, kernel="matmul"), R, F)
    check_op(launch.dev, "matmul", "matmul", gsize, [
        ("M", np.int32(R)), ("N", np.int32(F)), ("K", np.int32(C)), ("A", x), ("lda", np.int32(C)), ("B", W),
        ("ldb", np.int32(C if tb else F)), ("C", c0), ("ldc", np.int32(F)), ("bias", None), ("R", None),
        ("alpha", np.float32(0.5)), ("E", None), ("kc", np.int32(0)), ("GS", np.int32(1)),
        ("bstride", np.int32(C * F)), ("cstride", np.int32(0)), ("counts", counts), ("offs", offs)],
        want={"C": want}, defines=dict(GROUP=1, NGROUPS=E, TA=0, TB=tb, ACCUM=1, **mm), lsize=lsize)


@pytest.mark.parametrize("mm", [dict(TSM=8, TSN=8, TSK=4, WPTM=2, WPTN=2),
                                dict(TSM=16, TSN=32, TSK=4, WPTM=4, WPTN=4, LDSV=1, PREF=1, WARP=1)],
                         ids=["plain", "warp"])
@pytest.mark.parametrize("ta", [0, 1])
@pytest.mark.parametrize("kc", [0, 5], ids=["whole", "split"])
def test_grouped_matmul_tiled_k(launch, ta, kc, mm):
    """The tiled `matmul` with GROUP 2 (GPUs): each expert's weight gradient over its K = counts[e] rows; split:
    chunks of kc rows (raw sums, empty chunks skipped), then splitk_reduce_grouped adds them in order."""
    from clgpt.ops import matmul_launch
    E, C, F = 4, 13, 19
    counts = GROUPED_COUNTS
    offs, R = grouped_layout(counts, 8)
    dy, x, g0 = rnd(R, F, seed=4), rnd(R, C, seed=5), rnd(E, F, C, seed=6)
    want = g0.astype(np.float64)
    for e in range(E):
        rows = slice(offs[e], offs[e] + counts[e])
        want[e] += 2.0 * dy[rows].T.astype(np.float64) @ x[rows]
    A = dy if ta else np.ascontiguousarray(dy.T)  # TA=1 reads dy (R,F) in place; TA=0 an (F,R) copy
    (gx, gy), lsize = matmul_launch(dict(mm, kernel="matmul"), F, C)
    GS = -(-int(counts.max()) // kc) if kc else 1
    d = dict(GROUP=2, NGROUPS=E, TA=ta, TB=0, ACCUM=1, SPLITK=int(kc > 0), **mm)
    P = np.full((GS, E, F, C), np.nan, np.float32)  # chunks past a count stay unwritten
    args = [("M", np.int32(F)), ("N", np.int32(C)), ("K", np.int32(0)), ("A", A), ("lda", np.int32(F if ta else R)),
            ("B", x), ("ldb", np.int32(C)), ("C", P if kc else g0), ("ldc", np.int32(C)), ("bias", None),
            ("R", None), ("alpha", np.float32(1.0 if kc else 2.0)), ("E", None), ("kc", np.int32(kc or 1 << 30)),
            ("GS", np.int32(GS)), ("bstride", np.int32(0)), ("cstride", np.int32(F * C)), ("counts", counts),
            ("offs", offs)]
    if not kc:
        check_op(launch.dev, "matmul", "matmul", (gx, gy, E), args, want={"C": want}, defines=d, lsize=lsize + (1,))
        return
    P = run_op(launch.dev, "matmul", "matmul", (gx, gy, E * GS), args, d, lsize + (1,))["C"]
    for e in range(E):
        assert np.isnan(P[-(-counts[e] // kc):, e]).all(), f"expert {e}: an empty chunk was written"
    check_op(launch.dev, "matmul", "splitk_reduce_grouped", (F * C, E), [
        ("MN", np.int32(F * C)), ("kc", np.int32(kc)), ("accum", np.int32(1)), ("alpha", np.float32(2.0)),
        ("counts", counts), ("P", P), ("C", g0)], want={"C": want}, defines=dict(GROUP=2, NGROUPS=E))


@pytest.mark.parametrize("launch_row", ["gpu", "nvidia"])
def test_grouped_ops_gpu_row(monkeypatch, launch_row):
    """Ops' grouped launchers on a GPU table row (the tiled form, its tile choice, split-K of the weight
    gradients with the thresholds lowered so that small shapes split) against float64 per-expert products."""
    import pyopencl as cl
    from clgpt.ops import Ops
    from clgpt.ops.gemm import portable
    monkeypatch.setattr(portable, "SPLIT_MIN_TOTAL_K", 8)  # where split_plan reads them
    monkeypatch.setattr(portable, "SPLIT_MIN_K", {"big": 8, "small": 4})
    dev = get_device()
    o = Ops(dev, llama_cfg(), 6, knobs=Knobs(launch=launch_row))
    assert o.grouped_local()
    E, C, F, RM = 4, 24, 40, o.grouped_tiles()["RM"]
    counts = np.array([30, 0, 70, 5], np.int32)
    offs, R = grouped_layout(counts, RM)
    max_tiles = R // RM
    mf = cl.mem_flags
    dbuf = lambda a: cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))  # noqa
    x, W, c0 = rnd(R, C, seed=1), rnd(E, F, C, seed=2), rnd(R, F, seed=3)
    bx, bW, bc, bn, bo = dbuf(x), dbuf(W), dbuf(c0), dbuf(counts), dbuf(offs)
    o.matmul_grouped_rows(E, max_tiles, F, C, bx, C, bW, C, F * C, bc, F, bn, bo, None, accum=True, tb=1)
    g0 = rnd(E, F, C, seed=4)
    bg = dbuf(g0)
    o.matmul_grouped_k(E, F, C, bc, F, bx, C, bg, C, F * C, bn, bo, max_rows=80, total_rows=int(counts.sum()))
    got_c, got_g = np.empty_like(c0), np.empty_like(g0)
    cl.enqueue_copy(dev.queue, got_c, bc)
    cl.enqueue_copy(dev.queue, got_g, bg, is_blocking=True)
    want_c, want_g = c0.astype(np.float64), g0.astype(np.float64)
    for e in range(E):
        rows = slice(offs[e], offs[e] + counts[e])
        want_c[rows] += x[rows].astype(np.float64) @ W[e].T.astype(np.float64)
        want_g[e] += want_c[rows].T @ x[rows]
    close(got_c, want_c, "grouped rows (tiled)")
    close(got_g, want_g, "grouped weight gradients (tiled, split)")
    mm, S, kc = o.split_plan(F * E, C, int(counts.sum()) // E)
    assert S > 1, "the lowered thresholds should split these weight gradients"


def test_grouped_ops_on_tensor_cores(monkeypatch):
    """Ops' grouped launchers on the tensor cores (bf16, mma emulated): rows aligned to the mma tiles' BM,
    GROUP 1 with B_e read transposed in place, GROUP 2 split along K (thresholds lowered so that small shapes
    split) and reduced; against float64 per-expert products of the bf16-rounded operands."""
    import pyopencl as cl
    from clgpt.models.reference import round_bf16
    from clgpt.ops import Ops, grouped
    from precisioncheck import emulated_knobs
    monkeypatch.setattr(grouped, "SPLIT_MIN_TOTAL_K", 8)  # where Grouped._grouped_k_mma reads them
    monkeypatch.setattr(grouped, "MMA_SPLIT_MIN_K", 8)
    dev = get_device()
    o = Ops(dev, llama_cfg(), 6, precision="bf16", knobs=emulated_knobs())
    assert o.grouped_mma() and o.grouped_tiles()["RM"] == 32
    E, C, F, RM = 4, 24, 40, 32
    counts = np.array([30, 0, 70, 5], np.int32)
    offs, R = grouped_layout(counts, RM)
    mf = cl.mem_flags
    dbuf = lambda a: cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))  # noqa
    x, W, c0 = rnd(R, C, seed=1), rnd(E, F, C, seed=2), rnd(R, F, seed=3)
    bx, bW, bc, bn, bo = dbuf(x), dbuf(W), dbuf(c0), dbuf(counts), dbuf(offs)
    o.matmul_grouped_rows(E, R // RM, F, C, bx, C, bW, C, F * C, bc, F, bn, bo, None, accum=True, tb=1)
    got_c = np.empty_like(c0)
    cl.enqueue_copy(dev.queue, got_c, bc, is_blocking=True)
    g0 = rnd(E, F, C, seed=4)
    bg = dbuf(g0)
    o.matmul_grouped_k(E, F, C, bc, F, bx, C, bg, C, F * C, bn, bo, max_rows=80, total_rows=int(counts.sum()))
    got_g = np.empty_like(g0)
    cl.enqueue_copy(dev.queue, got_g, bg, is_blocking=True)
    rx = round_bf16(x).astype(np.float64)
    want_c, want_g = c0.astype(np.float64), g0.astype(np.float64)
    for e in range(E):
        rows = slice(offs[e], offs[e] + counts[e])
        want_c[rows] += rx[rows] @ round_bf16(W[e]).T.astype(np.float64)
        want_g[e] += round_bf16(got_c[rows]).T.astype(np.float64) @ rx[rows]
    close(got_c, want_c, "grouped rows (tensor cores)")
    close(got_g, want_g, "grouped weight gradients (tensor cores, split)")
    assert any(key[0] == "mma" and key[8] == 1 and key[-2] == 2 for key in o.product_kernels), "GROUP 2 did not split"


# ---- the reference model against finite differences ---------------------------------------------


# ---- the engine ---------------------------------------------------------------------------------


def test_load_balancing_loss_spreads_the_experts():
    """A router biased to expert 0 at first: training with a large aux coefficient lowers the aux loss
    and the busiest expert's share of the tokens."""
    cfg = llama_cfg(E=4, K=1, moe_aux_loss=1.0, n_layer=1)
    p = noisy_params(cfg)
    p["blk.0.ffn_gate_inp.weight"][0] += 2.0  # every token prefers expert 0 at first
    eng = LlamaEngine(cfg, p, batch_size=4, seq_len=6, knobs=Knobs())
    tokens, targets, mask = batch(cfg, 4, 6)
    eng.forward(tokens, targets, mask)
    first_aux, first_usage = eng.aux_loss(), eng.expert_usage()
    for _ in range(30):
        eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        eng.step(3e-2, weight_decay=0.0)
    eng.forward(tokens, targets, mask)
    assert eng.aux_loss() < first_aux, (first_aux, eng.aux_loss())
    assert eng.expert_usage().max() < first_usage.max()


def test_factory_and_errors():
    gpt2 = ModelConfig(vocab_size=23, n_ctx=6, n_embd=8, n_head=2, n_layer=1, n_ff=12)
    assert type(make_engine(gpt2, init_params(gpt2, 0), 1, 6, knobs=Knobs())) is Engine
    cfg = CFGS["moe"]
    eng = make_engine(cfg, init_params(cfg, 0), 2, 6, knobs=Knobs())
    assert type(eng) is LlamaEngine
    with pytest.raises(ClgptError, match="forward"):
        eng.expert_usage()
    with pytest.raises(ClgptError, match="LlamaEngine"):
        LlamaEngine(gpt2, init_params(gpt2, 0), 1, 6, knobs=Knobs())
    with pytest.raises(ClgptError, match="no experts"):
        LlamaEngine(CFGS["dense"], init_params(CFGS["dense"], 0), 1, 6, knobs=Knobs()).expert_usage()
    assert "position_embd.weight" not in param_shapes(cfg)
    assert param_shapes(cfg)["blk.0.ffn_down_exps.weight"] == (4, 8, 12)
    assert param_shapes(cfg)["blk.0.attn_k.weight"] == (4, 8)  # one kv head of dim 4


@pytest.mark.parametrize("change,match", [
    (dict(n_embd=6, n_head=2), "must be even"),
    (dict(n_head=4, n_head_kv=3), "must divide"),
    (dict(n_expert=1, n_expert_used=1), "at least 2"),
    (dict(n_expert=4, n_expert_used=5), "must lie in"),
    (dict(n_expert=0, n_expert_used=2), "needs n_expert"),
    (dict(arch="gpt2", n_expert=4, n_expert_used=2), "only the llama arch"),
])
def test_config_validation(change, match):
    with pytest.raises(ClgptError, match=match):
        ModelConfig(**{**llama_cfg().__dict__, **change}).validate()
