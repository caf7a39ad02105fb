"""kernels/matmul_wgmma.cl as NVIDIA's OpenCL built it for sm_90a (its PTX), loaded and launched through CUDA (CuPy,
bench/cuda_ptx.py) on GPT-2 small's products, for Nsight Compute, which profiles CUDA launches only (bench/flash_cuda.py
does the same for flash attention). Times each launch and checks that its output equals OpenCL's own launch, bit for
bit.

    source bench/gpu_env.sh; python3 bench/wgmma_cuda.py           (PTX_DIR: where the PTX goes, /tmp)
    REPS=1 ncu --clock-control none -k regex:matmul_wgmma --set full -o wgmma python3 bench/wgmma_cuda.py
WGMMA_CUDA_SHAPES picks products by name (comma-separated parts of their names); WGMMA_CUDA_TILE=BM,BN,STAGES,PIPE.
"""
import os
import sys

import numpy as np
import pyopencl as cl

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(__file__))
from clgpt.device.opencl import get_device  # noqa: E402
import cupy as cp  # noqa: E402
from cuda_ptx import cuda_function, us_a_launch  # noqa: E402

# name, M, N, K: C (M, N) = A (M, K) @ B (N, K)^T, both K-major (the forward's form)
SHAPES = [("GPT2S proj", 8192, 768, 768), ("GPT2S fc", 8192, 3072, 768), ("GPT2S qkv", 8192, 2304, 768),
          ("GPT2S fc2", 8192, 768, 3072), ("GPT2S head", 8192, 50304, 768)]
if os.environ.get("WGMMA_CUDA_SHAPES"):
    SHAPES = [s for s in SHAPES if any(p in s[0] for p in os.environ["WGMMA_CUDA_SHAPES"].split(","))]
BM, BN, STAGES, PIPE = map(int, os.environ.get("WGMMA_CUDA_TILE", "128,128,3,1").split(","))
reps = int(os.environ.get("REPS", "20"))

dev = get_device()
k = dev.kernel("matmul_wgmma", "matmul_wgmma", BM=BM, BN=BN, STAGES=STAGES, PIPE=PIPE,
               SMEM_BYTES=STAGES * (BM + BN) * 128 + 64)
fn = cuda_function(k, "matmul_wgmma")
i32, f32 = np.int32, np.float32
rng = np.random.default_rng(0)
mf = cl.mem_flags
for name, M, N, K in SHAPES:
    # random bf16 bits in the tiled layout (the values' order does not matter for timing; the check compares
    # the same kernel's two launches)
    A = (rng.integers(0x3c00, 0x3f80, size=M * K) | (rng.integers(0, 2, size=M * K) << 15)).astype(np.uint16)
    B = (rng.integers(0x3c00, 0x3f80, size=N * K) | (rng.integers(0, 2, size=N * K) << 15)).astype(np.uint16)
    a, b, c = cp.asarray(A), cp.asarray(B), cp.zeros(M * N, np.float32)
    grid, block = (-(-N // BN), -(-M // BM)), (2 * BM,)
    args = (i32(M), i32(N), i32(K), a, i32(M), i32(M), b, i32(N), i32(N), c, i32(N), None, None, f32(1.0), None)
    args = tuple(0 if x is None else x for x in args)

    def run():
        fn(grid, block, args, shared_mem=0)
    us = us_a_launch(run, reps)
    # OpenCL's own launch of the same kernel
    ca, cb_ = (cl.Buffer(dev.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=X) for X in (A, B))
    cc = cl.Buffer(dev.ctx, mf.READ_WRITE, M * N * 4)
    k(dev.queue, (grid[0] * block[0], grid[1]), (block[0], 1), i32(M), i32(N), i32(K), ca, i32(M), i32(M), cb_,
      i32(N), i32(N), cc, i32(N), None, None, f32(1.0), None)
    C = np.empty(M * N, np.float32)
    cl.enqueue_copy(dev.queue, C, cc)
    same = bool(np.array_equal(cp.asnumpy(c), C))
    print(f"{name} {M}x{N}x{K} tile {BM}x{BN}/S{STAGES}: {us:.1f} us a launch, "
          f"{2 * M * N * K / us / 1e6:.0f} TFLOP/s; CUDA's output equals OpenCL's: {same}", flush=True)
