"""Which device gets which matmul kernel: the sm_90a PTX patch and the register cap, the wgmma kernel's
build, the vendor and compute-capability guards, the kernel per precision, and the precision setting."""

from __future__ import annotations

import pyopencl as cl
import pytest

from clgpt.device import sm90a
from clgpt.config import validate_config
from clgpt.errors import ClgptError
from clgpt.device.knobs import OFF, Knobs
from clgpt.device.precision import matrix_path, resolve

from precisioncheck import _engine, emulated_knobs


def test_sm90a_ptx_patch():
    """clgpt/device/sm90a.py's rewrite: the target, the marked comments (registers filled in by the compiler) and the
    local array's size and alignment; PTX for another target is refused."""
    ptx = (".version 9.0\n.target sm_90, texmode_independent\n.address_size 64\n"
           ".shared .align 16 .b8 matmul_wgmma_$_smem[49152];\n"
           "\t// begin inline asm\n\t// @sm90a@ wgmma.fence.sync.aligned;\n\t// end inline asm\n")
    out = sm90a.patch_ptx(ptx, 196672)
    assert ".target sm_90a, texmode_independent" in out
    assert "\twgmma.fence.sync.aligned;" in out and "@sm90a@" not in out
    assert ".shared .align 1024 .b8 matmul_wgmma_$_smem[196672];" in out
    assert sm90a.patch_ptx(ptx) == out.replace("align 1024 .b8 matmul_wgmma_$_smem[196672]",
                                               "align 16 .b8 matmul_wgmma_$_smem[49152]")
    with pytest.raises(ClgptError, match="no .target sm_90"):
        sm90a.patch_ptx(ptx.replace("sm_90,", "sm_80,"))


def test_register_cap_goes_on_every_kernel_entry():
    """clgpt/device/sm90a.py cap_ptx: `.maxnreg` after each .entry's parameter list (before its other directives and
    body); PTX without an entry is refused."""
    ptx = (".target sm_90\n.entry flash_forward(\n\t.param .u32 flash_forward_param_0,\n\t.param .u64 .ptr "
           ".global .align 4 flash_forward_param_1\n)\n.reqntid 256, 1, 1\n{\n\tret;\n}\n"
           ".entry flash_bf16(\n\t.param .u32 flash_bf16_param_0\n)\n{\n\tret;\n}\n")
    out = sm90a.cap_ptx(ptx, 128)
    assert out.count(".maxnreg 128") == 2
    assert "flash_forward_param_1\n)\n.maxnreg 128\n.reqntid 256, 1, 1\n{" in out
    assert "flash_bf16_param_0\n)\n.maxnreg 128\n{" in out
    with pytest.raises(ClgptError, match="no PTX .entry"):
        sm90a.cap_ptx(".target sm_90\n", 128)


@pytest.mark.parametrize("defines", [dict(BN=128, BIAS=1, RESID=1, ACCUM=1, EPI=1), dict(BN=256, SPLITK=1),
                                     dict(BN=256, EPI=2, PIPE=0), dict(BN=128, TA=1, TB=1, SPLITK=1),
                                     dict(BN=256, TB=1, BIAS=1), dict(BN=128, BIAS=1, RESID=1, STAGE_OUT=0),
                                     dict(BN=128, EPI=3), dict(BN=256, BIAS=1, EPI=1, TILED_OUT=1),
                                     dict(BN=128, EPI=2, TILED_OUT=2), dict(BN=128, TILE_BAND=8, BIAS=1),
                                     dict(BN=128, TILE_BAND=64, OUT_BF16=1), dict(BN=256, BIAS=1, OUT_BF16=1),
                                     dict(BN=192, TA=1, TB=1, ACCUM=1), dict(BN=192, EPI=2, TILED_OUT=2),
                                     dict(BN=96, BIAS=1, RESID=1), dict(BN=96, EPI=3, TILED_OUT=3)])
def test_wgmma_kernel_compiles_apart_from_its_ptx(dev, defines):
    """kernels/matmul_wgmma.cl runs only on sm_90 GPUs; here its OpenCL C (descriptors, bulk-copy addresses,
    epilogue.cl's store_pair) builds on this device with the inline PTX stubbed out, so a C-level slip shows in CI."""
    from clgpt.device.opencl import KERNEL_DIR, kernel_source

    src = kernel_source(KERNEL_DIR / "matmul_wgmma.cl")
    assert sm90a.MARK in src and "asm volatile(" in src
    src = "#define STUB_ASM(...) ((void)0)\n" + src.replace("asm volatile(", "STUB_ASM(")
    smem = 4 * (128 + defines["BN"]) * 128 + 64
    options = [f"-D{k}={v}" for k, v in {**defines, "SMEM_BYTES": smem}.items()]
    cl.Kernel(cl.Program(dev.ctx, src).build(options=options), "matmul_wgmma")


@pytest.mark.parametrize("vendor,cc,want", [("NVIDIA Corporation", (9, 0), True), ("NVIDIA Corporation", (8, 0), False),
                                            ("NVIDIA Corporation", (10, 0), False), ("The pocl project", None, False)])
def test_wgmma_only_on_sm90(vendor, cc, want):
    """wgmma (sm_90a) exists on compute capability 9.0 only: not on Ampere, not on Blackwell's sm_100."""
    assert sm90a.supported(FakeDevice(vendor, cc)) is want


class FakeDevice:
    """Enough of a pyopencl Device for clgpt.device.precision's checks (vendor, platform, extensions, NV attributes)."""

    def __init__(self, vendor, cc=None, gpu=True):
        self.vendor = vendor
        self.platform = type("P", (), {"name": "NVIDIA CUDA" if "NVIDIA" in vendor else "Other"})()
        self.extensions = "cl_khr_fp64" + (" cl_nv_device_attribute_query" if cc else "")
        self.type = cl.device_type.GPU if gpu else cl.device_type.CPU
        self._cc = cc

    def get_info(self, what):
        if what == cl.device_info.COMPUTE_CAPABILITY_MAJOR_NV:
            return self._cc[0]
        if what == cl.device_info.COMPUTE_CAPABILITY_MINOR_NV:
            return self._cc[1]
        raise cl.Error("not this attribute")


@pytest.mark.parametrize("vendor,cc,gpu,path", [
    ("NVIDIA Corporation", (9, 0), True, "nv_mma"), ("NVIDIA Corporation", (8, 0), True, "nv_mma"),
    ("NVIDIA Corporation", (7, 5), True, None),  # Turing: no bf16 mma.sync
    ("NVIDIA Corporation", None, True, None),  # no cl_nv_device_attribute_query: capability unknown
    ("NVIDIA Corporation", (9, 0), False, None),
    ("Intel(R) Corporation", None, True, None), ("The pocl project", None, False, None)])
def test_matrix_path_guard_on_vendor_and_compute_capability( vendor, cc, gpu, path):
    """Tensor cores only on NVIDIA GPUs of compute capability 8.0 or more; auto is bf16 there, fp32 elsewhere."""
    d = FakeDevice(vendor, cc, gpu)
    assert matrix_path(d, Knobs()) == path
    assert resolve("auto", d, Knobs()) == ("bf16" if path else "fp32")
    assert resolve("tf32", d, Knobs()) == "tf32" and resolve("fp32", d, Knobs()) == "fp32"


def test_kernel_selection_per_precision(dev):
    """Which kernel each precision runs: PoCL (no matrix path) -> the portable kernels, auto -> fp32; a matrix
    path (emulated) -> bf16 on kernels/matmul_bf16.cl (CLGPT_BF16=off: matmul_mma.cl), tf32 on matmul_mma.cl."""
    for precision in ("bf16", "tf32", "auto"):
        ops = _engine(precision, launch="nvidia").ops
        assert ops.mma is None and ops.bf16 is None and ops.precision == ("fp32" if precision == "auto" else precision)
    ops = _engine("bf16", launch="nvidia", emulate=True).ops
    assert ops.mma is not None and ops.bf16 is not None and ops.bf16_options == {"MMA_EMULATE": 1}
    assert _engine("auto", launch="nvidia", emulate=True).ops.bf16 is not None
    ops = _engine("tf32", launch="nvidia", emulate=True).ops
    assert ops.mma is not None and ops.bf16 is None
    ops = _engine("bf16", knobs=emulated_knobs(bf16=OFF)).ops
    assert ops.mma is not None and ops.bf16 is None


def test_precision_setting(dev):
    cfg = validate_config({"pretrain": {"precision": "bf16"}})
    assert cfg["pretrain"]["precision"] == "bf16" and cfg["tune"]["precision"] == "auto"  # the default
    with pytest.raises(ClgptError, match="pretrain.precision"):
        validate_config({"pretrain": {"precision": "fp16"}})
    assert resolve("auto", dev.device, Knobs()) == ("bf16" if dev.device.vendor.lower().startswith("nvidia") else "fp32")
    with pytest.raises(ClgptError, match="precision 'half'"):
        resolve("half", dev.device, Knobs())
