"""Per-device launch choices: the matmul form and tiles, and the local sizes of the other kernels.

A small table keyed on the device type and vendor; the first row that matches wins. The figures behind
each row are in bench/RESULTS_GPU.md (GPUs) and the engine's commit notes (PoCL).

CLGPT_MATMUL overrides the matmul choice for experiments, e.g.
`CLGPT_MATMUL=kernel=matmul,TSM=128,TSN=128,TSK=16,WPTM=8,WPTN=8,LDSV=1`.
CLGPT_MMA and CLGPT_MMA_SMALL override the big and small tensor-core tiles, e.g. `CLGPT_MMA=BM=128,BN=128,WM=2,WN=2`.
CLGPT_BF16 and CLGPT_BF16_SMALL do so for the bf16 GEMM (kernels/matmul_bf16.cl), e.g.
`CLGPT_BF16=BM=128,BN=256,WM=2,WN=4,STAGES=2`; CLGPT_BF16=off sends bf16 to matmul_mma.cl instead.
CLGPT_LAUNCH=cpu|nvidia|gpu takes that table row whatever the device (tests run the GPU paths on PoCL); the cpu and
gpu rows run no tensor cores (clgpt.device.precision.matrix_path), so on an NVIDIA GPU `gpu` is the generic path.
clgpt/device/knobs.py lists these knobs with the others.
"""

from __future__ import annotations

import pyopencl as cl

from clgpt.device import knobs

# matmul: local-memory tiles TSM x TSN x TSK, WPTM x WPTN outputs per work-item (kernels/matmul.cl).
# matmul_rb: RM rows x NV vectors of VW floats per work-item, no local memory; lsize in work-items.
# Each row of op(A) is read through its own pointer (kernels/matmul.cl): indexed as rows[i] * lda + k, the
# compiler built the addresses in vector registers every k, on the FMA ports the products need.
# VW 16 (one AVX-512 register) with 6 x 4 accumulators: more independent sums in flight than 6 x 2 float8, so
# the FMA ports stay busy at the character recipe's and the default model's widths; the same sums bit for bit.
# A CPU whose native vectors are narrower (AVX2: 8 floats, 16 registers) keeps 6 x 2 float8 (_CPU_VEC8): 24
# float16 accumulators would spill there.
_CPU = dict(kernel="matmul_rb", RM=6, NV=4, VW=16, PREFETCH=1, lsize=(1, 1))
_CPU_VEC8 = dict(kernel="matmul_rb", RM=6, NV=2, VW=8, PREFETCH=1, lsize=(1, 4))
_NVIDIA = dict(kernel="matmul", TSM=128, TSN=128, TSK=8, WPTM=8, WPTN=8, LDSV=1, PREF=1)
# outputs 64 columns wide (attention's per-head products): no half-empty 128-column tiles
_NVIDIA_NARROW = dict(kernel="matmul", TSM=128, TSN=64, TSK=16, WPTM=8, WPTN=4, LDSV=1, PREF=1)
_GPU = dict(kernel="matmul", TSM=64, TSN=64, TSK=32, WPTM=8, WPTN=8, LDSV=0)
# GPUs: outputs too small to fill the device with big tiles (dW of a narrow layer: M, N small, K = B*T)
# take smaller tiles, 4x4 per work-item, so more work-groups run.
_GPU_SMALL = dict(kernel="matmul", TSM=32, TSN=32, TSK=16, WPTM=4, WPTN=4, LDSV=0)
_NVIDIA_SMALL = dict(_GPU_SMALL, PREF=1)
SMALL_GROUPS = 264  # fewer work-groups than this (2 per SM of an H200) with the big tiles -> small tiles
# Tensor cores (kernels/matmul_mma.cl, NVIDIA sm_80+, precision tf32/bf16): BM x BN outputs per work-group
# of WM x WN warps. Outputs giving fewer than MMA_SMALL_GROUPS work-groups of the big tiles take the small
# ones; products without an epilogue whose output still gives fewer than MMA_SPLIT_GROUPS are split along K
# (chunks >= MMA_SPLIT_MIN_K deep) as the fp32 kernel's are. Measured on the H200 (bench/RESULTS_GPU.md):
# 128x128 with 2x4 warps (156-186 registers, no spills) trains fastest; 2x2 warps (64x64 a warp) spill.
_NVIDIA_MMA = dict(kernel="matmul_mma", BM=128, BN=128, WM=2, WN=4)
_NVIDIA_MMA_SMALL = dict(kernel="matmul_mma", BM=64, BN=64, WM=2, WN=2)
MMA_SMALL_GROUPS = 132
# bf16 (kernels/matmul_bf16.cl): bf16 operand copies, cp.async STAGES deep, ldmatrix; BK = 32. Local memory
# per work-group: STAGES * (BM + BN) * 64 bytes (48 KB without opting in on NVIDIA's OpenCL).
_NVIDIA_BF16 = dict(kernel="matmul_bf16", BM=128, BN=128, WM=2, WN=4, STAGES=3)
_NVIDIA_BF16_SMALL = dict(kernel="matmul_bf16", BM=64, BN=64, WM=2, WN=2, STAGES=4)
# bf16 on Hopper (sm_90a: kernels/matmul_wgmma.cl, clgpt/device/sm90a.py): wgmma on tiled, swizzled bf16 copies fetched
# by bulk copies, 128 x 128 outputs per work-group of 2 warpgroups, 3 stages of 64 k (96 KB local memory, 103-118
# registers: two work-groups an SM, so one's epilogue overlaps the other's products): the narrow row, which most
# products take. The wide row, 128 x 256 with 3 stages (one work-group an SM), is faster only on deep products: at
# least WGMMA_WIDE_MIN_K deep and still WGMMA_SPLIT_GROUPS work-groups on the wide tile (the head's input and
# weight gradients at K = vocabulary or tokens, GPT-2 medium's K = 4096 products); on the others, shallow or left
# with too few work-groups (then split along K, the sums costing more than the tile saves), it measured slower
# (clgpt/ops/gemm/wgmma.py tiles, bench/RESULTS_GPU.md). Products without an epilogue giving fewer than
# WGMMA_SPLIT_GROUPS work-groups are split along K (chunks >= WGMMA_SPLIT_MIN_K deep).
_NVIDIA_WGMMA = dict(kernel="matmul_wgmma", BM=128, BN=256, STAGES=3, PIPE=1)
_NVIDIA_WGMMA_NARROW = dict(kernel="matmul_wgmma", BM=128, BN=128, STAGES=3, PIPE=1)
WGMMA_WIDE_MIN_K = 4096
# The mid row, 128 x 192 with 3 stages (120 KB: one work-group an SM), for shallow products the narrow tiles spread
# unevenly: GPT-2 small's 8192 x 768 outputs are 384 narrow tiles, so 120 SMs of 132 take a third tile alone after
# two shared, against two mid tiles each. A product at least WGMMA_MID_MIN_K and under WGMMA_WIDE_MIN_K deep takes
# the mid tiles where its busiest SM ends sooner on them, a work-group alone on an SM running at these fractions of
# the narrow pair's throughput (clgpt/ops/gemm/wgmma.py mid_ends_sooner). The rates fit the kernel alone on an H100
# (bench/RESULTS_GPU.md): mid against narrow 1.13x at 8192 x 768 x 3072, 1.09x at 8192 x 768 x 768, 1.03x at
# 8192 x 2304 x 768, 0.96x at 8192 x 3072 x 768. On the deep weight gradients (3072 x 768 x 8192, 144 narrow
# tiles) the mid tiles trained slower; below 12 k tiles (the character recipe's K = 384) they are not measured.
_NVIDIA_WGMMA_MID = dict(kernel="matmul_wgmma", BM=128, BN=192, STAGES=3, PIPE=1)
WGMMA_MID_MIN_K = 768
WGMMA_MID_RATE = 0.96
WGMMA_NARROW_ALONE_RATE = 0.68
# A product whose B copy outgrows the 50 MB L2 of the H100 and H200 while A's fits (the head's forward: B the
# vocabulary x C weights) takes its tiles in bands of WGMMA_BAND rows of tiles (kernels/epilogue.cl tile_of_group):
# in launch order each row of tiles fetched all of B from memory again. GPT-2 small's head forward: 298 -> 525
# TFLOP/s (bench/RESULTS_GPU.md); products whose B fits measured up to 7% slower in bands, so they keep launch order.
WGMMA_BAND = 64
WGMMA_BAND_MIN_BYTES = 48 << 20
WGMMA_SPLIT_GROUPS = 132
WGMMA_SPLIT_MIN_K = 512
# Smaller products (M*N*K below this: shape M's, whose work-groups do not fill the device and whose 4 k tiles do
# not fill the pipeline) measured faster on the mma.sync kernel (bench/RESULTS_GPU.md), so they stay there. Since
# wgmma's copies of a matrix serve several products, M6's 16384 x 384 x 384 products (2.4e9) gain there too: 2^30.
# The GELU' epilogue in the wgmma kernel (which reads E: 1 work-group an SM hides its loads poorly) is slower than
# mma.sync's, and both slower than the product without it and gelu' applied in its gradient's copy (Ops, "defer").
WGMMA_MIN_MNK = 2**30
MMA_SPLIT_GROUPS = 264
MMA_SPLIT_MIN_K = 256
# Split-K (GPUs, products with no bias/residual/epilogue whose output gives too few work-groups, chiefly the
# weight gradients dW = dy.T @ x with K = B*T): the K range is cut into S chunks, each work-group stores its
# part, a second kernel adds the S parts in a fixed order. Chunks stay >= SPLIT_MIN_K[tile] deep; the
# small tiles aim at SPLIT_SMALL_GROUPS work-groups (several of their 64-work-item groups fit one SM).
SPLIT_MIN_K = {"big": 512, "small": 128}
SPLIT_SMALL_GROUPS = 1056  # also the aim of the big tiles: about 4 waves of 2 work-groups per SM
SPLIT_MIN_TOTAL_K = 1024  # shallower products are not split (each split costs a launch: small shapes are host-bound)

# The GPU rows also name: rows = LW, the work-group size of the one-work-group-per-row kernels (layernorm,
# softmax, cross-entropy) and two-stage column sums; attn_gemm = 1 runs attention as batched matmuls with
# the row kernels (kernels/attention.cl); split_k = 1 allows split-K. CPUs keep the one-work-item-per-row
# kernels (PoCL runs those loops vectorised; its barriers cost).
# attn_gemm_min_t: shorter sequences keep the one-launch-per-pass attention kernels (fewer launches);
# colsum_min_parts: column sums over fewer row chunks than this keep the one-stage kernels;
# preset = 1: each launch site keeps its own cl.Kernel with its arguments set once (enqueue only after).
# ln_rw: LayerNorm with C % 128 == 0 (C <= 2048) as 32 work-items a row, ln_rw rows a work-group (kernels/layernorm.cl
# *_rows); ln_parts: its backward's work-groups (each one dw, db part) aimed at, each row-slot taking N // (ln_rw *
# ln_parts) rows (at least 1): N = 16384 -> 8 rows a slot, 512 work-groups, 512 parts for the final sum.
_GPU_ROWS = dict(rows=128, attn_gemm=1, attn_gemm_min_t=128, split_k=1, colsum_rows=64, colsum_min_parts=16,
                 preset=1, ln_rw=4, ln_parts=512)

# The CPU row also names: xent_fused = 1, cross-entropy forward and gradient in one vectorised pass per row
# (kernels/xent.cl; the backward folds scale / sum(mask) into the matmuls' alpha); cpu_bias = 1, the float8
# column sums of kernels/bias.cl for the bias gradients; ta_direct: matmul_rb reads op(A) = A.T in place (TA=1)
# when M*K is at most this many floats, else through a transposed copy (wide strided A: 2-2.5x slower).
# cpu_attn = 1: attention forward and query backward as attention.cl's CPU forms (q.k, dout.v 4 keys at a time); with
# head_dim % 16 == 0 also att @ v, datt @ k (attention_rows_rb) and the key side (attention_backward_key_rb) as
# register-blocked products, 6 rows x 16 columns a work-item (a row of q.k sums a work-item starves the FMA ports).
# cpu_vec = 1: AdamW 8 parameters a work-item as float8 (adamw_v8, kernels/adamw.cl: same results bit for bit;
# PoCL does not vectorise the one-parameter kernel) and transposes as 16x8 blocks through register shuffles
# (transpose_v8, kernels/transpose.cl) and the grad norm's chunk sums as float8 chains (grad_norm_partial_v8).
# ld_pad = 16: matmul_rb's op(B) rows a multiple of 64 floats apart get 16 floats of padding (a transposed B
# written so by transpose_ld_v8, a plain one of >= ld_pad_copy floats copied by copy_ld_v8; kernels/transpose.cl):
# such strides map a column strip onto a few cache sets.
# preset = 1 here too: on 2 cores the host's Python per launch competes with PoCL's workers. norm_rb / norm_cb: LayerNorm's and RMSNorm's one-work-item kernels take 8 rows (dw, db: 16
# channels) a work-item, one work-item a work-group. 8 rows are one float8 of in-order sums, 8x8 blocks turned in
# registers; 16 channels one float16 (kernels/layernorm.cl, rmsnorm.cl). The same bits, and one launch does the
# work of eight rows' launches, which on a small model is what the step's time is made of.
# rb_kmax: matmul_rb products with K above this run as launches of at most rb_kmax k each, every launch going on
# with the raw sums of the one before (INIT in kernels/matmul.cl; the same bits): a longer op(B) strip outgrows
# the caches (M's 2048x256x4096 LM-head product runs about twice as fast in chunks of K = 2048).
_CPU_ROWS = dict(preset=1, rb_kmax=2048, norm_rb=8, norm_cb=16, xent_fused=1, cpu_bias=1, ta_direct=3 << 17, cpu_attn=1, cpu_vec=1, ld_pad=16, ld_pad_copy=1 << 17)

# tile_band (the generic GPU row): the portable GEMM takes its output tiles in bands of this many rows of tiles,
# down a band before along n (kernels/epilogue.cl tile_of_group), so the tiles running at once share B's columns in
# the cache; in launch order a row of tiles spans all of n. On the H100 the generic row trained L in 0.958x the time
# (fp32, bench/RESULTS_GPU.md); a GPU with a smaller cache than its 50 MB rereads more in launch order.
GPU_TILE_BAND = 8

# (device type, vendor substring or "" for any) -> matmul config, local size of 1-D and 2-D launches.
TABLE = [
    (cl.device_type.CPU, "", dict(matmul=_CPU, local_1d=16, local_2d=(16, 1), vec=1, norm_parts=256, **_CPU_ROWS)),
    (cl.device_type.GPU, "nvidia", dict(matmul=_NVIDIA, matmul_small=_NVIDIA_SMALL, matmul_narrow=_NVIDIA_NARROW,
                                        matmul_mma=_NVIDIA_MMA, matmul_mma_small=_NVIDIA_MMA_SMALL, local_1d=128, local_2d=(32, 4), vec=0,
                                        norm_parts=8192, **_GPU_ROWS)),
    (cl.device_type.GPU, "", dict(matmul=_GPU, matmul_small=_GPU_SMALL, local_1d=128, local_2d=(32, 4), vec=0, norm_parts=8192,
                                  tile_band=GPU_TILE_BAND, **_GPU_ROWS)),
]
_DEFAULT = dict(matmul=_GPU, local_1d=64, local_2d=(16, 4), vec=0, norm_parts=4096)


def launch_tables(record: dict) -> dict:
    """The row entries a clgpt.device.tuner record sets: matmul (big tiles), matmul_small and matmul_shapes,
    {(M, N, K, ta, tb): (tiles, split)} (clgpt/ops/gemm/portable.py looks a product up there first); the tiles dicts are
    shared, so their kernels are built once."""
    rows = [dict(c) for c in record["candidates"]]
    shapes = {tuple(s["product"]): (rows[s["tiles"]], int(s["split"])) for s in record["products"]}
    return dict(matmul=rows[record["matmul"]], matmul_small=rows[record["matmul_small"]], matmul_shapes=shapes)


def launch_config(device: cl.Device, kn: knobs.Knobs) -> dict:
    """-> dict(matmul=..., [matmul_small=...,] local_1d=int, local_2d=(int, int), vec=0/1 (float8 attention),
    norm_parts: partial sums of the grad norm (GPUs: many, strided)) for this device under knobs `kn` (the Knobs
    the caller read at its edge)."""
    vendor = (device.vendor + " " + device.platform.name).lower()
    dtype_of = device.type
    if kn.launch:
        dtype_of = cl.device_type.CPU if kn.launch == "cpu" else cl.device_type.GPU
        vendor = "nvidia" if kn.launch == "nvidia" else "other"
    cfg = _DEFAULT
    for dtype, vend, row in TABLE:
        if dtype_of & dtype and vend in vendor:
            cfg = row
            break
    cfg = dict(cfg)
    if cfg["matmul"] is _CPU and device.native_vector_width_float < 16:
        cfg["matmul"] = _CPU_VEC8
    if kn.gemm_tuning is not None and cfg["matmul"].get("kernel") == "matmul":  # the tuner's tiles replace the row's
        cfg.pop("matmul_narrow", None)
        cfg.update(launch_tables(kn.gemm_tuning))
    rows = kn.rows_tuning or {}
    if rows and cfg.get("rows"):  # the row tuner's work-group sizes replace the row's (clgpt.device.tuner_rows)
        cfg["rows"] = int(rows["rows"]["rows"]) if rows.get("rows") else cfg["rows"]
        cfg["ln_rw"] = int(rows["norm"]["ln_rw"]) if rows.get("norm") else cfg["ln_rw"]
    if kn.matmul is not None:
        cfg.pop("matmul_shapes", None)
        cfg["matmul"] = dict(kn.matmul)
        if not kn.matmul_keep_small:
            cfg.pop("matmul_small", None)
            cfg.pop("matmul_narrow", None)
    cfg.setdefault("matmul_mma", _NVIDIA_MMA)  # used only where clgpt.device.precision.matrix_path says so
    cfg.setdefault("matmul_mma_small", _NVIDIA_MMA_SMALL)
    cfg.setdefault("matmul_bf16", _NVIDIA_BF16)
    cfg.setdefault("matmul_bf16_small", _NVIDIA_BF16_SMALL)
    cfg.setdefault("matmul_wgmma", _NVIDIA_WGMMA)  # used only on sm_90 devices (clgpt.device.sm90a.supported)
    cfg.setdefault("matmul_wgmma_narrow", _NVIDIA_WGMMA_NARROW)
    cfg.setdefault("matmul_wgmma_mid", _NVIDIA_WGMMA_MID)
    for key, tiles in (("matmul_mma", kn.mma), ("matmul_mma_small", kn.mma_small), ("matmul_bf16", kn.bf16),
                       ("matmul_bf16_small", kn.bf16_small), ("matmul_wgmma", kn.wgmma),
                       ("matmul_wgmma_narrow", kn.wgmma_narrow), ("matmul_wgmma_mid", kn.wgmma_mid)):
        if tiles == knobs.OFF:
            cfg[key] = None
        elif tiles is not None:
            cfg[key] = dict(tiles, kernel=key.replace("_small", "").replace("_narrow", "").replace("_mid", ""))
    if kn.preset is not None:
        cfg["preset"] = kn.preset
    return cfg
