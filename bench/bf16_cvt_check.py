"""Does the hardware's bf16 rounding (kernels/precision.cl BF16_CVT: cvt.rn.bf16x2.f32) give the same bits as the
integer form every other build uses (bf16_bits: round to nearest even)? Every one of the 2^32 float patterns is
rounded both ways on the device, as the low and as the high half of a pair; a float that is not NaN must come out
the same, a NaN as a NaN. Prints the counts and the first pattern that differs; exits 1 on any difference.

    source bench/gpu_env.sh; python3 bench/bf16_cvt_check.py        (an NVIDIA device: PYOPENCL_CTX picks it)
"""
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyopencl as cl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from clgpt.device.opencl import kernel_source  # noqa: E402

SRC = r"""
#include "precision.cl"
inline int is_nan(const uint u) { return (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu); }
// patterns base + i, each as the low half beside its sign-flipped self as the high half (so each is also a high half)
__kernel void check(const uint base, __global uint* counts, __global uint* first)
{
    const uint u = base + (uint)get_global_id(0), v = u ^ 0x80000000u;
    const uint hw = bf16x2(as_float(u), as_float(v));
    const uint sw = bf16_bits(as_float(u)) | (bf16_bits(as_float(v)) << 16);
    if (is_nan(u)) {  // NaN in, NaN out (the payload may differ)
        const uint h = hw & 0xFFFFu;
        if (!((h & 0x7F80u) == 0x7F80u && (h & 0x7Fu))) { atomic_inc(counts + 1); atomic_min(first + 1, u); }
        return;
    }
    if (hw != sw) { atomic_inc(counts); atomic_min(first, u); }
}
"""


def main() -> int:
    ctx = cl.create_some_context(interactive=False)
    dev = ctx.devices[0]
    print("device:", dev.name, dev.driver_version)
    with tempfile.TemporaryDirectory() as tmp:  # the includes come from kernels/, wherever the file is
        path = Path(tmp) / "bf16_cvt_check.cl"
        path.write_text(SRC)
        src = kernel_source(path)
    # elsewhere (a dry run on a CPU) the integer form against itself
    nvidia = "nvidia" in dev.platform.name.lower()
    prg = cl.Program(ctx, src).build(options=["-D", f"BF16_CVT={int(nvidia)}"])
    q = cl.CommandQueue(ctx)
    counts = np.zeros(2, np.uint32)
    first = np.full(2, 0xFFFFFFFF, np.uint32)
    dc = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=counts)
    df = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=first)
    chunk = 1 << 28 if nvidia else 1 << 20  # a CPU: the first 2^24 patterns
    check = cl.Kernel(prg, "check")
    for c in range(1 << 4):
        check(q, (chunk,), None, np.uint32(c * chunk), dc, df)
    cl.enqueue_copy(q, counts, dc)
    cl.enqueue_copy(q, first, df)
    print(f"{16 * chunk} patterns: {counts[0]} non-NaN floats rounded otherwise (first {first[0]:#010x}), "
          f"{counts[1]} NaN not kept NaN (first {first[1]:#010x})")
    return 1 if counts.any() else 0


if __name__ == "__main__":
    sys.exit(main())
