"""The bf16 operand copies wgmma reads, made by their producers or together, against the copies made one launch
each (as before): the same bits, fewer launches, and the step time of each, on an NVIDIA sm_90 GPU.

    python bench/bf16_copies.py [--steps 10] [--pairs 3] [--shapes GPT2S GPT2S_L] [--check-only]

"one a launch" is the same engine with the weights' batch cleared (TiledCopies.batch with none) and the norms'
backward asked for no dx copy: the launches every copy took before. gpt2-nobias (model.bias off) is the GPT-2 whose
LayerNorm backward writes dx's copy. Prints, per model:
    check  <model>: losses of 3 steps and the parameters after them bit for bit alike (widths multiples of 64, every
           product on wgmma), to_bf16 launches a step each way
    shape  <shape>: kernel launches and to_bf16 / to_bf16_batch launches a step each way, then ms a step, alternated
           pairs (together, one a launch, ...) in one run, and their medians
and `check: passed` or `check: FAILED`.
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections import Counter

import numpy as np

sys.path.insert(0, os.getcwd())
from clgpt.device.knobs import read as read_knobs  # noqa: E402
from clgpt.device.opencl import get_device  # noqa: E402
from clgpt.model import ModelConfig, init_params  # noqa: E402
from clgpt.models.factory import make_engine  # noqa: E402

CHECKS = {
    "gpt2": dict(arch="gpt2", vocab_size=320, n_ctx=128, n_embd=128, n_ff=512, n_head=2, n_layer=2),
    "gpt2-nobias": dict(arch="gpt2", vocab_size=320, n_ctx=128, n_embd=128, n_ff=512, n_head=2, n_layer=2,
                        bias=False),
    "llama": dict(arch="llama", vocab_size=320, n_ctx=128, n_embd=128, n_ff=384, n_head=2, n_layer=2),
}
SHAPES = {  # bench/gpu_env.sh's
    "GPT2S": (dict(arch="gpt2", vocab_size=50304, n_ctx=1024, n_embd=768, n_ff=3072, n_head=12, n_layer=12), 8),
    "GPT2S_L": (dict(arch="llama", vocab_size=50304, n_ctx=1024, n_embd=768, n_ff=2048, n_head=12, n_layer=12), 8),
    "GPT2M": (dict(arch="gpt2", vocab_size=50304, n_ctx=1024, n_embd=1024, n_ff=4096, n_head=16, n_layer=24), 8),
}


def one_a_launch(eng):
    """eng making each copy with its own launch, as before the batch and the norm-written copies."""
    eng.ops.backend.copies.batch(None, [])
    for name in ("rmsnorm_backward", "layernorm_backward"):
        norm_backward = getattr(eng.ops, name)
        setattr(eng.ops, name, lambda *a, _f=norm_backward, dx_copy=False, **kw: _f(*a, **kw))
    return eng


def step(eng, tok, tgt):
    loss = eng.forward(tok, tgt)
    eng.zero_grad()
    eng.backward()
    eng.step(1e-3)
    return loss


def launches(eng, tok, tgt) -> Counter:
    """Kernel launches of one step by kernel name."""
    launcher, names = eng.ops.launcher, Counter()
    saved = {m: getattr(launcher, m) for m in ("launch", "launch_plain")}

    def counting(fn):
        def wrapped(kern, *a, **kw):
            names[getattr(kern, "function_name", str(kern))] += 1
            return fn(kern, *a, **kw)
        return wrapped

    for m, fn in saved.items():
        setattr(launcher, m, counting(fn))
    try:
        step(eng, tok, tgt)
    finally:
        for m in saved:
            delattr(launcher, m)
    eng.queue.finish()
    return names


def engines(kw, B, knobs):
    cfg = ModelConfig(**kw)
    params = init_params(cfg, 0)
    rng = np.random.default_rng(1)
    tok = rng.integers(0, cfg.vocab_size, (B, cfg.n_ctx)).astype(np.int32)
    tgt = rng.integers(0, cfg.vocab_size, (B, cfg.n_ctx)).astype(np.int32)
    make = lambda: make_engine(cfg, params, batch_size=B, seq_len=cfg.n_ctx, device=dev, precision="bf16",  # noqa: E731
                               knobs=knobs)
    return {"together": make(), "one a launch": one_a_launch(make())}, tok, tgt


def copies(names: Counter) -> str:
    return f"{sum(names.values())} launches, to_bf16 {names['to_bf16']}, to_bf16_batch {names['to_bf16_batch']}"


ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--pairs", type=int, default=3)
ap.add_argument("--shapes", nargs="*", default=["GPT2S", "GPT2S_L"])
ap.add_argument("--check-only", action="store_true")
args = ap.parse_args()
dev = get_device()
print("device:", dev.name, flush=True)
ok = True
knobs = dataclasses.replace(read_knobs(), wgmma_min_mnk=0)  # every product on wgmma
for name, kw in CHECKS.items():
    engs, tok, tgt = engines(kw, 4, knobs)
    losses = {k: [step(e, tok, tgt) for _ in range(3)] for k, e in engs.items()}
    a, b = (e.get_params() for e in engs.values())
    same = losses["together"] == losses["one a launch"] and all(np.array_equal(a[n], b[n]) for n in a)
    ok &= same and engs["together"].ops.wgmma is not None
    print(f"check {name}: wgmma={engs['together'].ops.wgmma is not None} losses {losses['together']}, bit for bit "
          f"alike {same}; " + "; ".join(f"{k}: {copies(launches(e, tok, tgt))}" for k, e in engs.items()), flush=True)
if not args.check_only:
    for shape in args.shapes:
        kw, B = SHAPES[shape]
        engs, tok, tgt = engines(kw, B, read_knobs())
        for k, e in engs.items():
            for _ in range(2):
                step(e, tok, tgt)
            print(f"shape {shape} {k}: {copies(launches(e, tok, tgt))}", flush=True)
        times = {k: [] for k in engs}
        for _ in range(args.pairs):
            for k, e in engs.items():
                e.queue.finish()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(e, tok, tgt)
                e.queue.finish()
                times[k].append((time.perf_counter() - t0) * 1e3 / args.steps)
        print(f"shape {shape}: ms a step, alternated pairs " + "; ".join(
            f"{k} {' '.join(f'{t:.2f}' for t in v)} (median {statistics.median(v):.2f})" for k, v in times.items()),
              flush=True)
        del engs
print("check:", "passed" if ok else "FAILED")
sys.exit(0 if ok else 1)
