"""Per-device launch choices: the matmul form and tiles, and the local sizes of the other kernels.

A small table keyed on the device type and vendor; the first row that matches wins. The figures behind
each row are in bench/RESULTS_GPU.md (GPUs) and the engine's commit notes (PoCL).

CLGPT_MATMUL overrides the matmul choice for experiments, e.g.
`CLGPT_MATMUL=kernel=matmul,TSM=128,TSN=128,TSK=16,WPTM=8,WPTN=8,LDSV=1`.
"""

from __future__ import annotations

import os

import pyopencl as cl

# matmul: local-memory tiles TSM x TSN x TSK, WPTM x WPTN outputs per work-item (kernels/matmul.cl).
# matmul_rb: RM rows x NV float8 columns per work-item, no local memory; lsize in work-items.
_CPU = dict(kernel="matmul_rb", RM=6, NV=2, lsize=(1, 4))
_NVIDIA = dict(kernel="matmul", TSM=128, TSN=128, TSK=16, WPTM=8, WPTN=8, LDSV=0)
_GPU = dict(kernel="matmul", TSM=64, TSN=64, TSK=32, WPTM=8, WPTN=8, LDSV=0)
# GPUs: outputs too small to fill the device with big tiles (dW of a narrow layer: M, N small, K = B*T)
# take smaller tiles, 4x4 per work-item, so more work-groups run.
_GPU_SMALL = dict(kernel="matmul", TSM=32, TSN=32, TSK=16, WPTM=4, WPTN=4, LDSV=0)
SMALL_GROUPS = 264  # fewer work-groups than this (2 per SM of an H200) with the big tiles -> small tiles

# (device type, vendor substring or "" for any) -> matmul config, local size of 1-D and 2-D launches.
TABLE = [
    (cl.device_type.CPU, "", dict(matmul=_CPU, local_1d=16, local_2d=(16, 1), vec=1, norm_parts=256)),
    (cl.device_type.GPU, "nvidia", dict(matmul=_NVIDIA, matmul_small=_GPU_SMALL, local_1d=128, local_2d=(32, 4), vec=0, norm_parts=8192)),
    (cl.device_type.GPU, "", dict(matmul=_GPU, matmul_small=_GPU_SMALL, local_1d=128, local_2d=(32, 4), vec=0, norm_parts=8192)),
]
_DEFAULT = dict(matmul=_GPU, local_1d=64, local_2d=(16, 4), vec=0, norm_parts=4096)


def _parse(spec: str) -> dict:
    out = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key == "lsize":
            out[key] = tuple(int(v) for v in value.split("x"))
        else:
            out[key] = value if key == "kernel" else int(value)
    return out


def launch_config(device: cl.Device) -> dict:
    """-> dict(matmul=..., [matmul_small=...,] local_1d=int, local_2d=(int, int), vec=0/1 (float8 attention),
    norm_parts: partial sums of the grad norm (GPUs: many, strided)) for this device."""
    vendor = (device.vendor + " " + device.platform.name).lower()
    cfg = _DEFAULT
    for dtype, vend, row in TABLE:
        if device.type & dtype and vend in vendor:
            cfg = row
            break
    cfg = dict(cfg)
    spec = os.environ.get("CLGPT_MATMUL", "").strip()
    if spec:
        cfg["matmul"] = _parse(spec)
        cfg.pop("matmul_small", None)
    return cfg
