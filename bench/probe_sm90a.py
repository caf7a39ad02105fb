"""Can NVIDIA's OpenCL run Hopper's wgmma? Its compiler emits PTX for `.target sm_90`, where wgmma does not
exist (it needs sm_90a), and ptxas rejects the instruction at build time. Ways tried, in order:

1. `-cl-nv-arch sm_90a` on clBuildProgram with the wgmma in inline asm;
2. the program's own PTX (its "binary" on NVIDIA), retargeted to sm_90a and loaded with clCreateProgramWithBinary;
3. the same, with the wgmma written as a PTX comment that names its operands (the compiler fills in the
   registers) and turned into the instruction in the PTX text, so that the front end never sees it.

Then one warpgroup multiplies A (64x16 bf16, registers) by B (16x8 bf16, local memory through a matrix
descriptor) with wgmma.mma_async m64n8k16, checked against float64. Prints what worked.

    python bench/probe_sm90a.py        # on an NVIDIA sm_90 device (PYOPENCL_CTX picks it)
"""
import re

import numpy as np
import pyopencl as cl

ctx = cl.create_some_context(interactive=False)
q = cl.CommandQueue(ctx)
dev = ctx.devices[0]
print("device:", dev.name, dev.version, dev.driver_version)

WGMMA = ("{ .reg .pred p; setp.ne.b32 p, %9, 0;\n"
         "wgmma.fence.sync.aligned;\n"
         "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n"
         "wgmma.commit_group.sync.aligned;\n"
         "wgmma.wait_group.sync.aligned 0; }")

SRC = r"""
// A: 64x16 bf16 (ushort) row-major; B: 8x16 bf16, row n holds B[:, n] (k contiguous); D: 64x8 float.
__kernel __attribute__((reqd_work_group_size(128, 1, 1)))
void wg(__global const ushort *A, __global const ushort *B, __global float *D, ulong lbo, ulong sbo) {
    __local ushort Bs[128] __attribute__((aligned(256)));
    int tid = get_local_id(0), warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    // canonical no-swizzle layout: core matrix c (k 8c..8c+7) of 8 rows (n) x 16 bytes, 128 bytes each
    if (tid < 128) { int n = tid >> 4, k = tid & 15; Bs[(k >> 3) * 64 + n * 8 + (k & 7)] = B[n * 16 + k]; }
    barrier(CLK_LOCAL_MEM_FENCE);
    PROXY_FENCE
    int r = warp * 16 + g;
    uint a0 = A[r * 16 + 2 * t] | ((uint)A[r * 16 + 2 * t + 1] << 16);
    uint a1 = A[(r + 8) * 16 + 2 * t] | ((uint)A[(r + 8) * 16 + 2 * t + 1] << 16);
    uint a2 = A[r * 16 + 2 * t + 8] | ((uint)A[r * 16 + 2 * t + 9] << 16);
    uint a3 = A[(r + 8) * 16 + 2 * t + 8] | ((uint)A[(r + 8) * 16 + 2 * t + 9] << 16);
    ulong addr = (ulong)(size_t)Bs;
    ulong desc = ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32);
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    uint scale_d = 0;
    asm volatile(ASM : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d) : "memory");
    D[r * 8 + 2 * t] = d0; D[r * 8 + 2 * t + 1] = d1; D[(r + 8) * 8 + 2 * t] = d2; D[(r + 8) * 8 + 2 * t + 1] = d3;
}
"""


def source(asm: str, fence: str) -> str:
    return SRC.replace("ASM", '"' + asm.replace("\n", "\\n") + '"').replace("PROXY_FENCE", fence)


REAL = source(WGMMA, 'asm volatile("fence.proxy.async.shared::cta;" ::: "memory");')
COMMENT = source("// @WGMMA@ %0 %1 %2 %3 %4 %5 %6 %7 %8 %9", 'asm volatile("// @FENCE@" ::: "memory");')


def patch(ptx: str) -> str:
    """Retarget the PTX to sm_90a and turn the comments into the instructions they stand for."""
    ptx = re.sub(r"\.target\s+sm_90\b", ".target sm_90a", ptx)
    ptx = ptx.replace("// @FENCE@", "fence.proxy.async.shared::cta;")

    def inst(m):
        ops = m.group(1).split()
        body = WGMMA
        for i in reversed(range(10)):
            body = body.replace(f"%{i}", ops[i])
        return body
    return re.sub(r"// @WGMMA@ ((?:%\w+ ?){10})", inst, ptx)


def from_ptx(ptx: str):
    return cl.Program(ctx, [dev], [ptx.encode()]).build()


rng = np.random.default_rng(0)
Af = rng.standard_normal((64, 16)).astype(np.float32)
Bf = rng.standard_normal((16, 8)).astype(np.float32)
bf = lambda x: (x.view(np.uint32) >> 16).astype(np.uint16)  # truncate to bf16 (exact for the check below)
A16, B16 = bf(Af), bf(np.ascontiguousarray(Bf.T))
ref = (A16.astype(np.uint32) << 16).view(np.float32).astype(np.float64) @ \
      (B16.astype(np.uint32) << 16).view(np.float32).astype(np.float64).T
mf = cl.mem_flags
a = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=A16)
b = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=B16)
d = cl.Buffer(ctx, mf.WRITE_ONLY, 64 * 8 * 4)


def run(prg, name):
    for lbo, sbo in ((128, 256),):  # LBO: bytes to the next core matrix along k (256 reads past Bs and faults)
        D = np.zeros((64, 8), np.float32)
        prg.wg(q, (128,), (128,), a, b, d, np.uint64(lbo), np.uint64(sbo))
        cl.enqueue_copy(q, D, d)
        q.finish()
        err = float(np.abs(D - ref).max() / np.abs(ref).max())
        print(f"{name}: lbo {lbo} sbo {sbo}: max rel err vs float64 {err:.2e}", "OK" if err < 1e-5 else "WRONG")


ways = []
try:
    ways.append(("1 -cl-nv-arch sm_90a", cl.Program(ctx, REAL).build(options="-cl-nv-arch sm_90a")))
except Exception as e:
    print("1 -cl-nv-arch sm_90a: build failed:", " / ".join(l for l in str(e).splitlines() if "error" in l)[:600])
plain = cl.Program(ctx, COMMENT).build()
ptx = plain.binaries[0].decode(errors="replace")
print("own PTX header:", " | ".join(l for l in ptx.splitlines() if l.startswith((".version", ".target", ".address"))))
print("comment in PTX:", [l.strip() for l in ptx.splitlines() if "@WGMMA@" in l][:1])
try:
    ways.append(("2 retargeted sm_90a, no wgmma", from_ptx(re.sub(r"\.target\s+sm_90\b", ".target sm_90a", ptx))))
    print("2 retargeted PTX builds")
except Exception as e:
    print("2 retargeted PTX: build failed:", str(e)[-600:])
try:
    prg3 = from_ptx(patch(ptx))
    ways.append(("3 patched wgmma", prg3))
    print("3 patched PTX builds")
except Exception as e:
    print("3 patched PTX: build failed:", str(e)[-1500:])
    print(patch(ptx)[-3000:])
for name, prg in ways:
    if name.startswith("2"):
        continue
    try:
        run(prg, name)
    except Exception as e:
        print(name, "run failed:", str(e)[:300])
