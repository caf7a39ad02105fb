"""kernels/flash.cl's kernels as NVIDIA's OpenCL built them (their PTX), loaded and launched through CUDA (CuPy)
at GPT-2 small's attention (B 8, T 1024, 12 heads of 64): Nsight Compute profiles CUDA launches only, not
OpenCL's. Times each kernel and checks that the forward's output equals OpenCL's own run, bit for bit.

    source bench/gpu_env.sh; python3 bench/flash_cuda.py          (PTX_DIR: where the PTX goes, /tmp)
    REPS=1 ncu --clock-control none -k regex:flash_ --launch-skip 2 --launch-count 6 --set full -o flash \
        python3 bench/flash_cuda.py                                 (forward, dq, dk/dv, each twice)
"""
import os
import re
import sys

import numpy as np
import pyopencl as cl

sys.path.insert(0, os.path.dirname(__file__))
import flash_check as fc  # noqa: E402
import cupy as cp  # noqa: E402

B, T, C, H = 8, 1024, 768, 12
ops = fc.ops_for(B, T, C, H, True)
out_dir = os.environ.get("PTX_DIR", "/tmp")
mods = {}
for name in ("flash_bf16", "flash_forward", "flash_backward_dq", "flash_backward_dkv"):
    prg = ops.k[name].get_info(cl.kernel_info.PROGRAM)
    ptx = prg.get_info(cl.program_info.BINARIES)[0]
    # NVIDIA's OpenCL reads the work's offsets (envreg0, 1: groups; envreg3: items) and get_num_groups(1)
    # (envreg7) from registers its runtime sets; under CUDA: offsets 0 and the grid's own size
    text = ptx.decode(errors="replace").rstrip("\0")
    for reg, value in (("envreg0", "0"), ("envreg1", "0"), ("envreg2", "0"), ("envreg3", "0"), ("envreg4", "0"),
                       ("envreg5", "0"), ("envreg6", "%nctaid.x"), ("envreg7", "%nctaid.y"), ("envreg8", "%nctaid.z")):
        text = re.sub(r"mov\.b32(\s+%r\d+,\s+)%" + reg + r"\b", r"mov.u32\g<1>" + value, text)
    assert "envreg" not in text, sorted(set(re.findall(r"envreg\d+", text)))
    path = f"{out_dir}/{name}.ptx"
    open(path, "w").write(text)
    m = re.search(r"\.entry\s+" + name + r"\s*\((.*?)\)", text, re.S)
    print(name, "params:", re.findall(r"\.param\s+\.(\w+)", m.group(1)) if m else "?",
          "| maxnreg:", re.findall(r"\.maxnreg\s+\d+", text), flush=True)
    mods[name] = cp.RawModule(path=path).get_function(name)

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
    fn()
    cp.cuda.Device().synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    print(f"{name}: {cp.cuda.get_elapsed_time(a, b) / reps * 1e3:.1f} us a launch", flush=True)
# against OpenCL's own run of the same kernels: the forward's output
fc.step(ops, B, T, bufs := fc.bufs(ops, B, T, C, cp.asnumpy(qkv), cp.asnumpy(dout)))
want = fc.get(bufs, "out", (B, T, C))
print("CUDA launch's out equals OpenCL's:", bool(np.array_equal(cp.asnumpy(out).reshape(B, T, C), want)), flush=True)
