"""Portable flash attention (kernels/flash_portable.cl) on the generic GPU row (CLGPT_LAUNCH=gpu: nothing
NVIDIA-specific), in one run:

    python3 bench/flash_portable.py [--shapes L S] [--rounds 5] [--reps 10] [--tiny]

tune   the flash tuner at each shape (clgpt/device/tuner_flash.py tune: its total seconds, each kernel's tiles);
check  portable flash's forward + backward (tuned tiles, dropout 0.1) against the float64 reference at 2 x 4 heads
       of 64, T 300: relative error below 1e-4;
time   attention forward + backward, fp32, at L (B 16, T 512, 12 x 64) and S (GPT-2 small's B 8, T 1024, 12 x 64):
       portable flash (tuned tiles), the batched form (attention: batched, the T x T scores through the generic
       GEMM) and PyTorch's F.scaled_dot_product_attention on fp32 CUDA tensors (TF32 off; where torch and CUDA are
       there), alternated A, B, C in each of --rounds rounds of --reps calls; the median ms per call and the
       ratios to the batched form. --tiny: a CPU check of the script (PoCL, B 2, T 100, 2 x 16), not a figure.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np
import pyopencl as cl

sys.path.insert(0, os.getcwd())
from clgpt.device import tuner_flash  # noqa: E402
from clgpt.device.knobs import Knobs  # noqa: E402
from clgpt.device.opencl import get_device  # noqa: E402
from clgpt.model import ModelConfig  # noqa: E402
from clgpt.models import reference as ref  # noqa: E402
from clgpt.models.dropout import scale_mask  # noqa: E402
from clgpt.ops import Ops  # noqa: E402

SHAPES = {"L": (16, 512, 12, 64), "S": (8, 1024, 12, 64), "T": (2, 100, 2, 16)}  # B, T, H, D
f32 = np.float32


def make(dev, B, T, H, D, form, tiles=None):
    """(ops, buffers) of attention `form` (flash: portable flash; batched) on the generic GPU row, fp32."""
    C = H * D
    cfg = ModelConfig(vocab_size=64, n_ctx=T, n_embd=C, n_head=H, n_layer=1, n_ff=4 * C)
    ops = Ops(dev, cfg, T, "fp32", batch_size=B, knobs=Knobs(launch="gpu", flash_tuning=tiles), attention=form)
    assert ops.flash_portable is (form == "flash") and not ops.flash
    r = np.random.default_rng(3)
    mf = cl.mem_flags
    host = dict(qkv=r.normal(size=(B, T, 3 * C)).astype(f32), dout=r.normal(size=(B, T, C)).astype(f32))
    b = {k: cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=v) for k, v in host.items()}
    b.update(out=ops.buf(B * T * C), dqkv=ops.buf(B * T * 3 * C), att=ops.buf(ops.att_floats(B, T)),
             datt=ops.buf(ops.att_floats(B, T)), att_d=ops.buf(B * H * T * T) if form == "batched" else None)
    return ops, b, host


def step(ops, B, T, b, drop=None):
    d = drop and (*drop, b["att_d"])
    ops.attention_forward(B, T, b["qkv"], b["out"], b["att"], d)
    ops.attention_backward(B, T, b["dout"], b["qkv"], b["att"], b["datt"], b["dqkv"], d, out=b["out"])


def check(dev, tiles, D) -> bool:
    B, T, H = 2, 300, 4
    ops, b, host = make(dev, B, T, H, D, "flash", tiles)
    p, seed, site = 0.1, 1234, 5
    step(ops, B, T, b, (seed, site, p))
    C = H * D
    out, dqkv = np.empty((B, T, C), f32), np.empty((B, T, 3 * C), f32)
    for h, name in ((out, "out"), (dqkv, "dqkv")):
        cl.enqueue_copy(dev.queue, h, b[name])
    dev.queue.finish()
    dmask = scale_mask(seed, site, (B, H, T, T), p)
    want, att = ref.attention_forward(host["qkv"], H, dmask)
    dwant = ref.attention_backward(host["dout"], host["qkv"], att, H, dmask)
    err = max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in ((out, want), (dqkv, dwant)))
    print(f"check: portable flash (dropout {p}) vs float64 at B {B}, T {T}, {H} x {D}: max rel err {err:.2e} "
          f"({'ok' if err < 1e-4 else 'FAILED'})", flush=True)
    return err < 1e-4


def torch_form(B, T, H, D, tiny):
    """A PyTorch SDPA forward + backward on fp32 tensors (CUDA, TF32 off; on the CPU with --tiny), or None."""
    try:
        import torch
    except ImportError:
        return None
    dev = "cpu" if tiny else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device=dev, generator=g, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, T, D, device=dev, generator=g)

    def call():
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(y, (q, k, v), dout)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()
    return call, sync


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["L", "S"], choices=["L", "S"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    shapes = ["T"] if args.tiny else args.shapes
    dev = get_device()
    print(f"device: {dev.name} ({dev.device.platform.name.strip()}, driver {dev.device.driver_version.strip()})")
    ok = True
    for name in shapes:
        B, T, H, D = SHAPES[name]
        t0 = time.perf_counter()
        rec = tuner_flash.tune(dev, B, H, T, D, progress=lambda m: print("  " + m, flush=True),
                               max_candidates=2 if args.tiny else None)
        tiles = {k: tuple(v) for k, v in rec["tiles"].items()}
        print(f"tune {name}: {rec['seconds']:.1f} s in the tuner, {time.perf_counter() - t0:.1f} s wall: "
              f"{tuner_flash.describe(tiles)}", flush=True)
        ok &= check(dev, tiles, D)
        forms = {}
        for form in ("flash", "batched"):
            ops, b, _ = make(dev, B, T, H, D, form, tiles)
            forms[f"clgpt {form}"] = (lambda ops=ops, b=b: step(ops, B, T, b)), dev.queue.finish
        tf = torch_form(B, T, H, D, args.tiny)
        if tf is not None:
            forms["torch sdpa fp32"] = tf
        times = {k: [] for k in forms}
        for call, sync in forms.values():  # warm-up: builds, caches
            call()
            sync()
        for _ in range(args.rounds):
            for k, (call, sync) in forms.items():
                t1 = time.perf_counter()
                for _ in range(args.reps):
                    call()
                sync()
                times[k].append((time.perf_counter() - t1) / args.reps * 1e3)
        base = statistics.median(times["clgpt batched"])
        flops = 4 * B * H * T * T * D / 2 * 3.5  # causal forward (2 products) + backward (5): the usual count
        print(f"time {name} (B {B}, T {T}, {H} x {D}; forward + backward, median of {args.rounds} rounds of "
              f"{args.reps}, alternated):")
        for k, ts in times.items():
            ms = statistics.median(ts)
            print(f"  {k:18s} {ms:9.3f} ms  {flops / ms / 1e9:7.2f} TFLOP/s  {base / ms:5.2f}x the batched form  "
                  f"(rounds: {', '.join(f'{t:.2f}' for t in ts)})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
