"""kernels/flash.cl's kernels as NVIDIA's OpenCL built them (their PTX), loaded and launched through CUDA (CuPy)
at GPT-2 small's attention (B 8, T 1024, 12 heads of 64): Nsight Compute profiles CUDA launches only, not
OpenCL's. Times each kernel and checks that the forward's output equals OpenCL's own run, bit for bit.

    source bench/gpu_env.sh; python3 bench/flash_cuda.py          (PTX_DIR: where the PTX goes, /tmp)
    REPS=1 ncu --clock-control none -k regex:flash_ --launch-skip 2 --launch-count 6 --set full -o flash \
        python3 bench/flash_cuda.py                                 (forward, dq, dk/dv, each twice)
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import flash_check as fc  # noqa: E402
import cupy as cp  # noqa: E402
from cuda_ptx import cuda_function, us_a_launch  # noqa: E402

B, T, C, H = 8, 1024, 768, 12
ops = fc.ops_for(B, T, C, H, True)
mods = {name: cuda_function(ops.k[name], name)
        for name in ("flash_bf16", "flash_forward", "flash_backward_dq", "flash_backward_dkv")}

r = np.random.default_rng(0)
qkv = cp.asarray(r.normal(size=(B, T, 3 * C)).astype(np.float32))
dout = cp.asarray(r.normal(size=(B, T, C)).astype(np.float32))
n_att = ops.att_floats(B, T)
att, datt = cp.zeros(n_att, np.float32), cp.zeros(n_att, np.float32)
out, dqkv = cp.zeros(B * T * C, np.float32), cp.zeros(B * T * 3 * C, np.float32)
i32, u32, f32 = np.int32, np.uint32, np.float32
nq, BH = -(-T // 128), B * H


def copy(src, dst, n):
    n8 = n // 8
    mods["flash_bf16"]((-(-n8 // 256),), (256,), (i32(n8), i32(T), i32(BH), src, dst))


def fwd():
    mods["flash_forward"]((nq, BH), (256,), (i32(T), out, att, u32(0), u32(0), f32(0)))


def dq():
    mods["flash_backward_dq"]((nq, BH), (256,), (i32(T), dout, out, att, datt, dqkv, u32(0), u32(0), f32(0)))


def dkv():
    mods["flash_backward_dkv"]((-(-T // 64), BH), (128,), (i32(T), att, datt, dqkv, u32(0), u32(0), f32(0)))


copy(qkv, att, B * T * 3 * C)
copy(dout, datt, B * T * C)
reps = int(os.environ.get("REPS", "20"))
for name, fn in (("forward", fwd), ("dq", dq), ("dkv", dkv)):
    print(f"{name}: {us_a_launch(fn, reps):.1f} us a launch", flush=True)
# against OpenCL's own run of the same kernels: the forward's output
fc.step(ops, B, T, bufs := fc.bufs(ops, B, T, C, cp.asnumpy(qkv), cp.asnumpy(dout)))
want = fc.get(bufs, "out", (B, T, C))
print("CUDA launch's out equals OpenCL's:", bool(np.array_equal(cp.asnumpy(out).reshape(B, T, C), want)), flush=True)
