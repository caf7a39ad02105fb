"""How much local (shared) memory can one work-group use on NVIDIA's OpenCL? The device reports
CL_DEVICE_LOCAL_MEM_SIZE 49152; Hopper has up to 227 KB a block, which CUDA grants after an opt-in. Tried:
a __local kernel argument (dynamic shared memory) of growing size, and a static __local array whose size is
raised in the program's PTX (clgpt/device/sm90a.py's route). Each run writes every word and reads it back.

    python bench/probe_local_size.py
"""
import re

import numpy as np
import pyopencl as cl

ctx = cl.create_some_context(interactive=False)
q = cl.CommandQueue(ctx)
dev = ctx.devices[0]
print("device:", dev.name, "| CL_DEVICE_LOCAL_MEM_SIZE", dev.local_mem_size)
mf = cl.mem_flags
out = cl.Buffer(ctx, mf.READ_WRITE, 256 * 4)

BODY = r"""
    const uint t = get_local_id(0);
    for (uint i = t; i < n; i += 256) s[i] = i * 2654435761u;
    barrier(CLK_LOCAL_MEM_FENCE);
    uint x = 0;
    for (uint i = t; i < n; i += 256) x += (s[n - 1 - i] == (n - 1 - i) * 2654435761u);
    out[t] = x;
}
"""
DYN = "__kernel void k(__local uint* s, __global uint* out, const uint n) {" + BODY
STATIC = "__kernel void k(__global uint* out, const uint n) {\n    __local uint s[12288];" + BODY


def check(run, n):
    try:
        run()
        got = np.empty(256, np.uint32)
        cl.enqueue_copy(q, got, out)
        q.finish()
        return "ok" if int(got.sum()) == n else f"WRONG ({int(got.sum())} of {n})"
    except Exception as e:
        return "failed: " + str(e).strip().splitlines()[0][:160]


dyn = cl.Program(ctx, DYN).build()
kd = cl.Kernel(dyn, "k")
for kb in (48, 64, 96, 160, 227):
    n = kb * 1024 // 4
    kd.set_args(cl.LocalMemory(n * 4), out, np.uint32(n))
    print(f"dynamic __local argument {kb} KB:", check(lambda: cl.enqueue_nd_range_kernel(q, kd, (256,), (256,)), n))

plain = cl.Program(ctx, STATIC).build()
ptx = plain.get_info(cl.program_info.BINARIES)[0].decode()
print("static array in PTX:", [l.strip() for l in ptx.splitlines() if ".shared" in l][:2])
for kb in (48, 64, 96, 160, 227):
    n = kb * 1024 // 4
    p = re.sub(r"(\.shared\s+\.align\s+\d+\s+\.b8\s+\S+)\[49152\]", rf"\g<1>[{n * 4}]", ptx)
    p = re.sub(r"(\.shared\s+\.align\s+\d+\s+\.b32\s+\S+)\[12288\]", rf"\g<1>[{n}]", p)
    try:
        ks = cl.Kernel(cl.Program(ctx, [dev], [p.encode()]).build(), "k")
    except Exception as e:
        print(f"static array raised to {kb} KB in PTX: build failed:", str(e).strip().splitlines()[-1][:200])
        continue
    ks.set_args(out, np.uint32(n))
    print(f"static array raised to {kb} KB in PTX:", check(lambda: cl.enqueue_nd_range_kernel(q, ks, (256,), (256,)), n))
