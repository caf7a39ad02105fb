"""Hopper's sm_90a instructions (wgmma) from OpenCL C, and other edits of an NVIDIA program's PTX (a register cap).

NVIDIA's OpenCL compiles to PTX for `.target sm_90`, where wgmma does not exist, and ptxas rejects it when the
program is built (also with -cl-nv-arch sm_90a). A program's binary on NVIDIA is its PTX text, though, and the
driver builds PTX for sm_90a from a binary. So a kernel writes each such instruction as a PTX comment,
`asm volatile("// @sm90a@ wgmma... %0, %1 ...;" : operands)`: the compiler fills in the operands' registers as
it does for any inline asm and passes the comment through; `retarget` then turns the PTX's target to sm_90a,
drops the marks and builds the result from binary. bench/probe_sm90a.py is the smallest proof (a 64x16x8
product); kernels/matmul_wgmma.cl the GEMM.
"""

from __future__ import annotations

import re

import pyopencl as cl

from clgpt.device import knobs
from clgpt.errors import ClgptError

MARK = "// @sm90a@ "


def patch_ptx(ptx: str, smem_bytes: int | None = None) -> str:
    """The PTX text for sm_90a: target sm_90 -> sm_90a, MARK comments -> the instructions they carry, and with
    smem_bytes the local array named `smem` that size and 1024-aligned (wgmma's swizzle atoms)."""
    ptx, n = re.subn(r"^(\s*\.target\s+)sm_90\b", r"\1sm_90a", ptx, flags=re.M)
    if n != 1:
        raise ClgptError("sm90a: the program's PTX names no .target sm_90 (not an sm_90 device?)")
    if smem_bytes:
        ptx, n = re.subn(r"\.shared\s+\.align\s+\d+\s+\.b8\s+(\S*smem)\[\d+\]",
                         rf".shared .align 1024 .b8 \g<1>[{int(smem_bytes)}]", ptx)
        if n != 1:
            raise ClgptError("sm90a: no local array named smem in the PTX to give SMEM_BYTES")
    return ptx.replace(MARK, "")


def build_ptx(ctx: cl.Context, device: cl.Device, ptx: str) -> cl.Program:
    """A program built from PTX text (an NVIDIA program's binary); under CLGPT_SM90A_VERBOSE it prints ptxas's
    report (registers, spills, wgmma warnings)."""
    verbose = knobs.read().sm90a_verbose
    out = cl.Program(ctx, [device], [ptx.encode()]).build(options=["-cl-nv-verbose"] if verbose else [])
    if verbose:
        print(out.get_build_info(device, cl.program_build_info.LOG), flush=True)
    return out


def retarget(ctx: cl.Context, device: cl.Device, prg: cl.Program, smem_bytes: int | None = None) -> cl.Program:
    """The built program `prg` (whose source carries MARK comments) rebuilt for sm_90a from its own PTX.

    smem_bytes: the size of the kernel's local array named `smem`. OpenCL C may declare at most 48 KB
    (CL_DEVICE_LOCAL_MEM_SIZE); Hopper gives a block up to 227 KB, and a larger static array in the PTX runs
    (bench/probe_local_size.py), so the kernel declares 48 KB and its PTX array is set to smem_bytes."""
    return build_ptx(ctx, device, patch_ptx(prg.get_info(cl.program_info.BINARIES)[0].decode(), smem_bytes))


def cap_ptx(ptx: str, maxnreg: int) -> str:
    """The PTX text with `.maxnreg maxnreg` after every kernel entry's parameter list."""
    ptx, n = re.subn(r"(\.entry\s+\w+\s*\([^)]*\))", rf"\1\n.maxnreg {int(maxnreg)}", ptx)
    if not n:
        raise ClgptError("cap_registers: the program's binary holds no PTX .entry (not an NVIDIA device?)")
    return ptx


def cap_registers(ctx: cl.Context, device: cl.Device, prg: cl.Program, maxnreg: int) -> cl.Program:
    """The built program `prg` rebuilt from its PTX (an NVIDIA program's binary) with at most maxnreg registers
    a work-item in every kernel. NVIDIA's OpenCL takes no register cap among its build options, and a 256-item
    work-group just over 128 registers a work-item runs alone on its multiprocessor where the cap lets two share
    it (flash attention's forward and dq: 129 and 132 registers; at 128, forward + backward 7% faster at T 1024,
    the same bits)."""
    return build_ptx(ctx, device, cap_ptx(prg.get_info(cl.program_info.BINARIES)[0].decode(), maxnreg))


def supported(device: cl.Device) -> bool:
    """An NVIDIA device of compute capability 9.0 (H100, H200, GH200): the one target that has sm_90a."""
    from clgpt.device.precision import nvidia_compute_capability

    return nvidia_compute_capability(device) == (9, 0)
