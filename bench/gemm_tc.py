"""bf16 GEMM variants on NVIDIA tensor cores against torch.matmul bf16, in one device call (issue 15).

    python bench/gemm_tc.py [--quick]

Times, per tile shape of kernels/matmul_bf16.cl (BM x BN, WM x WN warps, STAGES cp.async stages):
  kernel  the GEMM alone on bf16 operand copies (what torch.matmul bf16 does: bf16 in, fp32 sums)
  full    Ops.matmul from the engine's fp32 buffers (the bf16 copies, and transposes, included)
and Ops.matmul on the previous tensor-core kernel (kernels/matmul_mma.cl, CLGPT_BF16=off), at 4096^2 and at
the training products of M6 (6 layers, 384 ch, B=64, T=256) and L (12 layers, 768 ch, B=16, T=512).
Every result is checked on 64 sampled rows against float64: of the bf16-rounded operands within 1e-5 of
|A||B| (fp32 sums), of the given operands within 2^-7 (bf16). Also prints ptxas's registers and spills.
"""
import os
import sys
import time

import numpy as np
import pyopencl as cl

sys.path.insert(0, os.getcwd())
from clgpt.device.opencl import get_device  # noqa: E402
from clgpt.model import ModelConfig, init_params  # noqa: E402
from clgpt.models import reference as ref  # noqa: E402
from clgpt.models.gpt2 import GPT2Engine  # noqa: E402
from clgpt.ops import ceil_to  # noqa: E402
from clgpt.device.knobs import read as read_knobs  # noqa: E402

dev = get_device()
mf = cl.mem_flags
TINY = ModelConfig(vocab_size=64, n_ctx=8, n_embd=16, n_ff=32, n_head=2, n_layer=1)
LOCAL = dev.device.local_mem_size
print("device:", dev.name, "|", dev.device.platform.name, dev.device.version, "| local memory", LOCAL, flush=True)

CONFIGS = [  # BM, BN, WM, WN, STAGES (16 warps: 512 work-items, registers capped at 128 by the 64K file)
    (128, 128, 2, 4, 3), (256, 128, 4, 4, 2), (128, 256, 4, 4, 2), (128, 256, 2, 8, 2), (256, 128, 8, 2, 2),
    (128, 64, 2, 2, 4), (64, 64, 2, 2, 4),
]
# (name, M, N, K, ta, tb) as the engine calls them (clgpt/models/gpt2.py):
# y = x @ W.T (tb=1), dx = dy @ W, dW = dy.T @ x
SHAPES = [("4096^2 NT", 4096, 4096, 4096, 0, 1), ("4096^2 NN", 4096, 4096, 4096, 0, 0),
          ("M6 qkv", 16384, 1152, 384, 0, 1), ("M6 fc", 16384, 1536, 384, 0, 1), ("M6 proj", 16384, 384, 1536, 0, 1),
          ("M6 dx fc", 16384, 384, 1536, 0, 0), ("M6 dW fc", 1536, 384, 16384, 1, 0),
          ("M6 fc +bias+gelu", 16384, 1536, 384, 0, 1, 1), ("M6 dx gelu'", 16384, 1536, 384, 0, 0, 2),
          ("L qkv", 8192, 2304, 768, 0, 1), ("L fc", 8192, 3072, 768, 0, 1), ("L proj", 8192, 768, 3072, 0, 1),
          ("L lm head", 8192, 8192, 768, 0, 1), ("L dx lm", 8192, 768, 8192, 0, 0), ("L dW fc", 3072, 768, 8192, 1, 0)]
if os.environ.get("GEMM_TC_CONFIGS"):  # e.g. "128,128,2,4,3;64,64,2,2,4"
    CONFIGS = [tuple(int(v) for v in c.split(",")) for c in os.environ["GEMM_TC_CONFIGS"].split(";")]
if "--quick" in sys.argv:
    CONFIGS, SHAPES = CONFIGS[:2], SHAPES[:3]
DRY = os.environ.get("GEMM_TC_DRY")  # a dry run on PoCL (mma emulated, torch on the CPU): the script's own checks
if DRY:
    os.environ.update(CLGPT_LAUNCH="nvidia", CLGPT_MMA_EMULATE="1", CLGPT_MMA="BM=32,BN=32,WM=2,WN=2",
                      CLGPT_MMA_SMALL="BM=32,BN=32,WM=2,WN=2")
    CONFIGS, SHAPES = [(32, 32, 2, 2, 3)], [("dry NT", 40, 70, 50, 0, 1), ("dry TN", 40, 30, 1100, 1, 0),
                                            ("dry gelu", 40, 70, 50, 0, 1, 1), ("dry gelu'", 40, 70, 50, 0, 0, 2)]


def spec(c):
    return "BM=%d,BN=%d,WM=%d,WN=%d,STAGES=%d" % c


def engine(bf16):
    os.environ["CLGPT_BF16"] = bf16
    os.environ["CLGPT_BF16_SMALL"] = bf16 if bf16 != "off" else ""
    return GPT2Engine(TINY, init_params(TINY, 0), 1, 8, dev, precision="bf16", knobs=read_knobs())


def best(fn, sync, reps=10, rounds=3):
    fn()
    sync()
    t = 1e9
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        t = min(t, (time.perf_counter() - t0) / reps)
    return t


def main():
    import torch

    os.environ["CLGPT_NV_VERBOSE"] = "1"
    rng = np.random.default_rng(0)
    probe = engine(spec(CONFIGS[0]))
    print("bf16 path:", probe.ops.bf16 is not None, "options", probe.ops.bf16_options, flush=True)
    summary = {}
    for name, M, N, K, ta, tb, *epi in SHAPES:
        epi = epi[0] if epi else 0
        A = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32)
        B = rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
        fl = 2.0 * M * N * K
        # torch: bf16 tensors in the same layout
        cuda = torch.cuda.is_available()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        tA, tB = torch.from_numpy(A).to("cuda" if cuda else "cpu").bfloat16(), torch.from_numpy(B).to("cuda" if cuda else "cpu").bfloat16()
        opa = tA.t() if ta else tA
        opb = tB.t() if tb else tB
        t_torch = best(lambda: torch.matmul(opa, opb), sync)
        del tA, tB, opa, opb
        if cuda:
            torch.cuda.empty_cache()
        print(f"== {name} {M}x{N}x{K} ta={ta} tb={tb}: torch.matmul bf16 {fl / t_torch / 1e12:.1f} TFLOP/s "
              f"({t_torch * 1e3:.3f} ms)", flush=True)
        rows = np.sort(rng.choice(M, size=min(64, M), replace=False))
        opA, opB = (A.T if ta else A), (B.T if tb else B)
        rA, rB = ref.ROUNDERS["bf16"](opA[rows]).astype(np.float64), ref.ROUNDERS["bf16"](opB).astype(np.float64)
        want_r = rA @ rB
        want_g = opA[rows].astype(np.float64) @ opB.astype(np.float64)
        scale = np.abs(rA) @ np.abs(rB)
        dA, dB, dC = (cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=A),
                      cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=B),
                      cl.Buffer(dev.ctx, mf.READ_WRITE, M * N * 4))
        # epilogues: a zero bias (C = the product; E = gelu(C)), or E = 0 (gelu'(0) = 0.5: C = half the product)
        dE = cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.zeros(M * N if epi else 1, np.float32))
        dbias = cl.Buffer(dev.ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.zeros(N, np.float32)) if epi == 1 else None
        if epi == 2:
            want_r, want_g = 0.5 * want_r, 0.5 * want_g

        def check(what):
            out = np.empty((M, N), np.float32)
            cl.enqueue_copy(dev.queue, out, dC, is_blocking=True)
            e_r = (np.abs(out[rows] - want_r) / scale).max()
            e_g = (np.abs(out[rows] - want_g) / scale).max()
            ok = e_r < 1e-5 and e_g < 2.0**-7
            return f"err {e_r:.1e} / {e_g:.1e} {'ok' if ok else 'FAIL'}", ok

        for c in CONFIGS + ["off"]:
            if c != "off" and c[4] * (c[0] + c[1]) * 64 > LOCAL:
                continue
            try:
                eng = engine(spec(c) if c != "off" else "off")
                ops = eng.ops
                cl.enqueue_fill_buffer(dev.queue, dC, np.float32(0), 0, M * N * 4)
                t_full = best(lambda: ops.matmul_epi(M, N, K, dA, dB, dC, ta=ta, tb=tb, bias=dbias, epi=epi, E=dE),
                              dev.queue.finish)
                msg_full, ok = check("full")
                line = f"  {spec(c) if c != 'off' else 'matmul_mma.cl (before)':32s} full {fl / t_full / 1e12:6.1f} TFLOP/s " \
                       f"= {t_torch / t_full:.3f}x torch, {msg_full}"
                if c != "off":
                    mm = dict(kernel="matmul_bf16", BM=c[0], BN=c[1], WM=c[2], WN=c[3], STAGES=c[4])
                    args = ops.bf16_operands(mm, M, N, K, dA, dB, ta, tb)
                    t_k = best(lambda: ops.matmul_bf16(mm, M, N, *args, dC, bias=dbias, epi=epi, E=dE),
                               dev.queue.finish)
                    msg_k, ok_k = check("kernel")
                    t_conv = best(lambda: ops.bf16_operands(mm, M, N, K, dA, dB, ta, tb), dev.queue.finish)
                    line += f" | kernel {fl / t_k / 1e12:6.1f} TFLOP/s = {t_torch / t_k:.3f}x torch, {msg_k}" \
                            f" | copies {t_conv * 1e3:.3f} ms"
                    if ok and ok_k:
                        summary.setdefault(c, []).append((name, t_torch / t_k, t_torch / t_full))
                print(line, flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  {c}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
    seen = set()
    for (stem, opts), prg in dev._programs.items():  # ptxas's report (-cl-nv-verbose)
        if stem != "matmul_bf16" or "-cl-nv-verbose" not in opts:
            continue
        log = prg.get_build_info(dev.device, cl.program_build_info.LOG)
        lines = " | ".join(x.strip() for x in log.splitlines() if "Used" in x and "matmul_bf16" not in x
                           and "smem" in x and "260 bytes" not in x)
        tag = " ".join(o for o in opts if o.split("=")[0] in ("-DBM", "-DBN", "-DWM", "-DWN", "-DSTAGES", "-DSPLITK",
                                                              "-DEPI", "-DAKC", "-DBKC", "-DBIAS"))
        if tag not in seen:
            seen.add(tag)
            kern = cl.Kernel(prg, "matmul_bf16")
            wg = {k: kern.get_work_group_info(getattr(cl.kernel_work_group_info, k), dev.device)
                  for k in ("WORK_GROUP_SIZE", "LOCAL_MEM_SIZE", "PRIVATE_MEM_SIZE")}
            print(f"ptxas {tag}: {lines[:400]} | {wg}")
            if len(seen) == 1:
                try:
                    ptx = prg.get_info(cl.program_info.BINARIES)[0].decode(errors="replace")
                    print("  PTX:", ptx.count("ldmatrix"), "ldmatrix,", ptx.count("cp.async.cg"), "cp.async,",
                          ptx.count("mma.sync"), "mma.sync,", ptx.count("ld.local") + ptx.count("st.local"),
                          "local (stack) accesses;", [x for x in ptx.splitlines() if x.startswith(".version")
                                                      or x.startswith(".target")])
                except Exception as e:  # noqa: BLE001
                    print("  PTX not read:", e)
    print("== summary (kernel / full vs torch.matmul bf16, geometric mean over shapes)")
    best_c = max(summary, key=lambda c: (len(summary[c]), np.mean([np.log(x[2]) for x in summary[c]])), default=None)
    if best_c and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "best_bf16.txt"), "w") as f:
            f.write(spec(best_c))
    print("fastest (full, all shapes passing):", best_c and spec(best_c))
    for c, v in summary.items():
        gk = np.exp(np.mean([np.log(x[1]) for x in v]))
        gf = np.exp(np.mean([np.log(x[2]) for x in v]))
        big = [x for x in v if x[0].startswith("4096")]
        print(f"  {spec(c)}: {len(v)} shapes, kernel {gk:.3f}x, full {gf:.3f}x; 4096^2: "
              + ", ".join(f"{x[0]} kernel {x[1]:.3f}x full {x[2]:.3f}x" for x in big))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"[gemm_tc: {time.perf_counter() - t0:.1f} s]")
