"""GEMM sweep on the OpenCL device through Engine.matmul (C = A @ B, NN) at n^2, vs torch.matmul fp32 (no TF32)."""
import os, sys, time
import numpy as np
import pyopencl as cl

sys.path.insert(0, os.getcwd())
from clgpt.device.opencl import get_device
from clgpt.model import ModelConfig, init_params
from clgpt.models.gpt2 import GPT2Engine as Engine
from clgpt.device.knobs import read as read_knobs  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
CONFIGS = [
    "kernel=matmul,TSM=128,TSN=128,TSK=8,WPTM=8,WPTN=8,LDSV=1,PREF=1",
    "kernel=matmul,TSM=128,TSN=128,TSK=16,WPTM=8,WPTN=8,LDSV=1,PREF=1",
    "kernel=matmul,TSM=128,TSN=64,TSK=8,WPTM=8,WPTN=4,LDSV=1,PREF=1",
]
dev = get_device()
print("device:", dev.name, "|", dev.device.platform.name, dev.device.version, flush=True)
rng = np.random.default_rng(0)
A = rng.standard_normal((n, n), dtype=np.float32)
B = rng.standard_normal((n, n), dtype=np.float32)
fl = 2.0 * n ** 3

ref = None
try:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    ta, tb = torch.from_numpy(A).cuda(), torch.from_numpy(B).cuda()
    ref = (ta.double() @ tb.double()).float().cpu().numpy()
    for _ in range(3):
        tc = ta @ tb
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            tc = ta @ tb
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / 10)
    torch_tf = fl / best / 1e12
    print(f"torch.matmul fp32 (allow_tf32=False) {n}^2: {torch_tf:.2f} TFLOP/s", flush=True)
    del ta, tb, tc
except Exception as e:  # noqa: BLE001
    torch_tf = None
    print("torch unavailable:", e)

if ref is None:
    ref = (A.astype(np.float64) @ B).astype(np.float32)
mf = cl.mem_flags
dA = cl.Buffer(dev.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=A)
dB = cl.Buffer(dev.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=B)
dC = cl.Buffer(dev.ctx, mf.READ_WRITE, n * n * 4)
cfg = ModelConfig(vocab_size=64, n_ctx=8, n_embd=16, n_ff=32, n_head=2, n_layer=1)
for spec in CONFIGS:
    os.environ["CLGPT_MATMUL"] = spec
    try:
        eng = Engine(cfg, init_params(cfg, 0), 1, 8, dev, knobs=read_knobs())
        f = lambda: eng.matmul(n, n, n, dA, dB, dC)  # noqa: E731
        f(); dev.queue.finish()
        best = 1e9
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(10):
                f()
            dev.queue.finish()
            best = min(best, (time.perf_counter() - t0) / 10)
        out = np.empty((n, n), np.float32)
        cl.enqueue_copy(dev.queue, out, dC, is_blocking=True)
        err = float(np.abs(out - ref).max() / np.abs(ref).max()) if ref is not None else float("nan")
        tf = fl / best / 1e12
        ratio = f"{tf / torch_tf:.3f}" if torch_tf else "?"
        print(f"{spec}: {tf:.2f} TFLOP/s, {best*1e3:.2f} ms, OpenCL/torch = {ratio}, max rel err {err:.1e}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{spec}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
