"""The GPU row kernels' sub-group forms against their local-memory forms on one OpenCL device, in one process,
alternated by rounds (local, then each sub-group size the device offers):

    python3 bench/subgroup_rows.py [--device intel] [--shape M] [--rounds 7] [--reps 20]

Kernels at one training step's shapes (--shape: N = batch x ctx rows of C channels, B x H x T softmax rows, N
cross-entropy rows of V logits): LayerNorm's 32-wide row slices forward and backward (kernels/layernorm.cl *_rows,
RW 4), batched attention's softmax and its backward (kernels/attention.cl), cross-entropy's forward
(kernels/xent.cl xent_forward_wg), each a work-group of the GPU row's 128 work-items (clgpt/device/tuning.py) where
not a row slice. Each round launches every kernel --reps times per form and waits; prints per kernel and form the
median over rounds of a launch's time and its ratio to the local form's. Sizes come from clgpt/device/capabilities.py
(the sizes the device builds, each checked by its probe); a device with none prints that and stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # (B, T, C, H, V): the README's shape M, nanoGPT's GPU baby GPT (M6); C % 128 == 0 for the row slices
    "M": (8, 256, 256, 4, 4096),
    "M6": (64, 256, 384, 6, 4096),
}
LW, RW = 128, 4


def launches(dev, shape: str, sg: dict):
    """[(kernel name, a function launching it once)] with build options sg ({} local memory, {SUBGROUP: n})."""
    import pyopencl as cl

    B, T, C, H, V = SHAPES[shape]
    N, R = B * T, B * H * T
    rng = np.random.default_rng(0)
    mf = cl.mem_flags

    def buf(a):
        return cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a, np.float32))

    i32 = np.int32
    x, w, b, dout, dx = (buf(rng.normal(size=n)) for n in (N * C, C, C, N * C, N * C))
    out, mean, rstd = buf(np.zeros(N * C)), buf(np.zeros(N)), buf(np.ones(N))
    rpi = max(1, N // (RW * 512))
    P = -(-N // (RW * rpi))
    part = buf(np.zeros(2 * P * C))
    att, datt = buf(rng.normal(size=R * T)), buf(rng.normal(size=R * T))
    logits = buf(rng.normal(size=N * V) * 4)
    targets = cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=rng.integers(0, V, N).astype(np.int32))
    mask, losses, lse = buf(np.ones(N)), buf(np.zeros(N)), buf(np.zeros(N))
    ln = dict(C=C, EPS=1e-5, RW=RW, **(sg if 32 % sg.get("SUBGROUP", 32) == 0 else {}))
    at = dict(C=C, H=H, D=C // H, SCALE=1.0, VEC=0, LW=LW, **sg)
    q = dev.queue
    k = {name: dev.kernel(file, name, **kw) for file, name, kw in (
        ("layernorm", "layernorm_forward_rows", ln), ("layernorm", "layernorm_backward_rows", ln),
        ("attention", "attention_softmax", at), ("attention", "attention_dsoftmax", at),
        ("xent", "xent_forward_wg", dict(V=V, LW=LW, **sg)))}
    return [
        ("layernorm_forward_rows", lambda: k["layernorm_forward_rows"](q, (32, -(-N // RW) * RW), (32, RW), i32(N), x,
                                                                       w, b, out, mean, rstd)),
        ("layernorm_backward_rows", lambda: k["layernorm_backward_rows"](q, (32, P * RW), (32, RW), i32(N), i32(rpi),
                                                                         i32(0), dout, x, w, mean, rstd, dx, part)),
        ("attention_softmax", lambda: k["attention_softmax"](q, (R * LW,), (LW,), i32(T), att)),
        ("attention_dsoftmax", lambda: k["attention_dsoftmax"](q, (R * LW,), (LW,), i32(T), att, datt)),
        ("xent_forward_wg", lambda: k["xent_forward_wg"](q, (N * LW,), (LW,), i32(N), logits, targets, mask, losses,
                                                         lse)),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="the OpenCL device (default: clgpt's choice)")
    ap.add_argument("--shape", default="M", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=7, help="alternated rounds (local, then each sub-group size)")
    ap.add_argument("--reps", type=int, default=20, help="launches of each kernel a round")
    args = ap.parse_args(argv)
    from clgpt.device.capabilities import subgroup_sizes
    from clgpt.device.opencl import get_device

    dev = get_device(args.device)
    sizes, fixed = subgroup_sizes(dev.device)
    print(f"{dev.name} ({dev.device.platform.name.strip()}): sub-group sizes {sizes or 'none'}"
          f"{' fixed at build time' if fixed else ''}; shape {args.shape} {SHAPES[args.shape]} (B, T, C, H, V)")
    if not sizes:
        return 0
    forms = {"local": {}} | {f"sub-group {n or 'auto'}": {"SUBGROUP": n if fixed else 0} for n in sizes}
    runs = {form: launches(dev, args.shape, sg) for form, sg in forms.items()}
    times = {(form, name): [] for form in forms for name, _ in runs[form]}
    for form in forms:  # warm-up: builds, first launches
        for _, fn in runs[form]:
            fn()
    dev.queue.finish()
    for _ in range(args.rounds):
        for form in forms:
            for name, fn in runs[form]:
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    fn()
                dev.queue.finish()
                times[(form, name)].append((time.perf_counter() - t0) / args.reps)
    names = [name for name, _ in runs["local"]]
    print(f"{'kernel':26s}" + "".join(f"{form:>22s}" for form in forms))
    for name in names:
        base = statistics.median(times[("local", name)])
        med = {f: statistics.median(times[(f, name)]) for f in forms}
        cells = [f"{med[f] * 1e6:9.1f} us {med[f] / base:5.2f}x" for f in forms]
        print(f"{name:26s}" + "".join(f"{c:>22s}" for c in cells))
    total = {f: sum(statistics.median(times[(f, n)]) for n in names) for f in forms}
    cells = [f"{total[f] * 1e6:9.1f} us {total[f] / total['local']:5.2f}x" for f in forms]
    print(f"{'all five':26s}" + "".join(f"{c:>22s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
