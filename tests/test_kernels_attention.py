"""The attention kernels against the float64 reference: the plain and vector forms, the CPU's 4-keys and
register-blocked forms, and the GPU's batched causal matmuls."""

from __future__ import annotations

import math

import numpy as np
import pyopencl as cl
import pytest

from clgpt.models import reference as ref

from conftest import assert_close, empty, from_dev, to_dev
from opcheck import FD, _gpu_engine, check_op, run_op

i32, f32 = np.int32, np.float32
rng = np.random.default_rng(1234)


@pytest.mark.parametrize("B,T,C,H", [(2, 70, 16, 2), (1, 5, 8, 1), (2, 33, 24, 3)])
def test_attention_batched_matmuls(dev, B, T, C, H):
    """The GPU attention (batched causal matmuls + softmax rows) against the float64 reference."""
    eng = _gpu_engine(B=B, T=T, C=C, H=H)
    eng.ops.facts.attn_gemm = True  # whatever the table's shortest sequence for it
    qkv = rng.normal(size=(B, T, 3 * C)).astype(f32)
    dout = rng.normal(size=(B, T, C)).astype(f32)
    want, att = ref.attention_forward(qkv, H)
    dqkv_want = ref.attention_backward(dout, qkv, att, H)
    qb, ob, ab = to_dev(dev, qkv), empty(dev, B * T * C), empty(dev, B * H * T * T)
    eng.ops.attention_forward(B, T, qb, ob, ab)
    assert_close(from_dev(dev, ob, (B, T, C)), want, 1e-5, 1e-4, "attention out")
    assert_close(from_dev(dev, ab, (B, H, T, T)), att, 1e-6, 1e-4, "attention att")
    dq, datt = empty(dev, B * T * 3 * C), empty(dev, B * H * T * T)
    eng.ops.attention_backward(B, T, to_dev(dev, dout), qb, ab, datt, dq)
    assert_close(from_dev(dev, dq, (B, T, 3 * C)), dqkv_want, 1e-5, 1e-4, "attention backward")


# ---------------- attention ----------------
@pytest.mark.parametrize("vec", [0, 1])
@pytest.mark.parametrize("B,T,C,H", [(2, 7, 12, 3), (1, 1, 8, 1), (3, 9, 16, 2), (2, 5, 48, 3)])
def test_attention(dev, B, T, C, H, vec):
    D = C // H
    qkv = rng.normal(size=(B, T, 3 * C)).astype(f32)
    dout = rng.normal(size=(B, T, C)).astype(f32)
    want, att = ref.attention_forward(qkv, H)
    dqkv_want = ref.attention_backward(dout, qkv, att, H)
    kw = dict(C=C, H=H, D=D, SCALE=1.0 / math.sqrt(D), VEC=vec)
    g, BT = (T, B * H), [("B", i32(B)), ("T", i32(T))]
    out = check_op(dev, "attention", "attention_forward", g, [*BT, ("qkv", qkv), ("out", np.zeros_like(dout)),
                   ("att", np.zeros((B, H, T, T), f32))], {"out": want, "att": att}, kw, rtol=1e-4, scaled=False)
    # the backward is two kernels: the query side writes datt and dq, the key side dk and dv
    q = run_op(dev, "attention", "attention_backward_query", g, [*BT, ("dout", dout), ("qkv", qkv),
               ("att", out["att"]), ("datt", np.zeros_like(out["att"])), ("dqkv", np.zeros_like(qkv))], kw)
    check_op(dev, "attention", "attention_backward_key", g, [*BT, ("dout", dout), ("qkv", qkv), ("att", out["att"]),
             ("datt", q["datt"]), ("dqkv", q["dqkv"])], {"dqkv": dqkv_want}, kw, rtol=1e-4, scaled=False,
             fd=FD(lambda qkv: ref.attention_forward(qkv, H)[0], {"qkv": qkv}, dout, grads={"dqkv": "qkv"}))


@pytest.mark.parametrize("B,T,C,H", [(2, 7, 12, 3), (1, 1, 8, 1), (3, 9, 16, 2), (2, 13, 48, 3), (1, 21, 64, 2)])
def test_attention_u4(dev, B, T, C, H):
    """kernels/attention.cl's 4-keys-at-a-time CPU attention: the float64 reference's values; given the same att, its
    query backward gives attention.cl's (VEC=1) datt and dq bit for bit (backward_key reads that datt)."""
    D = C // H
    qkv = rng.normal(size=(B, T, 3 * C)).astype(f32)
    dout = rng.normal(size=(B, T, C)).astype(f32)
    want, att = ref.attention_forward(qkv, H)
    dqkv_want = ref.attention_backward(dout, qkv, att, H)
    kw = dict(C=C, H=H, D=D, SCALE=1.0 / math.sqrt(D))
    qb, dob = to_dev(dev, qkv), to_dev(dev, dout)
    res = {}
    for form, (fw, bq) in {"u4": ("attention", "_u4"), "vec": ("attention", "")}.items():
        kf = dict(kw, VEC=1)
        ob, ab = empty(dev, B * T * C), empty(dev, B * H * T * T)
        datt, dq = empty(dev, B * H * T * T), empty(dev, B * T * 3 * C)
        dev.kernel(fw, "attention_forward" + bq, **kf)(dev.queue, (T, B * H), None, i32(B), i32(T), qb, ob, ab)
        if form == "vec":  # the same att into both backwards
            cl.enqueue_copy(dev.queue, ab, res["u4"][1])
        dev.kernel(fw, "attention_backward_query" + bq, **kf)(dev.queue, (T, B * H), None, i32(B), i32(T), dob, qb,
                                                              ab, datt, dq)
        dev.kernel("attention", "attention_backward_key", **dict(kw, VEC=1))(dev.queue, (T, B * H), None, i32(B),
                                                                             i32(T), dob, qb, ab, datt, dq)
        res[form] = [from_dev(dev, ob, (B, T, C)), from_dev(dev, ab, (B, H, T, T)),
                     from_dev(dev, datt, (B, H, T, T)), from_dev(dev, dq, (B, T, 3 * C))]
    out, a, _, dq = res["u4"]
    assert_close(out, want, 1e-5, 1e-4, "attention_forward_u4 out")
    assert_close(a, att, 1e-6, 1e-4, "attention_forward_u4 att")
    assert_close(dq, dqkv_want, 1e-5, 1e-4, "attention_backward_query_u4")
    res["u4"][2], res["vec"][2] = np.tril(res["u4"][2]), np.tril(res["vec"][2])  # datt above t: not written
    for x, y, what in zip(res["u4"][2:], res["vec"][2:], ("datt", "dqkv")):
        assert np.array_equal(x, y), f"attention u4 {what} differs from attention.cl's"


@pytest.mark.parametrize("B,T,C,H", [(2, 37, 64, 2), (1, 5, 32, 2), (2, 13, 48, 3), (1, 1, 16, 1)])
def test_attention_rb(dev, B, T, C, H):
    """kernels/attention.cl's register-blocked CPU attention products (D % 16 == 0): the u4 kernels with ROWS_RB=1
    plus attention_rows_rb (att @ v, datt @ k) and attention_backward_key_rb give the float64 reference's
    values, and att, datt, out and dqkv bit for bit as the u4 kernels with attention.cl's key backward."""
    D = C // H
    qkv = rng.normal(size=(B, T, 3 * C)).astype(f32)
    dout = rng.normal(size=(B, T, C)).astype(f32)
    want, att = ref.attention_forward(qkv, H)
    dqkv_want = ref.attention_backward(dout, qkv, att, H)
    kw = dict(C=C, H=H, D=D, SCALE=1.0 / math.sqrt(D), VEC=1)
    qb, dob = to_dev(dev, qkv), to_dev(dev, dout)
    q, res = dev.queue, {}
    for rb in (0, 1):
        ob, ab = empty(dev, B * T * C), empty(dev, B * H * T * T)
        datt, dq = empty(dev, B * H * T * T), empty(dev, B * T * 3 * C)
        kf = dict(kw, ROWS_RB=rb)
        dev.kernel("attention", "attention_forward_u4", **kf)(q, (T, B * H), None, i32(B), i32(T), qb, ob, ab)
        g_rows = (-(-T // 6), B * H * (D // 16))
        rows = dev.kernel("attention", "attention_rows_rb", **kw)
        if rb:
            rows(q, g_rows, None, i32(B), i32(T), ab, qb, i32(2 * C), i32(3 * C), ob, i32(0), i32(C), f32(1.0))
        dev.kernel("attention", "attention_backward_query_u4", **kf)(q, (T, B * H), None, i32(B), i32(T), dob, qb, ab,
                                                                datt, dq)
        if rb:
            rows(q, g_rows, None, i32(B), i32(T), datt, qb, i32(C), i32(3 * C), dq, i32(0), i32(3 * C),
                 f32(1.0 / math.sqrt(D)))
            dev.kernel("attention", "attention_backward_key_rb", **kw)(q, (-(-T // 6), B * H * (D // 8)), None, i32(B),
                                                                  i32(T), dob, qb, ab, datt, dq)
        else:
            dev.kernel("attention", "attention_backward_key", **dict(kw, VEC=1))(q, (T, B * H), None, i32(B),
                                                                                 i32(T), dob, qb, ab, datt, dq)
        res[rb] = [from_dev(dev, ob, (B, T, C)), from_dev(dev, ab, (B, H, T, T)),
                   np.tril(from_dev(dev, datt, (B, H, T, T))), from_dev(dev, dq, (B, T, 3 * C))]
    out, a, _, dq = res[1]
    assert_close(out, want, 1e-5, 1e-4, "attention rb out")
    assert_close(a, att, 1e-6, 1e-4, "attention rb att")
    assert_close(dq, dqkv_want, 1e-5, 1e-4, "attention rb dqkv")
    for x, y, what in zip(res[1], res[0], ("out", "att", "datt", "dqkv")):
        assert np.array_equal(x, y), f"attention rb {what} differs from the u4 kernels'"
