"""What one device and one model's widths decide once (Facts), the base every part of clgpt/ops takes them
through (Part), and split-K's reduce, which every GEMM backend runs.

The path a device takes comes from its clgpt.device.tuning row, clgpt.device.precision's matrix path and the
Knobs the caller passes, read once into clgpt/device/capabilities.py's record: the portable GEMM (mm), tensor
cores (mma), the bf16 GEMM (bf16) and wgmma (wgmma); clgpt/ops/gemm/__init__.py's factory picks the backend
from them once. Builds and launches no kernel itself: kernels/matmul.cl's splitk_reduce goes through the
launcher (clgpt/ops/launcher.py), built by the portable GEMM (clgpt/ops/gemm/portable.py).
"""

from __future__ import annotations

import numpy as np

from clgpt.device.opencl import Device
from clgpt.errors import ClgptError
from clgpt.device.capabilities import capabilities
from clgpt.device.knobs import Knobs
from clgpt.model import ModelConfig
from clgpt.ops.launcher import F32, Launcher, ceil_to
from clgpt.device.precision import ROUND
from clgpt.device.tuning import WGMMA_MIN_MNK

ATTENTION = ("auto", "flash", "batched")  # the stages' `attention` setting (clgpt/ops/attention.py use_flash)

__all__ = ["ATTENTION", "F32", "Facts", "Part", "ceil_to", "f32", "i32", "run_split_k"]

i32, f32 = np.int32, np.float32


class Facts:
    """The decisions of one Ops (see clgpt.ops.Ops), made once: the capabilities record, the precision, the GEMM
    backend's name and tiles, the op forms this model's widths allow, and the launcher every part launches
    through. The parts read the decisions through one shared Facts (tests turn a path on here)."""

    def __init__(self, dev: Device, cfg: ModelConfig, seq_len: int, precision: str, knobs: Knobs):
        self.dev, self.cfg = dev, cfg
        self.ctx, self.queue = dev.ctx, dev.queue
        kn = self.knobs = knobs
        self.caps = caps = capabilities(dev.device, kn)
        self.launch = dict(caps.launch)
        # the one place a kernel is enqueued (clgpt/ops/launcher.py): kernels by name, buffers, scratch
        self.launcher = Launcher(dev, self.launch, caps.preset, caps.row_groups_of_one, kn.nv_verbose)
        self.mm = self.launch["matmul"]
        # matmul precision: ROUND for the portable kernels; the GEMM backend the record gives for it, with its
        # (big, small) tiles: mma on fp32 operands, the bf16 GEMM on bf16 operand copies (kernels/matmul_bf16.cl:
        # cp.async, ldmatrix), and on sm_90 (H100, H200) wgmma (kernels/matmul_wgmma.cl) on tiled copies
        if precision not in ROUND:  # resolved where the device is made (EngineBase: clgpt.device.precision.resolve)
            raise ClgptError(f"Ops: precision {precision!r} is not resolved; use one of {', '.join(ROUND)}")
        self.precision = precision
        self.round = ROUND[self.precision]
        self.gemm = caps.gemm_backend(self.round)
        self.mma = self.bf16 = self.wgmma = self.wgmma_mid = None
        if self.gemm != "portable":
            self.mma = (self.launch["matmul_mma"], self.launch["matmul_mma_small"])
        if self.gemm in ("bf16", "wgmma"):
            self.bf16 = (self.launch["matmul_bf16"], self.launch["matmul_bf16_small"])
        if self.gemm == "wgmma":
            self.wgmma = (self.launch["matmul_wgmma"], self.launch["matmul_wgmma_narrow"])
            self.wgmma_mid = self.launch.get("matmul_wgmma_mid")  # None: off
        # bf16 on the portable tiled GEMM (no tensor cores): the products read bf16 copies of their operands (bf16
        # storage, clgpt/ops/gemm/portable.py), the same bits as rounding fp32 operands as they load (tests turn
        # it off here to compare)
        self.bf16_storage = self.round == 1 and self.gemm == "portable" and self.mm["kernel"] == "matmul"
        # the bf16 kernels' build options (MMA_EMULATE on PoCL for tests, else how smem_probe found a local
        # pointer becomes a shared-window address)
        self.bf16_options = dict(caps.bf16_options) if self.bf16 is not None else {}
        # the launcher's byte slots hold the bf16 copies: 0, 1 op(A), op(B); 2 reuse's; 3 a gradient's copy its
        # product wrote (TILED_OUT 2)
        self.wgmma_min = WGMMA_MIN_MNK if kn.wgmma_min_mnk is None else kn.wgmma_min_mnk  # 0: every product
        self.align = self.launcher.align  # sub-buffer alignment, in floats
        # the record's op forms where this model's widths allow them (see clgpt/device/capabilities.py)
        C, D = cfg.n_embd, cfg.head_dim
        self.rows = caps.group_rows  # GPUs: one work-group of `rows` work-items per row
        # their reductions through sub-groups (kernels/reduce.cl, -D SUBGROUP) where the record says so, and the
        # norms' 32-wide row slices' (kernels/norm_rows.cl: a fixed size dividing 32); {}: local memory
        self.sg = dict(SUBGROUP=caps.subgroup) if caps.subgroup_reduce else {}
        self.row_sg = dict(SUBGROUP=caps.row_subgroup) if caps.row_subgroup else {}
        self.ln_rows = caps.layernorm_rows and C % 128 == 0 and C <= 2048  # LayerNorm's and RMSNorm's
        self.attn_rb = caps.attention_rb and D % 16 == 0
        self.rope_vec = caps.rope_vec and D % 8 == 0
        self.attn_gemm = caps.attention_gemm_min_t is not None and seq_len >= caps.attention_gemm_min_t
        self.preset = caps.preset
        # on wgmma: outputs whose producers also write their tiled copies (LayerNorm's, flash's, the GELU
        # products'), reuse copies that also give the bias gradient's column sums
        self.tiled_outputs = self.wgmma is not None
        self.colsum_copies = self.wgmma is not None and caps.colsum_copies
        # the launcher's scratch: slots 0, 1 the transposed B, A for matmul_rb; grown floats "parts" split-K
        # partial products, "cparts" column-sum partials, "tparts" the column sums a TILED_OUT 2 product wrote
        self.product_kernels = {}  # the GEMM kernels built, by their build options (the backends' kernel())
        # LayerNorm's one-work-item kernels: rows (forward, backward) and channels (dw, db) a work-item
        self.norm_rb, self.norm_cb = self.launch.get("norm_rb", 1), self.launch.get("norm_cb", 1)


class Part:
    """A part of clgpt/ops: the Facts `f` it reads its decisions from, and their fixed objects at hand (the
    device, the model's widths, the capabilities record, the tuning row, the launcher and its kernel table)."""

    def __init__(self, f: Facts):
        self.f = f
        self.dev, self.cfg, self.caps, self.launch = f.dev, f.cfg, f.caps, f.launch
        self.launcher, self.k = f.launcher, f.launcher.k
        self.product_kernels = f.product_kernels


def run_split_k(launcher: Launcher, kern, gsize, lsize, M, N, S, operands, tail, accum, alpha, Cm):
    """Split-K as every GEMM backend runs it: `kern` (built with split=1) writes S raw M x N partial products,
    one per slice of K along grid dimension 2, into the "parts" scratch; splitk_reduce then adds them in
    order into Cm (alpha, accum). operands: the kernel's arguments between M, N and its output; tail: those
    after its epilogue's (the slice depth kc and what follows)."""
    P = launcher.grown("parts", S * M * N)
    launcher.launch(kern, (*gsize, S), (*lsize, 1),
                    (i32(M), i32(N), *operands, P, i32(N), None, None, f32(1.0), None, *tail))
    launcher.runp("splitk_reduce", (M * N,), i32(M * N), i32(S), i32(bool(accum)), f32(alpha), P, Cm)
