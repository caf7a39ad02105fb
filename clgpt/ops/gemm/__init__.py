"""The GEMM backends, one file each, all behind one interface, and the factory that picks one per Ops, once,
from the capabilities record's choice (clgpt/device/capabilities.py gemm_backend, read into Facts.gemm):

    portable.py   PortableGemm: kernels/matmul.cl's local-memory tiles (GPUs without tensor cores), split-K
    cpu.py        RegisterBlockedGemm: matmul_rb, register blocks (CPUs), the operand transposes it reads through
    mma.py        MmaGemm: mma.sync on fp32 operands (tf32; bf16 with the bf16 GEMM off)
    bf16.py       Bf16Gemm: mma.sync on bf16 operand copies (NVIDIA sm_80+)
    wgmma.py      WgmmaGemm: wgmma on tiled bf16 copies (sm_90a: H100, H200), the small products on its Bf16Gemm

The interface (each backend's): matmul(M, N, K, A, B, C, ta, tb, bias, resid, accum, alpha), matmul_epi (the
same with epi, E, ldc: the GELU and SwiGLU epilogues), bmm (the batched form), on_wgmma (whether a product runs
on wgmma) and copies (its clgpt/ops/copies.py TiledCopies: the tiled copies' lifetime, stable / reuse /
forget_copies / settle; only wgmma's makes copies).
"""

from __future__ import annotations

from dataclasses import dataclass

from clgpt.ops.core import Facts
from clgpt.ops.gemm.bf16 import Bf16Gemm
from clgpt.ops.gemm.cpu import RegisterBlockedGemm
from clgpt.ops.gemm.mma import MmaGemm
from clgpt.ops.gemm.portable import (MATMUL_TILES, PortableGemm, matmul_defines, matmul_launch,
                                     split_k_chunks)
from clgpt.ops.gemm.wgmma import WgmmaGemm

__all__ = ["MATMUL_TILES", "Gemms", "make_gemms", "matmul_defines", "matmul_launch", "split_k_chunks"]


@dataclass(frozen=True)
class Gemms:
    """The backend an Ops runs its products on (`chosen`), and the ones the grouped products and attention
    build their own forms from: the portable tiles (always), the register-blocked CPU form, mma, bf16 and wgmma
    (None where the device has none)."""
    chosen: object
    tiled: PortableGemm
    rb: RegisterBlockedGemm | None
    mma: MmaGemm | None
    bf16: Bf16Gemm | None
    wgmma: WgmmaGemm | None

    @property
    def portable(self):
        """The device's portable backend, on kernels/matmul.cl: the register-blocked form on CPUs, else the tiled."""
        return self.rb or self.tiled


def make_gemms(f: Facts) -> Gemms:
    """The backends of Facts f's choice: wgmma (holding its bf16 GEMM), bf16 (holding its mma), mma, the
    register-blocked CPU form or the portable tiles, in that order of preference."""
    tiled = PortableGemm(f)
    rb = RegisterBlockedGemm(f, tiled) if f.mm["kernel"] == "matmul_rb" else None
    mma = MmaGemm(f) if f.gemm != "portable" else None
    bf16 = Bf16Gemm(f, mma) if f.gemm in ("bf16", "wgmma") else None
    wgmma = WgmmaGemm(f, bf16) if f.gemm == "wgmma" else None
    chosen = wgmma or bf16 or mma or rb or tiled
    return Gemms(chosen, tiled, rb, mma, bf16, wgmma)
