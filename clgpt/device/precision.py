"""Matmul precision: fp32, tf32 or bf16 operands (fp32 sums), and which matrix path a device has.

`precision` (config: pretrain/tune `precision`; `clgpt bench --precision`):
  fp32  operands as they are (bit-exact as before this setting existed)
  tf32  operands rounded to tf32 (10 mantissa bits, nearest, ties away), fp32 sums
  bf16  operands rounded to bf16 (7 mantissa bits, nearest even), fp32 sums: autocast's matmuls
  auto  bf16 where the device has a matrix path (NVIDIA sm_80+: tensor cores); on another GPU bf16 where the
        device tuner measured the step's products faster on bf16 storage (its record's `bf16_storage`,
        clgpt/device/tuner.py); else fp32 (CPUs: fp32)
Only the matmuls' operands are rounded (the linear layers, and attention's products where they run as
matmuls: GPUs); weights, gradients, AdamW state, norms, softmax and the loss stay fp32, as under autocast.
Two kernels give each reduced precision: the portable one (kernels/matmul.cl with -D ROUND, any device,
what CI tests on PoCL) and the tensor-core one (kernels/matmul_mma.cl, NVIDIA sm_80+). They round operands
identically (kernels/precision.cl) and differ only in the order the tensor cores sum products. On a GPU without
tensor cores the portable kernel's bf16 products read bf16 copies of their operands (bf16 storage: kernels/matmul.cl
A16, B16), which matmul_bf16.cl's to_bf16 writes with the same rounding: the same bits, half the bytes moved.
"""

from __future__ import annotations

from clgpt.device import knobs
from clgpt.errors import ClgptError

PRECISIONS = ("fp32", "tf32", "bf16", "auto")
ROUND = {"fp32": 0, "bf16": 1, "tf32": 2}  # -D ROUND of kernels/precision.cl
# Build options of kernels/matmul_bf16.cl where only its to_bf16 runs (the portable GEMM's bf16 operand copies, on
# any device): its tensor-core GEMM, built beside it, in its portable emulation (no PTX) with one-warp 32 x 32
# tiles, so the program builds on every OpenCL device within 32 KB of local memory.
BF16_COPY_OPTIONS = dict(MMA_EMULATE=1, BM=32, BN=32, WM=1, WN=1, STAGES=2)


def nvidia_compute_capability(device) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA device (cl_nv_device_attribute_query), else None."""
    import pyopencl as cl  # here: the settings check (PRECISIONS) must not need OpenCL

    if "nvidia" not in (device.vendor + " " + device.platform.name).lower():
        return None
    if "cl_nv_device_attribute_query" not in device.extensions:
        return None
    try:
        return (int(device.get_info(cl.device_info.COMPUTE_CAPABILITY_MAJOR_NV)),
                int(device.get_info(cl.device_info.COMPUTE_CAPABILITY_MINOR_NV)))
    except cl.Error:
        return None


def intel_matrix_path(device) -> str | None:
    """The slot for Intel's matrix engines (XMX): a device with cl_intel_subgroup_matrix_multiply_accumulate
    (or cl_khr_cooperative_matrix) would get a kernel 'matmul_dpas' (sub-group tiles, intel_sub_group_
    i8/bf16 mad) and a tuning row 'matmul_dpas'. Not built: no such device to test on here. -> None."""
    return None


def matrix_path(device, kn: knobs.Knobs) -> str | None:
    """'nv_mma' (kernels/matmul_mma.cl) on NVIDIA sm_80+; intel_matrix_path's on Intel; else None.
    Knobs(mma_emulate=True) (CLGPT_MMA_EMULATE=1) gives 'nv_mma' on any device with the kernel's emulated mma
    (tests on PoCL); kn: the Knobs the caller read at its edge. The cpu and gpu launch rows (CLGPT_LAUNCH) have
    none: they stand for devices without one, so on an NVIDIA GPU they run nothing NVIDIA-specific."""
    if kn.mma_emulate:
        return "nv_mma"
    if kn.launch in ("cpu", "gpu"):
        return None
    import pyopencl as cl

    cc = nvidia_compute_capability(device)
    if cc is not None and cc >= (8, 0) and device.type & cl.device_type.GPU:
        return "nv_mma"
    return intel_matrix_path(device)


def storage_faster(record: dict | None) -> bool:
    """Whether a clgpt.device.tuner record measured the step's products faster on bf16 storage than in fp32."""
    pair = (record or {}).get("bf16_storage") or {}
    return pair.get("bf16_ms") is not None and pair["bf16_ms"] < pair["fp32_ms"]


def resolve(precision: str, device, kn: knobs.Knobs) -> str:
    """fp32 | tf32 | bf16 for this device ('auto': bf16 where there is a matrix path, or where the device tuner's
    record in kn.gemm_tuning measured bf16 storage faster; else fp32)."""
    if precision not in PRECISIONS:
        raise ClgptError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "bf16" if matrix_path(device, kn) or storage_faster(kn.gemm_tuning) else "fp32"
    return precision


def auto_reason(device, kn: knobs.Knobs) -> str:
    """Why 'auto' resolves as it does on this device: the line a stage's log gives."""
    if matrix_path(device, kn):
        return "bf16 (tensor cores)"
    pair = (kn.gemm_tuning or {}).get("bf16_storage")
    if not pair or pair.get("bf16_ms") is None:
        return "fp32 (no tensor cores, and no tuner record timing bf16 storage: the tuner runs on GPUs)"
    which = "bf16 (bf16 storage)" if storage_faster(kn.gemm_tuning) else "fp32"
    return (f"{which}: the tuner timed a step's products at {pair['fp32_ms']:.2f} ms in fp32, "
            f"{pair['bf16_ms']:.2f} ms on bf16 storage")


# ---- tensor-core matmul launches (kernels/matmul_mma.cl) ----

def mma_threads(mm: dict) -> int:
    return 32 * mm["WM"] * mm["WN"]


def mma_launch(mm: dict, M: int, N: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """-> (global size, local size) of matmul_mma with tiles `mm` for an (M,N) output."""
    nth = mma_threads(mm)
    return (-(-N // mm["BN"]) * nth, -(-M // mm["BM"])), (nth, 1)


def mma_bk(round_mode: int) -> int:
    """k values per staged tile: 16 words of two bf16 or one tf32."""
    return 32 if round_mode == 1 else 16


def mma_groups(mm: dict, M: int, N: int) -> int:
    return -(-M // mm["BM"]) * -(-N // mm["BN"])
