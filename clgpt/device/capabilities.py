"""The capabilities record: which form of each op, and which GEMM backend, one device runs, decided once.

Made here, in the device layer, once per (device, knobs): clgpt.ops builds and launches what this record says
and nothing else decides a variant: its fields name the choice they make. It is read off what the device reports
(type, vendor, NVIDIA compute capability, sm_90a) through its clgpt.device.tuning row, clgpt.device.precision's
matrix path and clgpt/device/sm90a.py, under the knobs in effect (a launch row taken on any device, emulated
tensor cores, GEMM tiles turned off), and off one probe run on the device: kernels/matmul_bf16.cl's smem_probe,
how a local pointer becomes a shared-window address for cp.async / ldmatrix (NVIDIA; without one the bf16 GEMM
and wgmma are off and bf16 products run on matmul_mma.cl).

Sub-groups (cl_khr_subgroups, the OpenCL 3.0 feature __opencl_c_subgroups, cl_intel_subgroups), on the GPU rows
only: which sizes the device builds (with cl_intel_required_subgroup_size each candidate size is built and run
once, kernels/reduce.cl's subgroup_probe; without it, the one size its compiler picks) and whether it forms them of
consecutive work-items with a reduce that adds them. The row kernels (kernels/reduce.cl's wg_reduce: softmax and
its backward, cross-entropy, the one-work-group-a-row norms, the grad norm; norm_rows.cl: the 32-wide row slices)
then reduce in sub-groups, a fixed size where the device lets the build fix it. NVIDIA's OpenCL and Mesa's
llvmpipe offer none, PoCL 3 none on CPUs: they keep the local-memory forms, as the CPU row always does.

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
from clgpt.device.knobs import SUBGROUP_VAR, Knobs
from clgpt.device.opencl import get_device_for
from clgpt.device.precision import matrix_path
from clgpt.device.tuning import launch_config
from clgpt.errors import ClgptError

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
    # sub-groups (GPU rows; see the module doc): the sizes the device builds and runs right, () where it offers none
    # or the row takes none (CPU); `subgroup_fixed`: each size fixed at build time (cl_intel_required_subgroup_size)
    subgroup_sizes: tuple = ()
    subgroup_fixed: bool = False
    # the row kernels' reductions through sub-groups (-D SUBGROUP), of size `subgroup` (0: the compiler's); False:
    # the local-memory forms. `row_subgroup`: the norms' 32-wide row slices' fixed size (dividing 32), 0: local memory
    subgroup_reduce: bool = False
    subgroup: int = 0
    row_subgroup: int = 0

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
        if emulated:
            bf16_options = dict(MMA_EMULATE=1)
        else:  # the local address form cp.async and ldmatrix take ({}: neither works, no bf16 GEMM here), and
            address = smem_address(device)  # bf16 rounding by the hardware's conversion (precision.cl BF16_CVT)
            bf16_options = dict(address, BF16_CVT=1) if address else {}
    bf16_gemm = bool(bf16_options)
    # wgmma on sm_90, or emulated (kernels/matmul_wgmma.cl WGMMA_EMULATE) with the emulated tensor cores
    wgmma = bool(tensor_cores and bf16_gemm and launch.get("matmul_wgmma")
                 and (sm90a.supported(device) or (emulated and kn.wgmma_emulate)))
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
        wgmma=wgmma, colsum_copies=wgmma and bool(rows) and launch.get("colsum_rows") == 64, bf16_options=bf16_options,
        **_subgroup_fields(device, kn, rows))


SUBGROUP_SIZES = (8, 16, 32, 64)  # the sizes tried where the build fixes one (cl_intel_required_subgroup_size)


def subgroup_extension(device) -> str:
    """The sub-group extension (or OpenCL 3.0 feature) the device offers, "" for none."""
    ext = device.extensions.split()
    for name in ("cl_khr_subgroups", "cl_intel_subgroups"):
        if name in ext:
            return name
    try:
        features = {f.name for f in device.opencl_c_features}
    except (cl.Error, AttributeError):  # before OpenCL 3.0
        features = set()
    return "__opencl_c_subgroups" if "__opencl_c_subgroups" in features else ""


_sizes_cache: dict[int, tuple[tuple, bool]] = {}


def subgroup_sizes(device) -> tuple[tuple, bool]:
    """(the sub-group sizes this device builds and runs right, each fixed at build time?), read once a device:
    with cl_intel_required_subgroup_size every SUBGROUP_SIZES size that builds and passes kernels/reduce.cl's
    subgroup_probe; without it, the size its compiler picks for the probe, where it passes; ((), False) without
    sub-groups."""
    key = device.int_ptr
    if key not in _sizes_cache:
        sizes, fixed = (), False
        if subgroup_extension(device):
            fixed = "cl_intel_required_subgroup_size" in device.extensions.split()
            sizes = tuple(n for n in SUBGROUP_SIZES if _probe_size(device, n)) if fixed else \
                tuple(_probe_size(device, 0))
        _sizes_cache[key] = (sizes, fixed)
    return _sizes_cache[key]


def _probe_size(device, n: int) -> list:
    """[the sub-group size] where kernels/reduce.cl's subgroup_probe built with SUBGROUP n (0: the compiler's
    size) runs as the row kernels need, else []: consecutive ids and a reduce that adds, in a work-group of 128
    (wg_reduce's) and, for a size dividing 32, of (32, 4) (the norms' row slices; Intel's CPU runtime makes
    sub-groups of 32 there when asked for 64)."""
    dev = get_device_for(device)
    try:
        kern = dev.kernel("reduce", "subgroup_probe", SUBGROUP=n, SUBGROUP_PROBE=1)
    except ClgptError:  # a size the device cannot build
        return []
    size = 0
    for lsize in ((128, 1), (32, 4)):
        out = np.zeros(256, np.uint32)
        d = cl.Buffer(dev.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=out)
        kern(dev.queue, lsize, lsize, d)
        cl.enqueue_copy(dev.queue, out, d, is_blocking=True)
        got = int(out[0] & 0xFF)
        size = size or got
        if got != size or size < 1 or (n and size != n) or 128 % size:
            return []
        t = np.arange(128)
        sums = (t // size * size) * size + size * (size - 1) // 2  # the sum of t over t's sub-group
        ids = size | (t // size) << 8 | (t % size) << 16
        if not (np.array_equal(out[:128], ids) and np.array_equal(out[128:], sums)):
            return []
        if 32 % size:  # the row slices will not take it: no need for the (32, 4) check
            break
    return [size]


def _subgroup_fields(device, kn: Knobs, rows: int) -> dict:
    """The record's sub-group fields: a GPU row's choice among the sizes the device offers (the largest dividing
    32, so that the norms' row slices take it too; else the largest), what the row tuner's record says
    (clgpt.device.tuner_rows: kn.rows_tuning), or what CLGPT_SUBGROUP asks."""
    if not rows:  # the CPU row has its own forms and no work-group reductions
        return {}
    sizes, fixed = subgroup_sizes(device)
    tuned = kn.rows_tuning or {}
    if kn.subgroup is None and tuned and sizes:
        wg, row = (tuned.get(f) and tuned[f]["sg"] for f in ("rows", "norm"))
        known = lambda sg: sg in sizes if fixed else sg == "auto"  # noqa: E731 - a record of another device: ignored
        out = dict(subgroup_sizes=sizes, subgroup_fixed=fixed)
        if wg is not None and wg != "local" and known(wg):
            out.update(subgroup_reduce=True, subgroup=0 if wg == "auto" else wg)
        if row is not None and row != "local" and fixed and known(row):
            out.update(row_subgroup=row)
        elif row is None and out.get("subgroup") and 32 % out["subgroup"] == 0:  # no row slices timed: as the rest
            out.update(row_subgroup=out["subgroup"])
        return out
    if kn.subgroup == 0 or (not sizes and kn.subgroup is None):
        return dict(subgroup_sizes=sizes, subgroup_fixed=fixed)
    if kn.subgroup is not None:
        if kn.subgroup not in sizes:
            offered = f"sub-group sizes {', '.join(map(str, sizes))}" if sizes else "no sub-groups"
            raise ClgptError(f"{SUBGROUP_VAR}={kn.subgroup}: {device.name.strip()} offers {offered}; set "
                             f"{'one of them, ' * bool(sizes)}off, or unset it")
        size = kn.subgroup
    else:
        size = max([n for n in sizes if 32 % n == 0] or sizes) if fixed else sizes[0]
    return dict(subgroup_sizes=sizes, subgroup_fixed=fixed, subgroup_reduce=True, subgroup=size if fixed else 0,
                row_subgroup=size if fixed and 32 % size == 0 else 0)


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
