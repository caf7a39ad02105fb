"""The row kernels' sub-group forms (-D SUBGROUP: kernels/reduce.cl's wg_reduce, kernels/norm_rows.cl's row slices)
on every CPU implementation that offers sub-groups, at every size it builds (clgpt.device.capabilities reads them:
Intel's CPU runtime builds 8, 16, 32 and 64; PoCL 3 and Mesa's llvmpipe offer none), against float64 references
and finite differences, two runs the same bytes; and an engine on the GPU row taking them through the
capabilities record and the CLGPT_SUBGROUP knob.

The cases are what each runtime offers, found when the module is collected; where none offers sub-groups the one
case "none" checks that none does. Work-groups of 128 (the GPU row's) hold several sub-groups (the local-memory
step); a work-group of 32 or 64 at those sizes is one (no barrier). Tolerances as tests/test_kernels_norms.py's:
outputs 1e-5 of the reference's largest magnitude, gradients 1e-4."""

from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from clgpt.device.capabilities import capabilities, subgroup_extension, subgroup_sizes
from clgpt.device.knobs import Knobs
from clgpt.device.opencl import cpu_implementations, get_device
from clgpt.errors import ClgptError
from clgpt.model import ModelConfig
from clgpt.models import reference as ref
from clgpt.models import reference_llama as ref_llama
from clgpt.models.gpt2 import GPT2Engine

from conftest import to_dev
from enginecheck import batch, max_rel, noisy_params
from opcheck import FD, check_op, run_op

i32, f32 = np.int32, np.float32
EPS, RW = 1e-5, 4
IMPLS = cpu_implementations()


def _cases() -> list:
    """(device spec, SUBGROUP) for every size each implementation offers (0: its compiler's size, not fixed)."""
    out = []
    for name, spec in IMPLS.items():
        sizes, fixed = subgroup_sizes(get_device(spec).device)
        out += [pytest.param(spec, n if fixed else 0, id=f"{name}-{n}") for n in sizes]
    return out or [pytest.param(None, None, id="none")]


CASES = _cases()
ROW_CASES = [c for c in CASES if c.values[1] and 32 % c.values[1] == 0] or [pytest.param(None, None, id="none")]


def _device(spec):
    """The device of a case, or None for the "none" case, having asserted that no implementation offers
    sub-groups."""
    if spec is None:
        offering = [name for name, s in IMPLS.items() if subgroup_extension(get_device(s).device)]
        assert not offering, f"{offering} offer sub-groups but gave no size the row kernels can use"
        return None
    return get_device(spec)


def test_every_implementation_offering_subgroups_gives_sizes():
    """An implementation with a sub-group extension gives the sizes the probe found; Intel's CPU runtime (where
    installed) at least 8, 16 and 32, each fixed at build time; one without gives none."""
    for name, spec in IMPLS.items():
        d = get_device(spec).device
        sizes, fixed = subgroup_sizes(d)
        assert bool(sizes) is bool(subgroup_extension(d)), f"{name}: extension {subgroup_extension(d)!r}, sizes {sizes}"
        if name == "intel":
            assert fixed and {8, 16, 32} <= set(sizes), f"intel: sizes {sizes}, fixed {fixed}"


def _lws(n):
    """Work-group sizes to check a size-n sub-group form at: 128 (several sub-groups) and, for the sizes a row
    tuner's work-group can be (32, 64), n (one sub-group: no barrier)."""
    return (128, n) if n in (32, 64) else (128,)


def _same_again(dev, file, name, gsize, args, kw, lsize, first, keys):
    """The kernel run again gives the same bytes as its first run `first` in each of `keys`."""
    again = run_op(dev, file, name, gsize, args, kw, lsize)
    for key in keys:
        assert np.array_equal(first[key], again[key]), f"{name} {key}: two runs differ"


@pytest.mark.parametrize("spec,n", CASES)
def test_norms_one_work_group_a_row(spec, n):
    """layernorm_forward_wg, layernorm_backward_wg, rmsnorm_forward_wg, rmsnorm_backward_wg with sub-group
    reductions: outputs against float64, dx against finite differences, two runs the same bytes."""
    dev = _device(spec)
    if dev is None:
        return
    rng = np.random.default_rng(7)
    N, C = 5, 200  # C not a multiple of the work-group: some work-items hold one more column
    x = (rng.normal(size=(N, C)) * 2 + 0.5).astype(f32)
    w, b, dout = rng.normal(size=C).astype(f32), rng.normal(size=C).astype(f32), rng.normal(size=(N, C)).astype(f32)
    want, (mean, rstd) = ref.layernorm_forward(x, w, b, EPS)
    dx_want = ref.layernorm_backward(dout, x, w, mean, rstd)[0]
    rms_want, rms_rstd = ref_llama.rmsnorm_forward(x, w, EPS)
    rms_dx = ref_llama.rmsnorm_backward(dout, x, w, rms_rstd)[0]
    for LW in _lws(n):
        kw, gs, ls = dict(C=C, EPS=EPS, LW=LW, SUBGROUP=n), (N * LW,), (LW,)
        fargs = [("N", i32(N)), ("x", x), ("w", w), ("b", b), ("out", np.zeros_like(x)), ("mean", np.zeros(N, f32)),
                 ("rstd", np.zeros(N, f32))]
        out = check_op(dev, "layernorm", "layernorm_forward_wg", gs, fargs, {"out": want, "rstd": rstd}, kw, ls)
        _same_again(dev, "layernorm", "layernorm_forward_wg", gs, fargs, kw, ls, out, ("out", "mean", "rstd"))
        bargs = [("N", i32(N)), ("accum", i32(0)), ("dout", dout), ("x", x), ("w", w), ("mean", out["mean"]),
                 ("rstd", out["rstd"]), ("dx", np.zeros_like(x))]
        fwd = lambda x, w, b: ref.layernorm_forward(x, w, b, EPS)[0]  # noqa: E731
        got = check_op(dev, "layernorm", "layernorm_backward_wg", gs, bargs, {"dx": dx_want}, kw, ls, atol=1e-4,
                       rtol=1e-4, fd=FD(fwd, {"x": x, "w": w, "b": b}, dout, grads={"dx": "x"}))
        _same_again(dev, "layernorm", "layernorm_backward_wg", gs, bargs, kw, ls, got, ("dx",))
        fargs = [("N", i32(N)), ("x", x), ("w", w), ("out", np.zeros_like(x)), ("rstd", np.zeros(N, f32))]
        out = check_op(dev, "rmsnorm", "rmsnorm_forward_wg", gs, fargs, {"out": rms_want, "rstd": rms_rstd}, kw, ls)
        bargs = [("N", i32(N)), ("accum", i32(0)), ("dout", dout), ("x", x), ("w", w), ("rstd", out["rstd"]),
                 ("dx", np.zeros_like(x))]
        fwd = lambda x, w: ref_llama.rmsnorm_forward(x, w, EPS)[0]  # noqa: E731
        got = check_op(dev, "rmsnorm", "rmsnorm_backward_wg", gs, bargs, {"dx": rms_dx}, kw, ls, atol=1e-4, rtol=1e-4,
                       fd=FD(fwd, {"x": x, "w": w}, dout, grads={"dx": "x"}))
        _same_again(dev, "rmsnorm", "rmsnorm_backward_wg", gs, bargs, kw, ls, got, ("dx",))


def _causal_softmax(s):
    """Rows r of s (R, T), query t = r % T: softmax over keys 0..t, zeros after (float64)."""
    R, T = s.shape
    s = s.astype(np.float64).copy()
    s[np.arange(T)[None, :] > (np.arange(R) % T)[:, None]] = -np.inf
    e = np.exp(s - s.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.mark.parametrize("spec,n", CASES)
def test_softmax_rows(spec, n):
    """attention_softmax and attention_dsoftmax (batched attention's row kernels) with sub-group reductions against
    float64, rows shorter than the work-group (sub-groups with no key: -inf, 0) and longer; dsoftmax's datt also
    against finite differences of the softmax; two runs the same bytes."""
    dev = _device(spec)
    if dev is None:
        return
    rng = np.random.default_rng(8)
    T = 150
    R = 2 * T
    s = (rng.normal(size=(R, T)) * 3).astype(f32)
    dp = rng.normal(size=(R, T)).astype(f32)
    p = _causal_softmax(s)
    dwant = p * (dp - (p * dp).sum(1, keepdims=True))
    for LW in _lws(n):
        kw, gs, ls = dict(C=8, H=1, D=8, SCALE=1.0, VEC=0, LW=LW, SUBGROUP=n), (R * LW,), (LW,)
        args = [("T", i32(T)), ("att", s)]
        got = check_op(dev, "attention", "attention_softmax", gs, args, {"att": p}, kw, ls, atol=1e-6, rtol=1e-5)
        _same_again(dev, "attention", "attention_softmax", gs, args, kw, ls, got, ("att",))
        pf = got["att"]
        args = [("T", i32(T)), ("att", pf), ("datt", dp)]
        fwd = lambda x: _causal_softmax(x)  # noqa: E731
        want = pf * (dp - (pf.astype(np.float64) * dp).sum(1, keepdims=True))
        got = check_op(dev, "attention", "attention_dsoftmax", gs, args, {"datt": want}, kw, ls, atol=1e-5,
                       rtol=1e-4, fd=FD(fwd, {"x": s}, dp, grads={"datt": "x"}, n=20))
        assert np.abs(got["datt"] - dwant).max() < 1e-4 * max(1.0, np.abs(dwant).max())
        _same_again(dev, "attention", "attention_dsoftmax", gs, args, kw, ls, got, ("datt",))


@pytest.mark.parametrize("spec,n", CASES)
def test_xent_and_grad_norm_work_groups(spec, n):
    """xent_forward_wg's losses and lse (a running max a work-item, then the group's max and sum) and the grad
    norm's work-group sums with sub-group reductions, against float64; two runs the same bytes."""
    dev = _device(spec)
    if dev is None:
        return
    rng = np.random.default_rng(9)
    N, V = 6, 1003
    logits = (rng.normal(size=(N, V)) * 8 + np.linspace(-20, 20, V)[None] * rng.choice([-1, 1], (N, 1))).astype(f32)
    targets = rng.integers(0, V, N).astype(i32)
    mask = np.ones(N, f32)
    mask[3] = 0
    x = logits.astype(np.float64)
    lse = x.max(1) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1))
    losses = np.where(mask != 0, lse - x[np.arange(N), targets], 0.0)
    g = rng.normal(size=20011).astype(f32) * 0.01
    norm = np.sqrt((g.astype(np.float64) ** 2).sum())
    for LW in _lws(n):
        kw, gs, ls = dict(V=V, LW=LW, SUBGROUP=n), (N * LW,), (LW,)
        args = [("N", i32(N)), ("logits", logits), ("targets", targets), ("mask", mask),
                ("losses", np.zeros(N, f32)), ("lse", np.zeros(N, f32))]
        got = check_op(dev, "xent", "xent_forward_wg", gs, args, {"lse": lse, "losses": losses}, kw, ls)
        _same_again(dev, "xent", "xent_forward_wg", gs, args, kw, ls, got, ("lse", "losses"))
        parts = 9
        kw = dict(LW=LW, SUBGROUP=n)
        pb, ob = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, parts * 4), cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE, 8)
        outs = []
        for _ in range(2):
            dev.kernel("adamw", "grad_norm_partial_wg", **kw)(dev.queue, (parts * LW,), (LW,), i32(g.size),
                                                              to_dev(dev, g), pb)
            dev.kernel("adamw", "grad_norm_final_wg", **kw)(dev.queue, (LW,), (LW,), i32(parts), f32(0.5), pb, ob)
            out = np.empty(2, f32)
            cl.enqueue_copy(dev.queue, out, ob, is_blocking=True)
            outs.append(out)
        assert abs(outs[0][0] - norm) <= 1e-5 * norm, f"grad norm {outs[0][0]} vs {norm}"
        assert outs[0][1] == np.float32(0.5) / outs[0][0] and np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("spec,n", ROW_CASES)
def test_norm_row_slices(spec, n):
    """The norms' 32-wide row slices (layernorm_*_rows, rmsnorm_*_rows: RW rows a work-group) with sub-groups
    of n (a row 32 / n of them): forward against float64, the backward's dx against finite differences and its
    dw (db) after the final sum against float64; N off a multiple of the rows a work-group; two runs the same
    bytes."""
    dev = _device(spec)
    if dev is None:
        return
    rng = np.random.default_rng(10)
    N, C, rpi = 37, 256, 3
    x = (rng.normal(size=(N, C)) * 2 + 0.5).astype(f32)
    w, b, dout = rng.normal(size=C).astype(f32), rng.normal(size=C).astype(f32), rng.normal(size=(N, C)).astype(f32)
    kw, rows, ls, P = dict(C=C, EPS=EPS, RW=RW, SUBGROUP=n), (32, -(-N // RW) * RW), (32, RW), -(-N // (RW * rpi))
    want, (mean, rstd) = ref.layernorm_forward(x, w, b, EPS)
    dx_want, dw_want, db_want = ref.layernorm_backward(dout, x, w, mean, rstd)
    fargs = [("N", i32(N)), ("x", x), ("w", w), ("b", b), ("out", np.zeros_like(x)), ("mean", np.zeros(N, f32)),
             ("rstd", np.zeros(N, f32))]
    out = check_op(dev, "layernorm", "layernorm_forward_rows", rows, fargs, {"out": want, "mean": mean, "rstd": rstd},
                   kw, ls)
    _same_again(dev, "layernorm", "layernorm_forward_rows", rows, fargs, kw, ls, out, ("out", "mean", "rstd"))
    bargs = [("N", i32(N)), ("rpi", i32(rpi)), ("accum", i32(0)), ("dout", dout), ("x", x), ("w", w),
             ("mean", out["mean"]), ("rstd", out["rstd"]), ("dx", np.zeros_like(x)), ("part", np.zeros(2 * P * C, f32))]
    fwd = lambda x, w, b: ref.layernorm_forward(x, w, b, EPS)[0]  # noqa: E731
    got = check_op(dev, "layernorm", "layernorm_backward_rows", (32, P * RW), bargs, {"dx": dx_want}, kw, ls,
                   atol=1e-4, rtol=1e-4, fd=FD(fwd, {"x": x, "w": w, "b": b}, dout, grads={"dx": "x"}))
    _same_again(dev, "layernorm", "layernorm_backward_rows", (32, P * RW), bargs, kw, ls, got, ("dx", "part"))
    check_op(dev, "layernorm", "layernorm_param_final_rows", (C // 2, 32), [("P", i32(P)), ("part", got["part"]),
             ("dw", np.zeros(C, f32)), ("db", np.zeros(C, f32))], {"dw": dw_want, "db": db_want}, kw, (8, 32),
             atol=1e-4, rtol=1e-4)
    want, rstd = ref_llama.rmsnorm_forward(x, w, EPS)
    dx_want, dw_want = ref_llama.rmsnorm_backward(dout, x, w, rstd)
    fargs = [("N", i32(N)), ("x", x), ("w", w), ("out", np.zeros_like(x)), ("rstd", np.zeros(N, f32))]
    out = check_op(dev, "rmsnorm", "rmsnorm_forward_rows", rows, fargs, {"out": want, "rstd": rstd}, kw, ls)
    _same_again(dev, "rmsnorm", "rmsnorm_forward_rows", rows, fargs, kw, ls, out, ("out", "rstd"))
    bargs = [("N", i32(N)), ("rpi", i32(rpi)), ("accum", i32(0)), ("dout", dout), ("x", x), ("w", w),
             ("rstd", out["rstd"]), ("dx", np.zeros_like(x)), ("part", np.zeros(P * C, f32))]
    fwd = lambda x, w: ref_llama.rmsnorm_forward(x, w, EPS)[0]  # noqa: E731
    got = check_op(dev, "rmsnorm", "rmsnorm_backward_rows", (32, P * RW), bargs, {"dx": dx_want}, kw, ls, atol=1e-4,
                   rtol=1e-4, fd=FD(fwd, {"x": x, "w": w}, dout, grads={"dx": "x"}))
    _same_again(dev, "rmsnorm", "rmsnorm_backward_rows", (32, P * RW), bargs, kw, ls, got, ("dx", "part"))
    check_op(dev, "rmsnorm", "rmsnorm_param_final_rows", (C // 4, 32), [("P", i32(P)), ("part", got["part"]),
             ("dw", np.zeros(C, f32))], {"dw": dw_want}, kw, (8, 32), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec,n", CASES)
def test_gpt2_engine_on_the_gpu_row_takes_the_subgroup_forms(spec, n):
    """A gpt2 engine on the GPU launch row with CLGPT_SUBGROUP's size (C = 128: the norms' row slices where the
    size divides 32, batched attention's softmax rows, cross-entropy's work-groups): the record says so, the row
    kernels are built for that size, and loss and every gradient match the float64 reference; a second engine
    gives the same bytes."""
    dev = _device(spec)
    if dev is None:
        return
    kn = Knobs(launch="gpu", subgroup=n or None)
    caps = capabilities(dev.device, kn)
    assert caps.subgroup_reduce and caps.subgroup == n, caps
    cfg = ModelConfig(vocab_size=37, n_ctx=16, n_embd=128, n_head=4, n_layer=1, n_ff=64)
    p = noisy_params(cfg)
    tokens, targets, mask = batch(cfg, 2, 16)
    runs = []
    for _ in range(2):
        eng = GPT2Engine(cfg, p, batch_size=2, seq_len=16, device=dev, knobs=kn)
        eng.ops.facts.attn_gemm = True  # the softmax row kernels at this short T too
        loss = eng.forward(tokens, targets, mask)
        eng.zero_grad()
        eng.backward()
        runs.append((loss, eng.get_grads()))
    if n:
        for name in ("attention_softmax", "xent_forward_wg", "layernorm_forward_rows" if 32 % n == 0 else None):
            if name:
                k = eng.ops.k[name]
                lsize = (32, RW) if name.endswith("_rows") else (128,)
                got = k.get_sub_group_info(dev.device, cl.kernel_sub_group_info.MAX_SUB_GROUP_SIZE_FOR_NDRANGE, lsize)
                assert got == n, f"{name}: sub-groups of {got}, not {n}"
    loss_ref, cache = ref.gpt_forward(p, cfg, tokens, targets, mask)
    assert abs(runs[0][0] - loss_ref) < 1e-5 * abs(loss_ref), f"loss {runs[0][0]} vs reference {loss_ref}"
    worst, where = max_rel(runs[0][1], ref.gpt_backward(cache))
    assert worst < 1e-4, f"grads: max relative diff {worst:.3e} in {where}"
    assert runs[0][0] == runs[1][0] and all(np.array_equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_a_size_the_device_does_not_offer_is_a_one_line_error():
    """CLGPT_SUBGROUP naming a size the device cannot build (or any size, on a device without sub-groups) stops
    with the sizes it offers; off keeps the local-memory forms."""
    for name, spec in IMPLS.items():
        d = get_device(spec).device
        sizes = subgroup_sizes(d)[0]
        with pytest.raises(ClgptError, match=r"CLGPT_SUBGROUP=7: .* offers .*off, or unset it"):
            capabilities(d, Knobs(launch="gpu", subgroup=7))
        caps = capabilities(d, Knobs(launch="gpu", subgroup=0))
        assert not caps.subgroup_reduce and caps.subgroup_sizes == sizes, name
        assert not capabilities(d, Knobs(launch="cpu")).subgroup_reduce, f"{name}: the CPU row takes no sub-groups"
