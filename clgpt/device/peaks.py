"""Peak dense FLOP/s of known devices by matmul precision: the denominator of model FLOPs utilisation (MFU), as
nanochat reports it beside tokens/s. From the vendors' datasheets (dense, no sparsity); a device not listed
(CPUs, whose peak depends on the cores a shared machine gives) has no MFU.

Matched against the OpenCL device name, first match wins, so the more specific names come first.
"""

from __future__ import annotations

# name substring -> {precision: FLOP/s}; fp32 is the CUDA cores' rate (clgpt's fp32 path), tf32 and bf16 tensor cores
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12}),
    ("H100", {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12}),  # SXM; nanochat's 989 TFLOP/s bf16
    ("H200", {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12}),  # SXM (the H100's compute, more memory)
    ("A100", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12}),
)


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of the named device at the matmuls' precision (fp32 | tf32 | bf16), or None where unknown."""
    for key, row in PEAKS:
        if key in device_name:
            return row.get(precision)
    return None
