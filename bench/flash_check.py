"""Flash attention (kernels/flash.cl) on an NVIDIA GPU (issue 15), in one device call:

    python bench/flash_check.py

check  the three kernels on the tensor cores against the float64 reference (clgpt/models/reference.py) at 6 heads of
       64, T = 300 (five 64-row blocks, the last partial), with and without dropout: relative error below 1e-2
       (bf16 operands), and a rerun gives the same bytes;
time   attention forward + backward at M6 (B 64, T 256, 6 x 64), L (B 16, T 512, 12 x 64) and S (GPT-2 small's
       B 8, T 1024, 12 x 64) and GPT-2 medium's (MED: 16 x 64): flash (its forward alone too), the batched form it replaces (attention: batched, T x T
       scores through the GEMM), and PyTorch's F.scaled_dot_product_attention (flash) on bf16 tensors, forward +
       backward, in the same process. FLASH_SHAPES="L S" picks shapes; FLASH_BATCHED=0 leaves the batched form out; FLASH_REPS timed calls (20).
"""
import math
import os
import sys
import time

import numpy as np
import pyopencl as cl

sys.path.insert(0, os.getcwd())
from clgpt.device.knobs import read as read_knobs  # noqa: E402
from clgpt.device.opencl import get_device  # noqa: E402
from clgpt.model import ModelConfig  # noqa: E402
from clgpt.models import reference as ref  # noqa: E402
from clgpt.models.dropout import scale_mask  # noqa: E402
from clgpt.ops import Ops  # noqa: E402

dev = get_device()
mf = cl.mem_flags
f32 = np.float32
print("device:", dev.name, "| CLGPT_FLASH:", os.environ.get("CLGPT_FLASH", "(the defaults)"), flush=True)


def ops_for(B, T, C, H, flash):
    cfg = ModelConfig(vocab_size=64, n_ctx=T, n_embd=C, n_head=H, n_layer=1, n_ff=4 * C)
    ops = Ops(dev, cfg, T, "bf16", knobs=read_knobs(), attention="flash" if flash else "batched")
    assert ops.flash is flash, "flash not taken: is this a bf16 tensor-core device?"
    return ops


def bufs(ops, B, T, C, qkv, dout):
    H = ops.cfg.n_head
    b = dict(qkv=cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=qkv),
             dout=cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=dout),
             out=ops.buf(B * T * C), dqkv=ops.buf(B * T * 3 * C), att=ops.buf(ops.att_floats(B, T)),
             datt=ops.buf(ops.att_floats(B, T)), att_d=ops.buf(B * H * T * T) if not ops.flash else None)
    return b


def step(ops, B, T, b, drop=None):
    d = drop and (*drop, b["att_d"])
    ops.attention_forward(B, T, b["qkv"], b["out"], b["att"], d)
    ops.attention_backward(B, T, b["dout"], b["qkv"], b["att"], b["datt"], b["dqkv"], d, out=b["out"])


def get(b, name, shape):
    x = np.empty(shape, f32)
    cl.enqueue_copy(dev.queue, x, b[name], is_blocking=True)
    return x


def check():
    B, T, C, H = 2, 300, 384, 6
    r = np.random.default_rng(3)
    qkv, dout = r.normal(size=(B, T, 3 * C)).astype(f32), r.normal(size=(B, T, C)).astype(f32)
    ops = ops_for(B, T, C, H, True)
    ok = True
    for p in (0.0, 0.2):
        b = bufs(ops, B, T, C, qkv, dout)
        seed, site = 1234, 5
        d = (seed, site, p, None) if p else None
        for what, fn in (("forward", lambda: ops.attention_forward(B, T, b["qkv"], b["out"], b["att"], d)),
                         ("backward", lambda: ops.attention_backward(B, T, b["dout"], b["qkv"], b["att"], b["datt"],
                                                                     b["dqkv"], d, out=b["out"]))):
            try:
                fn()
                dev.queue.finish()
            except cl.Error as e:
                print(f"check p={p}: the {what} kernels failed: {e}", flush=True)
                return False
        out, dqkv = get(b, "out", (B, T, C)), get(b, "dqkv", (B, T, 3 * C))
        dm = scale_mask(seed, site, (B, H, T, T), p) if p else None
        want, att = ref.attention_forward(qkv, H, dm)
        dwant = ref.attention_backward(dout, qkv, att, H, dm)
        errs = [float(np.abs(g - w).max() / np.abs(w).max()) for g, w in
                ((out, want), (dqkv[..., :C], dwant[..., :C]), (dqkv[..., C:2 * C], dwant[..., C:2 * C]),
                 (dqkv[..., 2 * C:], dwant[..., 2 * C:]))]
        step(ops, B, T, b, (seed, site, p) if p else None)
        same = np.array_equal(out, get(b, "out", (B, T, C))) and np.array_equal(dqkv, get(b, "dqkv", (B, T, 3 * C)))
        good = all(1e-5 < e < 1e-2 for e in errs) and same
        ok &= good
        print(f"check p={p}: relative error out {errs[0]:.2e} dq {errs[1]:.2e} dk {errs[2]:.2e} dv {errs[3]:.2e}, "
              f"rerun identical {same}: {'ok' if good else 'FAILED'}", flush=True)
    print("flash check:", "passed" if ok else "FAILED", flush=True)
    for (stem, opts), prg in dev._programs.items():  # registers and spills ptxas reported (CLGPT_NV_VERBOSE=1)
        if stem == "flash" and "-cl-nv-verbose" in opts:
            log = prg.get_build_info(dev.device, cl.program_build_info.LOG)
            print("ptxas flash:", " | ".join(x.strip() for x in log.splitlines()
                                             if "registers" in x or "spill" in x or "Compiling" in x))
    return ok


def timed(fn, n):
    fn()
    dev.queue.finish()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dev.queue.finish()
    return (time.perf_counter() - t) / n * 1e3


def time_shapes():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        torch = None
    shapes = {"M6": (64, 256, 384, 6), "L": (16, 512, 768, 12), "S": (8, 1024, 768, 12),
              "MED": (8, 1024, 1024, 16)}
    reps = int(os.environ.get("FLASH_REPS", "20"))
    for name in os.environ.get("FLASH_SHAPES", "M6 L S").split():
        B, T, C, H = shapes[name]
        r = np.random.default_rng(0)
        qkv, dout = r.normal(size=(B, T, 3 * C)).astype(f32), r.normal(size=(B, T, C)).astype(f32)
        row = {}
        for flash in (True, False)[:1 + (os.environ.get("FLASH_BATCHED", "1") != "0")]:
            ops = ops_for(B, T, C, H, flash)
            b = bufs(ops, B, T, C, qkv, dout)
            if flash:
                row["flash fwd"] = timed(lambda: ops.attention_forward(B, T, b["qkv"], b["out"], b["att"]), reps)
            row["flash" if flash else "batched"] = timed(lambda: step(ops, B, T, b), reps)
            row[("flash" if flash else "batched") + " drop"] = timed(lambda: step(ops, B, T, b, (7, 1, 0.2)), reps)
        if torch is not None and torch.cuda.is_available():
            D = C // H
            q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            g = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)

            def sdpa(p=0.0):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
                y.backward(g)
            for key, p in (("torch sdpa", 0.0), ("torch sdpa drop", 0.2)):
                for _ in range(3):
                    sdpa(p)
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(reps):
                    sdpa(p)
                torch.cuda.synchronize()
                row[key] = (time.perf_counter() - t) / reps * 1e3
        print(f"{name} attention fwd+bwd ms: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
        if "torch sdpa" in row:
            print(f"{name} flash / torch sdpa: {row['torch sdpa'] / row['flash']:.3f}x speed", flush=True)


if __name__ == "__main__":
    if check():
        time_shapes()
