"""OpenCL kernels as NVIDIA's OpenCL built them (their PTX), loaded and launched through CUDA (CuPy): Nsight Compute
profiles CUDA launches only, not OpenCL's. bench/flash_cuda.py (flash attention) and bench/wgmma_cuda.py (the wgmma
GEMM) use it."""
import os
import re

# NVIDIA's OpenCL reads the work's offsets (envreg0, 1, 2: groups; envreg3, 4, 5: items) and the group counts
# (envreg6, 7, 8) from registers its runtime sets; under CUDA: offsets 0 and the grid's own size
ENVREGS = (("envreg0", "0"), ("envreg1", "0"), ("envreg2", "0"), ("envreg3", "0"), ("envreg4", "0"), ("envreg5", "0"),
           ("envreg6", "%nctaid.x"), ("envreg7", "%nctaid.y"), ("envreg8", "%nctaid.z"))


def cuda_ptx(text: str) -> str:
    """An OpenCL program's PTX for a CUDA launch: every envreg read replaced by what CUDA gives instead."""
    for reg, value in ENVREGS:
        text = re.sub(r"mov\.b32(\s+%r\d+,\s+)%" + reg + r"\b", r"mov.u32\g<1>" + value, text)
    assert "envreg" not in text, sorted(set(re.findall(r"envreg\d+", text)))
    return text


def cuda_function(kernel, name: str):
    """The CuPy function of the built OpenCL kernel `kernel` (a pyopencl Kernel named `name`) from its program's PTX,
    written to PTX_DIR (/tmp) as NAME.ptx; prints the entry's parameter types and any register cap."""
    import cupy as cp
    import pyopencl as cl

    ptx = kernel.get_info(cl.kernel_info.PROGRAM).get_info(cl.program_info.BINARIES)[0]
    text = cuda_ptx(ptx.decode(errors="replace").rstrip("\0"))
    path = f"{os.environ.get('PTX_DIR', '/tmp')}/{name}.ptx"
    open(path, "w").write(text)
    m = re.search(r"\.entry\s+" + name + r"\s*\((.*?)\)", text, re.S)
    print(name, "params:", re.findall(r"\.param\s+\.(\w+)", m.group(1)) if m else "?",
          "| maxnreg:", re.findall(r"\.maxnreg\s+\d+", text), flush=True)
    return cp.RawModule(path=path).get_function(name)


def us_a_launch(run, reps: int) -> float:
    """Microseconds a call of `run` (a CUDA launch) takes: one call, then reps back to back between two events."""
    import cupy as cp

    run()
    cp.cuda.Device().synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    for _ in range(reps):
        run()
    b.record()
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / reps * 1e3
