"""The capabilities record: which form of each op, and which GEMM backend, one device runs, decided once.

Made here, in the device layer, once per (device, knobs): clgpt.ops builds and launches what this record says
and nothing else decides a variant: its fields name the choice they make. It is read off what the device reports
(type, vendor, NVIDIA compute capability, sm_90a) through its clgpt.device.tuning row, clgpt.device.precision's
matrix path and clgpt/device/sm90a.py, under the knobs in effect (a launch row taken on any device, emulated
tensor cores, GEMM tiles turned off), and off one probe run on the device: kernels/matmul_bf16.cl's smem_probe,
how a local pointer becomes a shared-window address for cp.async / ldmatrix (NVIDIA; without one the bf16 GEMM
and wgmma are off and bf16 products run on matmul_mma.cl).

The forms it picks among: kernels/layernorm.cl and rmsnorm.cl (a work-item, a work-group or a 32-wide slice a
row), kernels/rope.cl and swiglu.cl (a work-item a pair, or 4 outputs, on GPUs), kernels/adamw.cl (float8 AdamW,
work-group norm sums), kernels/transpose.cl and bias.cl (float8 transposes and column sums),
kernels/attention.cl (the u4 and register-blocked CPU forms, batched attention with row kernels), kernels/moe.cl (a work-group a row) and the
GEMMs of kernels/matmul.cl, matmul_mma.cl, matmul_bf16.cl and matmul_wgmma.cl.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyopencl as cl

from clgpt.device import sm90a
from clgpt.device.knobs import Knobs
from clgpt.device.opencl import get_device_for
from clgpt.device.precision import matrix_path
from clgpt.device.tuning import launch_config

GEMM_BACKENDS = ("portable", "mma", "bf16", "wgmma")


@dataclass(frozen=True)
class Capabilities:
    """One device's op forms and GEMM backends (see the module doc). Shape conditions (C % 128, D % 16, ...)
    stay with the op: a field says the device takes the form wherever the shape allows it."""

    launch: dict  # the clgpt.device.tuning row: tiles, local sizes and thresholds (Ops copies it: tests change it)
    # GPUs: one work-group of `group_rows` work-items a row (LayerNorm, RMSNorm, softmax, cross-entropy) and
    # two-stage column sums; 0: one work-item a row (CPUs: PoCL vectorises those loops, its barriers cost)
    group_rows: int
    layernorm_rows: bool  # LayerNorm, RMSNorm as 32 work-items a row, ln_rw rows a group (C % 128 == 0, C <= 2048)
    rope_per_pair: bool  # RoPE a work-item a (row, pair): one a row-slot leaves most of a GPU idle
    swiglu_per_element: bool  # SwiGLU's dense forward a work-item 4 outputs (F % 4 == 0) or one, for the same reason
    grad_norm_groups: bool  # the grad norm's sums as work-groups (GPUs: many strided parts)
    moe_route_group: bool  # MoE routing in one work-group (its local counts: 2 LW E words)
    moe_weight_backward_groups: bool  # each pick's weight gradient a work-group (a dot product of C terms)
    # CPUs: explicit float8 / float16 loops, which PoCL does not make of the one-element kernels
    row_groups_of_one: bool  # the one-work-item-a-row kernels a work-item a work-group (they loop in vectors)
    embedding_rows: bool  # the embedding a row a work-item
    adamw_v8: bool  # AdamW 8 parameters a work-item, the same bits
    transpose_v8: bool  # transposes as 16 x 8 blocks turned in registers
    rope_vec: bool  # RoPE 4 pairs a step (D % 8 == 0), the same bits
    grad_norm_v8: bool  # the grad norm's chunk sums as float8 chains (chunked, not strided, parts)
    pad_ld: bool  # transpose_ld_v8 / copy_ld_v8: matmul_rb's B rows padded off multiples of 64 floats
    xent_fused: bool  # cross-entropy's loss and gradient in one pass (the backward folds its scale into alpha)
    bias_v8: bool  # bias gradients as float8 column sums
    attention_u4: bool  # attention's q.k and dout.v sums 4 keys at a time
    attention_rb: bool  # att @ v, ds @ k and the key side as register-blocked products (D % 16 == 0)
    # attention as batched products with row kernels from this sequence length on; None: one launch a pass
    attention_gemm_min_t: int | None
    split_k: bool  # the portable GEMM splits deep products whose output gives too few work-groups
    preset: bool  # launches through cl.Kernels whose arguments were set once
    tensor_cores: bool  # mma.sync on NVIDIA sm_80+ (clgpt.device.precision.matrix_path), or emulated (mma_emulate)
    mma_emulated: bool  # the tensor-core kernels built with MMA_EMULATE: no NVIDIA device (tests on PoCL)
    bf16_gemm: bool  # bf16 products on kernels/matmul_bf16.cl (its tiles not turned off), else on matmul_mma.cl
    wgmma: bool  # large bf16 products on Hopper's wgmma (sm_90a and its tiles not turned off)
    colsum_copies: bool  # wgmma's reuse copies also give bias_partial's column sums (64-row chunks)
    # the bf16 kernels' build options: MMA_EMULATE (no NVIDIA device), or SMEM_CVTA 0 / 1 (smem_probe); {} where
    # the bf16 GEMM is off
    bf16_options: dict

    def gemm_backend(self, round_mode: int) -> str:
        """The GEMM for operands rounded as clgpt.device.precision.ROUND's round_mode: portable (kernels/matmul.cl),
        mma (tf32, or bf16 with its GEMM off), bf16, or wgmma (bf16 with wgmma for the large products)."""
        if not round_mode or not self.tensor_cores:
            return "portable"
        if round_mode != 1 or not self.bf16_gemm:
            return "mma"
        return "wgmma" if self.wgmma else "bf16"


_cache: dict[tuple, Capabilities] = {}


def capabilities(device, kn: Knobs) -> Capabilities:
    """The record of the cl.Device `device` under knobs `kn`, made once for each pair."""
    key = (device.int_ptr, repr(kn))
    caps = _cache.get(key)
    if caps is None:
        caps = _cache[key] = _read(device, kn)
    return caps


def _read(device, kn: Knobs) -> Capabilities:
    launch = launch_config(device, kn)
    rows = int(launch.get("rows", 0))
    vec = bool(launch.get("cpu_vec"))
    cpu_attn = bool(launch.get("cpu_attn"))
    tensor_cores = matrix_path(device, kn) == "nv_mma"
    emulated = "nvidia" not in device.vendor.lower()
    bf16_options = {}
    if tensor_cores and launch.get("matmul_bf16"):
        bf16_options = dict(MMA_EMULATE=1) if emulated else smem_address(device)
    bf16_gemm = bool(bf16_options)
    wgmma = bool(tensor_cores and bf16_gemm and launch.get("matmul_wgmma") and sm90a.supported(device))
    return Capabilities(
        launch=launch, group_rows=rows, layernorm_rows=bool(rows and launch.get("ln_rw")),
        rope_per_pair=bool(rows), swiglu_per_element=bool(rows), grad_norm_groups=bool(rows),
        moe_route_group=bool(rows), moe_weight_backward_groups=bool(rows),
        row_groups_of_one=vec, embedding_rows=vec, adamw_v8=vec, transpose_v8=vec, rope_vec=vec,
        grad_norm_v8=bool(launch.get("ld_pad")) and launch["norm_parts"] <= 256, pad_ld=bool(launch.get("ld_pad")),
        xent_fused=bool(launch.get("xent_fused")), bias_v8=bool(launch.get("cpu_bias")),
        attention_u4=cpu_attn, attention_rb=cpu_attn,
        attention_gemm_min_t=launch.get("attn_gemm_min_t", 0) if launch.get("attn_gemm") else None,
        split_k=bool(launch.get("split_k")), preset=bool(launch.get("preset", 0)),
        tensor_cores=tensor_cores, mma_emulated=emulated, bf16_gemm=bf16_gemm,
        wgmma=wgmma, colsum_copies=wgmma and bool(rows) and launch.get("colsum_rows") == 64, bf16_options=bf16_options)


def smem_address(device) -> dict:
    """How a local pointer becomes a shared-window address for cp.async / ldmatrix on this NVIDIA device: its
    integer value (SMEM_CVTA 0) or cvta.to.shared of it (SMEM_CVTA 1), as kernels/matmul_bf16.cl's smem_probe
    finds; {} where neither works (the bf16 GEMM cannot run here)."""
    dev = get_device_for(device)
    out = np.zeros(4, np.uint32)
    d = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=out)
    dev.kernel("matmul_bf16", "smem_probe")(dev.queue, (64,), (64,), d)
    cl.enqueue_copy(dev.queue, out, d, is_blocking=True)
    if out[1] == 0x5EED0003:
        return dict(SMEM_CVTA=0)
    if out[2] == 0x5EED0003:
        return dict(SMEM_CVTA=1)
    return {}
