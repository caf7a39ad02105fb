"""The wgmma GEMM (kernels/matmul_wgmma.cl, sm_90a through clgpt/device/sm90a.py) against torch.matmul bf16, in one
process on an H100/H200 (issue 15): the kernel alone, on operands already in its tiled layout (as torch.matmul
gets bf16 tensors); bench/gemm_tc.py times the engine's whole product (copies included).

    python bench/gemm_wgmma.py            # PYOPENCL_CTX picks the NVIDIA device

C = A @ B^T with bf16 A (M,K) and B (N,K), k-contiguous (the engine's forward products y = x W^T), fp32 sums.
Every result is checked on 64 sampled rows against float64 of the bf16 operands (within 1e-5 of |A||B|).
TFLOP/s are the best of 3 rounds of 20 back-to-back launches.
"""
import os
import sys
import time

import numpy as np
import pyopencl as cl

sys.path.insert(0, os.getcwd())
from clgpt.device.opencl import get_device  # noqa: E402

dev = get_device()
mf = cl.mem_flags
print("device:", dev.name, flush=True)
KEYS = ("BM", "BN", "STAGES", "PIPE", "TILE_BAND")  # TILE_BAND optional (0)
VARIANTS = "128,256,4,1;128,256,3,1;128,256,4,0;256,128,4,1;128,128,4,1"
if os.environ.get("WGMMA_VARIANTS"):  # e.g. "128,256,4,1;128,128,4,1": KEYS
    VARIANTS = os.environ["WGMMA_VARIANTS"]
VARIANTS = [dict(zip(KEYS, map(int, c.split(",")))) for c in VARIANTS.split(";")]
SHAPES = [("4096^2 NT", 4096, 4096, 4096), ("M6 qkv", 16384, 1152, 384), ("M6 fc", 16384, 1536, 384),
          ("M6 proj", 16384, 384, 1536), ("L qkv", 8192, 2304, 768), ("L fc", 8192, 3072, 768),
          ("L proj", 8192, 768, 3072), ("L lm head", 8192, 8192, 768), ("GPT2S attn proj", 8192, 768, 768),
          ("GPT2S head", 8192, 50304, 768)]
SHAPES = SHAPES[:int(os.environ.get("WGMMA_SHAPES", len(SHAPES)))]  # the first few
if os.environ.get("WGMMA_PICK"):  # e.g. "L fc,GPT2S": the shapes whose names hold one of these
    SHAPES = [s for s in SHAPES if any(p in s[0] for p in os.environ["WGMMA_PICK"].split(","))]


def bf16(x):
    """Round float32 to bf16 bits (nearest even), as kernels/precision.cl does."""
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def best(fn, sync, reps=20, rounds=3):
    fn()
    sync()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        times.append((time.perf_counter() - t) / reps)
    return min(times)


def main():
    import torch

    q = dev.queue
    rng = np.random.default_rng(0)
    rows = []
    for name, M, N, K in SHAPES:
        A = bf16(rng.standard_normal((M, K)).astype(np.float32))
        B = bf16(rng.standard_normal((N, K)).astype(np.float32))
        a = cl.Buffer(dev.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=A)
        b = cl.Buffer(dev.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=B)
        c = cl.Buffer(dev.ctx, mf.READ_WRITE, M * N * 4)
        Af = (A.astype(np.uint32) << 16).view(np.float32)
        Bf = (B.astype(np.uint32) << 16).view(np.float32)
        pick = rng.choice(M, 64, replace=False)
        want = Af[pick].astype(np.float64) @ Bf.astype(np.float64).T
        scale = np.abs(Af[pick]).astype(np.float64) @ np.abs(Bf).astype(np.float64).T
        flops = 2.0 * M * N * K
        tiles = {}

        def tiled(X):
            """X (R, K) as kernels/matmul_wgmma.cl reads it (matmul_bf16.cl's to_bf16 with TILED 1 writes it):
            K/64 x R/8 atoms of 8 rows x 64 k, row r's 16-byte chunk c at c ^ r."""
            if id(X) not in tiles:
                R = X.shape[0]
                r = np.arange(8)[:, None]
                T = X.reshape(R // 8, 8, K // 64, 8, 8).transpose(2, 0, 1, 3, 4)[:, :, r, r ^ np.arange(8)[None, :], :]
                tiles[id(X)] = cl.Buffer(dev.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(T))
            return tiles[id(X)]

        ta = torch.from_numpy(Af).cuda().to(torch.bfloat16)
        tb = torch.from_numpy(Bf).cuda().to(torch.bfloat16)
        t_torch = best(lambda: ta @ tb.T, torch.cuda.synchronize)
        line = [f"{name} {M}x{N}x{K}", f"torch {flops / t_torch / 1e12:6.1f}"]
        for v in VARIANTS:
            band = f"b{v['TILE_BAND']}" if v.get("TILE_BAND") else ""
            tag = f"{v['BM']}x{v['BN']}/S{v['STAGES']}{'p' if v['PIPE'] else ''}{band}"
            if M % v["BM"]:
                line.append(f"{tag} -")
                continue
            try:
                k = dev.kernel("matmul_wgmma", "matmul_wgmma", **v, SMEM_BYTES=v["STAGES"] * (v["BM"] + v["BN"]) * 128 + 64)
            except Exception as e:
                line.append(f"{tag} build failed: {str(e).strip().splitlines()[-1][:200]}")
                continue
            k.set_args(np.int32(M), np.int32(N), np.int32(K), tiled(A), np.int32(M), np.int32(M), tiled(B),
                       np.int32(N), np.int32(N), c, np.int32(N), None, None, np.float32(1.0), None)
            nt = 2 * v["BM"]
            run = lambda: cl.enqueue_nd_range_kernel(q, k, (-(-N // v["BN"]) * nt, M // v["BM"]), (nt, 1))
            try:
                run()
                C = np.empty((M, N), np.float32)
                cl.enqueue_copy(q, C, c)
                q.finish()
            except cl.Error as e:
                line.append(f"{tag} launch failed: {str(e).strip()[:200]}")
                continue
            err = float(np.max(np.abs(C[pick] - want) / (scale + 1e-30)))
            t = best(run, q.finish)
            ok = "ok" if err < 1e-5 else f"WRONG {err:.1e}"
            line.append(f"{tag} {flops / t / 1e12:6.1f} ({t_torch / t:.3f}x, {ok})")
        print(" | ".join(line), flush=True)
        rows.append(line)


if __name__ == "__main__":
    main()
